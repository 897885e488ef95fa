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
  RocketMQ leaves them. It gets a queue offset in its real topic and is indexed there like any message. A message
  whose real topic was deleted while it waited (its topic gone, or deleted and created again since it was parked)
  is not delivered: it went with its topic (logged, counted in ``dropped``). Delivered, it would land behind the
  deletion's cut and be served as a topic created again under the name's first messages.
* **Timer messages hop through the levels.** A message with TIMER_DELIVER_MS (ms since the epoch), TIMER_DELAY_MS or
  TIMER_DELAY_SEC (from the broker's receipt; RocketMQ 5's names, the first present of SEC, MS, DELIVER wins, as
  there) is kept with its absolute time in TIMER_DELIVER_MS and parked in the level with the longest delay not past
  the time left (the shortest level when every level is longer). When found due there it is delivered only if its
  time has come, otherwise parked again for the time left: appended to its next level in the same batch as the
  deliveries, before the progress moves past it, so a leader killed between the two parks it twice (a duplicate,
  never a loss). So it arrives no earlier than its time and at most about the shortest level (1 s by default) plus a
  round late, and every queue stays in due order (a hop is a new record). A 3-day wait is ~36 hops of 2 h, then a
  few shorter ones. A time already past is stored at once in its topic as a normal message; one more than
  ``timer_max_delay_sec`` ahead (RocketMQ's ``timerMaxDelaySec``, 3 days) is MESSAGE_ILLEGAL; DELAY above 0 wins
  over a timer property, which is dropped (RocketMQ's ``checkIfTimerMessage``), so a send-back never re-times.
* **Nothing on the send path for other messages.** The send processor looks DELAY up only in a message that has
  properties (one dict lookup, three more for the timer properties); a batch may not carry DELAY (as RocketMQ's
  MessageBatch). A batch entry's timer properties are not looked at: it is stored at once, as RocketMQ's broker
  does (its timer hook reads only the batch's own properties); raftmq's producer refuses them in a batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import trio

from broker.delay_level import timer_level
from broker.processor.base import RequestRejected, invalid
from broker.service_rounds import alone_entry_bytes, entry_limit, entry_room, log_unexpected_round_failure
from broker.store.results import GetMessageStatus
from remoting.codes import ResponseCode
from remoting.errors import RaftMQError
from remoting.message import (PROPERTY_DELAY, PROPERTY_REAL_QUEUE_ID, PROPERTY_REAL_TOPIC, PROPERTY_TIMER_DELAY_MS,
                              PROPERTY_TIMER_DELAY_SEC, PROPERTY_TIMER_DELIVER_MS, SCHEDULE_TOPIC, TIMER_PROPERTIES,
                              MessageFormatError, MessageInput, MessageView, decode_record, encode_batch)

if TYPE_CHECKING:
    from broker.node import BrokerNode

log = logging.getLogger(__name__)

__all__ = ["SCHEDULE_TABLE", "schedule_properties", "with_real_destination", "restored_message", "stored_again",
           "delay_level_of", "timer_property", "timer_deliver_ms", "ScheduleMessageService"]

SCHEDULE_TABLE = "broker.schedule_offset"
ROUND_INTERVAL_S = 0.1
# A round that failed is tried again after ROUND_INTERVAL_S * 2^failures, at most this long: a failure that comes
# back every round (a defect) must not log, and retry, ten times a second.
ROUND_BACKOFF_MAX_S = 10.0
DELIVER_MAX_MESSAGES = 64
_MAX_TIMER_DIGITS = 18  # a Java long's decimal digits, less one: int() of it is never past I64
def with_real_destination(properties: Mapping[str, Any], topic: str, queue_id: int) -> dict[str, Any]:
    """``properties`` plus REAL_TOPIC and REAL_QID: where a message parked in a system topic (a delay level's
    schedule queue, the transaction half queue) goes once it is due or committed (``restored_message``)."""
    props = dict(properties)
    props[PROPERTY_REAL_TOPIC] = topic
    props[PROPERTY_REAL_QUEUE_ID] = str(queue_id)
    return props


def schedule_properties(topic: str, queue_id: int, properties: Mapping[str, str], level: int) -> dict[str, str]:
    """The properties of a message of ``topic``:``queue_id`` stored to wait ``level`` in the schedule topic, without
    timer properties: a message delayed by level (DELAY, a send-back of a delivered timer message) does not wait
    for a delivery time as well, as RocketMQ's checkIfTimerMessage clears them when DELAY is set."""
    props = with_real_destination({**properties, PROPERTY_DELAY: str(level)}, topic, queue_id)
    for name in TIMER_PROPERTIES:
        props.pop(name, None)
    return props


def timer_property(properties: Mapping[str, Any]) -> str | None:
    """The first timer property ``properties`` carry, in RocketMQ's order of precedence; None if none."""
    for name in TIMER_PROPERTIES:
        if name in properties:
            return name
    return None


def timer_deliver_ms(properties: Mapping[str, Any], now_ms: int) -> int | None:
    """The delivery time (ms since the epoch) a timer message asks for: TIMER_DELAY_SEC or TIMER_DELAY_MS after
    ``now_ms``, else TIMER_DELIVER_MS (the first present, as RocketMQ's transformTimerMessage reads them); None
    without any. Raises ValueError naming the property whose value is not a non-negative decimal integer."""
    name = timer_property(properties)
    if name is None:
        return None
    value = properties[name]
    if type(value) is not str or not value.isascii() or not value.isdecimal() or len(value) > _MAX_TIMER_DIGITS:
        what = {PROPERTY_TIMER_DELAY_SEC: "a delay in seconds", PROPERTY_TIMER_DELAY_MS: "a delay in ms",
                PROPERTY_TIMER_DELIVER_MS: "a delivery time in ms since the epoch"}[name]
        raise ValueError(f"property {name!r} must be {what}, a decimal integer of at most {_MAX_TIMER_DIGITS} "
                         f"digits, got {value!r}")
    if name == PROPERTY_TIMER_DELAY_SEC:
        return now_ms + int(value) * 1000
    if name == PROPERTY_TIMER_DELAY_MS:
        return now_ms + int(value)
    return int(value)


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
        self.timer_hops = 0  # timer messages parked again, not yet due after a level's delay

    def redirect(self, topic: str, queue_id: int, properties: Mapping[str, Any]) -> tuple[str, int, Mapping[str, Any]]:
        """Where a sent message with a DELAY property is stored: the schedule queue of its level (level 0: where it
        was sent, or where its timer properties send it). Bad levels are INVALID_REQUEST naming ``properties``."""
        try:
            level = delay_level_of(properties[PROPERTY_DELAY], len(self.levels_ms))
        except ValueError as e:
            raise RequestRejected(ResponseCode.INVALID_REQUEST, f"request field 'properties': {e}",
                                  ext={"field": "properties"}) from None
        if level == 0:
            if timer_property(properties) is not None:
                return self.redirect_timer(topic, queue_id, properties)
            return topic, queue_id, properties
        return SCHEDULE_TOPIC, level - 1, schedule_properties(topic, queue_id, properties, level)

    def redirect_timer(self, topic: str, queue_id: int, properties: Mapping[str, Any],
                       now_ms: int | None = None) -> tuple[str, int, Mapping[str, Any]]:
        """Where a sent timer message is stored, its time kept absolute in TIMER_DELIVER_MS: the schedule queue of
        the level it waits in first (``timer_level``), or where it was sent when its time has come. A malformed
        timer property is INVALID_REQUEST naming ``properties``; a time past ``timer_max_delay_sec`` ahead is
        MESSAGE_ILLEGAL (RocketMQ's WHEEL_TIMER_MSG_ILLEGAL)."""
        now = int(time.time() * 1000) if now_ms is None else now_ms
        try:
            deliver_ms = timer_deliver_ms(properties, now)
        except ValueError as e:
            raise invalid("properties", str(e)) from None
        name = timer_property(properties)
        assert deliver_ms is not None and name is not None  # only called for a message with a timer property
        remaining = deliver_ms - now
        if name == PROPERTY_TIMER_DELIVER_MS:
            if remaining <= 0:
                return topic, queue_id, properties  # due already: a normal message, stored as sent
            props = properties
        else:
            # The relative properties become the time they stand for, so a hop (or a later look) reads one clock.
            props = {k: v for k, v in properties.items() if k not in TIMER_PROPERTIES}
            props[PROPERTY_TIMER_DELIVER_MS] = str(deliver_ms)
            if remaining <= 0:
                return topic, queue_id, props
        max_delay_s = self.node.config.timer_max_delay_sec  # at each send: UPDATE_BROKER_CONFIG may change it
        if remaining > max_delay_s * 1000:
            raise RequestRejected(ResponseCode.MESSAGE_ILLEGAL,
                                  f"timer message too far ahead: property {name!r} asks for delivery in {remaining} "
                                  f"ms, more than the most this broker waits, {max_delay_s * 1000} ms "
                                  f"(timer_max_delay_sec {max_delay_s}, RocketMQ's timerMaxDelaySec)")
        level = timer_level(self.levels_ms, remaining)
        return SCHEDULE_TOPIC, level - 1, with_real_destination({**props, PROPERTY_DELAY: str(level)}, topic,
                                                                 queue_id)

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
        failures = 0
        while True:
            await trio.sleep(min(ROUND_INTERVAL_S * 2 ** min(failures, 16), ROUND_BACKOFF_MAX_S))
            if not group.is_ready_leader:
                failures = 0
                continue
            # A failed round delivered nothing, or delivered without its progress replicated: the next round (here
            # or on the next leader) starts again from the replicated progress.
            try:
                while await self.deliver_due() and group.is_ready_leader:
                    await trio.sleep(0)
                failures = 0
            except (RequestRejected, RaftMQError) as e:
                failures += 1
                log.info("scheduled delivery round failed failures=%d error=%s", failures, getattr(e, "remark", e))
            except Exception:
                # The progress did not move, and every next leader would meet the same messages (as an entry past
                # max_entry_bytes once made them all stop).
                failures += 1
                log_unexpected_round_failure(log, "scheduled delivery", failures)

    async def deliver_due(self, now_ms: int | None = None) -> int:
        """One round: append what is due (at most one batch: deliveries, and timer messages parked again for the
        time they still have to wait), then replicate the progress; returns how many messages were appended (the
        caller goes on at once while rounds are full). A round holds at most ``DELIVER_MAX_MESSAGES``, records of
        ``max_message_size`` bytes, and what fits one DLedger entry (a message alone up to ``entry_limit``, more
        up to ``entry_room``): records are not all an entry carries, keys cost 12 bytes each, and a round past the
        entry limit would fail every time."""
        node = self.node
        store = node.store
        now = int(time.time() * 1000) if now_ms is None else now_ms
        done = self.offsets()
        max_bytes = node.max_message_size
        limit = entry_limit(node)
        room = entry_room(node)
        batch: list[MessageInput] = []
        size = 0
        entry = 0
        hops = 0
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
                if self._topic_gone(view):
                    progress[str(level)] = queue_offset + 1
                    continue
                measured = None
                hop = False
                remaining = self._timer_remaining_ms(view, now)
                if remaining > 0:
                    measured = self._parked_again(view, remaining, limit)
                    hop = measured is not None
                if measured is None:
                    measured = self._delivered(view, limit)
                if measured is not None:
                    message, cost = measured
                    if batch and entry + cost > room:
                        full = True
                        break
                    batch.append(message)
                    size += len(raw)
                    entry += cost
                    hops += hop
                progress[str(level)] = queue_offset + 1
        if not progress:
            return 0
        if batch:
            await node.append_messages(encode_batch(batch, node.store_host, max_message_size=max_bytes))
        if not node.is_leader():
            raise node.not_leader()
        await node.group.put_metadata(SCHEDULE_TABLE, progress, timeout_s=node.config.send_timeout_ms / 1000)
        self.delivered += len(batch) - hops
        self.timer_hops += hops
        return len(batch) or 1

    def _timer_remaining_ms(self, view: MessageView, now_ms: int) -> int:
        """How long a parked timer message still waits (0 or less: due; 0 too for a message delayed by level)."""
        value = view.properties.get(PROPERTY_TIMER_DELIVER_MS)
        if value is None:
            return 0
        if not value.isascii() or not value.isdecimal() or len(value) > _MAX_TIMER_DIGITS:
            # The send path stores only times it parsed: delivered now rather than block its level or be lost.
            log.warning("parked timer message with a malformed %s delivered now phy_offset=%d value=%r",
                        PROPERTY_TIMER_DELIVER_MS, view.phy_offset, value)
            return 0
        return int(value) - now_ms

    def _topic_gone(self, view: MessageView) -> bool:
        """Whether the real topic of the due record ``view`` was deleted while it waited (gone, or cut after this
        record: deleted and created again), so that it is neither delivered nor parked again (counted in
        ``dropped``). Judged at every hop: a copy parked after the deletion would be past the cut, and deliver into
        a topic created again under the name."""
        topic = self.node.deleted_real_topic(view)
        if topic is None:
            return False
        self.dropped += 1
        log.info("scheduled message not delivered: its topic was deleted while it waited topic=%s phy_offset=%d",
                 topic, view.phy_offset)
        return True

    def _parked_again(self, view: MessageView, remaining_ms: int, limit: int) -> tuple[MessageInput, int] | None:
        """A timer message found due in its level before its time, as appended to its next level: the very
        record, DELAY changed (its time, destination and UNIQ_KEY kept), and the entry bytes it takes alone. None
        if it cannot be written so."""
        level = timer_level(self.levels_ms, remaining_ms)
        try:
            message = stored_again(view, SCHEDULE_TOPIC, level - 1, {**view.properties, PROPERTY_DELAY: str(level)})
            cost = alone_entry_bytes(self.node, message)
        except MessageFormatError as e:
            # A longer DELAY value past the properties' limit: early beats lost, and it would block its level.
            log.error("timer message cannot be parked again, delivered %d ms early phy_offset=%d error=%s",
                      remaining_ms, view.phy_offset, e)
            return None
        if cost > limit:
            # The very record, DELAY changed: past only if the limit was lowered since it was stored, or DELAY
            # gained a digit (message_delay_level changed meanwhile).
            log.error("timer message cannot be parked again, delivered %d ms early phy_offset=%d error=it makes a "
                      "DLedger entry of %d bytes alone, more than max_entry_bytes %d", remaining_ms, view.phy_offset,
                      cost, limit)
            return None
        return message, cost

    def _delivered(self, view: MessageView, limit: int) -> tuple[MessageInput, int] | None:
        """The message a due record stands for in its real topic, and the entry bytes it takes alone; None (and
        counted in ``dropped``) for one that can never be stored."""
        try:
            message = restored_message(view, (PROPERTY_DELAY,))
            cost = alone_entry_bytes(self.node, message)
        except MessageFormatError as e:
            # Only the send path stores here, and it checked all of this: a message that still fails would block
            # its level for ever, so it is skipped, loudly.
            self.dropped += 1
            log.error("scheduled message not deliverable, skipped phy_offset=%d error=%s", view.phy_offset, e)
            return None
        if cost > limit:
            # It would fail every round. The copy is the stored record in its real topic, DELAY dropped: a real
            # topic name longer than SCHEDULE_TOPIC_XXXX can make it bigger, and so can a limit lowered since.
            self.dropped += 1
            log.error("scheduled message not deliverable, skipped phy_offset=%d error=it makes a DLedger entry of "
                      "%d bytes alone, more than max_entry_bytes %d", view.phy_offset, cost, limit)
            return None
        return message, cost
