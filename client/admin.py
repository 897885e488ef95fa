"""The admin client: topics and their status, routes, cluster info, consumer groups (progress, members, offset
resets, subscription group configs), message lookups (the everyday part of RocketMQ's mqadmin).

Topic changes go to the *leader* of each broker group (replicated there through Raft, then re-registered with
the name servers by the broker itself), so ``create_topic`` returns once every group has committed it. Which
groups: the ones of ``cluster`` (or explicit ``broker_names``), from the name servers' cluster info.

The result dataclasses (``ClusterInfo``, ``ConsumeStats``, ``SubscriptionGroup``...), ``SUBSCRIPTION_GROUP_FIELDS``
and the readers of the answers are in ``client/admin_types.py``; this module re-exports every result class.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import cbor2
import trio

from client.admin_types import (SUBSCRIPTION_GROUP_FIELDS, BrokerConfigUpdate, ClusterInfo, ConsumerConnection,
                                ConsumerRunningInfo, ConsumeStats, DelayLevelProgress, GroupDeletion, GroupOffsetClone,
                                OffsetReset, ProcessQueueInfo, ProducerConnection, QueueConsumeStats, SubscriptionGroup,
                                SubscriptionGroupUpdate, TopicConsumeStatus, TopicPermUpdate, TopicQueueStatus,
                                parse_consumer_running_info)
# The answer readers, under the names this module has always used.
from client.admin_types import (int_field as _int, names_field as _names, opt_int_field as _opt_int,
                                parse_cluster_info as _parse_cluster_info,
                                parse_subscription_group as _subscription_group, rate_field as _rate,
                                reading as _reading, str_field as _str)
from client.errors import ClientError
from client.instance import (
    ClientConfig, ClientInstance, answer_data, build_config, open_client_nursery, open_remoting, raise_for_response,
)
from client.message import I64_MAX, MessageExt, MessageQueue, check_int_arg, check_seconds
from client.pull_consumer import to_message_ext
from client.route import PERM_READ, PERM_WRITE, TopicRouteData, decode_route_response, parse_route, peer_addr
from client.trace import TRACE_TOPIC, TraceContext, TraceType, decode_trace_data
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError, TopicNotExistError, for_code
from remoting.message import (KEY_SEPARATOR, RETRY_GROUP_MAX_LENGTH, MessageFormatError, group_problem, iter_records,
                              parse_msg_id, retry_topic, topic_problem)

__all__ = ["AdminClient", "BrokerConfigUpdate", "ClusterInfo", "ConsumeStats", "ConsumerConnection",
           "ConsumerRunningInfo", "DelayLevelProgress", "GroupDeletion", "GroupOffsetClone", "OffsetReset",
           "ProcessQueueInfo", "ProducerConnection", "QueueConsumeStats", "TopicConsumeStatus",
           "SubscriptionGroup", "SubscriptionGroupUpdate", "SUBSCRIPTION_GROUP_FIELDS", "TopicPermUpdate",
           "TopicQueueStatus", "TraceContext", "open_admin", "UPDATABLE_PERMS"]

# The permissions update_topic_perm sets, as mqadmin updateTopicPerm takes them: write only, read only, both.
UPDATABLE_PERMS = (PERM_WRITE, PERM_READ, PERM_READ | PERM_WRITE)
MAX_QUERY_NUM = 64  # the broker's cap on the messages of one QUERY_MESSAGE (RocketMQ's maxNum bound)
# VIEW_MESSAGE_BY_ID's answers: QUERY_NOT_FOUND, no such message; SYSTEM_ERROR, how older brokers said so
# (RocketMQ's answer).
_VIEW_ANSWERS = (ResponseCode.SUCCESS, ResponseCode.QUERY_NOT_FOUND, ResponseCode.SYSTEM_ERROR)

log = logging.getLogger(__name__)


class AdminClient:
    def __init__(self, instance: ClientInstance) -> None:
        self._instance = instance

    async def cluster_info(self) -> ClusterInfo:
        frame = await self._instance.invoke_namesrv(RequestCode.GET_BROKER_CLUSTER_INFO)
        with _reading("GET_BROKER_CLUSTER_INFO", "the name servers"):
            return _parse_cluster_info(answer_data(frame))

    async def list_topics(self) -> list[str]:
        frame = await self._instance.invoke_namesrv(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER)
        with _reading("GET_ALL_TOPIC_LIST_FROM_NAMESERVER", "the name servers"):
            return sorted(_names(answer_data(frame).get("topic_list", []), "topic_list"))

    async def get_route(self, topic: str) -> TopicRouteData:
        frame = await self._instance.invoke_namesrv(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
        return parse_route(topic, decode_route_response(frame.ext, frame.body, topic))

    async def _target_masters(self, cluster: str | None, broker_names: Sequence[str] | None,
                              info: ClusterInfo | None = None) -> dict[str, str]:
        _check_targets(cluster, broker_names)
        info = info if info is not None else await self.cluster_info()
        if broker_names:
            names = list(broker_names)
        elif cluster is not None:
            if cluster not in info.clusters:
                raise ClientError(f"cluster {cluster!r} is not known to the name servers "
                                  f"(known: {', '.join(sorted(info.clusters)) or 'none'})", cluster=cluster)
            names = list(info.clusters[cluster])
        else:
            names = sorted(info.broker_addrs)
        out = {}
        for name in names:
            addr = info.master_addr(name)
            if not addr:
                raise ClientError(f"broker group {name!r} has no leader registered with the name servers",
                                  broker_name=name)
            out[name] = addr
        if not out:
            raise ClientError("no broker group is registered with the name servers")
        return out

    async def _to_leaders(self, masters: Mapping[str, str], code: int, ext: dict[str, Any],
                          ok: tuple[int, ...] = (ResponseCode.SUCCESS,),
                          answered_by: dict[str, str] | None = None) -> dict[str, Any]:
        """Send one request to each group's leader at once (following NOT_LEADER); returns each group's answer
        (a code in ``ok``; any other raises). ``answered_by`` gets the address of each group's leader."""
        answers: dict[str, Any] = {}

        async def _one(name: str, addr: str) -> None:
            for _ in range(4):
                frame = await self._instance.invoke(addr, code, ext, timeout_s=10.0)
                if frame.code == ResponseCode.NOT_LEADER and frame.ext.get("leader_addr"):
                    try:
                        addr = peer_addr(frame.ext["leader_addr"])
                    except ValueError:  # no address: this NOT_LEADER is raised below, naming the node asked
                        pass
                    else:
                        continue
                answers[name] = raise_for_response(frame, ok=ok, topic=ext.get("topic") or None, broker_name=name)
                if answered_by is not None:
                    answered_by[name] = addr
                return
            raise ClientError(f"broker group {name!r} kept naming another leader (last {addr})", broker_name=name)

        await _each_group(masters.items(), _one)
        return answers

    async def _route_masters(self, topic: str, info: ClusterInfo | None = None) -> dict[str, str]:
        """The registered leader of every group that routes ``topic``."""
        route = await self.get_route(topic)
        info = info if info is not None else await self.cluster_info()
        masters = {}
        for name in sorted({q.broker_name for q in route.queue_datas}):
            addr = info.master_addr(name)
            if not addr:
                raise ClientError(f"broker group {name!r} has no leader registered with the name servers",
                                  broker_name=name)
            masters[name] = addr
        return masters

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
        from its leader (GET_ALL_TOPIC_CONFIG) and written back (UPDATE_AND_CREATE_TOPIC: replicated, then
        re-registered with the name servers) with only ``perm`` changed: its queue counts, order flag, filter
        type and sys flag stay. ``create_topic`` with a perm sets every field, so the defaults (8 queues) replaced
        the counts the topic had. Works for the broker's retry and dead-letter topics (``%DLQ%group`` is created
        write-only; 6 makes its messages readable). A group where the topic already has ``perm`` is left alone.
        Returns what was done per group, by name; a topic on none of the groups asked is TopicNotExistError.

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
            await _each_group([(name,) for name, u in sorted(updates.items()) if u.changed], _one)
        except RaftMQError as e:
            if written:  # the others are not rolled back: say so, the operator runs it again for the rest
                e.add_note("changed all the same on broker group(s) " + ", ".join(
                    f"{name} (perm {updates[name].previous_perm} to {perm})" for name in sorted(written)))
            raise
        return [updates[name] for name in sorted(updates)]

    async def _topic_configs(self, masters: Mapping[str, str], topic: str) -> dict[str, dict[str, Any]]:
        """``topic``'s config on each group of ``masters`` (name -> leader) that has it, from GET_ALL_TOPIC_CONFIG."""
        frames = await self._to_leaders(masters, RequestCode.GET_ALL_TOPIC_CONFIG, {})
        found = {}
        for name, frame in frames.items():
            with _reading("GET_ALL_TOPIC_CONFIG", f"broker group {name!r}"):
                config = cbor2.loads(frame.body)["topic_configs"].get(topic)
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

    async def consume_stats(self, consumer_group: str, *, topic: str | None = None,
                            cluster: str | None = None) -> ConsumeStats:
        """The progress of ``consumer_group``: on every group of ``topic``'s route, or without a topic on every
        group of ``cluster`` (default: all), every topic it has committed offsets for. Each group's leader
        answers, so commits not yet replicated count too. No queue at all means the group consumes nothing
        there (never committed, and no member subscribed to ``topic``).

        ``consume_tps`` adds up every node's: a pull is counted by the node that served it, which is a follower
        during a failover (the consumer falls back to the followers) and for a while after it (the old leader
        keeps what it served). A node that does not answer within 3 s adds nothing."""
        if not consumer_group:
            raise ValueError("consume_stats needs a consumer group")
        info = await self.cluster_info()  # the leaders, then the followers' consume TPS
        if topic:
            masters = await self._route_masters(topic, info)
        else:
            masters = await self._target_masters(cluster, None, info)
        ext = {"consumer_group": consumer_group, "topic": topic or ""}
        leaders: dict[str, str] = {}
        frames = await self._to_leaders(masters, RequestCode.GET_CONSUME_STATS, ext, answered_by=leaders)
        queues = []
        tps = 0.0
        consumer_ids = {}
        for name, frame in sorted(frames.items()):
            with _reading("GET_CONSUME_STATS", f"broker group {name!r}"):
                answer = cbor2.loads(frame.body) if frame.body else {}
                tps += _rate(answer.get("consume_tps", 0.0))
                consumer_ids[name] = _names(answer.get("consumer_ids", []), "consumer_ids")
                for row in answer.get("offsets", []):
                    queues.append(QueueConsumeStats(
                        MessageQueue(_str(row["topic"], "topic"), name, _int(row["queue_id"], "queue_id")),
                        _int(row["broker_offset"], "broker_offset"),
                        _opt_int(row.get("consumer_offset"), "consumer_offset"), _int(row["lag"], "lag"),
                        _opt_int(row.get("last_timestamp"), "last_timestamp")))
        tps += await self._followers_consume_tps(info, leaders, ext)
        queues.sort(key=lambda q: (q.queue.topic, q.queue.broker_name, q.queue.queue_id))
        return ConsumeStats(consumer_group, tuple(queues), consumer_ids, round(tps, 1))

    async def _followers_consume_tps(self, info: ClusterInfo, leaders: Mapping[str, str],
                                     ext: dict[str, Any]) -> float:
        """The consume TPS the other nodes of each group in ``leaders`` (name -> the leader that answered)
        served, added up; what a node fails to answer is left out (a rate, not a count to trust)."""
        others = [(name, addr) for name, leader in sorted(leaders.items())
                  for addr in sorted(set(info.broker_addrs.get(name, {}).values())) if addr != leader]
        rates: list[float] = []

        async def _one(name: str, addr: str) -> None:
            try:
                frame = await self._instance.invoke(addr, RequestCode.GET_CONSUME_STATS, ext, timeout_s=3.0)
            except RaftMQError as e:
                log.debug("consume TPS of %s (%s) left out: %s", addr, name, e)
                return
            if frame.code != ResponseCode.SUCCESS or not frame.body:
                log.debug("consume TPS of %s (%s) left out: code %d %s", addr, name, frame.code, frame.remark)
                return
            try:
                with _reading("GET_CONSUME_STATS", addr):
                    rates.append(_rate(cbor2.loads(frame.body).get("consume_tps", 0.0)))
            except RaftMQError as e:  # as a node that did not answer: it raised out of the nursery before
                log.warning("consume TPS of %s (%s) left out: %s", addr, name, e)

        async with trio.open_nursery() as nursery:
            for name, addr in others:
                nursery.start_soon(_one, name, addr)
        return sum(rates)

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

    async def consumer_connections(self, consumer_group: str, *, cluster: str | None = None) -> ConsumerConnection:
        """The group's members online on the groups of ``cluster`` (default: all); empty ``connections`` when
        none is."""
        if not consumer_group:
            raise ValueError("consumer_connections needs a consumer group")
        frames = await self._to_leaders(await self._target_masters(cluster, None),
                                        RequestCode.GET_CONSUMER_CONNECTION_LIST, {"consumer_group": consumer_group},
                                        ok=(ResponseCode.SUCCESS, ResponseCode.CONSUMER_NOT_ONLINE))
        connections: dict[str, str] = {}
        subscriptions: dict[str, str] = {}
        member_subscriptions: dict[str, dict[str, str]] = {}
        model = where = consume_type = ""
        for name, frame in sorted(frames.items()):
            if frame.code != ResponseCode.SUCCESS:
                continue
            with _reading("GET_CONSUMER_CONNECTION_LIST", f"broker group {name!r}"):
                data = cbor2.loads(frame.body)
                model = _str(data.get("message_model", model), "message_model")
                where = _str(data.get("consume_from_where", where), "consume_from_where")
                consume_type = _str(data.get("consume_type", consume_type), "consume_type")
                for sub in data.get("subscriptions", []):
                    subscriptions.setdefault(_str(sub["topic"], "topic"), _str(sub["expression"], "expression"))
                for c in data.get("connections", []):
                    client_id = _str(c["client_id"], "client_id")
                    connections.setdefault(client_id, _str(c.get("client_addr", ""), "client_addr"))
                    member = member_subscriptions.setdefault(client_id, {})
                    for sub in c.get("subscriptions", []):
                        member.setdefault(_str(sub["topic"], "topic"), _str(sub["expression"], "expression"))
        members = {cid: dict(sorted(subs.items())) for cid, subs in sorted(member_subscriptions.items())}
        return ConsumerConnection(consumer_group, model, where, dict(sorted(subscriptions.items())),
                                  dict(sorted(connections.items())), members, consume_type)

    async def consumer_running_info(self, consumer_group: str, client_id: str | None = None, *,
                                    jstack: bool = False) -> ConsumerRunningInfo:
        """RocketMQ's getConsumerRunningInfo (``mqadmin consumerStatus``): what the online member ``client_id`` of
        ``consumer_group`` (default: the first online, by id) says it is doing, asked through the leader of a broker
        group it heartbeats to (GET_CONSUMER_RUNNING_INFO), each group's leader in turn until one knows it; with
        ``jstack``, its task dump too. ``ConsumerNotOnlineError`` when no group knows it online (or no member is);
        ``BrokerSystemError`` when it did not answer in time or failed to."""
        problem = group_problem(consumer_group) if isinstance(consumer_group, str) else "must be a string"
        if problem:
            raise ValueError(f"consumer_group {consumer_group!r} {problem}")
        if client_id is not None and (not isinstance(client_id, str) or not client_id):
            raise ValueError(f"client_id must be a non-empty string or None, got {client_id!r}")
        masters = await self._target_masters(None, None)
        if client_id is None:
            lists = await self._to_leaders(masters, RequestCode.GET_CONSUMER_LIST_BY_GROUP,
                                           {"consumer_group": consumer_group})
            online: set[str] = set()
            for name, frame in lists.items():
                with _reading("GET_CONSUMER_LIST_BY_GROUP", f"broker group {name!r}"):
                    online.update(_names(cbor2.loads(frame.body)["consumer_id_list"], "consumer_id_list"))
            if not online:
                raise for_code(ResponseCode.CONSUMER_NOT_ONLINE,
                               f"consumer group {consumer_group!r} has no member online on broker group(s) "
                               f"{', '.join(sorted(masters))}")
            client_id = min(online)
        ext = {"consumer_group": consumer_group, "client_id": client_id, "jstack": jstack}
        misses = []
        for name in sorted(masters):
            frames = await self._to_leaders({name: masters[name]}, RequestCode.GET_CONSUMER_RUNNING_INFO, ext,
                                            ok=(ResponseCode.SUCCESS, ResponseCode.CONSUMER_NOT_ONLINE))
            frame = frames[name]
            if frame.code == ResponseCode.CONSUMER_NOT_ONLINE:
                misses.append(f"{name}: {frame.remark}")
                continue
            with _reading("GET_CONSUMER_RUNNING_INFO", f"consumer {client_id!r} through broker group {name!r}"):
                return parse_consumer_running_info(name, cbor2.loads(frame.body))
        raise for_code(ResponseCode.CONSUMER_NOT_ONLINE, f"the consumer {client_id!r} of group {consumer_group!r} is "
                                                         f"not online on any broker group ({'; '.join(misses)})")

    async def clone_group_offset(self, src_group: str, dest_group: str, topic: str) -> GroupOffsetClone:
        """RocketMQ's cloneGroupOffset: give ``dest_group`` the offsets ``src_group`` committed on every queue of
        ``topic``, on every broker group that routes it (CLONE_GROUP_OFFSET to each leader, replicated there before
        it answers, as any offset commit); ``dest_group``'s online members are told to pull from there, as by
        ``reset_offset``. A broker group where ``src_group`` has none of the topic is left as it is; refused
        (``QueryNotFoundError``) when it has none anywhere: then nothing was changed."""
        for name, group in (("src_group", src_group), ("dest_group", dest_group)):
            problem = group_problem(group) if isinstance(group, str) else "must be a string"
            if problem:
                raise ValueError(f"{name} {group!r} {problem}")
        if src_group == dest_group:
            raise ValueError(f"src_group and dest_group are both {src_group!r}: nothing to clone")
        masters = await self._route_masters(topic)
        answers = await self._to_leaders(masters, RequestCode.CLONE_GROUP_OFFSET,
                                         {"src_group": src_group, "dest_group": dest_group, "topic": topic},
                                         ok=(ResponseCode.SUCCESS, ResponseCode.QUERY_NOT_FOUND))
        offsets: dict[MessageQueue, int] = {}
        previous: dict[MessageQueue, int | None] = {}
        told: dict[str, tuple[str, ...]] = {}
        for name, frame in sorted(answers.items()):
            if frame.code != ResponseCode.SUCCESS:
                continue
            with _reading("CLONE_GROUP_OFFSET", f"broker group {name!r}"):
                data = cbor2.loads(frame.body)
                for row in data["offsets"]:
                    mq = MessageQueue(topic, name, _int(row["queue_id"], "queue_id"))
                    offsets[mq] = _int(row["offset"], "offset")
                    previous[mq] = _opt_int(row.get("previous"), "previous")
                told[name] = _names(data.get("consumer_ids", []), "consumer_ids")
        if not offsets:
            raise for_code(ResponseCode.QUERY_NOT_FOUND,
                           f"consumer group {src_group!r} has no committed offset of topic {topic!r} on any broker "
                           f"group that routes it ({', '.join(sorted(answers))}): nothing to clone, nothing changed")
        return GroupOffsetClone(src_group, dest_group, topic, offsets, previous, told)

    async def producer_connections(self, producer_group: str, *, cluster: str | None = None) -> ProducerConnection:
        """The group's producers online on the groups of ``cluster`` (default: all), from each group's leader;
        empty ``connections`` when none is (transactional producers must be, for the brokers' check-backs)."""
        if not producer_group:
            raise ValueError("producer_connections needs a producer group")
        frames = await self._to_leaders(await self._target_masters(cluster, None),
                                        RequestCode.GET_PRODUCER_CONNECTION_LIST, {"producer_group": producer_group},
                                        ok=(ResponseCode.SUCCESS, ResponseCode.SYSTEM_ERROR))
        connections: dict[str, str] = {}
        heard_by: dict[str, list[str]] = {}
        for name, frame in sorted(frames.items()):
            if frame.code != ResponseCode.SUCCESS:  # RocketMQ's answer for a group with no producer online
                continue
            with _reading("GET_PRODUCER_CONNECTION_LIST", f"broker group {name!r}"):
                for c in cbor2.loads(frame.body)["connections"]:
                    client_id = _str(c["client_id"], "client_id")
                    connections.setdefault(client_id, _str(c.get("client_addr", ""), "client_addr"))
                    heard_by.setdefault(client_id, []).append(name)
        return ProducerConnection(producer_group, dict(sorted(connections.items())),
                                  {cid: tuple(names) for cid, names in sorted(heard_by.items())})

    async def delete_group(self, consumer_group: str, *, cluster: str | None = None,
                           broker_names: Sequence[str] | None = None) -> GroupDeletion:
        """RocketMQ's deleteSubGroup with its offsets (``-r``): remove ``consumer_group``'s offsets and subscription
        group config from every group of ``cluster`` (default: all) or of ``broker_names`` (DELETE_SUBSCRIPTIONGROUP,
        replicated), then delete its retry topic ``%RETRY%<group>`` where it is (its messages are redeliveries to
        this group alone). A
        group with members online is refused (they would commit their offsets again): first here, asking every
        group, so that a member online on one group leaves the offsets on all of them (each broker, which refuses
        too, would have removed them where no member was); then by each broker, for a member that joined in between.
        The dead-letter topic is kept: its messages may still be wanted (``delete_topic`` removes it). An
        assign-mode lite pull consumer joins no group: it is not seen, and its next commits bring offsets back."""
        if not consumer_group:
            raise ValueError("delete_group needs a consumer group")
        masters = await self._target_masters(cluster, broker_names)
        lists = await self._to_leaders(masters, RequestCode.GET_CONSUMER_LIST_BY_GROUP,
                                       {"consumer_group": consumer_group})
        online: dict[str, list[str]] = {}
        for name, frame in sorted(lists.items()):
            with _reading("GET_CONSUMER_LIST_BY_GROUP", f"broker group {name!r}"):
                ids = _names(cbor2.loads(frame.body)["consumer_id_list"], "consumer_id_list")
            if ids:
                online[name] = list(ids)
        if online:
            raise for_code(ResponseCode.NO_PERMISSION, f"consumer group {consumer_group!r} has members online ("
                           + "; ".join(f"{name}: {', '.join(ids[:3])}{', ...' if len(ids) > 3 else ''}"
                                       for name, ids in online.items())
                           + "): stop them first; no offset was removed")
        frames = await self._to_leaders(masters, RequestCode.DELETE_SUBSCRIPTIONGROUP,
                                        {"group_name": consumer_group, "clean_offset": True})
        removed = {}
        configs = []
        for name, frame in sorted(frames.items()):
            with _reading("DELETE_SUBSCRIPTIONGROUP", f"broker group {name!r}"):
                removed[name] = _int(frame.ext["removed"], "removed")
                if frame.ext.get("config_removed") is True:
                    configs.append(name)
        deleted: list[str] = []
        if len(consumer_group) <= RETRY_GROUP_MAX_LENGTH:  # a longer name makes no legal topic: it has none
            try:
                deleted = await self.delete_topic(retry_topic(consumer_group), broker_names=sorted(masters))
            except TopicNotExistError:  # the group never failed a message: it has no retry topic
                pass
        return GroupDeletion(consumer_group, removed, tuple(deleted), tuple(configs))

    async def update_subscription_group(self, consumer_group: str, *, cluster: str | None = None,
                                        broker_names: Sequence[str] | None = None,
                                        **fields: Any) -> list[SubscriptionGroupUpdate]:
        """RocketMQ's updateSubGroup: create ``consumer_group``'s subscription group, or set the ``fields`` given
        (``SUBSCRIPTION_GROUP_FIELDS``, e.g. ``consume_enable=False`` to stop its consumers), on every group of
        ``cluster`` (default: all) or of ``broker_names``. The fields not given keep their value (RocketMQ's
        default for a new group), so one change leaves the others alone; each leader replicates it before it
        answers, and its followers refuse a stopped group's pulls too. Returns what was done per group, by name.
        A group that fails (the first by name raised, the others' in its notes) leaves the others changed."""
        problem = group_problem(consumer_group) if isinstance(consumer_group, str) else "must be a string"
        if problem:
            raise ValueError(f"consumer_group {consumer_group!r} {problem}")
        for name, value in fields.items():
            kind = SUBSCRIPTION_GROUP_FIELDS.get(name)
            if kind is None:
                raise TypeError(f"{name!r} is not a subscription group field (fields: "
                                f"{', '.join(SUBSCRIPTION_GROUP_FIELDS)})")
            if kind is bool and not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
            if kind is not bool:
                check_int_arg(name, value, *kind)
        masters = await self._target_masters(cluster, broker_names)
        updates: dict[str, SubscriptionGroupUpdate] = {}

        async def _one(name: str) -> None:
            answers = await self._to_leaders({name: masters[name]}, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP,
                                             {"group_name": consumer_group, **fields})
            with _reading("UPDATE_AND_CREATE_SUBSCRIPTIONGROUP", f"broker group {name!r}"):
                data = cbor2.loads(answers[name].body)
                previous = data["previous"]
                updates[name] = SubscriptionGroupUpdate(
                    name, _subscription_group(name, data["config"]),
                    None if previous is None else _subscription_group(name, previous))

        try:
            await _each_group([(name,) for name in sorted(masters)], _one)
        except RaftMQError as e:
            if updates:  # not rolled back: the operator runs it again for the rest
                e.add_note("changed all the same on broker group(s) " + ", ".join(sorted(updates)))
            raise
        return [updates[name] for name in sorted(updates)]

    async def subscription_groups(self, consumer_group: str | None = None, *, cluster: str | None = None,
                                  broker_names: Sequence[str] | None = None) -> list[SubscriptionGroup]:
        """The subscription groups of every group of ``cluster`` (default: all) or of ``broker_names``, from each
        leader (GET_ALL_SUBSCRIPTIONGROUP_CONFIG), sorted by consumer group then broker group; only
        ``consumer_group``'s if given. A consumer group gets one when a member's heartbeat reaches a group's leader,
        or on its first pull there (``auto_create_subscription_group``), or from ``update_subscription_group``."""
        masters = await self._target_masters(cluster, broker_names)
        frames = await self._to_leaders(masters, RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG, {})
        found = []
        for name, frame in frames.items():
            with _reading("GET_ALL_SUBSCRIPTIONGROUP_CONFIG", f"broker group {name!r}"):
                table = cbor2.loads(frame.body)["subscription_groups"]
                if not isinstance(table, Mapping):
                    raise TypeError(f"subscription_groups {table!r} is not a map")
                found += [_subscription_group(name, data) for group, data in table.items()
                          if consumer_group is None or group == consumer_group]
        return sorted(found, key=lambda g: (g.group_name, g.broker_name))

    async def reset_offset(self, consumer_group: str, topic: str, timestamp_ms: int) -> OffsetReset:
        """RocketMQ's resetOffsetByTime: on every group of ``topic``, move ``consumer_group`` to the first
        message stored at or after ``timestamp_ms`` in each queue (0: the oldest kept; a time to come: the end).
        Online members drop what they cached of those queues and pull from there; offline ones start there."""
        if not consumer_group:
            raise ValueError("reset_offset needs a consumer group")
        check_int_arg("timestamp_ms", timestamp_ms, 0, I64_MAX)
        masters = await self._route_masters(topic)
        answers = await self._to_leaders(masters, RequestCode.INVOKE_BROKER_TO_RESET_OFFSET,
                                         {"consumer_group": consumer_group, "topic": topic,
                                          "timestamp": timestamp_ms})
        offsets, previous, told = {}, {}, {}
        for name, frame in sorted(answers.items()):
            with _reading("INVOKE_BROKER_TO_RESET_OFFSET", f"broker group {name!r}"):
                data = cbor2.loads(frame.body) if frame.body else {}
                for row in data.get("offsets", []):
                    mq = MessageQueue(topic, name, _int(row["queue_id"], "queue_id"))
                    offsets[mq] = _int(row["offset"], "offset")
                    previous[mq] = _opt_int(row.get("previous"), "previous")
                told[name] = _names(data.get("consumer_ids", []), "consumer_ids")
        return OffsetReset(consumer_group, offsets, previous, told)

    async def _read_from_group(self, info: ClusterInfo, name: str, code: int, ext: dict[str, Any],
                               ok: tuple[int, ...] = (ResponseCode.SUCCESS,), *, until_found: bool = False) -> Any:
        """A read any node of group ``name`` serves (their commit logs are byte-identical): the leader first,
        then the others when a node cannot be reached. With ``until_found``, also when a node answers other than
        SUCCESS (the last answer when none does): a follower learns that an entry is committed a moment after the
        leader, and only from a leader, so right after a leader dies the last messages it acknowledged are in the
        survivors' Raft logs but not yet in their commit logs, and one node's "not found" is not the group's."""
        nodes = info.broker_addrs.get(name, {})
        addrs = list(dict.fromkeys(addr for _id, addr in sorted(nodes.items())))
        if not addrs:
            raise ClientError(f"broker group {name!r} has no node registered with the name servers",
                              broker_name=name)
        answer: Any = None
        error: RaftMQError | None = None
        for addr in addrs:
            try:
                frame = await self._instance.invoke(addr, code, ext, timeout_s=10.0)
            except RaftMQError as e:
                if not e.retriable:
                    raise
                error = e
                continue
            answer = raise_for_response(frame, ok=ok, topic=ext.get("topic"), broker_name=name)
            if not until_found or answer.code == ResponseCode.SUCCESS:
                return answer
        if answer is not None:
            return answer
        assert error is not None
        raise error

    async def _read_from_route(self, topic: str, code: int, ext: dict[str, Any],
                               ok: tuple[int, ...] = (ResponseCode.SUCCESS,)) -> dict[str, Any]:
        """The same read of every group that routes ``topic``, at once (``_read_from_group``); each group's
        answer."""
        route = await self.get_route(topic)
        info = await self.cluster_info()
        answers: dict[str, Any] = {}

        async def _one(name: str) -> None:
            answers[name] = await self._read_from_group(info, name, code, ext, ok)

        await _each_group([(name,) for name in sorted({q.broker_name for q in route.queue_datas})], _one)
        return answers

    async def query_message(self, topic: str, key: str, *, max_num: int = 32, begin_ms: int = 0,
                            end_ms: int | None = None) -> list[MessageExt]:
        """RocketMQ's queryMessage: messages of ``topic`` whose KEYS hold ``key`` (or whose unique id is
        ``key``), stored between ``begin_ms`` and ``end_ms``, from every group of the topic; newest first, at
        most ``max_num`` (1..64)."""
        if not key:
            raise ValueError("query_message needs a key")
        check_int_arg("max_num", max_num, 1, MAX_QUERY_NUM)
        end_ms = I64_MAX if end_ms is None else end_ms
        check_int_arg("begin_ms", begin_ms, 0, I64_MAX)
        check_int_arg("end_ms", end_ms, 0, I64_MAX)
        if not 0 <= begin_ms <= end_ms:
            raise ValueError(f"the time range must satisfy 0 <= begin_ms <= end_ms, got {begin_ms}..{end_ms}")
        frames = await self._read_from_route(topic, RequestCode.QUERY_MESSAGE,
                                             {"topic": topic, "key": key, "max_num": max_num,
                                              "begin_timestamp": begin_ms, "end_timestamp": end_ms},
                                             ok=(ResponseCode.SUCCESS, ResponseCode.QUERY_NOT_FOUND))
        found = []
        for name, frame in frames.items():
            if frame.code == ResponseCode.SUCCESS:
                with _reading("QUERY_MESSAGE", f"broker group {name!r}"):
                    found += [to_message_ext(view, name) for view in iter_records(frame.body)]
        found.sort(key=lambda m: (-m.store_timestamp, m.broker_name, m.phy_offset))
        return found[:max_num]

    async def query_msg_trace(self, msg_id: str, *, trace_topic: str = TRACE_TOPIC) -> list[TraceContext]:
        """RocketMQ's queryMsgTraceById: the trace contexts of message ``msg_id`` (the producer's unique id,
        ``SendResult.msg_id``) that traced clients sent to ``trace_topic`` (``client/trace.py``), oldest first:
        its Pub, then each handler call's SubBefore and SubAfter. Found by key, at most ``MAX_QUERY_NUM`` trace
        messages; a trace message that cannot be decoded is logged and skipped. Empty if none holds one."""
        if not isinstance(msg_id, str) or not msg_id or KEY_SEPARATOR in msg_id:
            raise ValueError(f"query_msg_trace needs a msg id (a key: no spaces), got {msg_id!r}")
        problem = topic_problem(trace_topic)
        if problem:
            raise ValueError(f"trace_topic {trace_topic!r} {problem}")
        found = await self.query_message(trace_topic, msg_id, max_num=MAX_QUERY_NUM)
        contexts: dict[TraceContext, None] = {}  # a trace message sent twice (a retried send) counts once
        for message in found:
            try:
                decoded = decode_trace_data(message.body.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                log.warning("trace message skipped, it cannot be decoded trace_topic=%s msg_id=%s error=%s",
                            trace_topic, message.msg_id, e)
                continue
            contexts.update(dict.fromkeys(ctx for ctx in decoded if ctx.msg_id == msg_id))
        order = {TraceType.PUB: 0, TraceType.END_TRANSACTION: 1, TraceType.SUB_BEFORE: 2, TraceType.SUB_AFTER: 3}
        return sorted(contexts, key=lambda c: (c.timestamp_ms, order[c.trace_type]))

    async def view_message(self, msg_id: str, *, topic: str | None = None) -> MessageExt:
        """RocketMQ's viewMessage / queryMsgById. ``msg_id`` is the broker's offset message id (32 hex digits:
        ``SendResult.offset_msg_id``, ``MessageExt.offset_msg_id``), read from any node of the group that
        stored it (every group is asked when the node that stored it is registered no more); or, with ``topic``,
        the producer's unique id (``SendResult.msg_id``), found through the index. A message sent more than once
        under one unique id (a retried send) is found once: the newest."""
        try:
            (host, port), phy_offset = parse_msg_id(msg_id)
        except MessageFormatError:
            if topic is None:
                raise ValueError(f"msg_id {msg_id!r} is not an offset message id (32 hex digits); to look up a "
                                 f"producer's unique id, give its topic") from None
            found = await self.query_message(topic, msg_id, max_num=MAX_QUERY_NUM)
            for message in found:
                if message.msg_id == msg_id:
                    return message
            raise ClientError(f"no message with unique id {msg_id!r} in topic {topic!r}", topic=topic) from None
        store_addr = f"{host}:{port}"
        info = await self.cluster_info()
        # The id names the node that led the group when the message was stored; every member holds it.
        name = next((n for n, nodes in sorted(info.broker_addrs.items()) if store_addr in nodes.values()), None)
        if name is None:
            name, frame = await self._view_stored_by_unregistered(info, msg_id, store_addr)
        else:
            frame = await self._read_from_group(info, name, RequestCode.VIEW_MESSAGE_BY_ID, {"offset": phy_offset},
                                                ok=_VIEW_ANSWERS, until_found=True)
        with _reading("VIEW_MESSAGE_BY_ID", f"broker group {name!r}"):
            views = list(iter_records(frame.body)) if frame.code == ResponseCode.SUCCESS else []
        if not views:
            raise ClientError(f"no message {msg_id!r} on broker group {name!r}: {frame.remark or 'empty answer'}",
                              msg_id=msg_id, broker_name=name)
        if topic is not None and views[0].topic != topic:
            raise ClientError(f"message {msg_id!r} is of topic {views[0].topic!r}, not {topic!r}", msg_id=msg_id,
                              topic=topic)
        return to_message_ext(views[0], name)

    async def _view_stored_by_unregistered(self, info: ClusterInfo, msg_id: str, store_addr: str) -> tuple[str, Any]:
        """``(group, VIEW_MESSAGE_BY_ID answer)`` for an id whose storing node no name server lists: a leader
        killed (a node is unregistered when its connections close) or moved to another address. Its group's other
        members hold the message (before, the lookup was refused while they served it). Every group is asked with
        the whole id, which a node answers only with a record stored at that offset by that host."""
        misses = []
        for name in sorted(info.broker_addrs):
            try:
                frame = await self._read_from_group(info, name, RequestCode.VIEW_MESSAGE_BY_ID, {"msg_id": msg_id},
                                                    ok=_VIEW_ANSWERS, until_found=True)
            except RaftMQError as e:
                misses.append(f"{name}: {e}")
                continue
            if frame.code == ResponseCode.SUCCESS:
                return name, frame
            misses.append(f"{name}: {frame.remark or 'not found'}")
        raise ClientError(f"msg_id {msg_id!r} was stored by {store_addr}, which is no node of a group the name "
                          f"servers know, and no group holds it ({'; '.join(misses) or 'no group is registered'})",
                          msg_id=msg_id)

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


def _check_targets(cluster: Any, broker_names: Any) -> None:
    """``cluster`` and ``broker_names`` of a topic change: a str as ``broker_names`` was taken one character per
    group ("broker group 'b' has no leader"), a cluster that was no str reported as unknown to the name servers."""
    if cluster is not None and not isinstance(cluster, str):
        raise TypeError(f"cluster must be a cluster name (str), got {cluster!r}")
    if broker_names is None:
        return
    if isinstance(broker_names, (str, bytes)) or not isinstance(broker_names, Collection) or not all(
            isinstance(n, str) and n for n in broker_names):
        raise TypeError(f"broker_names must be a list of broker group names, got {broker_names!r}")


async def _each_group(calls: Iterable[tuple[Any, ...]], one: Callable[..., Awaitable[None]]) -> None:
    """``one(*args)`` for every group at once. A refusal or failure (``RaftMQError``) is raised as itself, not in
    an ExceptionGroup: the first group's, by name, with the others' noted (several groups usually refuse the
    same bad topic name alike)."""
    errors: dict[str, RaftMQError] = {}

    async def _run(args: tuple[Any, ...]) -> None:
        try:
            await one(*args)
        except RaftMQError as e:
            errors[str(args[0])] = e

    async with trio.open_nursery() as nursery:
        for args in calls:
            nursery.start_soon(_run, args)
    if errors:
        first, *others = sorted(errors)
        error = errors[first]
        if others:
            error.add_note("also from broker group(s) " + "; ".join(f"{name}: {errors[name]}" for name in others))
        raise error


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
