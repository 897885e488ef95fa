"""QUERY_CONSUMER_OFFSET, UPDATE_CONSUMER_OFFSET, GET_CONSUME_STATS, INVOKE_BROKER_TO_RESET_OFFSET,
DELETE_SUBSCRIPTIONGROUP and CLONE_GROUP_OFFSET.

Updates are accepted by the leader only (NOT_LEADER elsewhere, with ``leader_addr``) and replicated in batches
(``broker/offset_manager.py``); a group's first offset of a queue before the answer (``BrokerNode.commit_offset``).
An update for a consumer group this broker has no subscription group config of is served as a pull is: the config is
auto-created, or, with ``auto_create_subscription_group`` false (or no room under ``max_subscription_group_count``),
the update is refused SUBSCRIPTION_GROUP_NOT_EXIST, as RocketMQ 5 refuses it.
Queries too are answered by the leader only, once its no-op is applied (``BrokerNode.wait_ready_leader``): the
answer is where a consumer resumes, and only that table holds every replicated commit. A group that never committed
an offset for the queue gets QUERY_NOT_FOUND, and the client then starts from its ``consume_from_where`` (RocketMQ
answers 0 while the queue still starts at 0, which replays the backlog to a new group from its last offset; the push
consumer covers what that answer was for: a queue created after it subscribed starts at its first message, and a
start it found is committed at once).

GET_CONSUME_STATS is RocketMQ's consumer progress (``mqadmin consumerProgress``): for every queue of the topics
a group consumes here, the queue's max offset, the group's offset and the lag between them. Any node answers;
the leader's answer includes commits not yet replicated, a follower's may be one flush interval behind.

DELETE_SUBSCRIPTIONGROUP is RocketMQ's deleteSubGroup: on the leader, the group's subscription-group config goes
(``broker/subscription_group.py``; its next pull auto-creates it again with the defaults, or is refused with
``auto_create_subscription_group`` false) and, with ``clean_offset`` (default true), its offsets, its POP state and
its POP retry topics ``%RETRY%<group>+<topic>``, replicated before the answer (ext ``removed``, the queues that had
an offset; ``config_removed``, whether it had a config). ``clean_offset``
false for a group without a config, which would remove nothing, is refused. A group with members online here is
refused too: they would commit their offsets again within a second, and the group would seem deleted.

INVOKE_BROKER_TO_RESET_OFFSET is RocketMQ's resetOffsetByTime: on the leader, every read queue of the topic gets
the offset of its first message stored at or after ``timestamp`` (0: the oldest kept; a future time: the end),
replicated before the answer; the group's online members are told to drop what they cached and pull from there.

CLONE_GROUP_OFFSET is RocketMQ's cloneGroupOffset: on the leader, ``dest_group`` gets ``src_group``'s committed
offset of every queue of ``topic`` (those ``src_group`` committed, or a POP group's pop offsets; the others are left
as they are), replicated as an offset reset is (a POP ``dest_group``'s pop offsets move too), and ``dest_group``'s
online members are told to pull from there, as by a reset (RocketMQ tells them nothing, and their next commits put
their old offsets back). A ``src_group`` with no committed offset of the topic here is QUERY_NOT_FOUND: nothing is
changed, and the admin client, which asks every group of the topic, refuses only when no group had any.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import cbor2

from broker.offset_manager import consumer_lag
from broker.processor.base import (I64, RequestRejected, get_bool, get_existing_topic, get_group, get_int,
                                   get_topic_queue, invalid)
from remoting.codec import Frame, make_response
from remoting.codes import ResponseCode
from remoting.message import split_pop_retry_topic

if TYPE_CHECKING:
    from broker.node import BrokerNode


class ConsumerManageProcessor:
    def __init__(self, node: BrokerNode) -> None:
        self.node = node

    def _key(self, request: Frame) -> tuple[str, str, int]:
        ext = request.ext
        group = get_group(ext)
        topic, queue_id = get_topic_queue(self.node, ext)
        return group, topic, queue_id

    async def query_consumer_offset(self, request: Frame, conn: Any) -> Frame:
        # A follower's table, or a leader's before its no-op is applied, may lack the latest commits: a consumer
        # told an older offset went back over what it had committed, and one told none (a group's first commits)
        # started from consume_from_where, from its last offset past every message it had not consumed.
        await self.node.wait_ready_leader()
        group, topic, queue_id = self._key(request)
        offset = self.node.offsets.query(group, topic, queue_id)
        if offset is None:
            return make_response(request, ResponseCode.QUERY_NOT_FOUND,
                                 remark=f"consumer group {group!r} has no offset for {topic}:{queue_id}",
                                 ext={"offset": -1})
        return make_response(request, ResponseCode.SUCCESS, ext={"offset": offset})

    async def update_consumer_offset(self, request: Frame, conn: Any) -> Frame | None:
        if not self.node.is_leader():
            raise self.node.not_leader()
        group, topic, queue_id = self._key(request)
        offset = get_int(request.ext, "commit_offset", lo=0)
        self.node.subscription_groups.check_offset_commit(group)
        await self.node.commit_offset(group, topic, queue_id, offset)
        return None if request.is_oneway else make_response(request, ResponseCode.SUCCESS)

    async def reset_offset(self, request: Frame, conn: Any) -> Frame:
        """Body: ``{"offsets": [{queue_id, offset, previous}], "consumer_ids": [members told]}``."""
        node = self.node
        await node.wait_ready_leader()  # "previous" offsets and the topic, from a complete table
        group = get_group(request.ext)
        topic = get_existing_topic(node, request.ext)
        timestamp = get_int(request.ext, "timestamp", lo=0, hi=I64[1])
        config = node.topic(topic)
        assert config is not None
        previous = node.offsets.offsets_of_group(group)
        offsets = {q: node.store.get_offset_by_time(topic, q, timestamp) for q in range(config.read_queue_nums)}
        told = await node.reset_offsets(group, topic, offsets)
        rows = [{"queue_id": q, "offset": o, "previous": previous.get((topic, q))} for q, o in sorted(offsets.items())]
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps({"offsets": rows, "consumer_ids": told}))

    async def get_consume_stats(self, request: Frame, conn: Any) -> Frame:
        """Body: ``{"offsets": [{topic, queue_id, broker_offset, consumer_offset, lag, last_timestamp}],
        "consumer_ids": [...], "consume_tps": messages/s pulled by the group from those topics here}``.
        ``topic`` (optional) narrows it to one topic; without it, every topic the group has an offset for on this
        group. ``consumer_offset`` is None where the group committed nothing."""
        node = self.node
        group = get_group(request.ext)
        committed = node.offsets.offsets_of_group(group)
        topic = get_existing_topic(node, request.ext, required=False)
        if topic:
            # RocketMQ lists a topic the group subscribes to even before its first commit.
            subscribed = node.clients.find_subscription(group, topic) is not None
            topics = [topic] if subscribed or any(t == topic for t, _q in committed) else []
        else:
            topics = sorted({t for t, _q in committed})
        store = node.store
        rows = []
        for name in topics:
            config = node.topic(name)
            if config is None:  # offsets of a topic deleted a moment ago
                continue
            queue_ids = set(range(config.read_queue_nums)) | {q for t, q in committed if t == name}
            for queue_id in sorted(queue_ids):
                broker_offset = store.get_max_offset_in_queue(name, queue_id)
                min_offset = store.get_min_offset_in_queue(name, queue_id)
                consumer_offset = committed.get((name, queue_id))
                last_timestamp = None
                if consumer_offset is not None and min_offset < consumer_offset <= broker_offset:
                    message = node.message_at(name, queue_id, consumer_offset - 1)
                    last_timestamp = message.store_timestamp if message is not None else None
                rows.append({"topic": name, "queue_id": queue_id, "broker_offset": broker_offset,
                             "consumer_offset": consumer_offset,
                             "lag": consumer_lag(broker_offset, min_offset, consumer_offset),
                             "last_timestamp": last_timestamp})
        tps = sum(node.pull_stats.tps(group, name) for name in topics)
        body = cbor2.dumps({"offsets": rows, "consumer_ids": node.clients.consumer_ids(group),
                            "consume_tps": round(tps, 1)})
        return make_response(request, ResponseCode.SUCCESS, body=body)

    async def delete_subscription_group(self, request: Frame, conn: Any) -> Frame:
        node = self.node
        await node.wait_ready_leader()  # the leader's table alone holds every commit
        group = get_group(request.ext, "group_name")
        clean_offset = get_bool(request.ext, "clean_offset", default=True)
        if not clean_offset and node.subscription_groups.get(group) is None:
            raise invalid("clean_offset", f"false would delete nothing: consumer group {group!r} has no subscription "
                                          f"group config on broker {node.config.broker_name}, and its offsets are kept")
        members = node.clients.consumer_ids(group)
        if members:
            raise RequestRejected(ResponseCode.NO_PERMISSION,
                                  f"consumer group {group!r} has {len(members)} member(s) online on broker "
                                  f"{node.config.broker_name} ({', '.join(sorted(members)[:3])}"
                                  f"{', ...' if len(members) > 3 else ''}): stop them first, or their next commits "
                                  f"bring its offsets back", ext={"consumer_group": group})
        removed = await self._clean_group(group) if clean_offset else 0
        config_removed = await node.subscription_groups.delete(group)
        return make_response(request, ResponseCode.SUCCESS, ext={"removed": removed, "config_removed": config_removed})

    async def _clean_group(self, group: str) -> int:
        """``clean_offset``: the group's offsets and POP state, and its POP retry topics with them (a retry topic
        without the pop offsets saying how far it was read is read again from its start by the group's next POP);
        its push retry topic ``%RETRY%<group>`` is deleted by the admin tool, as RocketMQ's mqadmin deleteSubGroup
        does. The number of queues that had an offset."""
        node = self.node
        async with node.pop.forgetting(group=group):  # nothing of it written back after (broker/pop.py)
            removed = await node.delete_group_offsets(group)
            retry_topics = [config.topic_name for config in node.topics.all()
                            if (split_pop_retry_topic(config.topic_name) or ("",))[0] == group]
            for topic in retry_topics:
                await node.delete_topic(topic)
        return removed

    async def clone_group_offset(self, request: Frame, conn: Any) -> Frame:
        """Ext ``src_group``, ``dest_group``, ``topic``. Body: ``{"offsets": [{queue_id, offset, previous}],
        "consumer_ids": [dest_group's members told]}``, ``previous`` being ``dest_group``'s offset before (None:
        none)."""
        node = self.node
        await node.wait_ready_leader()  # the source's offsets from a complete table
        src = get_group(request.ext, "src_group")
        dest = get_group(request.ext, "dest_group")
        if src == dest:
            raise invalid("dest_group", f"is the source group {src!r} itself: nothing to clone")
        topic = get_existing_topic(node, request.ext)
        offsets = {q: o for (t, q), o in node.offsets.offsets_of_group(src).items() if t == topic}
        offsets.update(node.pop.pop_offsets(src, topic))  # a POP group's own offsets: where its next POP reads
        if not offsets:
            raise RequestRejected(ResponseCode.QUERY_NOT_FOUND,
                                  f"consumer group {src!r} has no committed offset of topic {topic!r} on broker "
                                  f"{node.config.broker_name}: nothing to clone", ext={"consumer_group": src})
        previous = node.offsets.offsets_of_group(dest)
        told = await node.reset_offsets(dest, topic, offsets)
        rows = [{"queue_id": q, "offset": o, "previous": previous.get((topic, q))} for q, o in sorted(offsets.items())]
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps({"offsets": rows, "consumer_ids": told}))
