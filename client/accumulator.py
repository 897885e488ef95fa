"""Producer auto-batching: RocketMQ 5's ``DefaultMQProducer#setAutoBatch`` (``ProduceAccumulator``), opt-in with
``open_producer(..., auto_batch=True)``.

Why: every request costs the broker a frame, a header decode and an answer, and costs the client a round trip's
worth of bookkeeping; a batch pays that once for all its messages (measured: one 1 KiB single send costs the
group leader ~40 µs of CPU, one message of a batch of 32 ~17 µs). With auto-batching, many concurrent ``send``
calls share SEND_BATCH_MESSAGE requests, and each caller still gets its own ``SendResult`` after the Raft commit.

Rules:
- Only ``send`` is batched. ``send_batch`` already is a batch, ``send_oneway`` has no answer to split, and a
  message that a batch could not carry unchanged goes alone (bigger than ``auto_batch_max_bytes``, or a topic,
  properties or flag the client cannot encode: then the broker's own answer names the problem, as without
  auto-batching).
- A batch's encoded size (each message's bodies and properties plus its entry header) also stays within
  ``max_message_size_bytes``, the broker's limit for a whole batch body: with ``auto_batch_max_bytes`` near it,
  the headers made full batches too big, and each of their callers got the broker's "batch body of N bytes
  exceeds max_message_size" for a small message.
- Messages are grouped by topic and, where the caller fixed one (``queue`` or ``sharding_key``), by queue: an
  ordered send stays in its queue and in its order. A group without a fixed queue picks one per batch, as one
  send picks one per message (round robin, fault avoidance, retries elsewhere).
- Nagle, not a timer: while fewer than ``auto_batch_max_in_flight`` batches of a group are in flight its
  messages leave at once, so a caller sending one message at a time waits for nothing. Otherwise they wait for
  a batch to finish, for the batch to fill (``auto_batch_max_messages`` / ``auto_batch_max_bytes``), or for
  ``auto_batch_max_delay_ms`` (RocketMQ's ``batchMaxDelayMs``), whichever comes first.
- A batch also carries at most ``auto_batch_max_keys`` index keys (each message's UNIQ_KEY and every key of its
  KEYS): the broker's IndexFile takes 12 bytes of the batch's DLedger entry per key, and 200 sends of 15,000 keys
  each, batched by bytes alone, made entries so large that the leader stalled past its followers' election timeout.
- The broker's limits are its own and may change at run time (``max_batch_messages``, ``store.max_message_size``,
  the entry size): a batch it refuses as a batch (INVALID_REQUEST naming ``body``, ``batch`` or ``keys``;
  MESSAGE_ILLEGAL) is sent again in halves, down to one message, so a refusal reaches only the caller whose message
  it is about (with 64 messages a batch against a broker taking 16, each caller of one message got "holds 64
  messages"). Refused, nothing of the batch was stored, so nothing is stored twice. A refusal
  recognised as the batch's (its count, its body's size, its entry's size or index keys) is remembered for the
  topic for ``_LEARNED_LIMIT_S``: its later batches stay within half of the refused one's count, bytes or keys.
- A batch is one Raft record: stored whole or not at all. Each caller gets its message's ids and queue offset;
  a failed batch raises its error in each of its callers. A caller cancelled before its message left takes it
  out; one cancelled later abandons the answer (the message may still be stored, as with any send).
- Closing (``close``): the messages waiting for a slot or for company leave at once, and the producer waits for
  every batch to be answered, up to ``send_msg_timeout_ms``. A batch still unanswered then fails its callers with
  ``SendFailedError`` saying its outcome is unknown (it may be stored), never ``ClientClosedError``, which says
  the message was not sent: a caller sending it again on that word made duplicates.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from client.errors import ClientClosedError, MessageIllegalError, SendFailedError
from client.message import Message, MessageQueue, SendResult, batch_entry_overhead
from remoting.errors import InvalidRequestError
from remoting.message import BATCH_HEAD, MessageFormatError, check_topic, split_keys

if TYPE_CHECKING:
    from client.producer import Producer

__all__ = ["ProduceAccumulator"]

log = logging.getLogger(__name__)

# How long a limit learned from a refused batch holds for its topic: the broker's limits change at run time
# (``raftmq admin update-broker-config``), so a lowered one is tried again after a while, at the cost of one
# refused request, instead of batching small for the producer's whole life.
_LEARNED_LIMIT_S = 60.0

# What a refusal of a batch is about, as far as a smaller batch changes it (_refusal): its message count, its body's
# bytes, its DLedger entry (records plus 12 bytes per index key), or unknown (maybe one message's: split, learn
# nothing).
_COUNT, _BYTES, _ENTRY, _UNKNOWN = "count", "bytes", "entry", "unknown"


class _Item:
    """One caller's message, waiting in a group or in flight in a batch."""

    __slots__ = ("body", "props", "flag", "uniq", "deadline", "task", "result", "error", "sent", "done", "encoded",
                 "keys", "on_wire")

    def __init__(self, body: bytes, props: bytes, flag: int, uniq: str, deadline: float, entry_overhead: int,
                 keys: int) -> None:
        self.body = body
        self.props = props
        self.flag = flag
        self.uniq = uniq
        self.deadline = deadline
        self.task = trio.lowlevel.current_task()
        self.result: SendResult | None = None
        self.error: BaseException | None = None
        self.sent = False  # taken into a batch
        self.done = False  # answered, or its caller gave up
        self.encoded = len(body) + len(props) + entry_overhead  # its bytes in the batch body
        self.keys = keys  # its index keys: UNIQ_KEY and each key of KEYS
        self.on_wire = False  # in a request not answered yet (False again once a refusal said it was not stored)

    @property
    def size(self) -> int:
        return len(self.body) + len(self.props)

    def finish(self) -> None:
        if not self.done:
            self.done = True
            trio.lowlevel.reschedule(self.task)


