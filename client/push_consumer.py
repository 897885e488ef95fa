"""The push consumer: ``async for msg in consumer`` or a handler, with the group's queues shared among members.

How it works (RocketMQ's DefaultMQPushConsumer, as trio tasks):
- **Membership** (``client/push_rebalance.py``, which states its rules): a rebalance every
  ``rebalance_interval_ms`` shares each subscribed topic's queues out among the group's members by
  ``allocate_strategy``, each new queue's start offset found before its first pull; ``subscribe`` and
  ``unsubscribe`` work on an open consumer; a SQL92 subscription is checked with the brokers before it is consumed
  (``SubscriptionRefusedError``); an offset reset (``raftmq admin reset-offset``) restarts the named queues there.
- **One pull task per assigned queue**, in its own cancel scope: long-polls the group (held on the broker up to
  ``broker_suspend_max_time_ms``) and puts what it gets into that queue's ``ProcessQueue``
  (``client/process_queue.py``), pausing ``pull_interval_ms`` (RocketMQ's pullInterval, 0) after each pull that
  found messages. Flow control: a pull waits while the queue already caches ``pull_threshold_for_queue`` messages, or
  ``pull_threshold_size_for_queue_mib`` MiB of bodies, not yet consumed (RocketMQ's two bounds: a count alone let
  a queue of 4 MiB messages cache 4 GiB); in the concurrent handler form also while its offsets, from the least one
  not yet consumed to the last one pulled, span more than ``consume_concurrently_max_span`` (2000, RocketMQ's
  consumeConcurrentlyMaxSpan), so a message stuck in its handler holds its queue rather than let the committed
  offset fall ever further behind what was handled (all of which is handled again after a restart or a rebalance).
  A body stored compressed is inflated up to ``max_inflated_body_size_bytes`` (4 MiB; client/pull_consumer.py): one
  that would inflate further is logged at ERROR and delivered as stored, so a zlib bomb costs no more than that.
- **Suspend** (``suspend()`` / ``resume()``, RocketMQ's): no queue is pulled in between (pulls in flight are
  cancelled: they took nothing), but cached messages are still delivered, rebalances, heartbeats and offset commits
  go on; ``statistics().suspended`` says so.
- **Delivery**: in iterator form the loop takes each queue's messages from its ``ProcessQueue`` in queue order, the
  queues with messages taking turns a message each, so a queue with a deep backlog holds back no other. What waits
  for the loop is the queues' caches, which flow control bounds and ``statistics().cached`` counts; a queue taken
  away, reset or closed lets go of the messages it had not handed out at once (it left a whole cache behind each
  time, in a channel of pulled batches, until the loop reached it). A message counts as consumed when the loop asks
  for the next one, or when the ``async with`` block ends normally (after a ``break``); one the block was left by an
  exception on is delivered again. In handler form
  (``client/consume_service.py``, RocketMQ's ConsumeMessageConcurrentlyService) messages of every queue go to one
  pool of at most ``max_concurrent_handlers`` (20) handler calls at once, RocketMQ's consumeThreadMax: a queue's
  calls start in offset order but run side by side and finish in any order, so nothing is guaranteed about the
  order within a queue (``orderly=True`` is for order); freed slots go round the waiting queues in turn, and a
  queue's offset never passes a message whose call has not finished. The iterator form has no failure but leaving
  the ``async with`` block by an exception, which already means "deliver this message again" (from its queue, to
  the next member: nothing is sent back); it still consumes the retry topic that handler-form members fill.
- **Handler results** (RocketMQ's ConsumeConcurrentlyStatus / ConsumeOrderlyStatus): a handler that returns None
  or ``ConsumeStatus.SUCCESS`` consumed its message. It failed if it raised, returned
  ``ConsumeStatus.RECONSUME_LATER``, raised ``ReconsumeLater`` (which also carries the context's settings:
  ``delay_level``, ``suspend_ms``), or returned anything else. Anything else, because taking an answer the consumer
  does not know for success is how a ported listener's "RECONSUME_LATER" lost its messages without a word: a
  failure costs a redelivery, and the first value of each type is logged at ERROR naming it. (None is success,
  unlike RocketMQ's null, because a Python function that returns nothing returns None.)
- **Failures, clustering** (concurrent form): the message is sent back to its broker (CONSUMER_SEND_MSG_BACK), which
  stores it delayed in the group's retry topic ``%RETRY%<group>`` (``ReconsumeLater.delay_level``, RocketMQ's
  delayLevelWhenNextConsume; 0/None: the broker's backoff, level 3 + reconsume times), or in its dead-letter topic
  ``%DLQ%<group>`` once it fails after ``max_reconsume_times`` retries (-1, the default: 16, as RocketMQ) or at
  once with ``delay_level=-1``; the queue moves on. Every clustering member subscribes to the retry topic, and a message
  pulled from it reaches the handler with its first topic restored and ``reconsume_times`` counting its failures.
  Only if the send-back fails is it retried here after ``reconsume_delay_ms``, holding its queue (which starts no
  further call meanwhile; the calls already running go on, and the waiting message gives its slot back), with
  ``reconsume_times`` counted up and a send-back after each failure, never skipped (as RocketMQ's clustering
  consumer: the group's message would be lost); past ``max_reconsume_times`` the send-back that gets through puts it
  in the dead letters.
- **Failures, broadcasting**: RocketMQ logs a failed broadcast message and drops it (it sends nothing back: a
  broadcast message is each member's own, and the group's retry topic would hand it to every member). We retry it
  here instead, as above (``reconsume_delay_ms``, up to ``max_reconsume_times``, then logged and skipped; at
  once with ``delay_level=-1``), because a drop on the first failure loses the message for this member for good,
  however passing the trouble was; the price is that its queue waits meanwhile.
- **Consume timeout** (``consume_timeout_min``, RocketMQ's consumeTimeout, 15 min): a concurrent handler call that
  runs longer is cancelled and counts as a failure (sent back, its slot freed), logged at WARNING with topic,
  queue and offset (RocketMQ's cleanExpireMsg sends such a message back too, but leaves its thread running; a trio
  task can be stopped). Not for orderly consumption (RocketMQ applies it only to concurrent consumption: an orderly
  queue's next message must wait for this one anyway), nor for the iterator form (the loop body is the caller's).
- **Batches** (``batch_handler=`` instead of ``handler=``; ``consume_message_batch_max_size``, RocketMQ's
  consumeMessageBatchMaxSize, 1 by default, 1..1024): each call gets a tuple of up to that many messages of one
  queue, in offset order, and takes one of the ``max_concurrent_handlers`` slots; the consume timeout bounds the
  call. What it returns or raises is about the whole batch, except ``ReconsumeLater(ack_index=k)`` (RocketMQ's
  ackIndex): messages 0..k consumed, the rest failed. Failed messages go as above, each sent back on its own, those
  retried here called again together (``client/consume_service.py``). A size above 1 without ``batch_handler`` is
  refused, so a handler written for one message never gets a sequence; so is ``orderly=True`` with either
  (``consume_message_batch_max_size`` > 1 or ``batch_handler``): orderly consumption takes one message at a time.
- **One iterating task at a time**: the consumer holds one pending message (the last one returned), so a second
  task's ``__anext__`` would acknowledge the first task's message while it is still being processed. A task
  that calls ``__anext__`` while another waits in it or holds its last message gets ``RuntimeError``; another
  task may take over once the first has finished, or has let its message go (``ack_pending()`` after its loop).
  For parallel consumption use the handler form (``max_concurrent_handlers``).
- **Offsets**: a queue's consume offset is the smallest offset still cached (or one past the last pulled), and a
  message leaves the cache only once consumed (its handler call finished), so the offset never passes an
  unprocessed message, however many later ones finished first; dirty offsets are committed every
  ``persist_consumer_offset_interval_ms``, when a queue is taken away, and on close; a start found from
  ``consume_from_where`` (the group had no offset) at once, before the first pull. A concurrent queue taken away
  (or reset, or closed) has its handler calls in flight cancelled first; their messages stay unconsumed and are
  delivered again. Delivery is at least once.
- **Orderly consumption** (``orderly=True``, handler form; RocketMQ's MessageListenerOrderly): in clustering mode a
  queue is pulled and consumed only while this member holds its lock on the broker (``client/orderly.py``), so no
  two members handle one queue at once, even while they disagree about the allocation. A queue taken away (or
  whose lock was lost, or on close) stops pulling at once, finishes the message in its handler, commits its offset
  (or the offset an admin reset told meanwhile set: the reset wins) and only then is unlocked; its next holder
  starts from that offset. A handler that fails suspends its queue for
  ``suspend_current_queue_time_ms`` (this time's ``ReconsumeLater.suspend_ms``, if given) and gets the same message
  again with ``reconsume_times`` counted up, without end by default (``max_reconsume_times`` -1: unlimited, as
  RocketMQ's orderly service); once it fails after ``max_reconsume_times`` retries, or at once with
  ``ReconsumeLater(delay_level=-1)``, the message goes to the group's dead-letter topic (send-back with delay level
  -1; should that fail, the queue stays suspended and tries again); in broadcasting mode it is logged and skipped.
  Offsets only ever pass messages whose handler returned (or that were sent to the dead letters or skipped so).
  Close waits up to ``client.orderly.CLOSE_WAIT_S`` (3 s) for the messages in handlers, then cancels them (they
  are delivered again to the next holder, never at the same time). A member killed outright keeps its locks until
  they lapse on the broker (``rebalance_lock_max_live_time_ms``, 60 s): its queues wait that long, and its
  successor handles again what it had handled after its last commit (at least once).

Layout: ``PushConsumerConfig``, ``ConsumerStatistics``, ``CONSUME_FROM``, the checks of the handlers
``open_push_consumer`` is given and the BROADCASTING offset file are in ``client/push_consumer_config.py``, and
re-exported here; the membership half of ``PushConsumer`` (subscriptions, rebalance, start offsets, offset resets)
is its base class ``PushRebalance`` in ``client/push_rebalance.py``. What stays here is what runs per pull and per
message: the pull loop, the iterator, the handler calls, suspend/resume and close.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import logging
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import trio

from client.consume_service import BatchHandler, ConcurrentConsumeService
from client.errors import ClientClosedError
from client.filter import MessageSelector, Subscription, parse_subscription
from client.instance import ClientInstance, ServerRequests, build_config, now_ms, open_client_nursery, open_remoting
from client.listener import (CONCURRENT_MAX_RECONSUME_TIMES, ORDERLY_MAX_RECONSUME_TIMES, ConsumeStatus,
                             FailureCause, ReconsumeLater, failure_of, grouped_failure)
from client.message import MessageExt, MessageQueue, PullResult, PullStatus
from client.offset_store import LocalFileOffsetStore, RemoteOffsetStore
from client.orderly import OrderlyService
from client.process_queue import FLOW_SPAN, ProcessQueue
from client.pull_consumer import FailedPulls, PullAPI, pull_should_wait
# CONSUME_FROM and LOCK_RETRY_S only re-exported: they were defined here before the config and the membership moved.
from client.push_consumer_config import (CONSUME_FROM, ConsumerStatistics, Handler, PushConsumerConfig, check_batch,
                                         check_handler, check_orderly, claim_offset_file, local_offset_store)
from client.push_rebalance import LOCK_RETRY_S, PushRebalance
from client.rebalance import resolve_allocate_strategy
from client.consume_hook import ConsumeCall, ConsumeHook, told_pull
from client.running_info import attach_push_consumer
from client.trace import ConsumeTracer, open_trace_dispatcher
from remoting.config import ConfigError
from remoting.errors import RaftMQError
from remoting.message import PROPERTY_RETRY_TOPIC, RETRY_GROUP_MAX_LENGTH, RETRY_GROUP_TOPIC_PREFIX, retry_topic

__all__ = ["PushConsumerConfig", "PushConsumer", "ProcessQueue", "open_push_consumer", "ConsumerStatistics",
           "ConsumeStatus", "ReconsumeLater"]

log = logging.getLogger(__name__)


class PushConsumer(PushRebalance):
    def __init__(self, config: PushConsumerConfig, instance: ClientInstance, subscriptions: Sequence[Subscription],
                 handler: Handler | None, local_offsets: LocalFileOffsetStore | None = None, *,
                 batch_handler: BatchHandler | None = None, tracer: ConsumeTracer | None = None) -> None:
        if not subscriptions:
            raise ValueError("a push consumer needs at least one subscription (topic)")
        check_batch(config, handler, batch_handler)
        check_orderly(config, handler)
        self.config = config
        self._instance = instance
        self._api = PullAPI(instance, config.consumer_group, check_crc=config.check_crc,
                            max_inflated_body_size_bytes=config.max_inflated_body_size_bytes)
        self._subs: dict[str, Subscription] = {s.topic: s for s in subscriptions}
        # Clustering members all consume the group's retry topic, where failed messages come back (RocketMQ's
        # copySubscription); broadcasting ones retry locally, as RocketMQ's, which sends nothing back for them.
        self._retry_topic: str | None = None
        if config.message_model == "CLUSTERING":
            if len(config.consumer_group) > RETRY_GROUP_MAX_LENGTH:
                # Legal as a group (255), but its retry topic's name is not: the subscription to it failed with an
                # error about a topic the user never named.
                raise ConfigError(f"consumer_group {config.consumer_group[:40]!r}... is {len(config.consumer_group)} "
                                  f"characters long; a CLUSTERING consumer's group names its retry topic "
                                  f"{RETRY_GROUP_TOPIC_PREFIX}<group>, so it may have at most "
                                  f"{RETRY_GROUP_MAX_LENGTH}")
            self._retry_topic = retry_topic(config.consumer_group)
            self._subs.setdefault(self._retry_topic, parse_subscription(self._retry_topic, "*"))
        self._handler = handler
        self._batch_handler = batch_handler  # takes a sequence of messages (client/consume_service.py)
        # Told of every pull and handler call by their call sites (client/consume_hook.py); None until
        # something subscribes (consume_hook()), so until then a call pays one attribute test.
        self._hook: ConsumeHook | None = None
        if tracer is not None:  # enable_msg_trace (client/trace.py): SubBefore/SubAfter per handler call or hold
            tracer.subscribe_to(self.consume_hook())
        if config.message_model == "BROADCASTING":
            self._offsets: Any = local_offsets if local_offsets is not None else local_offset_store(config)
        else:
            self._offsets = RemoteOffsetStore(self._api.fetch_consume_offset, self._api.commit_consume_offset)
        self._pqs: dict[MessageQueue, ProcessQueue] = {}
        # Iterator form: the queues with messages the loop has not taken yet, each once, in turn (_IteratedQueue);
        # _arrived wakes the loop waiting for one, _round_closed (close) ends it.
        self._round: collections.deque[_IteratedQueue] = collections.deque()
        self._arrived = trio.Event()
        self._round_closed = False
        # The last message the iterator returned and its queue, acknowledged on the next __anext__.
        self._pending_pq: ProcessQueue | None = None
        self._pending_msg: MessageExt | None = None
        # Its hold as the hook's hold listeners (message trace) know it; None when nothing listens.
        self._pending_hold: ConsumeCall | None = None
        # The task iterating (one at a time, see the module docstring) and whether it waits in __anext__.
        self._iter_task: trio.lowlevel.Task | None = None
        self._iter_waiting = False
        self._rebalance_now = trio.Event()
        self._lock = trio.Lock()
        self._delivered = 0  # by the iterator and the concurrent handlers; orderly ones count in OrderlyService
        self._bad_result_types: set[type] = set()  # handler return values of these types were logged at ERROR
        self._rebalances = 0
        self._pulls = 0
        self._pull_errors = 0
        self._nursery: trio.Nursery | None = None
        self._closing = False
        # suspend()/resume(): pull tasks wait on _resumed while suspended; suspend() cancels the pulls in flight (their
        # scopes), so a long poll held on a broker brings nothing in after it.
        self._suspended = False
        self._resumed = trio.Event()
        self._resumed.set()
        # Each pull in flight's scope and its queue's topic (a new expression for the topic cancels its pulls).
        self._pull_scopes: dict[trio.CancelScope, str] = {}
        self._span_flow_controls = 0  # times a queue's pull waited for consume_concurrently_max_span
        # The read queues of each subscribed topic in the first route this consumer got (none for a topic no name
        # server knew when it started): a queue beyond them was created later, and holds only messages sent since.
        self._first_queues: dict[str, frozenset[MessageQueue]] = {}
        self._allocate = resolve_allocate_strategy(config.allocate_strategy)
        # Queues an allocate strategy named that the topic's route does not have (warned about once each).
        self._stray_queues: set[MessageQueue] = set()
        # SQL92 subscriptions not every broker group of their topic could be asked about yet (no route, no node
        # answered): each rebalance asks again, before it allocates the topic's queues.
        self._unchecked: dict[str, Subscription] = {}
        # Offset resets the brokers told and not yet applied to (or committed over) their queue (push_rebalance.py).
        self._resets_pending: dict[MessageQueue, int] = {}
        self._orderly = (OrderlyService(self, config, self._api, instance.client_id, self._offsets)
                         if config.orderly else None)
        self._concurrent = (ConcurrentConsumeService(self, config.max_concurrent_handlers, batch_handler,
                                                     config.consume_message_batch_max_size)
                            if (handler is not None or batch_handler is not None) and not config.orderly else None)
        instance.heartbeat_data = self._heartbeat_data

    @property
    def client_id(self) -> str:
        return self._instance.client_id

    def consume_hook(self) -> ConsumeHook:
        """The hook this consumer's pulls and handler calls (and, in iterator form, the messages the loop took) are
        told to: running info and message trace subscribe to it. Made on first asking."""
        if self._hook is None:
            self._hook = ConsumeHook()
        return self._hook

    @property
    def max_reconsume_times(self) -> int:
        """``config.max_reconsume_times`` as it applies, and as the broker is sent it (never -1): -1 is 16 for
        concurrent consumption and unlimited (``I32_MAX``) for orderly, as RocketMQ."""
        times = self.config.max_reconsume_times
        if times >= 0:
            return times
        return ORDERLY_MAX_RECONSUME_TIMES if self.config.orderly else CONCURRENT_MAX_RECONSUME_TIMES

    def assigned_queues(self) -> list[MessageQueue]:
        return sorted(self._pqs)

    def statistics(self) -> ConsumerStatistics:
        delivered = self._delivered + (self._orderly.delivered if self._orderly is not None else 0)
        return ConsumerStatistics(len(self._pqs), delivered, self._rebalances, self._pulls,
                                  self._pull_errors, sum(pq.count for pq in self._pqs.values()),
                                  sum(pq.msg_bytes for pq in self._pqs.values()),
                                  self._concurrent.handling if self._concurrent is not None else 0, self._suspended)

    def suspend(self) -> None:
        """Stop pulling every queue until ``resume()`` (RocketMQ's DefaultMQPushConsumer.suspend): pulls in flight
        are cancelled and none is sent meanwhile, but the messages already cached are still delivered (handled),
        rebalances and heartbeats go on (a queue assigned meanwhile gets its start offset, and waits), and offsets
        are committed as usual. Suspending a suspended consumer does nothing."""
        self._check_open("suspend")
        if self._suspended:
            return
        self._suspended = True
        self._resumed = trio.Event()
        # A cancelled pull took nothing: its queue's next pull, after resume(), asks for the same offset.
        for scope in self._pull_scopes:
            scope.cancel()
        log.info("push consumer suspended group=%s client=%s", self.config.consumer_group, self.client_id)

    def resume(self) -> None:
        """Pull again after ``suspend()`` (RocketMQ's DefaultMQPushConsumer.resume); does nothing if not suspended."""
        self._check_open("resume")
        if not self._suspended:
            return
        self._suspended = False
        self._resumed.set()
        log.info("push consumer resumed group=%s client=%s", self.config.consumer_group, self.client_id)

    def _check_open(self, method: str) -> None:
        if self._closing or self._instance.closed:
            raise ClientClosedError(f"the push consumer is closed: {method}() cannot be called on it")

    # -- iterator form --------------------------------------------------------------------------------------------
    def __aiter__(self) -> PushConsumer:
        if self._handler is not None or self._batch_handler is not None:
            raise TypeError("this consumer was opened with a handler; it cannot also be iterated")
        return self

    async def __anext__(self) -> MessageExt:
        task = trio.lowlevel.current_task()
        if task is not self._iter_task:
            self._take_iteration(task)
        pq = self._pending_pq
        if pq is not None:  # ack_pending, inlined: this runs once per message
            self._pending_pq = None
            self._consumed(pq, self._pending_msg)  # type: ignore[arg-type]
            if self._hook is not None:
                self._hook.handed_out(pq.mq, 1)
                if self._pending_hold is not None:
                    self._end_hold(pq)
        round_ = self._round
        while not round_ or self._round_closed:
            if self._round_closed:
                raise StopAsyncIteration  # also past a queue a rebalance racing close added: nothing after close
            self._iter_waiting = True
            try:
                self._arrived = arrived = trio.Event()
                await arrived.wait()
            finally:
                self._iter_waiting = False
        # A queue in the round is not dropped and has a message to hand out (_IteratedQueue); its next one comes after
        # every other queue's next one.
        pq = round_.popleft()
        msgs = pq.undelivered
        msg = msgs.popleft()
        if msgs:
            round_.append(pq)
        else:
            pq.in_round = False
        self._pending_pq = pq
        self._pending_msg = msg
        self._delivered += 1
        hook = self._hook
        if hook is not None and hook.holds_heard:
            self._pending_hold = hook.hold_started(pq.mq, (msg,))
        return msg

    def _take_iteration(self, task: trio.lowlevel.Task) -> None:
        """Let ``task`` iterate, unless another task still does: one waiting in ``__anext__`` or holding the message
        it returned last (the next ``__anext__`` would acknowledge it, however far that task has got with it). A
        task that finished, or that let its message go (``ack_pending``, ``forget_pending``), hands over."""
        owner = self._iter_task
        if (owner is not None and (self._iter_waiting or self._pending_pq is not None)
                and inspect.getcoroutinestate(owner.coro) != inspect.CORO_CLOSED):
            raise RuntimeError("a push consumer is iterated by one task at a time; use the handler form for "
                               "parallel consumption")
        self._iter_task = task

    def ack_pending(self) -> None:
        """Mark the last message the iterator returned as consumed (done on the next ``__anext__``)."""
        pq = self._pending_pq
        if pq is not None:
            self._pending_pq = None
            self._consumed(pq, self._pending_msg)  # type: ignore[arg-type]
            if self._hook is not None:
                self._hook.handed_out(pq.mq, 1)
                if self._pending_hold is not None:
                    self._end_hold(pq)

    def forget_pending(self) -> None:
        """Leave the last message the iterator returned unconsumed: its queue's offset stays before it."""
        self._pending_pq = None
        self._pending_msg = None
        self._pending_hold = None  # never ended: its SubBefore stays alone, as a cancelled handler call's

    def _end_hold(self, pq: ProcessQueue) -> None:
        """The pending message, from ``pq``, was acknowledged: its hold ends, unless ``pq`` was dropped meanwhile (its
        queue taken away, reset or closed), where the acknowledgement commits nothing and the message comes again."""
        hold, self._pending_hold = self._pending_hold, None
        if not pq.dropped:
            assert self._hook is not None and hold is not None
            self._hook.hold_ended(hold)

    def _consumed(self, pq: ProcessQueue, msg: MessageExt) -> None:
        offset = pq.remove(msg.queue_offset)
        if not pq.dropped:
            pq.unflushed_offset = offset

    def _flush_offsets(self) -> None:
        """Hand every queue's consumed offset to the offset store (before it persists or forgets a queue)."""
        for pq in self._pqs.values():
            self._flush_offset(pq)

    def _flush_offset(self, pq: ProcessQueue) -> None:
        offset = pq.unflushed_offset
        if offset is not None:
            pq.unflushed_offset = None
            self._offsets.update(pq.mq, offset, increase_only=True)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    async def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        for topic in self._subs:
            await self._note_first_queues(topic)
        await self._instance.send_heartbeat_to_all()
        await self.rebalance()
        nursery.start_soon(self._serve_rebalance)
        nursery.start_soon(self._serve_persist)
        if self._orderly is not None and self._orderly.locks is not None:
            nursery.start_soon(self._orderly.locks.serve_renewal)

    async def close(self) -> None:
        """Stop pulling, commit offsets, leave the group (so the others rebalance at once). Orderly: first let each
        handler finish its message (``client.orderly.CLOSE_WAIT_S`` at most), then commit and unlock each queue."""
        self._closing = True
        self.ack_pending()
        self._flush_offsets()
        if self._orderly is not None:
            await self._orderly.close(list(self._pqs))
        for pq in list(self._pqs.values()):
            pq.drop()
        with trio.move_on_after(3) as scope:
            scope.shield = True
            # Every offset not committed yet; a reset told meanwhile wins over the position of its queue.
            await self._commit_leaving(sorted(set(self._pqs) | set(self._offsets.dirty())), dirty_only=True)
            await self._instance.unregister(None, self.config.consumer_group)
        self._pqs.clear()
        self._round_closed = True
        self._arrived.set()

    async def _serve_persist(self) -> None:
        while True:
            await trio.sleep(self.config.persist_consumer_offset_interval_ms / 1000)
            self._flush_offsets()
            await self._offsets.persist_all()

    def _add_queue(self, mq: MessageQueue, start_offset: int | None = None, after: ProcessQueue | None = None) -> None:
        assert self._nursery is not None
        cfg = self.config
        # The span bound is the concurrent handler form's alone: the iterator and orderly consumption take a queue's
        # messages in order, so their span is held by the count bound already (client/process_queue.py).
        threshold_bytes = cfg.pull_threshold_size_for_queue_mib << 20
        pq: ProcessQueue
        if self._concurrent is not None:
            pq = ProcessQueue(mq, cfg.pull_threshold_for_queue, threshold_bytes, cfg.consume_concurrently_max_span)
        elif self._orderly is not None:
            pq = ProcessQueue(mq, cfg.pull_threshold_for_queue, threshold_bytes)
        else:
            pq = _IteratedQueue(mq, self._round, cfg.pull_threshold_for_queue, threshold_bytes)
        self._pqs[mq] = pq
        if self._orderly is not None:
            self._nursery.start_soon(self._orderly.run_queue, pq, start_offset, after)
        else:
            self._nursery.start_soon(self._run_queue, pq, start_offset)

    async def _run_queue(self, pq: ProcessQueue, start_offset: int | None) -> None:
        # One cancel scope per queue stops its pull (and its handler calls) the moment the queue is taken away.
        with pq.cancel_scope:
            if self._concurrent is None:
                await self._pull_loop(pq, None, start_offset)
            else:
                await self._concurrent.run_queue(pq, start_offset)

    async def _pull_loop(self, pq: ProcessQueue, send: trio.MemorySendChannel | None, offset: int | None) -> None:
        """Pull ``pq``'s queue into it until it is dropped. Each pulled batch also goes to ``send``, the handler
        form's; without (the iterator form, ``pq`` an ``_IteratedQueue``) into the consumer's round."""
        cfg = self.config
        delay = cfg.pull_time_delay_ms_when_exception / 1000
        sub = self._subs.get(pq.mq.topic)
        if sub is None:
            return  # unsubscribed before this task first ran: its queue is dropped already
        while offset is None:
            try:
                offset = await self._compute_pull_from(pq.mq)
            except RaftMQError as e:
                log.info("cannot find start offset mq=%s error=%s", pq.mq, e)
                await trio.sleep(delay)
        pq.max_offset_seen = offset - 1
        failed = FailedPulls(delay)
        while not pq.dropped:
            if (reason := pq.flow_control()) is not None:
                if reason == FLOW_SPAN:
                    self._span_flow_controlled(pq)
                await pq.wait_space()
            try:
                result = await self._pull_unless_suspended(pq, offset, sub)
                if result is None:
                    continue  # suspend() stopped it: wait for resume(), then pull the same offset
            except RaftMQError as e:
                self._pull_errors += 1
                await trio.sleep(failed.record(log, pq.mq, offset, e))
                continue
            failed.clear()
            if pq.dropped:
                # Dropped while the answer was on its way (the task ran on before its cancelled scope stopped it): the
                # answer is for a queue gone, whose messages were let go of and whose offset is no longer this one's.
                return
            if result.status is PullStatus.FOUND:
                msgs = result.messages
                if pq.mq.topic == self._retry_topic:
                    msgs = _restore_retry_topic(msgs)
                pq.put(msgs)
                if send is not None:
                    send.send_nowait((pq, msgs))
                else:
                    assert isinstance(pq, _IteratedQueue)
                    self._hand_out(pq, msgs)
            elif result.status is PullStatus.OFFSET_ILLEGAL:
                log.warning("pull offset moved mq=%s offset=%d next=%d", pq.mq, offset,
                            result.next_begin_offset)
                if result.next_begin_offset < offset and self._nursery is not None:
                    # Beyond the queue's end (an offset committed past it, a wiped store): the leader names where
                    # to go on, back to its min offset, as RocketMQ's OFFSET_OVERFLOW_BADLY correction. Follow it as
                    # an offset reset does (this queue's cache dropped, the new offset stored, a fresh pull task):
                    # never moving back, the loop pulled the same offset at once, forever.
                    self._nursery.start_soon(self._reset_queues, {pq.mq: result.next_begin_offset})
                    return
            if result.status is not PullStatus.FOUND or not result.messages:
                # Filtered-out or moved ranges hold nothing to consume; let the offset pass them.
                pq.max_offset_seen = max(pq.max_offset_seen, result.next_begin_offset - 1)
                if not pq.msgs and result.next_begin_offset > offset:
                    self._flush_offset(pq)
                    self._offsets.update(pq.mq, result.next_begin_offset, increase_only=True)
            # RocketMQ's pullInterval paces a queue that delivers; an empty answer is asked again at once, as there
            # (pull_should_wait below keeps an unheld empty pull from spinning).
            pause_s = cfg.pull_interval_ms / 1000 if result.status is PullStatus.FOUND else 0.0
            if pull_should_wait(result, offset, cfg.broker_suspend_max_time_ms):
                pause_s = max(pause_s, delay)
            offset = max(offset, result.next_begin_offset)
            if pause_s:
                await trio.sleep(pause_s)

    def _hand_out(self, pq: _IteratedQueue, msgs: Sequence[MessageExt]) -> None:
        """Iterator form: ``msgs``, just cached in ``pq``, wait for the loop; ``pq`` joins the round if it was out."""
        pq.undelivered.extend(msgs)
        if not pq.in_round:
            pq.in_round = True
            self._round.append(pq)
            self._arrived.set()

    async def _pull_unless_suspended(self, pq: ProcessQueue, offset: int, sub: Subscription) -> PullResult | None:
        """One pull of ``pq``'s queue from ``offset``, sent once the consumer is not suspended; None if ``suspend()``
        or a new expression for its topic cancelled it on its way (it took nothing: a pull commits no offset, and the
        broker's late answer is dropped)."""
        while self._suspended:
            await self._resumed.wait()
        # The topic's expression as it is now (subscribe() may have changed it since the queue started); the one the
        # queue started with if the topic was unsubscribed meanwhile (its queue is being dropped).
        sub = self._subs.get(pq.mq.topic, sub)
        # No checkpoint since the test above: a suspend() or a new expression from now on finds this pull's scope
        # and cancels it.
        with trio.CancelScope() as scope:
            self._pull_scopes[scope] = pq.mq.topic
            try:
                self._pulls += 1
                return await told_pull(self._hook, pq.mq, self._api.pull(
                    pq.mq, offset, self.config.pull_batch_size, subscription=sub,
                    suspend_timeout_ms=self.config.broker_suspend_max_time_ms))
            finally:
                self._pull_scopes.pop(scope, None)
        return None

    def _span_flow_controlled(self, pq: ProcessQueue) -> None:
        # A queue held by the span bound waits for one slow message, which is worth seeing; but not every time (a
        # slow handler can hit it all day): the first time and every 1000th, as RocketMQ. The count and size bounds
        # are routine back-pressure and say nothing.
        self._span_flow_controls += 1
        if self._span_flow_controls % 1000 == 1:
            log.warning("pulls of a queue wait: its offsets from the least one not yet consumed to the last one pulled "
                        "span more than consume_concurrently_max_span (said the first and every 1000th time) mq=%s "
                        "least_offset=%d last_pulled=%d span=%d max_span=%s times=%d", pq.mq, pq.consume_offset(),
                        pq.max_offset_seen, pq.span, pq.max_span, self._span_flow_controls)

    async def _call_handler(self, pq: ProcessQueue, msg: MessageExt, *,
                            timeout_s: float = math.inf) -> ReconsumeLater | None:
        """Call the handler on ``msg`` once: None if it consumed it (returned None or ``ConsumeStatus.SUCCESS``),
        else the failure as a ``ReconsumeLater`` carrying what the handler asked for (a plain one when it raised
        something else, returned anything else, or ran past ``timeout_s`` and was cancelled; its ``cause`` says which
        of the first two, for message trace)."""
        assert self._handler is not None
        with trio.move_on_after(timeout_s) as scope:
            try:
                result = await self._handler(msg)
            except ReconsumeLater as e:
                # Asked for, so no traceback: RocketMQ counts a RECONSUME_LATER and logs nothing either.
                log.debug("handler asked to reconsume later mq=%s offset=%d reconsume_times=%d delay_level=%s "
                          "suspend_ms=%s", pq.mq, msg.queue_offset, msg.reconsume_times, e.delay_level,
                          e.suspend_ms)
                return e
            except BaseExceptionGroup as group:
                return grouped_failure(group, lambda rest: log.error(
                    "handler failed mq=%s offset=%d reconsume_times=%d", pq.mq, msg.queue_offset,
                    msg.reconsume_times, exc_info=rest))
            except Exception:
                log.exception("handler failed mq=%s offset=%d reconsume_times=%d", pq.mq, msg.queue_offset,
                              msg.reconsume_times)
                return failure_of(FailureCause.RAISED)
        if scope.cancelled_caught:
            log.warning("handler cancelled after consume_timeout_min=%d, the message counts as failed topic=%s "
                        "broker_name=%s queue_id=%d offset=%d msg_id=%s", self.config.consume_timeout_min,
                        pq.mq.topic, pq.mq.broker_name, pq.mq.queue_id, msg.queue_offset, msg.msg_id)
            return ReconsumeLater()
        if result is None or result is ConsumeStatus.SUCCESS:
            return None
        if result is ConsumeStatus.RECONSUME_LATER:
            return ReconsumeLater()
        self._unknown_result(result, pq, msg)
        return failure_of(FailureCause.NO_STATUS)

    def _unknown_result(self, result: object, pq: ProcessQueue, msg: MessageExt) -> None:
        # A failure, so nothing is lost; said at ERROR once per type (every message of a ported listener returns
        # one), naming the type only: the value may hold the message's content.
        kind = type(result)
        if kind in self._bad_result_types:
            log.debug("handler returned a %s, taken as a failure mq=%s offset=%d", kind.__qualname__, pq.mq,
                      msg.queue_offset)
            return
        self._bad_result_types.add(kind)
        log.error("handler returned a %s, not None or a ConsumeStatus: taken as a failure, so the message is "
                  "consumed again (said once per type) group=%s mq=%s offset=%d", kind.__qualname__,
                  self.config.consumer_group, pq.mq, msg.queue_offset)

    async def send_back(self, mq: MessageQueue, msg: MessageExt, *, delay_level: int = 0) -> bool:
        """CONSUMER_SEND_MSG_BACK of a failed message; False (logged) if the broker could not take it."""
        try:
            await self._api.send_back(mq, msg, self.max_reconsume_times, delay_level=delay_level)
        except RaftMQError as e:
            log.warning("send back failed, retrying locally mq=%s offset=%d msg_id=%s error=%s", mq,
                        msg.queue_offset, msg.msg_id, e)
            return False
        return True


class _IteratedQueue(ProcessQueue):
    """A queue of the iterator form: its cache (``msgs``, what flow control counts, the message the loop holds
    included until acknowledged) and, of it, the messages the loop has not taken yet (``undelivered``, in offset
    order), with which the queue waits for its turn in the consumer's round (``in_round``). Dropped (taken away, reset,
    closed), it lets go of all of them at once and leaves the round: nothing of a queue gone waits in memory for the
    loop to reach it, and a queue dropped and added again caches one threshold's worth, not one more each time."""

    def __init__(self, mq: MessageQueue, round_: collections.deque[_IteratedQueue], threshold: int,
                 threshold_bytes: int) -> None:
        super().__init__(mq, threshold, threshold_bytes)
        self.undelivered: collections.deque[MessageExt] = collections.deque()
        self.in_round = False
        self._round = round_

    def drop(self) -> None:
        super().drop()
        # The message the loop holds, if it is this queue's, is acknowledged for nothing now (PushConsumer._consumed:
        # no offset moves), so whoever pulls the queue next gets it again: nothing here needs the cache any more.
        self.undelivered.clear()
        self.msgs.clear()
        self.msg_bytes = 0
        if self.in_round:
            self.in_round = False
            self._round.remove(self)


def _restore_retry_topic(msgs: Sequence[MessageExt]) -> tuple[MessageExt, ...]:
    """A message pulled from the retry topic as its handler knew it: its first topic (RocketMQ's
    resetRetryAndNamespace); ``reconsume_times`` tells how often it failed."""
    return tuple(dataclasses.replace(m, topic=origin) if (origin := m.properties.get(PROPERTY_RETRY_TOPIC)) else m
                 for m in msgs)



@contextlib.asynccontextmanager
async def open_push_consumer(namesrv: str | Sequence[str] | None = None, *, topic: str | None = None,
                             expression: str | MessageSelector = "*",
                             subscriptions: Mapping[str, str | MessageSelector] | None = None,
                             handler: Handler | None = None, batch_handler: BatchHandler | None = None,
                             **options: Any) -> AsyncIterator[PushConsumer]:
    """Open a push consumer subscribed to ``topic`` (with tag ``expression``, or a ``MessageSelector``) or to every
    ``{topic: expression}`` of ``subscriptions``. With ``handler`` it consumes in the background until the block
    exits; without, iterate it: ``async for msg in consumer``. ``batch_handler`` instead of ``handler`` takes a
    sequence of up to ``consume_message_batch_max_size`` messages of one queue a call. Other options are
    ``PushConsumerConfig`` fields. ``SubscriptionRefusedError`` if a broker group refuses a SQL92 subscription."""
    if namesrv is not None:
        options["namesrv"] = namesrv
    config: PushConsumerConfig = build_config(PushConsumerConfig, options)
    if subscriptions is not None and not isinstance(subscriptions, Mapping):
        # dict() of a list of topic names made each name's first two characters a (topic, expression) pair.
        raise TypeError(f"subscriptions must map topic to tag expression, e.g. {{'TopicA': '*'}}, got "
                        f"{subscriptions!r}")
    subs = dict(subscriptions or {})
    if topic is not None:
        if topic in subs and subs[topic] != expression:
            raise ValueError(f"topic {topic!r} is subscribed twice: with expression {expression!r} and, in "
                             f"subscriptions, {subs[topic]!r}")
        subs[topic] = expression
    elif expression != "*":
        # Without a topic it applied to nothing, silently: the subscriptions kept their own expressions.
        raise ValueError(f"expression {expression!r} is for topic, which is not given (subscriptions map each topic "
                         f"to its own expression)")
    if not subs:
        raise ValueError("open_push_consumer needs a topic or subscriptions")
    if handler is not None:
        check_handler(handler)
    if batch_handler is not None:
        check_handler(batch_handler, "batch_handler", "sequence of messages")
    check_batch(config, handler, batch_handler)
    check_orderly(config, handler)
    version = now_ms()  # RocketMQ's subVersion
    parsed = [parse_subscription(t, e, sub_version=version) for t, e in subs.items()]
    local_offsets = local_offset_store(config) if config.message_model == "BROADCASTING" else None
    server_requests = ServerRequests()
    with claim_offset_file(local_offsets, config):
        async with contextlib.AsyncExitStack() as stack:
            # Outside the consumer: closed after it, so the traces of its last handler calls or messages are sent too.
            tracer = None
            if config.enable_msg_trace:
                dispatcher = await stack.enter_async_context(open_trace_dispatcher(config, config.trace_topic))
                tracer = ConsumeTracer(dispatcher, config.consumer_group, config.client_ip)
            async with _open_consumer(config, server_requests, parsed, handler, batch_handler, local_offsets,
                                      tracer) as consumer:
                yield consumer


@contextlib.asynccontextmanager
async def _open_consumer(config: PushConsumerConfig, server_requests: ServerRequests, parsed: list[Subscription],
                         handler: Handler | None, batch_handler: BatchHandler | None,
                         local_offsets: LocalFileOffsetStore | None,
                         tracer: ConsumeTracer | None) -> AsyncIterator[PushConsumer]:
    async with open_remoting(config, server_requests) as remoting:
        async with open_client_nursery() as nursery:
            instance = ClientInstance(config, remoting, nursery)
            consumer = PushConsumer(config, instance, parsed, handler, local_offsets, batch_handler=batch_handler,
                                    tracer=tracer)
            # Before the first heartbeat: a consumer whose subscription a broker refuses never joins its group.
            await consumer.check_subscriptions()
            server_requests.on_consumer_ids_changed = (
                lambda group: consumer.trigger_rebalance() if group in (None, config.consumer_group) else None)
            server_requests.on_reset_offset = consumer.offsets_reset
            server_requests.on_consumer_running_info = attach_push_consumer(consumer)  # consumer-status
            instance.start_background()
            await consumer.start(nursery)
            try:
                yield consumer
            except BaseException:
                # The block left by an exception, maybe while handling the message the iterator returned last:
                # not consumed, so delivered again (at least once). Leaving by `break` consumes it (close).
                consumer.forget_pending()
                raise
            finally:
                instance.stop_background()
                await consumer.close()
                instance.closed = True
                nursery.cancel_scope.cancel()
