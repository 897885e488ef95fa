"""Delayed messages: RocketMQ's ScheduleMessageService on a Raft group.

Rules this module keeps:

* **Where a delayed message waits.** A message with property DELAY = ``level`` (1-based into the broker's
  ``message_delay_level``) is stored, as sent, in ``SCHEDULE_TOPIC_XXXX`` queue ``level - 1``, with its real
  topic and queue in REAL_TOPIC and REAL_QID (``schedule_properties``). One queue per level keeps each queue in
  due order: every message of a level waits the same time, and a queue is in store-time order.
  A queue left from a longer ``message_delay_level`` (fewer levels after a restart) is due by the last level.
* **Who delivers.** Only the leader whose no-op is applied, so one node at a time and with the complete progress
  table. Each round reads the head of each level's queue, appends every message that is due (store timestamp +
  the level's delay) to its real topic in one batch through the group commit, and only then replicates the new
  progress (``broker.schedule_offset``: level → next schedule queue offset) as Raft metadata, as consumer offsets
  are. A leader killed between the two steps makes its successor deliver that batch again: at-least-once, as
  RocketMQ, never a loss.
* **What is delivered.** The message as it was sent: body, flag, sys flag, born time and host, reconsume times
  and every property (keys, tags, UNIQ_KEY: the same message id) but DELAY; REAL_TOPIC and REAL_QID stay, as
  RocketMQ leaves them. It gets a queue offset in its real topic and is indexed there like any message.
* **Nothing on the send path for other messages.** The send processor looks DELAY up only in a message that has
  properties (one dict lookup); a batch may not carry DELAY (as RocketMQ's MessageBatch).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import trio

from broker.processor.base import RequestRejected
from broker.store.results import GetMessageStatus
from remoting.codes import ResponseCode
from remoting.errors import RaftMQError
from remoting.message import (PROPERTY_DELAY, PROPERTY_REAL_QUEUE_ID, PROPERTY_REAL_TOPIC, SCHEDULE_TOPIC,
                              MessageFormatError, MessageInput, MessageView, decode_record, encode_batch)

if TYPE_CHECKING:
    from broker.node import BrokerNode

log = logging.getLogger(__name__)

__all__ = ["SCHEDULE_TABLE", "schedule_properties", "with_real_destination", "restored_message", "stored_again",
           "delay_level_of", "ScheduleMessageService"]

SCHEDULE_TABLE = "broker.schedule_offset"
ROUND_INTERVAL_S = 0.1
DELIVER_MAX_MESSAGES = 64


def with_real_destination(properties: Mapping[str, Any], topic: str, queue_id: int) -> dict[str, Any]:
    """``properties`` plus REAL_TOPIC and REAL_QID: where a message parked in a system topic (a delay level's
    schedule queue, the transaction half queue) goes once it is due or committed (``restored_message``)."""
    props = dict(properties)
    props[PROPERTY_REAL_TOPIC] = topic
    props[PROPERTY_REAL_QUEUE_ID] = str(queue_id)
    return props


def schedule_properties(topic: str, queue_id: int, properties: Mapping[str, str], level: int) -> dict[str, str]:
    """The properties of a message of ``topic``:``queue_id`` stored to wait ``level`` in the schedule topic."""
    return with_real_destination({**properties, PROPERTY_DELAY: str(level)}, topic, queue_id)


def restored_message(view: MessageView, drop: Sequence[str], *, sys_flag: int | None = None,
                     prepared_transaction_offset: int | None = None) -> MessageInput:
    """The message a parked record stands for, back in its REAL_TOPIC / REAL_QID: body, flag, born time and host,
    reconsume times and every property but those in ``drop``, as it was sent. Raises ``MessageFormatError``
    (field ``properties``) when the record names no real destination, or one it cannot be written to."""
    props = dict(view.properties)
    topic = props.get(PROPERTY_REAL_TOPIC)
    queue_id = props.get(PROPERTY_REAL_QUEUE_ID)
    for name in drop:
        props.pop(name, None)
    if topic is None or queue_id is None or not queue_id.isdecimal():
        raise MessageFormatError("properties", f"REAL_TOPIC {topic!r} / REAL_QID {queue_id!r} missing or not a queue")
    return stored_again(view, topic, int(queue_id), props, sys_flag=sys_flag,
                        prepared_transaction_offset=prepared_transaction_offset)


def stored_again(view: MessageView, topic: str, queue_id: int, properties: Mapping[str, str], *,
                 sys_flag: int | None = None, reconsume_times: int | None = None,
                 prepared_transaction_offset: int | None = None) -> MessageInput:
    """A stored record written again to ``topic``/``queue_id`` with ``properties``: its body, flag, born time and
    host as they were, and its sys flag, reconsume times and prepared transaction offset unless given."""
    return MessageInput(topic=topic, queue_id=queue_id, body=bytes(view.body), properties=properties,
                        flag=view.flag, sys_flag=view.sys_flag if sys_flag is None else sys_flag,
                        born_timestamp=view.born_timestamp, born_host=view.born_host,
                        reconsume_times=view.reconsume_times if reconsume_times is None else reconsume_times,
                        prepared_transaction_offset=(view.prepared_transaction_offset
                                                     if prepared_transaction_offset is None
                                                     else prepared_transaction_offset))


def delay_level_of(value: Any, levels: int) -> int:
    """The level a DELAY property names; raises ValueError saying what a level must be."""
    if type(value) is not str or not value.isdecimal() or len(value) > 9 or not 0 <= int(value) <= levels:
        raise ValueError(f"property {PROPERTY_DELAY!r} must be a delay level 0..{levels} (this broker's "
                         f"message_delay_level has {levels} levels; 0 is no delay), got {value!r}")
    return int(value)


class ScheduleMessageService:
    """Delivers due messages of ``SCHEDULE_TOPIC_XXXX`` to their real topics, on the ready leader only."""

    def __init__(self, node: BrokerNode, levels_ms: Sequence[int]) -> None:
        self.node = node
        self.levels_ms = tuple(levels_ms)
        self.delivered = 0
        self.dropped = 0

    def redirect(self, topic: str, queue_id: int, properties: Mapping[str, Any]) -> tuple[str, int, Mapping[str, Any]]:
        """Where a sent message with a DELAY property is stored: the schedule queue of its level (level 0: where it
        was sent). Bad levels are INVALID_REQUEST naming ``properties``."""
        try:
            level = delay_level_of(properties[PROPERTY_DELAY], len(self.levels_ms))
        except ValueError as e:
            raise RequestRejected(ResponseCode.INVALID_REQUEST, f"request field 'properties': {e}",
                                  ext={"field": "properties"}) from None
        if level == 0:
            return topic, queue_id, properties
        return SCHEDULE_TOPIC, level - 1, schedule_properties(topic, queue_id, properties, level)

    def offsets(self) -> dict[int, int]:
        """Replicated progress: level → next schedule queue offset to deliver."""
        return {int(k): int(v) for k, v in self.node.group.metadata(SCHEDULE_TABLE).items()}

    def levels(self) -> list[tuple[int, int]]:
        """``(level, delay_ms)`` of every schedule queue that is read: the configured levels, then any queue left
        from a longer ``message_delay_level`` (fewer levels after a restart). Its messages would otherwise never be
        delivered; they go out after the last level's delay, the longest wait still known."""
        levels = list(enumerate(self.levels_ms, 1))
        levels += [(queue_id + 1, self.levels_ms[-1]) for queue_id in self.node.store.queue_ids(SCHEDULE_TOPIC)
                   if queue_id >= len(self.levels_ms)]
        return levels

    def progress(self) -> list[dict[str, int]]:
        """GET_ALL_DELAY_OFFSET (RocketMQ's delayOffset table, with each queue's end): per level its delay, the
        replicated progress (``delivered_offset``: the next schedule queue offset to deliver; everything before it
        went out, or was removed by retention first) and the schedule queue's ``max_offset``. What still waits is
        the difference. Any node answers from its own replica."""
        done = self.offsets()
        store = self.node.store
        return [{"level": level, "delay_ms": delay_ms, "delivered_offset": done.get(level, 0),
                 "max_offset": store.get_max_offset_in_queue(SCHEDULE_TOPIC, level - 1)}
                for level, delay_ms in self.levels()]

    async def serve(self) -> None:
        group = self.node.group
        past = [queue_id + 1 for queue_id in self.node.store.queue_ids(SCHEDULE_TOPIC)
                if queue_id >= len(self.levels_ms)]
        if past:
            # Not refused: the messages were acknowledged. But they now go out sooner (or later) than they were
            # sent to, and nothing else would tell the operator who shortened message_delay_level.
            log.warning("schedule queues of delay levels %s are past message_delay_level's %d levels: their "
                        "messages are delivered after the last level's delay, %d ms", past, len(self.levels_ms),
                        self.levels_ms[-1])
        while True:
            await trio.sleep(ROUND_INTERVAL_S)
            if not group.is_ready_leader:
                continue
            try:
                while await self.deliver_due() and group.is_ready_leader:
                    await trio.sleep(0)
            except (RequestRejected, RaftMQError) as e:
                # Not delivered, or delivered without its progress replicated: the next round (here or on the next
                # leader) starts again from the replicated progress.
                log.info("scheduled delivery round failed error=%s", getattr(e, "remark", e))

    async def deliver_due(self, now_ms: int | None = None) -> int:
        """One round: append what is due (at most one batch), then replicate the progress; returns how many
        messages were delivered (the caller goes on at once while rounds are full)."""
        node = self.node
        store = node.store
        now = int(time.time() * 1000) if now_ms is None else now_ms
        done = self.offsets()
        max_bytes = node.max_message_size
        batch: list[MessageInput] = []
        size = 0
        progress: dict[str, int] = {}
        full = False
        for level, delay_ms in self.levels():
            if full:
                break
            offset = done.get(level, 0)
            result = store.get_messages(SCHEDULE_TOPIC, level - 1, offset, DELIVER_MAX_MESSAGES, max_bytes)
            if result.status in (GetMessageStatus.OFFSET_TOO_SMALL, GetMessageStatus.OFFSET_FOUND_NULL) \
                    and result.next_begin_offset > offset:
                # Retention removed them before they were due (file_reserved_hours below the delay).
                log.warning("scheduled messages removed before delivery level=%d from=%d to=%d", level, offset,
                            result.next_begin_offset)
                progress[str(level)] = result.next_begin_offset
                continue
            for raw, queue_offset in zip(result.messages, result.queue_offsets):
                view = decode_record(raw, check_crc=False)
                if view.store_timestamp + delay_ms > now:
                    break
                if batch and (size + len(raw) > max_bytes or len(batch) >= DELIVER_MAX_MESSAGES):
                    full = True
                    break
                message = self._delivered(view)
                if message is not None:
                    batch.append(message)
                    size += len(raw)
                progress[str(level)] = queue_offset + 1
        if not progress:
            return 0
        if batch:
            await node.append_messages(encode_batch(batch, node.store_host, max_message_size=max_bytes))
        if not node.is_leader():
            raise node.not_leader()
        await node.group.put_metadata(SCHEDULE_TABLE, progress, timeout_s=node.config.send_timeout_ms / 1000)
        self.delivered += len(batch)
        return len(batch) or 1

    def _delivered(self, view: MessageView) -> MessageInput | None:
        try:
            message = restored_message(view, (PROPERTY_DELAY,))
            encode_batch([message], self.node.store_host, max_message_size=self.node.max_message_size)
        except MessageFormatError as e:
            # Only the send path stores here, and it checked all of this: a message that still fails would block
            # its level for ever, so it is skipped, loudly.
            self.dropped += 1
            log.error("scheduled message not deliverable, skipped phy_offset=%d error=%s", view.phy_offset, e)
            return None
        return message