class _Group:
    __slots__ = ("topic", "queue", "sharding_key", "items", "size", "keys", "in_flight", "timer_armed",
                 "entry_overhead")

    def __init__(self, topic: str, queue: MessageQueue | None, sharding_key: str | None) -> None:
        self.topic = topic
        self.entry_overhead = batch_entry_overhead(topic)
        self.queue = queue
        self.sharding_key = sharding_key
        self.items: list[_Item] = []
        self.size = 0
        self.keys = 0
        self.in_flight = 0
        self.timer_armed = False


class _Limits:
    """What one batch may hold: messages, bodies + properties, encoded bytes, index keys."""

    __slots__ = ("messages", "size", "encoded", "keys", "until")

    def __init__(self, messages: int, size: int, encoded: int, keys: int, until: float = 0.0) -> None:
        self.messages = messages
        self.size = size
        self.encoded = encoded
        self.keys = keys
        self.until = until

    def take(self, items: list[_Item]) -> int:
        """How many of ``items``, from the first, one batch takes: at least one (a message past a limit on its own
        goes in a batch of its own, and the broker's answer decides)."""
        take = size = encoded = keys = 0
        while take < len(items) and take < self.messages:
            nxt = items[take]
            if take and (size + nxt.size > self.size or encoded + nxt.encoded > self.encoded
                         or keys + nxt.keys > self.keys):
                break
            size += nxt.size
            encoded += nxt.encoded
            keys += nxt.keys
            take += 1
        return take


