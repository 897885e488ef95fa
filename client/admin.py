"""The admin client: topics and their status, routes, cluster info, consumer groups (progress, members, offset
resets, subscription group configs), message lookups (the everyday part of RocketMQ's mqadmin).

Topic changes go to the *leader* of each broker group (replicated there through Raft, then re-registered with
the name servers by the broker itself), so ``create_topic`` returns once every group has committed it. Which
groups: the ones of ``cluster`` (or explicit ``broker_names``), from the name servers' cluster info.

The result dataclasses (``ClusterInfo``, ``ConsumeStats``, ``SubscriptionGroup``...), ``SUBSCRIPTION_GROUP_FIELDS``
and the readers of the answers are in ``client/admin_types.py``; this module re-exports every result class. The
client is one class assembled from parts, each a module: ``admin_base.py`` (name server answers, requests to the
groups' leaders or any node), ``admin_groups.py`` (consumer groups), ``admin_messages.py`` (message lookups) and this
one (topics, brokers, ``open_admin``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import cbor2
import trio

from client.admin_base import each_group
from client.admin_groups import GroupAdmin
from client.admin_messages import MessageAdmin
from client.admin_types import (SUBSCRIPTION_GROUP_FIELDS, BrokerConfigUpdate, ClusterInfo, ConsumerConnection,
                                ConsumerRunningInfo, ConsumeStats, DelayLevelProgress, GroupDeletion, GroupOffsetClone,
                                OffsetReset, ProcessQueueInfo, ProducerConnection, QueueConsumeStats, SubscriptionGroup,
                                SubscriptionGroupUpdate, TopicConsumeStatus, TopicPermUpdate, TopicQueueStatus)
# The answer readers, under the names the admin client has always used.
from client.admin_types import int_field as _int, opt_int_field as _opt_int, reading as _reading, str_field as _str
from client.errors import ClientError
from client.instance import (
    ClientConfig, ClientInstance, answer_data, build_config, open_client_nursery, open_remoting, raise_for_response,
)
from client.message import MessageQueue, check_int_arg, check_seconds
from client.route import PERM_READ, PERM_WRITE, TopicRouteData, peer_addr
from client.trace import TraceContext
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError, for_code

__all__ = ["AdminClient", "BrokerConfigUpdate", "ClusterInfo", "ConsumeStats", "ConsumerConnection",
           "ConsumerRunningInfo", "DelayLevelProgress", "GroupDeletion", "GroupOffsetClone", "OffsetReset",
           "ProcessQueueInfo", "ProducerConnection", "QueueConsumeStats", "TopicConsumeStatus",
           "SubscriptionGroup", "SubscriptionGroupUpdate", "SUBSCRIPTION_GROUP_FIELDS", "TopicPermUpdate",
           "TopicQueueStatus", "TraceContext", "open_admin", "UPDATABLE_PERMS"]

# The permissions update_topic_perm sets, as mqadmin updateTopicPerm takes them: write only, read only, both.
UPDATABLE_PERMS = (PERM_WRITE, PERM_READ, PERM_READ | PERM_WRITE)

log = logging.getLogger(__name__)


class AdminClient(GroupAdmin, MessageAdmin):
    """mqadmin's everyday requests (see the module's doc): topics and brokers here, consumer groups in
    ``GroupAdmin``, message lookups in ``MessageAdmin``, routes and the ways to reach the groups in ``AdminBase``."""

    async def create_topic(self, topic: str, *, read_queue_nums: int = 8, write_queue_nums: int = 8,
                           perm: int = PERM_READ | PERM_WRITE, cluster: str | None = None,
                           broker_names: Sequence[str] | None = None, order: bool = False,
                           wait_route_s: float = 5.0) -> TopicRouteData | None:
        """Create or update ``topic`` on every group of ``cluster`` (default: all); waits until the name servers
        route it (up to ``wait_route_s``) and returns that route."""
        for name, value in (("read_queue_nums", read_queue_nums), ("write_queue_nums", write_queue_nums)):
            check_int_arg(name, value, 1, 1024)
        if write_queue_nums > read_queue_nums:
            # Consumers are assigned the read queues only: what producers send to the others is never consumed.
            raise ValueError(f"write_queue_nums {write_queue_nums} is more than read_queue_nums {read_queue_nums}: "
                             f"messages sent to queues {read_queue_nums}..{write_queue_nums - 1} would be read by no "
                             f"consumer (to shrink a topic, lower write_queue_nums first, then read_queue_nums)")
        # Checked here, not by trio.move_on_after once every group has created the topic.
        check_seconds("wait_route_s", wait_route_s, allow_zero=True)
        masters = await self._target_masters(cluster, broker_names)
        await self._to_leaders(masters, RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": topic, "read_queue_nums": read_queue_nums, "write_queue_nums": write_queue_nums,
            "perm": perm, "topic_sys_flag": 0, "order": order})
        with trio.move_on_after(wait_route_s):
            while True:
                try:
                    route = await self.get_route(topic)
                    if {q.broker_name for q in route.queue_datas} >= set(masters):
                        return route
                except RaftMQError as e:
                    log.debug("route not there yet topic=%s error=%s", topic, e)
                await trio.sleep(0.05)
        return None

    async def delete_topic(self, topic: str, *, cluster: str | None = None,
                           broker_names: Sequence[str] | None = None) -> list[str]:
        """Delete ``topic`` from every group of ``cluster`` (default: all) or of ``broker_names`` that has it;
        returns those groups' names. A topic need not be on every group (created with ``broker_names``, or while
        a group was down): a group without it has nothing to delete (before, its TOPIC_NOT_EXIST failed the whole
        delete, though the others had deleted it). Only a topic on none of them is refused, as the first group's
        TopicNotExistError."""
        masters = await self._target_masters(cluster, broker_names)
        frames = await self._to_leaders(masters, RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": topic},
                                        ok=(ResponseCode.SUCCESS, ResponseCode.TOPIC_NOT_EXIST))
        deleted = sorted(name for name, frame in frames.items() if frame.code == ResponseCode.SUCCESS)
        if not deleted:
            first, *others = sorted(frames)
            try:
                raise_for_response(frames[first], topic=topic, broker_name=first)
            except RaftMQError as e:
                if others:
                    e.add_note("also from broker group(s) " + "; ".join(f"{name}: {frames[name].remark}"
                                                                       for name in others))
                raise
        return deleted

    async def update_topic_perm(self, topic: str, perm: int, *, cluster: str | None = None,
                                broker_names: Sequence[str] | None = None) -> list[TopicPermUpdate]:
        """RocketMQ's updateTopicPerm: set ``topic``'s permission to ``perm`` (2 write, 4 read, 6 both) on every
        group of ``cluster`` (default: all) or of ``broker_names`` that has it. Each group's own config is read
        from its leader (GET_ALL_TOPIC_CONFIG naming the topic) and written back (UPDATE_AND_CREATE_TOPIC:
        replicated, then re-registered with the name servers) with only ``perm`` changed: its queue counts, order
        flag, filter type and sys flag stay. ``create_topic`` with a perm sets every field, so the defaults (8
        queues) replaced the counts the topic had. Works for the broker's retry and dead-letter topics
        (``%DLQ%group`` is created write-only; 6 makes its messages readable). A group where the topic already has
        ``perm`` is left alone. Returns what was done per group, by name; a topic on none of the groups asked is
        TopicNotExistError.

        The read and the write are two requests: a change made to the topic by someone else between them is
        overwritten, as with mqadmin."""
        if isinstance(perm, bool) or perm not in UPDATABLE_PERMS:
            raise ValueError(f"perm must be 2 (write), 4 (read) or 6 (read and write), as mqadmin updateTopicPerm "
                             f"takes, got {perm!r}")
        masters = await self._target_masters(cluster, broker_names)
        configs = await self._topic_configs(masters, topic)
        if not configs:
            raise for_code(ResponseCode.TOPIC_NOT_EXIST, f"topic {topic!r} is on none of broker group(s) "
                                                         f"{', '.join(sorted(masters))}", topic=topic)
        updates = {name: TopicPermUpdate(name, c["perm"], perm, c["read_queue_nums"], c["write_queue_nums"],
                                         c["order"], c["topic_sys_flag"]) for name, c in configs.items()}
        written: list[str] = []

        async def _one(name: str) -> None:
            config = configs[name]
            await self._to_leaders({name: masters[name]}, RequestCode.UPDATE_AND_CREATE_TOPIC, {
                "topic": topic, "read_queue_nums": config["read_queue_nums"],
                "write_queue_nums": config["write_queue_nums"], "perm": perm,
                "topic_filter_type": config["topic_filter_type"], "topic_sys_flag": config["topic_sys_flag"],
                "order": config["order"]})
            written.append(name)

        try:
            await each_group([(name,) for name, u in sorted(updates.items()) if u.changed], _one)
        except RaftMQError as e:
            if written:  # the others are not rolled back: say so, the operator runs it again for the rest
                e.add_note("changed all the same on broker group(s) " + ", ".join(
                    f"{name} (perm {updates[name].previous_perm} to {perm})" for name in sorted(written)))
            raise
        return [updates[name] for name in sorted(updates)]

    async def _topic_configs(self, masters: Mapping[str, str], topic: str) -> dict[str, dict[str, Any]]:
        """``topic``'s config on each group of ``masters`` (name -> leader) that has it, from GET_ALL_TOPIC_CONFIG
        naming it (ext ``topic``): the whole table may be more than one answer carries."""
        tables = await self._leader_tables(masters, RequestCode.GET_ALL_TOPIC_CONFIG, "topic_configs",
                                           {"topic": topic})
        found = {}
        for name, table in tables.items():
            with _reading("GET_ALL_TOPIC_CONFIG", f"broker group {name!r}"):
                config = table.get(topic)
                if config is None:
                    continue
                order = config.get("order", False)
                if type(order) is not bool:
                    raise TypeError(f"order {order!r} is not true or false")
                found[name] = {"read_queue_nums": _int(config["read_queue_nums"], "read_queue_nums"),
                               "write_queue_nums": _int(config["write_queue_nums"], "write_queue_nums"),
                               "perm": _int(config["perm"], "perm"),
                               "topic_filter_type": _str(config.get("topic_filter_type", "SINGLE_TAG"),
                                                         "topic_filter_type"),
                               "topic_sys_flag": _int(config.get("topic_sys_flag", 0), "topic_sys_flag"),
                               "order": order}
        return found

    async def topic_status(self, topic: str) -> list[TopicQueueStatus]:
        """Every queue of ``topic`` on every group that routes it, with its offsets (any node answers: the
        leader first)."""
        frames = await self._read_from_route(topic, RequestCode.GET_TOPIC_STATS_INFO, {"topic": topic})
        out = []
        for name, frame in frames.items():
            with _reading("GET_TOPIC_STATS_INFO", f"broker group {name!r}"):
                out += [TopicQueueStatus(MessageQueue(topic, name, _int(row["queue_id"], "queue_id")),
                                         _int(row["min_offset"], "min_offset"), _int(row["max_offset"], "max_offset"),
                                         _opt_int(row.get("last_update_timestamp"), "last_update_timestamp"))
                        for row in cbor2.loads(frame.body).get("offsets", [])]
        return sorted(out, key=lambda q: (q.queue.broker_name, q.queue.queue_id))

    async def broker_status(self, addr: str) -> dict[str, Any]:
        frame = raise_for_response(await self._instance.invoke(addr, RequestCode.GET_BROKER_RUNTIME_INFO))
        with _reading("GET_BROKER_RUNTIME_INFO", addr):
            status = answer_data(frame)
            if not isinstance(status, Mapping):
                raise TypeError(f"the status is a {type(status).__name__}, not a map")
            return dict(status)

    async def broker_config(self, addr: str) -> dict[str, Any]:
        """GET_BROKER_CONFIG of the node at ``addr`` (any member): its effective config, ``store`` and ``dledger``
        nested, the cluster secret left out (RocketMQ's getBrokerConfig)."""
        frame = raise_for_response(await self._instance.invoke(addr, RequestCode.GET_BROKER_CONFIG))
        with _reading("GET_BROKER_CONFIG", addr):
            config = answer_data(frame)
            if not isinstance(config, Mapping):
                raise TypeError(f"the config is a {type(config).__name__}, not a map")
            return dict(config)

    async def update_broker_config(self, addr: str, values: Mapping[str, Any]) -> BrokerConfigUpdate:
        """UPDATE_BROKER_CONFIG of the node at ``addr`` only (RocketMQ's updateBrokerConfig): ``values`` maps config
        keys the brokers change at runtime (``broker.config.RUNTIME_KEYS``: ``broker_permission``,
        ``auto_create_topic_enable``, ``long_polling_timeout_ms``...) to values, sent as text (a boolean as
        ``true``/``false``). The node judges them as its config file would and applies all or none; it keeps them
        across restarts. A group's every member registers and may lead: change each
        (``broker_member_addrs``). Raises the node's refusal (``InvalidRequestError`` naming the key)."""
        if not isinstance(values, Mapping) or not values:
            raise TypeError(f"values must be a non-empty map of config key -> value, got {values!r}")
        body = {}
        for key, value in values.items():
            if not isinstance(key, str) or not key:
                raise TypeError(f"config keys must be non-empty texts, got {key!r}")
            body[key] = _config_text(key, value)
        # 10 s: a change of broker_permission is answered once the node has registered it with every name server
        # (each under the node's register_timeout_ms, 3 s by default).
        frame = raise_for_response(await self._instance.invoke(addr, RequestCode.UPDATE_BROKER_CONFIG,
                                                               body=cbor2.dumps(body), timeout_s=10.0))
        with _reading("UPDATE_BROKER_CONFIG", addr):
            answer = cbor2.loads(frame.body)
            now, before = answer["values"], answer["previous"]
            if not isinstance(now, Mapping) or not isinstance(before, Mapping):
                raise TypeError("values and previous must be maps")
            return BrokerConfigUpdate(addr, dict(now), dict(before))

    async def broker_member_addrs(self, broker_name: str) -> list[str]:
        """The service address of every member of group ``broker_name``, as its nodes' config lists them
        (GET_BROKER_CONFIG's ``dledger.members``, asked of the leader first, else of another node the name servers
        know): a member that is down is listed too, where the name servers list only those registered."""
        info = await self.cluster_info()
        registered = info.broker_addrs.get(broker_name)
        if not registered:
            raise ClientError(f"broker group {broker_name!r} has no node registered with the name servers (known "
                              f"groups: {', '.join(sorted(info.broker_addrs)) or 'none'})", broker_name=broker_name)
        leader = registered.get(0)
        last_error: RaftMQError | None = None
        for addr in sorted(set(registered.values()), key=lambda a: (a != leader, a)):
            try:
                config = await self.broker_config(addr)
            except RaftMQError as e:
                last_error = e
                continue
            with _reading("GET_BROKER_CONFIG", addr):
                return [peer_addr(_str(m["service_address"], "service_address")) for m in config["dledger"]["members"]]
        assert last_error is not None
        raise last_error

    async def delay_offsets(self, addr: str) -> list[DelayLevelProgress]:
        """The delayed messages of the group of node ``addr``, per level (any node answers from its replica; the
        leader's is the freshest)."""
        frame = raise_for_response(await self._instance.invoke(addr, RequestCode.GET_ALL_DELAY_OFFSET))
        with _reading("GET_ALL_DELAY_OFFSET", addr):
            return [DelayLevelProgress(*(_int(row[k], k) for k in ("level", "delay_ms", "delivered_offset",
                                                                     "max_offset")))
                    for row in cbor2.loads(frame.body)["levels"]]


def _config_text(key: str, value: Any) -> str:
    """A value of UPDATE_BROKER_CONFIG as text, as the broker reads it (a TOML value): RocketMQ's properties are
    text too."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, str)):
        return str(value)
    raise TypeError(f"the value of config key {key!r} must be text, an integer or a boolean, got {value!r}")


@contextlib.asynccontextmanager
async def open_admin(namesrv: str | Sequence[str] | None = None, **options: Any) -> AsyncIterator[AdminClient]:
    if namesrv is not None:
        options["namesrv"] = namesrv
    config: ClientConfig = build_config(ClientConfig, options)
    async with open_remoting(config) as remoting:
        async with open_client_nursery() as nursery:
            instance = ClientInstance(config, remoting, nursery)
            try:
                yield AdminClient(instance)
            finally:
                instance.closed = True
                nursery.cancel_scope.cancel()
