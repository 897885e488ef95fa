"""Concurrent consumption for the push consumer's handler form (RocketMQ's ConsumeMessageConcurrentlyService), in
trio tasks. Orderly consumption is ``client/orderly.py``; the iterator form has no service (the loop is the caller's).

The rules:

- **A pool of handler calls shared by the consumer's queues.** Each assigned queue has a pull task (filling its
  ``ProcessQueue``), a dispatch task, and worker tasks in the queue's nursery that make the handler calls, one at a
  time each. At most ``max_concurrent_handlers`` calls run at once across all queues (RocketMQ's
  consumeThreadMin/consumeThreadMax pool, 20 threads): a call takes a slot of one ``trio.Semaphore`` before it starts
  and gives it back when its message is done. A trio task costs no thread, so there is no minimum to keep.
- **Fairness.** The queue's dispatcher takes a slot, then spawns a worker holding it; workers never wait for one
  (but to resume a local retry, below). So each queue waits for one slot at a time, and trio's ``Semaphore`` hands
  a released slot to its first waiter. So while every slot is taken, every queue with messages waiting gets one of
  the slots freed, in turn: a queue with a deep backlog gets its share, never all of them. (A free slot is taken
  without a checkpoint, which jumps no queue: a slot is free only when nobody waits for one.)
- **Workers go on while nobody waits.** A worker that has finished a call gives its slot back, then takes its queue's
  next waiting message if it can take a free slot at once (so, as above, ahead of no queue); else it ends, and the
  message is the dispatcher's. The dispatcher spawns a further worker only once the one it spawned last has run, for
  messages still waiting then. So a quick handler's backlog takes a task per batch pulled, not one per message (a
  task per message cost a handler that does nothing most of its throughput), while calls that wait get a worker
  each, up to the slots their queue gets.
- **Order.** A call takes the first message its queue has waiting when it starts, whichever worker makes it and
  whatever order trio runs them in, so a queue's calls start in offset order; but they run side by side and finish
  in any order, as with RocketMQ's concurrent listener: nothing is guaranteed about the order of delivery within a
  queue. ``orderly=True`` is for order.
- **Offsets.** A message stays in its ``ProcessQueue`` until its call has finished: succeeded, or failed and been sent
  back, dead-lettered, or retried here until done or given up. A queue's offset is the least offset still there
  (RocketMQ's TreeMap first key), so it never passes a message whose call has not finished, however many later ones
  finished first; and flow control (``pull_threshold_for_queue``, ``..._size_...``) counts the messages in calls.
- **Local retries** (the send-back failed; broadcasting): the message gives its slot back while it waits
  ``reconsume_delay_ms`` (RocketMQ's submitConsumeRequestLater holds no thread either), and its queue starts no
  further call until it is done (neither its dispatcher nor a worker finishing meanwhile), as the one-call-per-queue
  form did ("holding its queue"): a queue that cannot hand its failures to the broker should not race through its
  backlog failing them all. Calls already running go on.
- **Batches** (``batch_handler``, ``consume_message_batch_max_size``, RocketMQ's consumeMessageBatchMaxSize): a call
  takes up to that many of its queue's first waiting messages (never another queue's, never waiting for more) and
  one slot, and everything above holds with "batch" for "message": the consume timeout bounds the call, and failed
  messages are sent back each on its own, those the broker refused retried here together (broadcasting: all of
  them, up to ``max_reconsume_times``) while the queue is held. The answer is the batch's, but for
  ``ReconsumeLater.ack_index`` (RocketMQ's ackIndex: the messages up to it consumed, the rest failed). A message
  leaves its ``ProcessQueue`` when it is done, so the offset passes the consumed head of a batch whose tail is
  retried, and no further. The one-message path (``_consume``) is chosen per worker and left as it was.
- **Taken away, reset, closed.** The queue's cancel scope (``ProcessQueue.cancel_scope``) cancels its pull, its
  dispatcher and every call in flight, as it did the one call before. A cancelled call's message is not consumed:
  the queue's offset stays before it and it is delivered again (to the next holder, or after a restart): at least
  once. A call finishing after its queue was dropped no longer moves the offset (``PushConsumer._consumed``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from client.listener import ConsumeStatus, FailureCause, ReconsumeLater, failure_of, grouped_failure
from client.message import MessageExt

if TYPE_CHECKING:
    from client.push_consumer import ProcessQueue, PushConsumer

__all__ = ["ConcurrentConsumeService", "BatchHandler"]

# open_push_consumer(batch_handler=...): called with a tuple of up to consume_message_batch_max_size messages of one
# queue, in offset order (a tuple, as RocketMQ hands an unmodifiable list: ReconsumeLater.ack_index indexes it).
BatchHandler = Callable[[Sequence[MessageExt]], Awaitable[Any]]

log = logging.getLogger(__name__)

# A worker lets other tasks run at least every so many calls (as many as a pull brings by default, which the
# one-call-per-queue loop made between two reads of its channel).
_CALLS_PER_CHECKPOINT = 32


def _acked(failure: ReconsumeLater | None, size: int) -> int:
    """How many of a batch of ``size``, its head, a call consumed: all, or up to the ``ack_index`` of its failure
    (RocketMQ's ackIndex; None or -1: none; past the batch's end: all, as RocketMQ clamps it)."""
    if failure is None:
        return size
    return 0 if failure.ack_index is None else min(failure.ack_index + 1, size)


class _QueueHold:
    """One queue's messages in local retry: while there is any, the queue starts no further handler call."""

    __slots__ = ("retrying", "_resumed")

    def __init__(self) -> None:
        self.retrying = 0
        self._resumed = trio.Event()
        self._resumed.set()

    def pause(self) -> None:
        if self.retrying == 0:
            self._resumed = trio.Event()
        self.retrying += 1

    def resume(self) -> None:
        self.retrying -= 1
        if self.retrying == 0:
            self._resumed.set()

    async def wait_resumed(self) -> None:
        await self._resumed.wait()


