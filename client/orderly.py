"""Orderly consumption for the push consumer: its queue locks (RocketMQ's RebalanceImpl.lock / lockAll / unlock)
and its handling (ConsumeMessageOrderlyService).

Members of a group compute the queue allocation each on its own, at their own moments, so around a join or a
leave two of them may both think a queue theirs. An orderly member (``open_push_consumer(..., orderly=True)``)
therefore consumes a queue only while it holds the queue's lock on the queue's broker group (LOCK_BATCH_MQ,
``broker/rebalance_lock.py``):

- A newly assigned queue is locked before its start offset is read and its first pull is sent; one the broker
  refuses (another member still holds it) is asked for again at the next rebalance, half a second later.
- Every held lock is renewed every ``rebalance_lock_interval_ms`` (20 s), or every third of the broker's lock life
  if that is shorter. A lock is trusted for half the life the broker gave, counted from when it was asked for: the
  broker counts from when it answered, later, and keeps it the whole life, so the member stops trusting it well
  before anyone else can get it. A member consumes no message without a trusted lock; a renewal refused (the lock
  lapsed and another member took it) drops the queue at once.
- A queue taken away is unlocked only after its in-flight message is handled and its offset committed
  (``OrderlyService._release`` does that, then calls ``unlock``); an admin reset told meanwhile wins: the reset
  offset is committed instead of the position. A release is bounded (twice the request timeout): one whose commit
  did not go through in time, or that was cut short, stops renewing the lock without giving it back
  (``forget``, ``abandon``): the lock lapses on the broker after its life, and the next holder waits that long
  (kept renewed, the queue would be nobody's for this member's life; given back, its next holder would start
  before messages handled here).

Requests to one broker group go one at a time (a renewal computed before an unlock and sent after it would take
the queue back), and each renews only queues still held when it is sent; its answer trusts again only those still
held when it comes back.

Handling, per queue, one message at a time (also in broadcasting mode, which needs no lock: every member consumes
every queue), as RocketMQ's ConsumeMessageOrderlyService: a handler that fails (raises, returns
``ConsumeStatus.RECONSUME_LATER`` or anything but None and ``SUCCESS``: ``client.push_consumer``) suspends the queue
for ``suspend_current_queue_time_ms``, or the ``suspend_ms`` of the ``ReconsumeLater`` it raised, and gets the same
message again with ``reconsume_times`` counted up. Once the message fails after ``max_reconsume_times`` retries (-1, the
default: never, as RocketMQ's Integer.MAX_VALUE), or at once if the handler raised ``ReconsumeLater(delay_level=-1)``,
in clustering mode it is sent to its group's dead-letter topic (CONSUMER_SEND_MSG_BACK with delay level -1, retried
while the queue stays suspended); in broadcasting mode (no broker-side retries, as RocketMQ) it is logged and
skipped. No consume timeout: RocketMQ's consumeTimeout is for concurrent consumption, and the queue's next message
waits for this one however long it takes. A queue's offset only passes messages whose handler returned, or that
went to the dead letters or were skipped.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from client.message import MessageExt, MessageQueue
from client.pull_consumer import PullAPI
from remoting.errors import RaftMQError

if TYPE_CHECKING:
    from client.push_consumer import ProcessQueue, PushConsumer, PushConsumerConfig

__all__ = ["QueueLocks", "OrderlyService", "CLOSE_WAIT_S"]

log = logging.getLogger(__name__)

# Until the broker says (its LOCK_BATCH_MQ answer carries its rebalance_lock_max_live_time_ms): RocketMQ's 60 s.
DEFAULT_LOCK_LIFE_S = 60.0
# How long a closing consumer waits for the messages in its handlers before it cancels them.
CLOSE_WAIT_S = 3.0


class QueueLocks:
    """The locks one orderly member holds. ``on_lost(mq)`` is called when a renewal finds a queue's lock taken."""

    def __init__(self, api: PullAPI, client_id: str, *, renew_interval_ms: int,
                 on_lost: Callable[[MessageQueue], None]) -> None:
        self._api = api
        self._client_id = client_id
        self._renew_interval_s = renew_interval_ms / 1000
        self._on_lost = on_lost
        # Each held queue's end of trust (trio clock); a queue stays here, renewed, until it is unlocked.
        self._trusted_until: dict[MessageQueue, float] = {}
        self._shortest_life_s = DEFAULT_LOCK_LIFE_S  # of the lock lives the brokers gave, for the renewal period
        self._request_locks: dict[str, trio.Lock] = {}

    def held(self) -> list[MessageQueue]:
        return sorted(self._trusted_until)

    def trusted(self, mq: MessageQueue) -> bool:
        """Whether ``mq`` may be consumed now: its lock is held and was last granted less than half a life ago."""
        return trio.current_time() < self._trusted_until.get(mq, -math.inf)

    def _request_lock(self, broker_name: str) -> trio.Lock:
        return self._request_locks.setdefault(broker_name, trio.Lock())

    async def lock(self, mqs: Iterable[MessageQueue]) -> set[MessageQueue]:
        """Lock ``mqs`` (renewing those held); returns those held now. A group that cannot be asked holds none."""
        locked: set[MessageQueue] = set()
        for broker_name, queues in _by_broker(mqs).items():
            async with self._request_lock(broker_name):
                locked |= await self._ask(broker_name, queues)
        return locked

    async def renew(self) -> None:
        """Renew every held lock; a queue refused is no longer held (``on_lost``). One that cannot be asked keeps
        its trust until that runs out. One abandoned while its renewal was on its way stays abandoned."""
        for broker_name in sorted({mq.broker_name for mq in self._trusted_until}):
            async with self._request_lock(broker_name):
                queues = sorted(mq for mq in self._trusted_until if mq.broker_name == broker_name)
                if not queues:
                    continue
                try:
                    locked, trusted_until = await self._request(queues)
                except RaftMQError as e:
                    log.info("queue locks not renewed broker_name=%s queues=%d error=%s", broker_name, len(queues), e)
                    continue
                for mq in queues:
                    if mq not in self._trusted_until:
                        continue  # abandoned meanwhile: trusted again, it would be renewed for the member's life
                    if mq in locked:
                        self._trusted_until[mq] = trusted_until
                    else:
                        del self._trusted_until[mq]
                        log.warning("queue lock lost (another member holds it) mq=%s", mq)
                        self._on_lost(mq)

    async def _ask(self, broker_name: str, queues: list[MessageQueue]) -> set[MessageQueue]:
        try:
            locked, trusted_until = await self._request(queues)
        except RaftMQError as e:
            log.info("queues not locked broker_name=%s queues=%d error=%s", broker_name, len(queues), e)
            return set()
        for mq in queues:
            if mq in locked:
                self._trusted_until[mq] = trusted_until
            else:
                self._trusted_until.pop(mq, None)  # another member's now
        return locked

    async def _request(self, queues: list[MessageQueue]) -> tuple[set[MessageQueue], float]:
        """LOCK_BATCH_MQ of ``queues``: those locked, and until when (trio clock) their locks are trusted."""
        asked_at = trio.current_time()
        locked, life_ms = await self._api.lock_batch(self._client_id, queues)
        life_s = life_ms / 1000
        self._shortest_life_s = min(self._shortest_life_s, life_s)
        return locked, asked_at + life_s / 2

    async def unlock(self, mqs: Iterable[MessageQueue]) -> None:
        """Give ``mqs`` back. They are no longer held here whether or not the broker could be told: a lock it was
        not told of lapses after its life, and the next member waits that long."""
        for broker_name, queues in _by_broker(mqs).items():
            async with self._request_lock(broker_name):
                for mq in queues:
                    self._trusted_until.pop(mq, None)
                try:
                    await self._api.unlock_batch(self._client_id, queues)
                except RaftMQError as e:
                    log.warning("queue locks not released, they lapse on the broker instead broker_name=%s "
                                "queues=%s error=%s", broker_name, ", ".join(map(str, queues)), e)

    async def forget(self, mq: MessageQueue) -> None:
        """Stop renewing ``mq`` without telling the broker: its lock lapses there after its life."""
        async with self._request_lock(mq.broker_name):  # not while a renewal of it is in flight
            self._trusted_until.pop(mq, None)

    def abandon(self, mq: MessageQueue) -> None:
        """``forget`` at once, for a release cut short that cannot wait for its group's requests: a renewal of
        ``mq`` on its way does not make it held again (``renew``), and only ``lock`` asks for it again."""
        self._trusted_until.pop(mq, None)

    def renew_interval_s(self) -> float:
        return min(self._renew_interval_s, self._shortest_life_s / 3)

    async def serve_renewal(self) -> None:
        while True:
            await trio.sleep(self.renew_interval_s())
            await self.renew()


