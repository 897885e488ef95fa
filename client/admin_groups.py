"""The admin client's consumer-group part: progress (consume stats), members (consumer and producer connections, a
member's running info), offsets (reset by time, clone from another group) and subscription group configs (update,
list, delete). Mixed into ``AdminClient`` (``client/admin.py``), whose docs these methods are."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import cbor2
import trio

from client.admin_base import AdminBase, each_group
from client.admin_types import (SUBSCRIPTION_GROUP_FIELDS, ClusterInfo, ConsumerConnection, ConsumerRunningInfo,
                                ConsumeStats, GroupDeletion, GroupOffsetClone, OffsetReset, ProducerConnection,
                                QueueConsumeStats, SubscriptionGroup, SubscriptionGroupUpdate,
                                parse_consumer_running_info)
# The answer readers, under the names the admin client has always used.
from client.admin_types import (int_field as _int, names_field as _names, opt_int_field as _opt_int,
                                parse_subscription_group as _subscription_group, rate_field as _rate,
                                reading as _reading, str_field as _str)
from client.message import I64_MAX, MessageQueue, check_int_arg
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError, TopicNotExistError, for_code
from remoting.message import RETRY_GROUP_MAX_LENGTH, group_problem, retry_topic

log = logging.getLogger(__name__)


class GroupAdmin(AdminBase):
    """``AdminClient``'s consumer-group requests."""

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
            await each_group([(name,) for name in sorted(masters)], _one)
        except RaftMQError as e:
            if updates:  # not rolled back: the operator runs it again for the rest
                e.add_note("changed all the same on broker group(s) " + ", ".join(sorted(updates)))
            raise
        return [updates[name] for name in sorted(updates)]

    async def subscription_groups(self, consumer_group: str | None = None, *, cluster: str | None = None,
                                  broker_names: Sequence[str] | None = None) -> list[SubscriptionGroup]:
        """The subscription groups of every group of ``cluster`` (default: all) or of ``broker_names``, from each
        leader (GET_ALL_SUBSCRIPTIONGROUP_CONFIG: page by page, or naming ``consumer_group`` when given, for its
        alone), sorted by consumer group then broker group. A consumer group gets one when a member's heartbeat
        reaches a group's leader, or on its first pull there (``auto_create_subscription_group``), or from
        ``update_subscription_group``."""
        masters = await self._target_masters(cluster, broker_names)
        tables = await self._leader_tables(masters, RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG, "subscription_groups",
                                           None if consumer_group is None else {"group_name": consumer_group})
        found = []
        for name, table in tables.items():
            with _reading("GET_ALL_SUBSCRIPTIONGROUP_CONFIG", f"broker group {name!r}"):
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
