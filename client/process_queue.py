"""One assigned queue's cache in the push consumer (RocketMQ's ProcessQueue): the messages pulled but not yet consumed,
in offset order, and the flow control that holds back the queue's next pull.

The rules:

- **Offsets only grow** within one ``ProcessQueue`` (an offset reset makes a new one), so messages are put in
  increasing offset order and the dict keeps that order: its first key is the least offset cached, which is the
  queue's consume offset (RocketMQ's TreeMap first key), or one past the last pulled when nothing is cached.
- **A pull waits** (``wait_space``) while the queue caches ``threshold`` messages (``pull_threshold_for_queue``) or
  ``threshold_bytes`` of bodies (``pull_threshold_size_for_queue_mib``), or, when ``max_span`` is set (the concurrent
  handler form: ``consume_concurrently_max_span``), while the offsets from the least one cached to the last one pulled
  span more than ``max_span``. One pull may go past any of them by its size.
- **The span is counted to the last offset pulled**, not to the largest one still cached as RocketMQ's getMaxSpan
  does: once the messages after a stuck one were consumed, RocketMQ's span fell back to 0 and its pulls went on a
  batch at a time, so the queue's committed offset (held at the stuck message) fell behind without bound, and all
  that was handled since was handled again after a restart or a rebalance. Counted so, the span bounds that: at most
  ``max_span`` offsets (plus one pull) past the consume offset are ever handled ahead of it. The iterator form and
  orderly consumption have no span bound: each consumes a queue in order, so the offsets cached are the next ones in
  line and the count bound already holds the span (1000 + one pull, under the default 2000).
- **The conditions are checked when a pull is about to go**, and again each time a message leaves while a pull
  waits: whatever moved the span (messages put, a filtered-out range passed, messages consumed) is seen.
- **Dropped** (``drop``: taken away, reset, closed), a queue stops its pull and wakes a pull waiting for space, but
  keeps its cache: an orderly handler finishing its message after the drop finds the offset past it there (its
  release commits that). The iterator form's queue (``_IteratedQueue`` in ``client/push_consumer.py``) lets go of
  its cache at once instead: nothing reads it after the drop, and it was a whole threshold's worth per drop.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from client.message import MessageExt, MessageQueue

__all__ = ["ProcessQueue", "FLOW_COUNT", "FLOW_SIZE", "FLOW_SPAN"]

# Why a pull waits (ProcessQueue.flow_control): RocketMQ's three flow controls of a push consumer's queue.
FLOW_COUNT = "count"
FLOW_SIZE = "size"
FLOW_SPAN = "span"


class ProcessQueue:
    """Messages of one queue pulled but not yet consumed, in offset order. Pulls wait (``wait_space``) while it
    holds ``threshold`` messages or ``threshold_bytes`` of bodies, or (``max_span`` set) while its offsets span more
    than ``max_span``; one pull may go past any of them by its size."""

    def __init__(self, mq: MessageQueue, threshold: int = 1000, threshold_bytes: int = 100 << 20,
                 max_span: int | None = None) -> None:
        self.mq = mq
        self.threshold = threshold
        self.threshold_bytes = threshold_bytes
        self.max_span = max_span
        self.msgs: dict[int, MessageExt] = {}
        self.msg_bytes = 0
        self.dropped = False
        self.max_offset_seen = -1
        # The consume offset reached by the last consumed message, not yet handed to the offset store: one
        # attribute write per message; the consumer flushes it before every persist and when the queue goes.
        self.unflushed_offset: int | None = None
        self.cancel_scope = trio.CancelScope()
        # Orderly form: cancel_scope stops the pull only; the handler finishes its message unless this is cancelled
        # too (close past its wait, an offset reset). ``reset``: dropped by an offset reset, which keeps the lock.
        self.handler_scope = trio.CancelScope()
        self.reset = False
        self.finished = trio.Event()  # its orderly queue task has ended
        # Set when a pull that waits may go on; only looked at (in remove) while one waits, so the hot path of a
        # queue under no flow control is one attribute test per message.
        self._space = trio.Event()
        self._pull_waiting = False

    @property
    def count(self) -> int:
        return len(self.msgs)

    @property
    def span(self) -> int:
        """Offsets from the least one cached to the last one pulled; 0 when nothing is cached."""
        return self.max_offset_seen - next(iter(self.msgs)) if self.msgs else 0

    def put(self, msgs: Sequence[MessageExt]) -> None:
        # Offsets only grow within one ProcessQueue (a reset makes a new one), so none is put twice.
        for m in msgs:
            self.msgs[m.queue_offset] = m
            self.msg_bytes += len(m.body)
            self.max_offset_seen = max(self.max_offset_seen, m.queue_offset)

    def remove(self, offset: int) -> int:
        """Drop a consumed message; returns the queue's new consume offset."""
        msgs = self.msgs
        msg = msgs.pop(offset, None)
        if msg is not None:
            self.msg_bytes -= len(msg.body)
        if self._pull_waiting and self.flow_control() is None:
            self._pull_waiting = False
            self._space.set()
        # Offsets are inserted in increasing order and dicts keep insertion order: the first is the least.
        return next(iter(msgs)) if msgs else self.max_offset_seen + 1

    def consume_offset(self) -> int:
        if self.msgs:
            # Offsets are inserted in increasing order and dicts keep insertion order: the first is the least.
            return next(iter(self.msgs))
        return self.max_offset_seen + 1

    def flow_control(self) -> str | None:
        """Why the next pull must wait (``FLOW_COUNT``, ``FLOW_SIZE``, ``FLOW_SPAN``), or None if it may go."""
        if len(self.msgs) >= self.threshold:
            return FLOW_COUNT
        if self.msg_bytes >= self.threshold_bytes:
            return FLOW_SIZE
        if self.max_span is not None and self.span > self.max_span:
            return FLOW_SPAN
        return None

    async def wait_space(self) -> None:
        """Wait until the next pull may go (see ``flow_control``), or the queue is dropped."""
        while not self.dropped and self.flow_control() is not None:
            if not self._pull_waiting:
                self._space = trio.Event()
                self._pull_waiting = True
            await self._space.wait()

    def drop(self) -> None:
        self.dropped = True
        self.cancel_scope.cancel()
        self._pull_waiting = False
        self._space.set()