class _QueueCalls:
    """One queue's side of the pool: its messages waiting for a call, its local-retry hold, its worker on its way."""

    __slots__ = ("pq", "hold", "waiting", "spawned", "take")

    def __init__(self, pq: ProcessQueue, take: int = 1) -> None:
        self.pq = pq
        self.take = take  # messages a call takes at most: 1, or a batch handler's consume_message_batch_max_size
        self.hold = _QueueHold()
        # The messages whose call is not started yet, in offset order. Each call takes the first one as it starts,
        # whichever worker makes it and whatever order trio runs them in: a queue's calls start in offset order.
        self.waiting: collections.deque[MessageExt] = collections.deque()
        # Set by the worker spawned last when it has run (taken its first message, or found it may not); None after.
        self.spawned: trio.Event | None = None

    def unclaimed(self) -> int:
        """Waiting messages no worker is bound to take: all but those the worker on its way will (one call's)."""
        return len(self.waiting) - (self.take if self.spawned is not None else 0)


class ConcurrentConsumeService:
    """The handler calls of one push consumer (handler form, not orderly); the rules are in the module docstring."""

    def __init__(self, consumer: PushConsumer, max_concurrent_handlers: int, batch_handler: BatchHandler | None = None,
                 batch_max_size: int = 1) -> None:
        self._consumer = consumer
        self._max = max_concurrent_handlers
        self._slots = trio.Semaphore(max_concurrent_handlers)
        # None: the consumer's handler, one message a call (PushConsumer._call_handler).
        self._batch_handler = batch_handler
        self._take = batch_max_size if batch_handler is not None else 1

    @property
    def handling(self) -> int:
        """Handler calls holding a slot now: running, sending their failed message back, or about to start."""
        return self._max - self._slots.value

    async def run_queue(self, pq: ProcessQueue, start_offset: int | None) -> None:
        """Pull ``pq``'s queue and handle its messages until cancelled (the caller runs this in ``pq.cancel_scope``)."""
        send, recv = trio.open_memory_channel[tuple["ProcessQueue", Sequence[MessageExt]]](math.inf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._consumer._pull_loop, pq, send, start_offset)
            nursery.start_soon(self._dispatch, _QueueCalls(pq, self._take), recv, nursery)

    async def _dispatch(self, q: _QueueCalls, recv: trio.MemoryReceiveChannel, nursery: trio.Nursery) -> None:
        async for _, msgs in recv:
            q.waiting.extend(msgs)
            # Not back to the channel while a message waits: the worker spawned last may leave its message (a local
            # retry began before it ran), and workers that finish take a further one only when a slot is free.
            while q.waiting:
                if q.unclaimed() <= 0:
                    # Only the messages the worker spawned last is bound to take (one call's): see that it does.
                    assert q.spawned is not None
                    await q.spawned.wait()
                    continue
                # One slot at a time for this queue: the fairness between queues (see the module docstring).
                await self._take_slot(q.hold)
                if q.spawned is not None:
                    # The worker spawned last has not run yet, and it may take every message waiting (as may the
                    # workers running, as they finish): a worker per message was a task per message however quick
                    # the handler. It runs in the next pass of trio's scheduler, as it never waits before its first
                    # message; this queue keeps the slot it had its turn for meanwhile.
                    try:
                        await q.spawned.wait()
                    except BaseException:
                        self._slots.release()  # cancelled with the queue: the slot is every queue's
                        raise
                if q.waiting and not q.hold.retrying:
                    q.spawned = trio.Event()
                    nursery.start_soon(self._work, q)
                else:
                    # Taken by workers that finished meanwhile, or a local retry began: to whoever waits for one.
                    self._slots.release()

    async def _take_slot(self, hold: _QueueHold) -> None:
        if not hold.retrying:
            try:
                # A slot free means nobody waits for one (trio's Semaphore hands a released slot to its first waiter):
                # taking it without a checkpoint jumps no queue, and spares a trip through the scheduler per message.
                self._slots.acquire_nowait()
                return
            except trio.WouldBlock:
                pass
        while True:
            await hold.wait_resumed()
            await self._slots.acquire()
            if not hold.retrying:
                return
            # A message of this queue went into a local retry while we waited: the slot goes to another queue.
            self._slots.release()

    async def _work(self, q: _QueueCalls) -> None:
        """Spawned holding a slot (the dispatcher's): the calls of ``q``'s first waiting message, then of the next and
        so on as long as a slot is free at once (see the module docstring)."""
        spawned, q.spawned = q.spawned, None
        assert spawned is not None
        spawned.set()
        if not q.waiting or q.hold.retrying:
            # Taken by workers that finished, or a local retry began, since the dispatcher took the slot: the queue's
            # messages wait for the dispatcher, which starts the next call once the retry is done.
            self._slots.release()
            return
        # Chosen once a worker, not per call: the one-message path stays as it was.
        consume = self._consume if self._batch_handler is None else self._consume_batch
        for calls in itertools.count(1):
            await consume(q.pq, q.hold, q.waiting)  # gives its slot back
            if calls % _CALLS_PER_CHECKPOINT == 0:
                # Handlers that never wait would otherwise hold trio's loop through all their queue has waiting, up
                # to its whole cache, while pulls, heartbeats and the other queues wait for their turn.
                await trio.lowlevel.checkpoint()
            if not q.waiting or q.hold.retrying:
                return
            try:
                # Free means nobody waits for a slot (trio's Semaphore hands a released one to its first waiter):
                # taking it jumps no queue. When one waits, the slot just given back went to it, and this queue's
                # next message is left to its dispatcher, which waits for its turn.
                self._slots.acquire_nowait()
            except trio.WouldBlock:
                return

    async def _consume(self, pq: ProcessQueue, hold: _QueueHold, waiting: collections.deque[MessageExt]) -> None:
        # Called holding a slot, which it gives back when its message is done, or when it is cancelled.
        held = True  # whether this call holds a slot (not while it waits to retry locally)
        try:
            msg = waiting.popleft()
            consumer = self._consumer
            timeout_s = consumer.config.consume_timeout_min * 60
            attempts = consumer.max_reconsume_times + 1
            clustering = consumer._retry_topic is not None
            retrying = False
            try:
                for attempt in itertools.count(1):
                    hook = consumer._hook  # client/consume_hook.py
                    if hook is None:
                        failure = await consumer._call_handler(pq, msg, timeout_s=timeout_s)
                    else:
                        call = hook.call_started(pq.mq, (msg,), timeout_s)
                        failure = await consumer._call_handler(pq, msg, timeout_s=timeout_s)
                        hook.call_ended(call, failure, 1 if failure is None else 0)
                    if failure is None:
                        break
                    delay_level = failure.delay_level or 0
                    # Clustering: handed back to the broker (retry topic, then dead letters) and done. Only when that
                    # fails is it retried here, as RocketMQ's consumeMessageDirectly fallback, and without end as
                    # there: skipping it would lose a message the broker still holds for the group, while the next
                    # send-back that gets through (past max_reconsume_times: to the dead letters) keeps it.
                    if clustering:
                        if await consumer.send_back(pq.mq, msg, delay_level=delay_level):
                            break
                    elif delay_level < 0:
                        log.error("message skipped, its handler asked for the dead letters (delay_level -1), which a "
                                  "broadcasting consumer has none of mq=%s offset=%d msg_id=%s", pq.mq,
                                  msg.queue_offset, msg.msg_id)
                        break
                    elif attempt >= attempts:
                        log.error("message skipped after %d failed attempts mq=%s offset=%d msg_id=%s", attempts,
                                  pq.mq, msg.queue_offset, msg.msg_id)
                        break
                    held, first, retrying = False, not retrying, True  # resumed in the finally, even if cancelled
                    await self._wait_to_retry(hold, first=first)
                    held = True
                    # Counted up for the handler, as RocketMQ's local retry does (setReconsumeTimes before
                    # resubmitting).
                    msg = dataclasses.replace(msg, reconsume_times=msg.reconsume_times + 1)
            finally:
                if retrying:
                    hold.resume()
            consumer._delivered += 1
            consumer._consumed(pq, msg)
        finally:
            if held:
                self._slots.release()

    async def _consume_batch(self, pq: ProcessQueue, hold: _QueueHold,
                             waiting: collections.deque[MessageExt]) -> None:
        """``_consume`` for a batch handler: one call takes up to a batch of the queue's first waiting messages. The
        failed ones (all of the batch, or those after ``ReconsumeLater.ack_index``) go as one failed message does;
        those retried here are called again together, as RocketMQ resubmits a batch's failed send-backs. A message
        leaves the queue as soon as it is done, so the offset may pass the head of a batch whose tail is retried."""
        held = True  # whether this call holds a slot (not while it waits to retry locally)
        try:
            batch = tuple(waiting.popleft() for _ in range(min(self._take, len(waiting))))
            consumer = self._consumer
            timeout_s = consumer.config.consume_timeout_min * 60
            attempts = consumer.max_reconsume_times + 1
            clustering = consumer._retry_topic is not None
            retrying = False
            try:
                for attempt in itertools.count(1):
                    hook = consumer._hook  # client/consume_hook.py
                    if hook is None:
                        failure = await self._call_batch(pq, batch, timeout_s)
                    else:
                        call = hook.call_started(pq.mq, batch, timeout_s)
                        failure = await self._call_batch(pq, batch, timeout_s)
                        hook.call_ended(call, failure, _acked(failure, len(batch)))
                    if failure is None:
                        self._done(pq, batch)
                        break
                    acked = _acked(failure, len(batch))
                    self._done(pq, batch[:acked])
                    failed = batch[acked:]
                    if not failed:
                        break
                    delay_level = failure.delay_level or 0
                    if clustering:
                        # Each failed message sent back on its own, as RocketMQ; only those the broker did not take
                        # are retried here (without end: see _consume).
                        kept = []
                        for msg in failed:
                            if await consumer.send_back(pq.mq, msg, delay_level=delay_level):
                                self._done(pq, (msg,))
                            else:
                                kept.append(msg)
                        if not kept:
                            break
                        failed = tuple(kept)
                    elif delay_level < 0 or attempt >= attempts:
                        for msg in failed:
                            if delay_level < 0:
                                log.error("message skipped, its batch handler asked for the dead letters (delay_level "
                                          "-1), which a broadcasting consumer has none of mq=%s offset=%d msg_id=%s",
                                          pq.mq, msg.queue_offset, msg.msg_id)
                            else:
                                log.error("message skipped after %d failed attempts mq=%s offset=%d msg_id=%s",
                                          attempts, pq.mq, msg.queue_offset, msg.msg_id)
                        self._done(pq, failed)
                        break
                    held, first, retrying = False, not retrying, True  # resumed in the finally, even if cancelled
                    await self._wait_to_retry(hold, first=first)
                    held = True
                    batch = tuple(dataclasses.replace(m, reconsume_times=m.reconsume_times + 1) for m in failed)
            finally:
                if retrying:
                    hold.resume()
        finally:
            if held:
                self._slots.release()

    async def _wait_to_retry(self, hold: _QueueHold, *, first: bool) -> None:
        """Called holding a slot, before a local retry: gives the slot back for ``reconsume_delay_ms`` (the queue
        held from the first retry on: it starts no further call) and returns holding one again; cancelled while
        waiting, it holds none."""
        if first:
            hold.pause()
        self._slots.release()
        await trio.sleep(self._consumer.config.reconsume_delay_ms / 1000)
        await self._slots.acquire()

    def _done(self, pq: ProcessQueue, msgs: Sequence[MessageExt]) -> None:
        consumer = self._consumer
        consumer._delivered += len(msgs)
        for msg in msgs:
            consumer._consumed(pq, msg)

    async def _call_batch(self, pq: ProcessQueue, batch: tuple[MessageExt, ...],
                          timeout_s: float) -> ReconsumeLater | None:
        """``PushConsumer._call_handler`` for a batch: None if the batch handler consumed it all (returned None or
        ``ConsumeStatus.SUCCESS``), else the failure as a ``ReconsumeLater`` (the handler's own, which may carry
        ``ack_index``; a plain one, all failed, when it raised anything else, returned anything else, or ran past
        ``timeout_s`` and was cancelled; its ``cause`` says which of the first two, for message trace)."""
        assert self._batch_handler is not None
        first, last = batch[0].queue_offset, batch[-1].queue_offset
        with trio.move_on_after(timeout_s) as scope:
            try:
                result = await self._batch_handler(batch)
            except ReconsumeLater as e:
                log.debug("batch handler asked to reconsume later mq=%s offsets=%d..%d messages=%d ack_index=%s "
                          "delay_level=%s", pq.mq, first, last, len(batch), e.ack_index, e.delay_level)
                return e
            except BaseExceptionGroup as group:
                return grouped_failure(group, lambda rest: log.error(
                    "batch handler failed mq=%s offsets=%d..%d messages=%d", pq.mq, first, last, len(batch),
                    exc_info=rest))
            except Exception:
                log.exception("batch handler failed mq=%s offsets=%d..%d messages=%d", pq.mq, first, last, len(batch))
                return failure_of(FailureCause.RAISED)
        if scope.cancelled_caught:
            log.warning("batch handler cancelled after consume_timeout_min=%d, its messages count as failed topic=%s "
                        "broker_name=%s queue_id=%d offsets=%d..%d messages=%d",
                        self._consumer.config.consume_timeout_min, pq.mq.topic, pq.mq.broker_name, pq.mq.queue_id,
                        first, last, len(batch))
            return ReconsumeLater()
        if result is None or result is ConsumeStatus.SUCCESS:
            return None
        if result is ConsumeStatus.RECONSUME_LATER:
            return ReconsumeLater()
        self._consumer._unknown_result(result, pq, batch[0])
        return failure_of(FailureCause.NO_STATUS)