def _by_broker(mqs: Iterable[MessageQueue]) -> dict[str, list[MessageQueue]]:
    groups: dict[str, list[MessageQueue]] = {}
    for mq in sorted(set(mqs)):
        groups.setdefault(mq.broker_name, []).append(mq)
    return groups


class OrderlyService:
    """The orderly half of a ``PushConsumer``: which queues it may start, and each queue's task (pull, handle in
    order, give back). A part of the consumer kept in its own module for size: it works on the consumer's queues
    (``_pqs``), pulls and offsets directly."""

    def __init__(self, consumer: PushConsumer, config: PushConsumerConfig, api: PullAPI, client_id: str,
                 offsets: Any) -> None:
        self._consumer = consumer
        self._config = config
        self._offsets = offsets
        # Clustering only: a broadcasting member consumes every queue itself.
        self.locks = (QueueLocks(api, client_id, renew_interval_ms=config.rebalance_lock_interval_ms,
                                 on_lost=self._lock_lost)
                      if config.message_model == "CLUSTERING" else None)
        # Queues taken away whose task is finishing its message, committing and unlocking: not taken again before.
        self.releasing: dict[MessageQueue, ProcessQueue] = {}
        self._released = trio.Event()
        # Whether the last rebalance left queues to other holders: they are asked for again soon.
        self.lock_retry = False
        self.delivered = 0

    @property
    def _pqs(self) -> dict[MessageQueue, ProcessQueue]:
        return self._consumer._pqs

    @property
    def _timeout_s(self) -> float:
        return self._consumer._instance.timeout_s

    async def lock_new_queues(self, queues: Sequence[MessageQueue]) -> list[MessageQueue]:
        """The newly assigned ``queues`` this member may start: those whose lock it now holds. One whose last holder
        has not given it back (or that this member is still giving back) is asked for again soon (``lock_retry``)."""
        if self.locks is None:
            return list(queues)
        free = [mq for mq in queues if mq not in self.releasing]
        locked = await self.locks.lock(free) if free else set()
        if len(locked) < len(queues):
            self.lock_retry = True
            log.debug("queues held elsewhere, asked for again soon group=%s queues=%s", self._config.consumer_group,
                      ", ".join(str(mq) for mq in queues if mq not in locked))
        return [mq for mq in queues if mq in locked]

    def take_away(self, mq: MessageQueue) -> None:
        """Stop pulling ``mq`` now; its task finishes the message in the handler, commits and unlocks. A queue
        already taken away (its lock lost while a rebalance that also took it away waited) is left as it is."""
        pq = self._pqs.pop(mq, None)
        if pq is None:
            return
        self.releasing[mq] = pq
        pq.drop()

    def _lock_lost(self, mq: MessageQueue) -> None:
        # Another member holds the lock now: stop (a rebalance takes the queue again, from the committed offset,
        # once it can lock it).
        if mq in self._pqs:
            self.take_away(mq)
            self._consumer.trigger_rebalance()

    async def run_queue(self, pq: ProcessQueue, start_offset: int | None, after: ProcessQueue | None = None) -> None:
        """Pull and handle ``pq`` until it is dropped, then (unless an offset reset dropped it, keeping the lock)
        commit and unlock it. ``after``: the queue's previous task, reset, which must be gone before this one
        handles anything."""
        try:
            if after is not None:
                await after.finished.wait()
            send, recv = trio.open_memory_channel[tuple[Any, Sequence[MessageExt]]](math.inf)

            async def pull() -> None:
                with pq.cancel_scope:  # drop() stops the pull alone
                    await self._consumer._pull_loop(pq, send, start_offset)
                    await trio.sleep_forever()  # it returned for an offset reset, which drops the queue
                send.close()  # ends the handler's loop

            async with trio.open_nursery() as nursery:
                nursery.start_soon(pull)
                with pq.handler_scope:
                    await self._handle_loop(pq, recv)
                if self._pqs.get(pq.mq) is pq:
                    # Its lock is no longer trusted (not renewed for half a life: the broker unreachable), and
                    # another member may get it soon. Give it up; a rebalance takes it again once it can lock it.
                    log.warning("queue lock no longer trusted, queue given up mq=%s", pq.mq)
                    self.take_away(pq.mq)
                    self._consumer.trigger_rebalance()
                pq.drop()
            if pq.reset:
                return
            with trio.move_on_after(2 * self._timeout_s) as scope:
                scope.shield = True  # a close under cancellation still commits and unlocks
                await self._release(pq, scope.deadline)
            if scope.cancelled_caught:
                # Cut short, its commit perhaps never sent: the lock must not stay held (renewed for the member's
                # life, the queue nobody's) nor be given back ahead of the offset. It lapses on the broker.
                log.warning("queue release timed out, offset perhaps not committed, queue lock left to lapse on "
                            "the broker mq=%s", pq.mq)
                if pq.mq not in self._pqs:
                    self._consumer.forget_offset(pq.mq)
                if self.locks is not None:
                    self.locks.abandon(pq.mq)
        finally:
            pq.finished.set()
            if self.releasing.get(pq.mq) is pq:
                del self.releasing[pq.mq]
                self._consumer.reset_settled(pq.mq)  # committed by the release, or too late for it
                self._released.set()
                self._released = trio.Event()

    def _trusted(self, mq: MessageQueue) -> bool:
        return self.locks is None or self.locks.trusted(mq)

    async def _handle_loop(self, pq: ProcessQueue, recv: trio.MemoryReceiveChannel) -> None:
        async for _, msgs in recv:
            for msg in msgs:
                if pq.dropped or not self._trusted(pq.mq):
                    return
                if not await self._handle(pq, msg):
                    return

    async def _handle(self, pq: ProcessQueue, msg: MessageExt) -> bool:
        """Handle ``msg`` until its handler succeeds (RocketMQ's SUSPEND_CURRENT_QUEUE_A_MOMENT between attempts),
        or, once it fails after ``max_reconsume_times`` retries (or asked for the dead letters), send it to the
        dead-letter topic (clustering) or skip it (broadcasting); False if the queue stopped first (``msg``
        unconsumed)."""
        consumer = self._consumer
        max_times = consumer.max_reconsume_times
        attempts = 0
        while True:
            hook = consumer._hook  # client/consume_hook.py
            if hook is None:
                failure = await consumer._call_handler(pq, msg)
            else:
                call = hook.call_started(pq.mq, (msg,))
                failure = await consumer._call_handler(pq, msg)
                hook.call_ended(call, failure, 1 if failure is None else 0)
            if failure is None:
                break
            attempts += 1
            # RocketMQ's checkReconsumeTimes: the count the message carries, which each failure here adds to.
            if failure.delay_level == -1 or msg.reconsume_times >= max_times:
                if consumer._retry_topic is None:
                    # Broadcasting: no broker-side retries (as RocketMQ), so the message is given up here.
                    log.error("message skipped after %d failed attempts mq=%s offset=%d msg_id=%s", attempts,
                              pq.mq, msg.queue_offset, msg.msg_id)
                    break
                # Clustering: to the group's dead-letter topic (delay level -1), as RocketMQ's orderly service;
                # should that fail, the queue stays suspended on this message and tries again, never skipping it.
                if await consumer.send_back(pq.mq, msg, delay_level=-1):
                    log.error("message sent to the dead-letter topic after %d failed attempts mq=%s offset=%d "
                              "msg_id=%s", attempts, pq.mq, msg.queue_offset, msg.msg_id)
                    break
            suspend_ms = failure.suspend_ms if failure.suspend_ms is not None else \
                self._config.suspend_current_queue_time_ms
            await trio.sleep(suspend_ms / 1000)
            # The handler sees how often the message failed, as RocketMQ's orderly service counts it.
            msg = dataclasses.replace(msg, reconsume_times=msg.reconsume_times + 1)
            if pq.dropped or not self._trusted(pq.mq):
                return False
        self.delivered += 1
        # Also when the queue was taken away meanwhile: its release commits this.
        pq.unflushed_offset = pq.remove(msg.queue_offset)
        return True

    async def _release(self, pq: ProcessQueue, deadline: float) -> None:
        """Commit what ``pq``'s handler finished (or the offset an admin reset told meanwhile set: the reset wins,
        ``PushRebalance._commit_leaving``), then unlock its queue: its next holder starts there. The commit is
        retried while the lock is still trusted and a request timeout is left before ``deadline`` (trio clock, when
        the release is cut short) for the unlock; failing that, the lock is not given back but left to lapse on the
        broker: given back, the next holder would start before messages handled here."""
        mq = pq.mq
        consumer = self._consumer
        consumer._flush_offset(pq)
        committed = not await consumer._commit_leaving([mq])
        pause_s = self._config.suspend_current_queue_time_ms / 1000
        while not committed and self.locks is not None and self.locks.trusted(mq) and \
                trio.current_time() + pause_s <= deadline - self._timeout_s:
            await trio.sleep(pause_s)
            committed = not await consumer._commit_leaving([mq])
        if mq not in self._pqs:
            consumer.forget_offset(mq)
        if self.locks is None:
            return
        if committed:
            await self.locks.unlock([mq])
        else:
            log.warning("offset not committed, queue lock left to lapse on the broker mq=%s", mq)
            await self.locks.forget(mq)

    async def close(self, queues: Iterable[MessageQueue]) -> None:
        """Take every queue away and wait (``CLOSE_WAIT_S``) for their handlers to finish their messages, then
        cancel those still busy (their messages go to the next holder, not at the same time: the unlock comes
        after); each queue commits and unlocks itself."""
        for mq in list(queues):
            self.take_away(mq)
        with trio.CancelScope(shield=True):
            with trio.move_on_after(CLOSE_WAIT_S):
                await self._wait_released()
            for pq in self.releasing.values():
                pq.handler_scope.cancel()
            with trio.move_on_after(2 * self._timeout_s + 1):
                await self._wait_released()
            # Locked by a rebalance that raced the close, never consumed: nothing to commit. Not a queue still
            # releasing (its handler deaf to the cancel): its offset is not committed yet, and its own task
            # unlocks it after the commit, or leaves it to lapse.
            if self.locks is not None:
                idle = [mq for mq in self.locks.held() if mq not in self.releasing]
                if idle:
                    with trio.move_on_after(self._timeout_s):
                        await self.locks.unlock(idle)

    async def _wait_released(self) -> None:
        while self.releasing:
            await self._released.wait()
