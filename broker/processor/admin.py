"""Admin requests: topic create/update/delete, topic listing, subscription group create/update and listing, queue
offsets, topic status, broker status, the node's config and its runtime update, delayed messages' progress.

Topic changes are leader-only and replicated through the group's metadata before the answer, then the node
re-registers with every name server at once, so a route query right after the answer already shows the change.
Subscription group changes are leader-only and replicated before the answer too (``broker/subscription_group.py``);
any node lists its own copy.
Offset reads (min/max, by timestamp, earliest store time) are served by any node from its own store.

The two table listings (GET_ALL_TOPIC_CONFIG, GET_ALL_SUBSCRIPTIONGROUP_CONFIG) never answer more than one frame
carries: a table may hold 200,000 entries (``max_topic_count``, ``max_subscription_group_count``), and at ~23,600
groups with 255-character names the whole of it was past 16 MiB, so every listing failed for good. A request names
one entry (ext ``topic`` / ``group_name``) and gets that entry alone, or pages (ext ``after``, ``limit``) through
the table in name order; one that does neither, as older clients send, gets the whole table when it fits and a
refusal naming ``limit`` when it does not (a first page would pass for the whole table with them).
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cbor2

from broker.config import RuntimeConfigError, check_runtime_key, parse_runtime_value
from broker.processor.base import (I32, I64, RequestRejected, existing_topic_config, get_existing_topic, get_int,
                                   get_str, get_topic_queue, invalid, request_data)
from broker.subscription_group import SubscriptionGroupConfig, SubscriptionGroupError
from broker.topic_config import SYSTEM_TOPIC_PREFIX, TopicConfig, TopicConfigError, is_reserved_topic, is_system_topic
from remoting.codec import Frame, make_response
from remoting.codes import ResponseCode

if TYPE_CHECKING:
    from broker.node import BrokerNode

# Room a listing's page leaves in the frame for the response header and the body's other keys (data_version, a
# next_after of up to 255 characters) take a few hundred bytes; 4096 leaves room to spare.
LISTING_HEADROOM_BYTES = 4096


class AdminProcessor:
    def __init__(self, node: BrokerNode) -> None:
        self.node = node

    # --- topics --------------------------------------------------------------------------------------------
    async def update_and_create_topic(self, request: Frame, conn: Any) -> Frame:
        await self.node.wait_ready_leader()
        try:
            config = TopicConfig.from_wire(request.ext)
        except TopicConfigError as e:
            raise RequestRejected(ResponseCode.INVALID_REQUEST, f"request field {e.field!r}: {e}",
                                  ext={"field": e.field}) from None
        # Every system name (RocketMQ's isSystemTopic) is the broker's own: creating one would only put a topic in
        # the routes that every send refuses, or (the trace topic) one the brokers create themselves.
        if is_reserved_topic(config.topic_name):
            why = (f"prefix {SYSTEM_TOPIC_PREFIX!r} is reserved for the broker" if is_system_topic(config.topic_name)
                   else "the name is reserved for the broker")
            raise RequestRejected(ResponseCode.INVALID_REQUEST,
                                  f"request field 'topic_name': topic {config.topic_name!r} conflicts with the "
                                  f"system topics ({why})", ext={"field": "topic_name"})
        await self.node.update_topic(config)
        return make_response(request, ResponseCode.SUCCESS)

    async def delete_topic(self, request: Frame, conn: Any) -> Frame:
        # A topic created just before this leader was elected exists once it has applied its no-op.
        await self.node.wait_ready_leader()
        topic = get_str(request.ext, "topic")
        # A stored topic goes whatever its name: an older version let a trailing newline through, and such a
        # topic can only be deleted.
        existing_topic_config(self.node, topic)
        # A POP, ack or revive of the topic (or of its POP retry topics) in flight would write its keys back after
        # the delete removed them (broker/pop.py, "Nothing comes back after a delete").
        async with self.node.pop.forgetting(topic=topic):
            await self.node.delete_topic(topic)
        return make_response(request, ResponseCode.SUCCESS)

    async def get_all_topic_config(self, request: Frame, conn: Any) -> Frame:
        """RocketMQ's getAllTopicConfig (ext ``topic``: its getTopicConfig): ``{"data_version", "topic_configs":
        {topic: config}, "next_after"}``, this node's copy; one topic, a page or the whole table (``_listing``)."""
        topics = self.node.topics

        def wire(topic: str) -> dict[str, Any] | None:
            config = topics.get(topic)
            return None if config is None else config.to_wire()

        body = self._listing(request, "topic_configs", "topic", "topic", topics.data_version, wire,
                             lambda: [c.topic_name for c in topics.all()], topics.to_wire)
        return make_response(request, ResponseCode.SUCCESS, body=body)

    # --- subscription groups -------------------------------------------------------------------------------
    async def update_and_create_subscription_group(self, request: Frame, conn: Any) -> Frame:
        """RocketMQ's updateAndCreateSubscriptionGroup, on the leader: a CBOR map (body, or ext) with ``group_name``
        and the fields to set; the fields left out (or null) keep their value, RocketMQ's default for a new group.
        Answer body: ``{"config": the group's config now, "previous": before, null if it was created}``."""
        data = request_data(request)
        try:
            wanted = SubscriptionGroupConfig.from_wire(data)  # every field judged before the leader is asked
            config, previous = await self.node.subscription_groups.update(wanted.group_name, data)
        except SubscriptionGroupError as e:
            raise RequestRejected(ResponseCode.INVALID_REQUEST, f"request field {e.field!r}: {e}",
                                  ext={"field": e.field}) from None
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps(
            {"config": config.to_wire(), "previous": previous.to_wire() if previous is not None else None}))

    async def get_all_subscription_group_config(self, request: Frame, conn: Any) -> Frame:
        """This node's copy of the group's subscription groups: ``{"data_version", "subscription_groups": {name:
        config}, "next_after"}``; one group (ext ``group_name``), a page or the whole table (``_listing``). A
        follower's may be a replication behind its leader's."""
        table = self.node.subscription_groups.table

        def wire(group: str) -> dict[str, Any] | None:
            config = table.get(group)
            return None if config is None else config.to_wire()

        body = self._listing(request, "subscription_groups", "group_name", "subscription group", table.data_version,
                             wire, lambda: [c.group_name for c in table.all()], table.to_wire)
        return make_response(request, ResponseCode.SUCCESS, body=body)

    def _listing(self, request: Frame, key: str, name_field: str, noun: str, data_version: int,
                 wire: Callable[[str], dict[str, Any] | None], names: Callable[[], list[str]],
                 whole: Callable[[], Mapping[str, Any]]) -> bytes:
        """The body of a table listing: ``{"data_version", key: {name: config}, "next_after"}``.

        - ext ``name_field`` (a name): that entry alone, or an empty map; ``next_after`` null.
        - ext ``after`` (a name, "" for the start) and/or ``limit`` (1..I32 max): the entries named after ``after``
          in code point order, at most ``limit`` and at most what fits in this node's ``max_frame_size``;
          ``next_after`` is the last name answered when more follow (the next page's ``after``), else null.
        - neither (an older client): the whole table when it fits, else INVALID_REQUEST naming ``limit``.

        The entries are taken as a list first: ``all()`` copies them in one step, where a generator over the table
        would meet a change applied meanwhile on the Raft thread (the topic table's)."""
        ext = request.ext
        paged = ext.get("after") is not None or ext.get("limit") is not None
        budget = self.node.config.max_frame_size - LISTING_HEADROOM_BYTES
        if ext.get(name_field) is not None:
            name = get_str(ext, name_field)
            if paged:
                raise invalid(name_field, "names one entry and cannot go with 'after' or 'limit', which page "
                                          "through the whole table")
            config = wire(name)
            return cbor2.dumps({"data_version": data_version, key: {} if config is None else {name: config},
                                "next_after": None})
        if not paged:
            table = whole()
            size = 0
            # Measured entry by entry, to stop at the budget: 200,000 topics took 1.2 s to encode whole, on the
            # thread that serves every other request.
            for name, config in table.items():
                size += len(cbor2.dumps(name)) + len(cbor2.dumps(config))
                if size > budget:
                    raise invalid("limit", f"is required: this node's {len(table)} {noun}s take more than the "
                                           f"{budget} bytes one answer carries (max_frame_size "
                                           f"{self.node.config.max_frame_size}); ask page by page with 'after' and "
                                           f"'limit' (raftmq admin does)")
            return cbor2.dumps({"data_version": data_version, key: table, "next_after": None})
        after = get_str(ext, "after", default="", allow_empty=True)
        limit = get_int(ext, "limit", default=I32[1], lo=1, hi=I32[1])
        # One more name than asked tells whether another page follows.
        candidates = heapq.nsmallest(limit + 1, (n for n in names() if n > after))
        page: dict[str, Any] = {}
        size = 0
        last = None  # the last name looked at: the next page starts after it
        for name in candidates[:limit]:
            config = wire(name)
            if config is not None:  # else deleted since names() was taken
                entry_bytes = len(cbor2.dumps(name)) + len(cbor2.dumps(config))
                if page and size + entry_bytes > budget:
                    break
                page[name] = config
                size += entry_bytes
            last = name
        more = last is not None and last < candidates[-1]
        return cbor2.dumps({"data_version": data_version, key: page, "next_after": last if more else None})

    # --- queue offsets -------------------------------------------------------------------------------------
    def _queue(self, request: Frame) -> tuple[str, int]:
        return get_topic_queue(self.node, request.ext)

    async def get_max_offset(self, request: Frame, conn: Any) -> Frame:
        topic, queue_id = self._queue(request)
        return make_response(request, ResponseCode.SUCCESS,
                             ext={"offset": self.node.store.get_max_offset_in_queue(topic, queue_id)})

    async def get_min_offset(self, request: Frame, conn: Any) -> Frame:
        topic, queue_id = self._queue(request)
        return make_response(request, ResponseCode.SUCCESS,
                             ext={"offset": self.node.store.get_min_offset_in_queue(topic, queue_id)})

    async def search_offset_by_timestamp(self, request: Frame, conn: Any) -> Frame:
        topic, queue_id = self._queue(request)
        timestamp = get_int(request.ext, "timestamp", lo=0, hi=I64[1])
        return make_response(request, ResponseCode.SUCCESS,
                             ext={"offset": self.node.store.get_offset_by_time(topic, queue_id, timestamp)})

    async def get_earliest_msg_store_time(self, request: Frame, conn: Any) -> Frame:
        topic, queue_id = self._queue(request)
        store = self.node.store
        min_offset = store.get_min_offset_in_queue(topic, queue_id)
        if min_offset >= store.get_max_offset_in_queue(topic, queue_id):
            return make_response(request, ResponseCode.SUCCESS, ext={"timestamp": -1})
        message = self.node.message_at(topic, queue_id, min_offset)
        return make_response(request, ResponseCode.SUCCESS,
                             ext={"timestamp": message.store_timestamp if message is not None else -1})

    async def get_topic_stats_info(self, request: Frame, conn: Any) -> Frame:
        """RocketMQ's topicStatus: per queue the min and max offsets and when its last message was stored."""
        node = self.node
        topic = get_existing_topic(node, request.ext)
        config = node.topic(topic)
        assert config is not None
        store = node.store
        rows = []
        for queue_id in range(max(config.read_queue_nums, config.write_queue_nums)):
            min_offset = store.get_min_offset_in_queue(topic, queue_id)
            max_offset = store.get_max_offset_in_queue(topic, queue_id)
            last = node.message_at(topic, queue_id, max_offset - 1) if max_offset > min_offset else None
            rows.append({"queue_id": queue_id, "min_offset": min_offset, "max_offset": max_offset,
                         "last_update_timestamp": last.store_timestamp if last is not None else None})
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps({"offsets": rows}))

    # --- status --------------------------------------------------------------------------------------------
    async def get_broker_runtime_info(self, request: Frame, conn: Any) -> Frame:
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps(self.node.runtime_info()))

    async def get_broker_config(self, request: Frame, conn: Any) -> Frame:
        """RocketMQ's getBrokerConfig: this node's effective config, every key of its file and the defaults it left,
        as a CBOR map (sections ``store`` and ``dledger`` nested); any node answers for itself. The cluster
        secret is never sent, only whether one is set (RocketMQ's has no such key; ours authenticates every Raft
        frame, and this request has no authentication of its own)."""
        config = _plain(self.node.config)
        config["dledger"]["secret"] = "<set>" if config["dledger"]["secret"] else ""
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps(config))

    async def update_broker_config(self, request: Frame, conn: Any) -> Frame:
        """RocketMQ's updateBrokerConfig, on this node only (every node registers and may lead, so an admin updates
        each): a CBOR map of config key -> value as text. Only ``broker.config.RUNTIME_KEYS``; each value is read
        and judged as the config file's would be. Every key is checked before any is applied: one refused, none
        is (INVALID_REQUEST naming it, ext ``field``). Answer: body ``{"values": {key: value now}, "previous":
        {key: value before}}``. No authentication, as every other admin request on this port (topic changes
        included): the remoting port is for trusted clients only (docs/operations.md)."""
        data = request_data(request)
        if not isinstance(data, dict) or not data:
            raise invalid("body", f"must be a non-empty map of config key -> value (text), got {data!r}")
        try:
            values = {check_runtime_key(key): parse_runtime_value(key, text) for key, text in data.items()}
            previous = await self.node.update_config(values)
        except RuntimeConfigError as e:
            raise RequestRejected(ResponseCode.INVALID_REQUEST, str(e), ext={"field": e.key or "body"}) from None
        now = self.node.config
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps(
            {"values": {key: getattr(now, key) for key in values}, "previous": previous}))

    async def get_all_delay_offset(self, request: Frame, conn: Any) -> Frame:
        """Delayed messages per level: delivered up to where, stored up to where (``ScheduleMessageService``)."""
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps({"levels": self.node.schedule.progress()}))


def _plain(value: Any) -> Any:
    """A config as CBOR can carry it: dataclasses as maps, tuples as lists, paths and enums as text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value