class ProduceAccumulator:
    def __init__(self, producer: Producer, nursery: trio.Nursery) -> None:
        config = producer.config
        self._producer = producer
        self._nursery = nursery
        # What the broker takes in one batch as far as this client knows (its max_message_size_bytes); the broker's
        # own may be lower, which a refusal teaches (_learned).
        self._limits = _Limits(config.auto_batch_max_messages, config.auto_batch_max_bytes,
                               config.max_message_size_bytes - BATCH_HEAD.size, config.auto_batch_max_keys)
        self._max_bytes = config.auto_batch_max_bytes
        self._max_in_flight = config.auto_batch_max_in_flight
        self._max_delay_s = config.auto_batch_max_delay_ms / 1000
        self._default_timeout_s = config.send_msg_timeout_ms / 1000
        self._groups: dict[tuple[str, MessageQueue | None, str | None], _Group] = {}
        self._learned: dict[str, _Limits] = {}  # per topic, until its time is up
        self._batches = 0  # batch tasks running
        self._closing = False
        self.batches_sent = 0

    @property
    def busy(self) -> bool:
        """Whether a message waits in a group or a batch is in flight."""
        return bool(self._batches or any(group.items for group in self._groups.values()))

    def takes(self, message: Message) -> bool:
        # A delayed message is stored in its delay level's queue, so it cannot share a batch (one queue).
        return len(message.body) < self._max_bytes and not message.delay_level

    def close(self) -> None:
        """The producer is closing: whatever waits for a batch slot or for company leaves now (the producer then
        waits for the batches to be answered), and no message waits from now on."""
        self._closing = True
        for group in list(self._groups.values()):
            while group.items:
                self._flush(group)

    async def send(self, message: Message, queue: MessageQueue | None, sharding_key: str | None,
                   timeout_s: float | None) -> SendResult | None:
        """The message's own SendResult once its batch is committed; None if the message cannot be batched
        unchanged (the caller then sends it alone)."""
        try:
            check_topic(message.topic)
            (body, encoded, flag), uniq = message.batch_item()
        except MessageFormatError as e:
            log.debug("message sent alone, not batched: %s", e)
            return None
        timeout = timeout_s if timeout_s is not None else self._default_timeout_s
        key = (message.topic, queue, sharding_key)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(message.topic, queue, sharding_key)
        item = _Item(body, encoded, flag, uniq, time.monotonic() + timeout, group.entry_overhead,
                     1 + _key_count(message.keys))
        if item.encoded > self._limits.encoded:
            self._forget_if_idle(group)
            return None  # too big for a batch of its own: alone, the broker's check is on its body
        group.items.append(item)
        group.size += item.size
        group.keys += item.keys
        limits = self._limits_for(group.topic)
        if (group.in_flight < self._max_in_flight or self._closing or len(group.items) >= limits.messages
                or group.size >= limits.size or group.keys >= limits.keys):
            self._flush(group)
        elif not group.timer_armed:
            group.timer_armed = True
            self._nursery.start_soon(self._flush_later, group)

        def abort(_: Any) -> trio.lowlevel.Abort:
            item.done = True
            if not item.sent:
                group.items.remove(item)
                group.size -= item.size
                group.keys -= item.keys
                self._forget_if_idle(group)
            return trio.lowlevel.Abort.SUCCEEDED

        # The caller's own deadline: its batch runs to the latest deadline of the messages in it (the earliest
        # made a 3 s send fail with a 50 ms one it happened to share a batch with, where it would have retried).
        with trio.move_on_after(max(item.deadline - time.monotonic(), 0)) as waited:
            await trio.lowlevel.wait_task_rescheduled(abort)
        if waited.cancelled_caught:
            what = "in its batch's request" if item.sent else "for its batch to leave"
            raise SendFailedError(f"sending to topic {message.topic!r} timed out after {timeout:.3f}s, waiting {what}",
                                  attempts=1 if item.sent else 0, last_error=trio.TooSlowError(
                                      f"send timed out after {timeout:.3f}s"), topic=message.topic)
        if item.error is not None:
            raise item.error
        assert item.result is not None
        return item.result

    def _limits_for(self, topic: str) -> _Limits:
        learned = self._learned.get(topic)
        if learned is None:
            return self._limits
        if learned.until <= time.monotonic():
            del self._learned[topic]
            return self._limits
        return learned

    def _learn(self, topic: str, kind: str, batch: list[_Item]) -> None:
        """A batch of ``topic`` was refused for its ``kind`` (_refusal): its later batches hold at most half of
        what it held, in that respect, for ``_LEARNED_LIMIT_S``."""
        if kind == _UNKNOWN:
            return  # maybe one message's: a lower limit would only make every later batch smaller
        now = time.monotonic()
        # Expired ones go with the next lesson: topics come and go, and the map must not grow with them.
        for name in [name for name, limits in self._learned.items() if limits.until <= now]:
            del self._learned[name]
        current = self._limits_for(topic)
        learned = _Limits(current.messages, current.size, current.encoded, current.keys, now + _LEARNED_LIMIT_S)
        if kind == _COUNT:
            learned.messages = min(current.messages, max(1, len(batch) // 2))
        else:
            learned.encoded = min(current.encoded, max(1, sum(i.encoded for i in batch) // 2))
            if kind == _ENTRY:
                learned.keys = min(current.keys, max(1, sum(i.keys for i in batch) // 2))
        self._learned[topic] = learned
        log.info("auto batch refused by the broker, later batches of topic %s stay smaller for %ds refused=%s "
                 "messages=%d max_messages=%d max_encoded_bytes=%d max_keys=%d", topic, _LEARNED_LIMIT_S, kind,
                 len(batch), learned.messages, learned.encoded, learned.keys)

    def _flush(self, group: _Group) -> None:
        """Send the group's oldest messages, up to one batch, as one request."""
        items = group.items
        take = self._limits_for(group.topic).take(items) if items else 0
        if not take:
            return
        batch, group.items = items[:take], items[take:]
        for item in batch:
            item.sent = True
            group.size -= item.size
            group.keys -= item.keys
        group.in_flight += 1
        self._batches += 1
        self.batches_sent += 1
        self._nursery.start_soon(self._send_batch, group, batch)

    async def _flush_later(self, group: _Group) -> None:
        await trio.sleep(self._max_delay_s)
        group.timer_armed = False
        while group.items:
            self._flush(group)
        self._forget_if_idle(group)

    def _forget_if_idle(self, group: _Group) -> None:
        # Groups come and go with their keys (a sharding key each): keep only the busy ones.
        if not group.items and not group.in_flight and not group.timer_armed:
            self._groups.pop((group.topic, group.queue, group.sharding_key), None)

    async def _send_batch(self, group: _Group, batch: list[_Item]) -> None:
        try:
            await self._deliver(group, batch)
        finally:
            # Cancelled: the producer closed before the batch was answered. It may come as a group of Cancelled from
            # a nursery on the way (an `except trio.Cancelled` missed that, and the callers waited forever), so
            # whatever the batch ended with, no caller is left unanswered. A message in a request that went out may
            # be stored: its caller must not read "closed" as "not sent", and send it again.
            for item in batch:
                if not item.done:
                    item.error = (_outcome_unknown(group.topic) if item.on_wire else
                                  ClientClosedError("the producer closed before the message was sent"))
                    item.finish()
            group.in_flight -= 1
            self._batches -= 1
            # A slot is free: whatever waited for one leaves now (Nagle).
            if group.items and group.in_flight < self._max_in_flight:
                self._flush(group)
            self._forget_if_idle(group)
            self._producer._send_ended()

    async def _deliver(self, group: _Group, batch: list[_Item]) -> None:
        """Send ``batch`` as one request and answer its callers; refused as a batch, send it again in parts."""
        for item in batch:
            item.on_wire = True
        try:
            timeout = max(max(item.deadline for item in batch) - time.monotonic(), 0.001)
            result = await self._producer._send_encoded_batch(
                group.topic, [(i.body, i.props, i.flag) for i in batch], tuple(i.uniq for i in batch),
                group.queue, group.sharding_key, timeout)
        except Exception as e:
            kind = _refusal(e) if len(batch) > 1 else None
            if kind is None:  # the batch's error is each caller's error
                _fail(batch, lambda: e)
                return
            for item in batch:
                item.on_wire = False  # refused: not stored
            # Not failed (yet): each message is counted once its part is answered. Counted here, 200 sends against a
            # broker taking 16 a batch, all stored, showed 384 failed.
            self._producer._stats.failed -= len(batch)
            self._learn(group.topic, kind, batch)
            # In parts within what was learned and at most half as big, one after another, so that an ordered send
            # keeps its order; until each message that is refused is refused alone, to its own caller. A caller that
            # gave up meanwhile does not have its message sent again.
            rest = [item for item in batch if not item.done]
            limits = self._limits_for(group.topic)
            halves = _Limits(min(limits.messages, max(1, len(batch) // 2)), limits.size, limits.encoded, limits.keys)
            while rest:
                take = halves.take(rest)
                part, rest = [item for item in rest[:take] if not item.done], rest[take:]
                if part:
                    self.batches_sent += 1
                    await self._deliver(group, part)
            return
        offset_ids = result.offset_msg_id.split(",") if result.offset_msg_id else []
        if len(offset_ids) != len(batch):
            offset_ids = [result.offset_msg_id] * len(batch)
        for n, item in enumerate(batch):
            item.result = SendResult(send_status=result.send_status, msg_id=item.uniq,
                                     offset_msg_id=offset_ids[n], message_queue=result.message_queue,
                                     queue_offset=result.queue_offset + n if result.queue_offset >= 0 else -1,
                                     msg_ids=(item.uniq,))
            item.finish()


def _key_count(keys: str | list[str] | tuple[str, ...] | None) -> int:
    """The index keys of a message's KEYS, counted as the broker's IndexFile takes them (``split_keys``)."""
    if not keys:
        return 0
    if isinstance(keys, str):
        return len(split_keys(keys))
    return sum(1 for key in keys if key)


def _refusal(error: BaseException) -> str | None:
    """What a refusal of a batch of several messages is about, if sending its messages in smaller batches may
    change the answer; None for any other error (the batch's error is then each caller's).

    INVALID_REQUEST naming ``body`` is the broker's ``max_batch_messages`` (the rest of what it names so, a batch it
    cannot read, this client does not send). MESSAGE_ILLEGAL naming ``batch`` is the batch's DLedger entry (its
    size, its index keys), naming ``body`` the whole body past ``max_message_size``; naming nothing, one message's
    problem, which the halving isolates without a lesson. Brokers before those fields named none: their remarks
    tell the same apart."""
    field = getattr(error, "field", None)
    if isinstance(error, InvalidRequestError):
        return _COUNT if field == "body" else None
    if not isinstance(error, MessageIllegalError):
        return None
    remark = error.remark or ""
    if field == "batch" or (field is None and ("index" in remark or "DLedger entry" in remark)):
        return _ENTRY
    if field == "body" or (field is None and remark.startswith("batch body of")):
        return _BYTES
    return _UNKNOWN


def _outcome_unknown(topic: str) -> SendFailedError:
    closed = ClientClosedError("the producer closed before the batch was answered")
    return SendFailedError(f"the producer closed before the batch carrying this message to topic {topic!r} was "
                           f"answered, send_msg_timeout_ms after it began closing: the outcome is unknown (the "
                           f"message may be stored; sent again, it may be stored twice)", attempts=1,
                           last_error=closed, topic=topic)


def _fail(batch: list[_Item], error: Callable[[], BaseException]) -> None:
    for item in batch:
        item.error = error()
        item.finish()
