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
- A batch is one Raft record: stored whole or not at all. Each caller gets its message's ids and queue offset;
  a failed batch raises its error in each of its callers. A caller cancelled before its message left takes it
  out; one cancelled later abandons the answer (the message may still be stored, as with any send).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from client.errors import ClientClosedError, SendFailedError
from client.message import Message, MessageQueue, SendResult, batch_entry_overhead
from remoting.message import BATCH_HEAD, MessageFormatError, check_topic

if TYPE_CHECKING:
    from client.producer import Producer

__all__ = ["ProduceAccumulator"]

log = logging.getLogger(__name__)


class _Item:
    """One caller's message, waiting in a group or in flight in a batch."""

    __slots__ = ("body", "props", "flag", "uniq", "deadline", "task", "result", "error", "sent", "done", "encoded")

    def __init__(self, body: bytes, props: bytes, flag: int, uniq: str, deadline: float, entry_overhead: int) -> None:
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

    @property
    def size(self) -> int:
        return len(self.body) + len(self.props)

    def finish(self) -> None:
        if not self.done:
            self.done = True
            trio.lowlevel.reschedule(self.task)


class _Group:
    __slots__ = ("topic", "queue", "sharding_key", "items", "size", "in_flight", "timer_armed", "entry_overhead")

    def __init__(self, topic: str, queue: MessageQueue | None, sharding_key: str | None) -> None:
        self.topic = topic
        self.entry_overhead = batch_entry_overhead(topic)
        self.queue = queue
        self.sharding_key = sharding_key
        self.items: list[_Item] = []
        self.size = 0
        self.in_flight = 0
        self.timer_armed = False


class ProduceAccumulator:
    def __init__(self, producer: Producer, nursery: trio.Nursery) -> None:
        config = producer.config
        self._producer = producer
        self._nursery = nursery
        self._max_messages = config.auto_batch_max_messages
        self._max_bytes = config.auto_batch_max_bytes
        self._max_encoded = config.max_message_size_bytes - BATCH_HEAD.size  # what the broker takes in one batch
        self._max_in_flight = config.auto_batch_max_in_flight
        self._max_delay_s = config.auto_batch_max_delay_ms / 1000
        self._default_timeout_s = config.send_msg_timeout_ms / 1000
        self._groups: dict[tuple[str, MessageQueue | None, str | None], _Group] = {}
        self.batches_sent = 0

    def takes(self, message: Message) -> bool:
        # A delayed message is stored in its delay level's queue, so it cannot share a batch (one queue).
        return len(message.body) < self._max_bytes and not message.delay_level

    async def send(self, message: Message, queue: MessageQueue | None, sharding_key: str | None,
                   timeout_s: float | None) -> SendResult | None:
        """The message's own SendResult once its batch is committed; None if the message cannot be batched
        unchanged (the caller then sends it alone)."""
        try:
            check_topic(message.topic)
            (body, encoded, flag), uniq = message.batch_item()
        except MessageFormatError:
            return None
        timeout = timeout_s if timeout_s is not None else self._default_timeout_s
        key = (message.topic, queue, sharding_key)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(message.topic, queue, sharding_key)
        item = _Item(body, encoded, flag, uniq, time.monotonic() + timeout, group.entry_overhead)
        if item.encoded > self._max_encoded:
            self._forget_if_idle(group)
            return None  # too big for a batch of its own: alone, the broker's check is on its body
        group.items.append(item)
        group.size += item.size
        if (group.in_flight < self._max_in_flight or len(group.items) >= self._max_messages
                or group.size >= self._max_bytes):
            self._flush(group)
        elif not group.timer_armed:
            group.timer_armed = True
            self._nursery.start_soon(self._flush_later, group)

        def abort(_: Any) -> trio.lowlevel.Abort:
            item.done = True
            if not item.sent:
                group.items.remove(item)
                group.size -= item.size
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

    def _flush(self, group: _Group) -> None:
        """Send the group's oldest messages, up to one batch, as one request."""
        items = group.items
        take = 0
        size = 0
        encoded = 0
        while take < len(items) and take < self._max_messages:
            nxt = items[take]
            if take and (size + nxt.size > self._max_bytes or encoded + nxt.encoded > self._max_encoded):
                break
            size += nxt.size
            encoded += nxt.encoded
            take += 1
        if not take:
            return
        batch, group.items = items[:take], items[take:]
        group.size -= size
        for item in batch:
            item.sent = True
        group.in_flight += 1
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
            timeout = max(max(item.deadline for item in batch) - time.monotonic(), 0.001)
            try:
                result = await self._producer._send_encoded_batch(
                    group.topic, [(i.body, i.props, i.flag) for i in batch], tuple(i.uniq for i in batch),
                    group.queue, group.sharding_key, timeout)
            except Exception as e:  # the batch's error is each caller's error
                _fail(batch, lambda: e)
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
        finally:
            # Cancelled: the producer is closing. It may come as a group of Cancelled from a nursery on the way (an
            # `except trio.Cancelled` missed that, and the callers waited forever), so whatever the batch ended
            # with, no caller is left unanswered.
            unanswered = [item for item in batch if not item.done]
            if unanswered:
                _fail(unanswered, lambda: ClientClosedError("the producer closed before the batch was answered"))
            group.in_flight -= 1
            # A slot is free: whatever waited for one leaves now (Nagle).
            if group.items and group.in_flight < self._max_in_flight:
                self._flush(group)
            self._forget_if_idle(group)


def _fail(batch: list[_Item], error: Callable[[], BaseException]) -> None:
    for item in batch:
        item.error = error()
        item.finish()
