"""The push consumer: ``async for msg in consumer`` or a handler, with the group's queues shared among members.

How it works (RocketMQ's DefaultMQPushConsumer, as trio tasks):
- **Rebalance** every ``rebalance_interval_ms`` (and once at start, after a first heartbeat so this member is
  counted): ask a broker of each subscribed topic for the group's members, allocate the queues by
  ``allocate_strategy`` (RocketMQ's strategies by name, AllocateMessageQueueAveragely by default, or a function:
  ``client/rebalance.py``; every member of a group must use the same one, which nothing checks, in RocketMQ
  either), stop the queues that went to someone else (committing their offsets first) and start the new ones, each
  from the offset found for it before its first pull (so ``open_push_consumer`` returns with the start positions
  fixed). A strategy that raises, or returns anything but queues, is logged and leaves the topic's queues as
  they are.
- **Subscriptions while open** (``subscribe(topic, expression)``, ``unsubscribe(topic)``, RocketMQ's, which it also
  allows after start): the subscription table changes and a heartbeat tells every broker node before the call
  returns. A new topic is rebalanced at once (its start offsets fixed before ``subscribe`` returns); a new
  expression for a subscribed topic applies from the next pulls (long polls in flight are cancelled and sent again;
  what was pulled before is still delivered). ``unsubscribe`` takes the topic's queues away as a rebalance does
  (offsets committed first; an orderly queue finishes its handler's message, commits and unlocks in the background;
  a broadcasting member's offset file keeps them). The group's retry topic stays subscribed, as RocketMQ's does, and
  cannot be subscribed or unsubscribed by hand. A topic's queues are split among all of the group's members, so every
  member should make the same calls.
- **SQL92 subscriptions are checked before they are consumed** (RocketMQ's checkClientInBroker): at open, before
  the first heartbeat, and in ``subscribe``, CHECK_CLIENT_CONFIG asks a node of each broker group serving the topic
  whether it would serve the expression, and a refusal (a node without ``enable_property_filter``) raises
  ``SubscriptionRefusedError`` naming the group and the reason: ``open_push_consumer`` fails and nothing is left
  running; ``subscribe`` changes nothing. A topic with no route yet (or a group none of whose nodes answered) is
  not checked then, as RocketMQ's; each rebalance asks again before it allocates the topic's queues, and leaves the
  topic out, logged at ERROR, while refused. Tag subscriptions send nothing.
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
- **Delivery**: in iterator form all queues feed one channel, so messages of one queue come out in queue order;
  a message counts as consumed when the loop asks for the next one, or when the ``async with`` block ends
  normally (after a ``break``); one the block was left by an exception on is delivered again. In handler form
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
- **Offset resets** (``raftmq admin reset-offset``): the broker tells every online member; each drops the named
  queues it holds, commits the new offsets at once and pulls from them.
- **Orderly consumption** (``orderly=True``, handler form; RocketMQ's MessageListenerOrderly): in clustering mode a
  queue is pulled and consumed only while this member holds its lock on the broker (``client/orderly.py``), so no
  two members handle one queue at once, even while they disagree about the allocation. A queue taken away (or
  whose lock was lost, or on close) stops pulling at once, finishes the message in its handler, commits its offset
  and only then is unlocked; its next holder starts from that offset. A handler that fails suspends its queue for
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
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from client.consume_service import BatchHandler, ConcurrentConsumeService
from client.errors import ClientClosedError, SubscriptionRefusedError
from client.filter import SQL92, MessageSelector, Subscription, parse_subscription
from client.instance import (
    HOUR_MS, ClientConfig, ClientInstance, ServerRequests, build_config, now_ms, open_client_nursery,
    open_remoting,
)
from client.listener import (CONCURRENT_MAX_RECONSUME_TIMES, ORDERLY_MAX_RECONSUME_TIMES, ConsumeStatus,
                             ReconsumeLater, grouped_failure)
from client.message import (DEFAULT_MAX_INFLATED_BODY, I32_MAX, I64_MAX, MAX_INFLATED_BODY, MessageExt, MessageQueue,
                            PullResult, PullStatus)
from client.offset_store import LocalFileOffsetStore, RemoteOffsetStore
from client.orderly import OrderlyService
from client.process_queue import FLOW_SPAN, ProcessQueue
from client.pull_consumer import PullAPI, log_failed_pull, pull_should_wait
from client.rebalance import (DEFAULT_ALLOCATE_STRATEGY, AllocateStrategy, allocate_share, allocate_strategy_problem,
                              consumer_heartbeat_data, diff_assignment, find_consumer_ids, resolve_allocate_strategy)
from remoting.config import ConfigError, blank_dir_problem, bounded
from remoting.errors import RaftMQError
from remoting.message import (PROPERTY_RETRY_TOPIC, RETRY_GROUP_MAX_LENGTH, RETRY_GROUP_TOPIC_PREFIX, group_problem,
                              retry_topic)

__all__ = ["PushConsumerConfig", "PushConsumer", "ProcessQueue", "open_push_consumer", "ConsumerStatistics",
           "ConsumeStatus", "ReconsumeLater"]

log = logging.getLogger(__name__)

Handler = Callable[[MessageExt], Awaitable[Any]]

CONSUME_FROM = ("CONSUME_FROM_LAST_OFFSET", "CONSUME_FROM_FIRST_OFFSET", "CONSUME_FROM_TIMESTAMP")

# A queue another member still holds is asked for again this soon (RocketMQ's rebalanceLater(500)).
LOCK_RETRY_S = 0.5
@dataclasses.dataclass(frozen=True)
class PushConsumerConfig(ClientConfig):
    consumer_group: str = bounded("DEFAULT_CONSUMER", check=group_problem)
    message_model: str = bounded("CLUSTERING", choices=("CLUSTERING", "BROADCASTING"))
    consume_from_where: str = bounded("CONSUME_FROM_LAST_OFFSET", choices=CONSUME_FROM)
    consume_timestamp_ms: int = bounded(0, min=0, max=I64_MAX,
                                        doc="start time for CONSUME_FROM_TIMESTAMP; 0: 30 min ago")
    pull_batch_size: int = bounded(32, min=1, max=1024)
    pull_threshold_for_queue: int = bounded(1000, min=1, max=65_535,  # RocketMQ's range
                                            doc="flow control: messages cached per queue")
    pull_threshold_size_for_queue_mib: int = bounded(100, min=1, max=1 << 20,
                                                     doc="flow control: MiB of message bodies cached per queue")
    # RocketMQ's consumeConcurrentlyMaxSpan and its range. Counted to the last offset pulled, not to the largest one
    # still cached as RocketMQ does, so that it bounds what a stuck message has handled again (client/process_queue.py).
    consume_concurrently_max_span: int = bounded(2000, min=1, max=65_535,
                                                 doc="concurrent handler form, flow control: a queue's pulls wait "
                                                     "while its offsets from the least one not yet consumed to the "
                                                     "last one pulled span more than this")
    # RocketMQ's pullInterval and its range.
    pull_interval_ms: int = bounded(0, min=0, max=65_535, doc="pause after a pull of a queue that found messages")
    # A Java int on the wire: the broker refuses every pull asking for more (and holds at most its own
    # long_polling_timeout_ms anyway).
    broker_suspend_max_time_ms: int = bounded(15_000, min=0, max=I32_MAX, doc="long-polling hold on the broker")
    rebalance_interval_ms: int = bounded(5_000, min=10, max=HOUR_MS)
    persist_consumer_offset_interval_ms: int = bounded(1_000, min=10, max=HOUR_MS)
    # 0 made every failing pull loop retry at once: one queue whose broker refused or could not be reached took a
    # core (RocketMQ waits 3000 ms; we retry sooner, a leader usually moves within a second).
    pull_time_delay_ms_when_exception: int = bounded(200, min=10, max=HOUR_MS,
                                                     doc="pause after a failed pull, before the next")
    # A Java int on the wire: the broker refused every send-back of a member asking for more, INVALID_REQUEST. -1
    # is never sent: PushConsumer.max_reconsume_times turns it into the count it means.
    max_reconsume_times: int = bounded(-1, min=-1, max=I32_MAX,
                                       doc="failures before the dead letters; -1: 16 (concurrent), unlimited (orderly)")
    # RocketMQ's consumeTimeout (minutes, 15). A day at most: a handler call longer than that is stuck, not slow.
    consume_timeout_min: int = bounded(15, min=1, max=1440,
                                       doc="concurrent handler form: a call running longer is cancelled and its "
                                           "message counts as failed")
    # RocketMQ's consumeThreadMin/consumeThreadMax (20/20, each 1..1000): its pool's threads are trio tasks here, and
    # a task costs nothing idle, so one bound is all there is to set.
    max_concurrent_handlers: int = bounded(20, min=1, max=1000,
                                           doc="concurrent handler form: handler calls running at once across all the "
                                               "consumer's queues; a queue's messages may then be handled side by "
                                               "side and finish out of order (orderly=True keeps order)")
    # RocketMQ's consumeMessageBatchMaxSize and its range. Only with batch_handler (open_push_consumer checks): a
    # handler written for one message must never be handed a list because a config file says so.
    consume_message_batch_max_size: int = bounded(1, min=1, max=1024,
                                                  doc="concurrent batch_handler form: most messages of one queue a "
                                                      "call gets; more than 1 needs batch_handler")
    reconsume_delay_ms: int = bounded(1_000, min=0, max=HOUR_MS)
    # An empty one put the offset files in the current directory (Path("") is ".").
    offset_store_dir: str = bounded(".raftmq-offsets", check=blank_dir_problem,
                                    doc="where BROADCASTING consumers keep offsets")
    check_crc: bool = bounded(False, doc="recompute each pulled body's crc32c")
    # A producer's few-KiB zlib bomb inflated to 256 MiB in every member, 32 a pull, before flow control saw a body.
    max_inflated_body_size_bytes: int = bounded(DEFAULT_MAX_INFLATED_BODY, min=1, max=MAX_INFLATED_BODY,
                                                doc="most a compressed body is inflated to; a larger one is "
                                                    "delivered as stored, compressed, and logged")
    orderly: bool = bounded(False, doc="handler form only: hold each queue's lock on the broker while consuming it, "
                                       "one message at a time, retrying a failed one before its successors")
    rebalance_lock_interval_ms: int = bounded(20_000, min=10, max=3_600_000,
                                              doc="orderly: how often held queue locks are renewed (sooner if the "
                                                  "broker's lock life is under three times this)")
    # RocketMQ clamps its suspendCurrentQueueTimeMillis to 10..30000 ms.
    suspend_current_queue_time_ms: int = bounded(1_000, min=10, max=30_000,
                                                 doc="orderly: pause of a queue whose handler raised, before the same "
                                                     "message is handled again")
    # RocketMQ's allocateMessageQueueStrategy (client/rebalance.py). A function is taken as it is: a TOML file can
    # only name one. Checked in __post_init__ (the loader builds through it too, so the sentence is the same).
    allocate_strategy: str | AllocateStrategy = bounded(
        DEFAULT_ALLOCATE_STRATEGY,
        doc="clustering: how the group's members split each topic's queues, by a RocketMQ strategy's name "
            "(client.rebalance.ALLOCATE_STRATEGIES) or a function like client.rebalance.allocate_average; every member "
            "of a group must use the same")

    def __post_init__(self) -> None:
        super().__post_init__()
        problem = allocate_strategy_problem(self.allocate_strategy)
        if problem is not None:
            raise ConfigError(f"allocate_strategy {problem}, got {self.allocate_strategy!r}")
        if self.message_model == "BROADCASTING" and self.allocate_strategy != DEFAULT_ALLOCATE_STRATEGY:
            # RocketMQ ignores it there; set, it was meant to do something, and it would not.
            raise ConfigError(f"allocate_strategy is for CLUSTERING consumers (a BROADCASTING member consumes every "
                              f"queue), got {self.allocate_strategy!r} with message_model 'BROADCASTING'")
        if self.orderly and self.consume_message_batch_max_size > 1:
            # RocketMQ takes orderly batches, but fails them whole: a batch whose retries ran out for some of its
            # messages puts those in the dead letters and still hands them over again with the rest. One message
            # at a time keeps "this message failed" meaning one message.
            raise ConfigError(f"consume_message_batch_max_size is for the concurrent handler form (batch_handler); "
                              f"orderly=True handles one message at a time, got {self.consume_message_batch_max_size}")


@dataclasses.dataclass(frozen=True, slots=True)
class ConsumerStatistics:
    assigned_queues: int
    delivered: int
    rebalances: int
    pulls: int
    pull_errors: int
    cached: int
    cached_bytes: int
    # Concurrent handler form: handler calls running now (at most max_concurrent_handlers); else 0.
    handling: int = 0
    # Between suspend() and resume(): no queue is pulled.
    suspended: bool = False


def local_offset_store(config: PushConsumerConfig) -> LocalFileOffsetStore:
    """A BROADCASTING member's offset file, loaded; ``ConfigError`` naming ``offset_store_dir`` if it cannot be used
    (before, a directory that could not be created failed the first persist and took the consumer down)."""
    # Stable across restarts of the same member, so it resumes: the group and instance_name, not the address
    # (RocketMQ's ip@instanceName), which a container may be given afresh at every start, and which says nothing a
    # file in this host's directory needs. Every config, one built directly too, has had its instance_name checked
    # (client.instance.check_instance_name): it cannot put the file outside offset_store_dir.
    directory = Path(config.offset_store_dir)
    path = directory / f"{config.consumer_group}@{config.instance_name}.json"
    if not path.exists():
        # Earlier versions named the file by the address too, which was 127.0.0.1 unless client_ip was set: taken
        # over once, else an upgraded member would start again from consume_from_where.
        for ip in dict.fromkeys((config.client_ip, "127.0.0.1")):
            legacy = directory / f"{config.consumer_group}@{ip}@{config.instance_name}.json"
            if legacy.exists():
                with contextlib.suppress(OSError):  # then it starts afresh, as it would have without the file
                    os.replace(legacy, path)
                break
    try:
        return LocalFileOffsetStore(path)
    except ValueError as e:
        raise ConfigError(f"offset_store_dir {config.offset_store_dir!r} cannot keep the offsets: {e}") from None


# The offset files of this process's open BROADCASTING consumers: two members of a group with one instance_name
# (the default "DEFAULT" for both) wrote one file, each overwriting the other's offsets.
_claimed_offset_files: set[Path] = set()


@contextlib.contextmanager
def _claim_offset_file(store: LocalFileOffsetStore | None, config: PushConsumerConfig) -> Iterator[None]:
    if store is None:
        yield
        return
    path = store.path.resolve()
    if path in _claimed_offset_files:
        raise ConfigError(f"another BROADCASTING consumer of group {config.consumer_group!r} in this process keeps its "
                          f"offsets in {str(path)!r}: give each member its own instance_name (now "
                          f"{config.instance_name!r})")
    _claimed_offset_files.add(path)
    try:
        yield
    finally:
        _claimed_offset_files.discard(path)


class PushConsumer:
    def __init__(self, config: PushConsumerConfig, instance: ClientInstance, subscriptions: Sequence[Subscription],
                 handler: Handler | None, local_offsets: LocalFileOffsetStore | None = None, *,
                 batch_handler: BatchHandler | None = None) -> None:
        if not subscriptions:
            raise ValueError("a push consumer needs at least one subscription (topic)")
        _check_batch(config, handler, batch_handler)
        _check_orderly(config, handler)
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
        if config.message_model == "BROADCASTING":
            self._offsets: Any = local_offsets if local_offsets is not None else local_offset_store(config)
        else:
            self._offsets = RemoteOffsetStore(self._api.fetch_consume_offset, self._api.commit_consume_offset)
        self._pqs: dict[MessageQueue, ProcessQueue] = {}
        # Pull tasks hand over whole pulled batches: one channel operation per pull, not per message.
        self._send, self._recv = trio.open_memory_channel[tuple[ProcessQueue, Sequence[MessageExt]]](math.inf)
        self._batch: collections.deque[MessageExt] = collections.deque()
        self._batch_pq: ProcessQueue | None = None
        # The last message the iterator returned and its queue, acknowledged on the next __anext__.
        self._pending_pq: ProcessQueue | None = None
        self._pending_msg: MessageExt | None = None
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
        self._orderly = (OrderlyService(self, config, self._api, instance.client_id, self._offsets)
                         if config.orderly else None)
        self._concurrent = (ConcurrentConsumeService(self, config.max_concurrent_handlers, batch_handler,
                                                     config.consume_message_batch_max_size)
                            if (handler is not None or batch_handler is not None) and not config.orderly else None)
        instance.heartbeat_data = self._heartbeat_data

    @property
    def client_id(self) -> str:
        return self._instance.client_id

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

    def subscriptions(self) -> dict[str, str | MessageSelector]:
        """The topics subscribed now and their tag expressions, or their ``MessageSelector.by_sql`` (not the
        group's retry topic, which a clustering consumer subscribes to by itself)."""
        return {t: MessageSelector.by_sql(s.expression) if s.expression_type == SQL92 else s.expression
                for t, s in sorted(self._subs.items()) if t != self._retry_topic}

    async def subscribe(self, topic: str, expression: str | MessageSelector = "*") -> None:
        """Subscribe to ``topic`` (RocketMQ's DefaultMQPushConsumer.subscribe, here on an open consumer too): a
        heartbeat tells the brokers at once, and for a new topic a rebalance allocates its queues and fixes their
        start offsets before this returns (so from ``CONSUME_FROM_LAST_OFFSET`` every message sent afterwards is
        consumed). A topic already subscribed takes ``expression`` from its next pulls (those in flight are
        cancelled and sent again); messages pulled before are still delivered. Every member of the group should
        make the same call: a topic's queues are split among all of them. ``expression`` is a tag expression or a
        ``MessageSelector`` (``MessageSelector.by_sql("a > 5")``): a SQL92 one is first checked with a node of
        each broker group serving the topic, and ``SubscriptionRefusedError`` (nothing changed) if one refuses it.
        ``ValueError`` for an illegal topic or expression or the group's retry topic; ``ClientClosedError`` on a
        closed consumer."""
        self._check_open("subscribe")
        self._check_not_retry_topic(topic, "subscribe")
        # RocketMQ's subVersion, the time: the brokers keep the group's newest subscription of each topic.
        sub = parse_subscription(topic, expression, sub_version=now_ms())
        # Before anything changes: a refused subscription leaves the consumer as it was.
        checked = await self._api.check_subscription(sub)
        async with self._lock:
            self._check_open("subscribe")
            old = self._subs.get(topic)
            self._subs[topic] = sub
            self._note_checked(sub, checked)
            if old is None:
                await self._note_first_queues(topic)
        if old is not None:
            if (old.expression_type, old.expression) != (sub.expression_type, sub.expression):
                # Long polls held on the broker with the old expression would bring in what it selects.
                for scope, scope_topic in list(self._pull_scopes.items()):
                    if scope_topic == topic:
                        scope.cancel()
            log.info("subscription changed group=%s topic=%s expression=%s was=%s", self.config.consumer_group,
                     topic, sub.expression, old.expression)
        else:
            log.info("subscribed group=%s topic=%s expression=%s", self.config.consumer_group, topic, sub.expression)
        await self._instance.send_heartbeat_to_all()
        if old is None:
            await self._rebalance_now_or_later()

    async def unsubscribe(self, topic: str) -> None:
        """Stop consuming ``topic`` (RocketMQ's DefaultMQPushConsumer.unsubscribe, which leaves it to the next
        rebalance; here at once): its queues are taken away as a rebalance takes one, their offsets committed
        first, and a heartbeat tells the brokers. An orderly queue finishes the message in its handler, commits and
        unlocks in the background. The group's retry topic stays subscribed (as RocketMQ's), so a message of
        ``topic`` that failed before may still come back from it. Every member of the group should make the same
        call: the others keep leaving this member's share of the topic's queues to it. ``ValueError`` for a topic
        not subscribed or the retry topic; ``ClientClosedError`` on a closed consumer."""
        self._check_open("unsubscribe")
        self._check_not_retry_topic(topic, "unsubscribe")
        async with self._lock:
            self._check_open("unsubscribe")
            if topic not in self._subs:
                subscribed = ", ".join(map(repr, self.subscriptions())) or "none"
                raise ValueError(f"topic {topic!r} is not subscribed (subscribed: {subscribed})")
            del self._subs[topic]
            self._first_queues.pop(topic, None)
            self._unchecked.pop(topic, None)
            await self._drop_unsubscribed()
        log.info("unsubscribed group=%s topic=%s", self.config.consumer_group, topic)
        await self._instance.send_heartbeat_to_all()

    async def check_subscriptions(self) -> None:
        """Ask the broker groups of each subscribed topic whether they serve its subscription (only SQL92 ones
        are asked: ``PullAPI.check_subscription``); ``SubscriptionRefusedError`` for a refusal. Called once by
        ``open_push_consumer`` before the consumer's first heartbeat, as RocketMQ's start() calls
        checkClientInBroker."""
        for sub in list(self._subs.values()):
            self._note_checked(sub, await self._api.check_subscription(sub))

    def _note_checked(self, sub: Subscription, checked: bool) -> None:
        if checked:
            self._unchecked.pop(sub.topic, None)
        else:
            self._unchecked[sub.topic] = sub

    def _check_not_retry_topic(self, topic: object, method: str) -> None:
        if self._retry_topic is not None and topic == self._retry_topic:
            raise ValueError(f"{method}() of {topic!r}: a CLUSTERING consumer subscribes to its group's retry topic by "
                             f"itself, for as long as it is open")

    async def _rebalance_now_or_later(self) -> None:
        try:
            await self.rebalance()
        except RaftMQError as e:
            # As the periodic one: the next (rebalance_interval_ms) tries again.
            log.info("rebalance failed group=%s error=%s", self.config.consumer_group, e)

    def _heartbeat_data(self) -> dict[str, Any]:
        return consumer_heartbeat_data(self.config.consumer_group, "CONSUME_PASSIVELY", self.config.message_model,
                                       self.config.consume_from_where, self._subs.values())

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
        batch = self._batch
        while True:
            while not batch:
                self._iter_waiting = True
                try:
                    self._batch_pq, msgs = await self._recv.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    raise StopAsyncIteration from None
                finally:
                    self._iter_waiting = False
                batch.extend(msgs)
            pq = self._batch_pq
            assert pq is not None
            msg = batch.popleft()
            if not pq.dropped:
                self._pending_pq = pq
                self._pending_msg = msg
                self._delivered += 1
                return msg
            batch.clear()

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

    def forget_pending(self) -> None:
        """Leave the last message the iterator returned unconsumed: its queue's offset stays before it."""
        self._pending_pq = None
        self._pending_msg = None

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

    async def _note_first_queues(self, topic: str) -> None:
        """Remember the read queues ``topic``'s route has as it is subscribed (``_compute_pull_from``)."""
        try:
            route = await self._instance.routes.get(topic)
        except RaftMQError as e:
            # Subscribing before the topic exists is allowed: the periodic rebalance picks it up. The retry
            # topic exists only once a member sent a message back.
            log.log(logging.INFO if topic == self._retry_topic else logging.WARNING,
                    "no route for subscribed topic yet topic=%s error=%s", topic, e)
            if getattr(e, "topic_unknown", False):
                self._first_queues[topic] = frozenset()
        else:
            self._first_queues[topic] = frozenset(route.read_queues())

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
            await self._offsets.persist_all()
            await self._instance.unregister(None, self.config.consumer_group)
        self._pqs.clear()
        self._send.close()

    def trigger_rebalance(self) -> None:
        self._rebalance_now.set()

    async def _serve_rebalance(self) -> None:
        while True:
            interval_s = self.config.rebalance_interval_ms / 1000
            soon = self._orderly is not None and self._orderly.lock_retry
            with trio.move_on_after(min(interval_s, LOCK_RETRY_S) if soon else interval_s):
                await self._rebalance_now.wait()
            self._rebalance_now = trio.Event()
            await self._rebalance_now_or_later()

    async def _serve_persist(self) -> None:
        while True:
            await trio.sleep(self.config.persist_consumer_offset_interval_ms / 1000)
            self._flush_offsets()
            await self._offsets.persist_all()

    def offsets_reset(self, consumer_group: str, topic: str, broker_name: str, offsets: dict[int, int]) -> None:
        """The broker reset the group's offsets of ``topic`` on ``broker_name`` (``raftmq admin reset-offset``)."""
        if consumer_group != self.config.consumer_group or topic not in self._subs or self._nursery is None:
            return
        self._nursery.start_soon(self._reset_queues, {MessageQueue(topic, broker_name, q): o
                                                      for q, o in offsets.items()})

    async def _reset_queues(self, offsets: dict[MessageQueue, int]) -> None:
        # RocketMQ's resetOffset: drop the queue (its pull, its cached messages, its handler), store the new offset
        # and pull again from it. The new offset is committed at once, so a commit of the old position that was
        # already on its way to the broker cannot stay the last word.
        async with self._lock:
            for mq, offset in sorted(offsets.items()):
                pq = self._pqs.pop(mq, None)
                if pq is None or self._closing:
                    continue  # another member's queue (it resets its own), or we are leaving
                # Orderly: the handler stops too, and the queue keeps its lock for the new start (no commit of the
                # old position, no unlock).
                pq.reset = True
                pq.handler_scope.cancel()
                pq.drop()
                self._offsets.update(mq, offset)
                log.info("offset reset group=%s mq=%s offset=%d", self.config.consumer_group, mq, offset)
                await self._offsets.persist(mq)
                self._add_queue(mq, after=pq)

    # -- rebalance ------------------------------------------------------------------------------------------------
    async def find_consumer_ids(self, topic: str) -> list[str]:
        return await find_consumer_ids(self._instance, self.config.consumer_group, topic)

    async def rebalance(self) -> None:
        async with self._lock:
            if self._orderly is not None:
                self._orderly.lock_retry = False
            await self._drop_unsubscribed()
            for topic in list(self._subs):
                if self._closing:
                    return
                try:
                    route = await self._instance.routes.get(topic)
                except RaftMQError as e:
                    log.info("rebalance skipped topic=%s error=%s", topic, e)
                    continue
                unchecked = self._unchecked.get(topic)
                if unchecked is not None:
                    try:
                        self._note_checked(unchecked, await self._api.check_subscription(unchecked))
                    except SubscriptionRefusedError as e:
                        # Too late to fail the start: said loudly each round instead of pulling to be refused.
                        log.error("subscription refused, topic not rebalanced group=%s topic=%s error=%s",
                                  self.config.consumer_group, topic, e)
                        continue
                mqs = route.read_queues()
                self._first_queues.setdefault(topic, frozenset(mqs))
                if self.config.message_model == "BROADCASTING":
                    wanted = mqs
                else:
                    cids = await self.find_consumer_ids(topic)
                    if self.client_id not in cids:
                        # A node we had not met yet (a new topic's group, a restarted node): introduce ourselves.
                        await self._instance.send_heartbeat_to_all()
                        cids = await self.find_consumer_ids(topic)
                    if not cids:
                        log.info("no group members known yet group=%s topic=%s", self.config.consumer_group, topic)
                        continue
                    allocated = self._allocate_queues(topic, mqs, cids)
                    if allocated is None:
                        continue
                    wanted = allocated
                current = [mq for mq in self._pqs if mq.topic == topic]
                diff = diff_assignment(current, wanted)
                if not diff.changed:
                    continue
                added = diff.added
                if self._orderly is not None and added:
                    added = await self._orderly.lock_new_queues(added)
                    if not added and not diff.removed:
                        continue  # nothing changes until the holders give their queues back
                self._rebalances += 1
                log.info("rebalance group=%s topic=%s client=%s added=%d removed=%d now=%d",
                         self.config.consumer_group, topic, self.client_id, len(added), len(diff.removed),
                         len(current) - len(diff.removed) + len(added))
                for mq in diff.removed:
                    await self._remove_queue(mq)
                starts = await self._start_offsets(added)
                for mq in added:
                    if not self._closing:
                        self._add_queue(mq, starts.get(mq))

    def _allocate_queues(self, topic: str, mqs: Sequence[MessageQueue],
                         cids: Sequence[str]) -> list[MessageQueue] | None:
        """This member's share of ``topic``'s queues ``mqs`` by the allocate strategy, or None (logged) if the
        strategy failed: the topic's queues then stay as they are, as RocketMQ's rebalanceByTopic leaves them."""
        return allocate_share(self._allocate, self.config.consumer_group, self.client_id, topic, mqs, cids,
                              warned=self._stray_queues, log=log, strategy_name=self.config.allocate_strategy)

    async def _drop_unsubscribed(self) -> None:
        """Take away the queues of topics no longer subscribed (``unsubscribe``), as a rebalance takes a queue away
        (RocketMQ's truncateMessageQueueNotMyTopic)."""
        gone = sorted(mq for mq in self._pqs if mq.topic not in self._subs)
        for mq in gone:
            if mq in self._pqs:
                await self._remove_queue(mq)
        if gone:
            log.info("unsubscribed topics' queues dropped group=%s client=%s queues=%s", self.config.consumer_group,
                     self.client_id, ", ".join(map(str, gone)))

    async def _remove_queue(self, mq: MessageQueue) -> None:
        if self._orderly is not None:
            self._orderly.take_away(mq)
            return
        pq = self._pqs.pop(mq)
        pq.drop()
        self._flush_offset(pq)
        await self._offsets.persist(mq)
        self.forget_offset(mq)

    def forget_offset(self, mq: MessageQueue) -> None:
        """Stop tracking the offset of ``mq``, a queue no longer consumed here, once it was committed. A
        broadcasting member's offset file keeps it (as RocketMQ's LocalFileOffsetStore.removeOffset, which does
        nothing): the queue is nobody else's, and a topic subscribed again resumes there."""
        if isinstance(self._offsets, RemoteOffsetStore):
            self._offsets.remove(mq)

    async def _start_offsets(self, queues: Sequence[MessageQueue]) -> dict[MessageQueue, int]:
        """Where each newly assigned queue starts, found before its pull task runs (as RocketMQ's rebalance
        computes pull-from-where before it dispatches the first pull): found later, in the pull task, a
        CONSUME_FROM_LAST_OFFSET start was the queue's end *then*, after messages sent once the consumer had
        opened, which nobody consumed. A queue whose offset cannot be found now is left to its pull task, which
        retries; the others are not held up by it."""
        starts: dict[MessageQueue, int] = {}

        async def one(mq: MessageQueue) -> None:
            try:
                starts[mq] = await self._compute_pull_from(mq)
            except RaftMQError as e:
                log.info("cannot find start offset mq=%s error=%s", mq, e)

        if queues and not self._closing:
            async with trio.open_nursery() as nursery:
                for mq in queues:
                    nursery.start_soon(one, mq)
        return starts

    def _add_queue(self, mq: MessageQueue, start_offset: int | None = None, after: ProcessQueue | None = None) -> None:
        assert self._nursery is not None
        cfg = self.config
        # The span bound is the concurrent handler form's alone: the iterator and orderly consumption take a queue's
        # messages in order, so their span is held by the count bound already (client/process_queue.py).
        pq = ProcessQueue(mq, cfg.pull_threshold_for_queue, cfg.pull_threshold_size_for_queue_mib << 20,
                          cfg.consume_concurrently_max_span if self._concurrent is not None else None)
        self._pqs[mq] = pq
        if self._orderly is not None:
            self._nursery.start_soon(self._orderly.run_queue, pq, start_offset, after)
        else:
            self._nursery.start_soon(self._run_queue, pq, start_offset)

    async def _run_queue(self, pq: ProcessQueue, start_offset: int | None) -> None:
        # One cancel scope per queue stops its pull (and its handler calls) the moment the queue is taken away.
        with pq.cancel_scope:
            if self._concurrent is None:
                await self._pull_loop(pq, self._send, start_offset)
            else:
                await self._concurrent.run_queue(pq, start_offset)

    async def _compute_pull_from(self, mq: MessageQueue) -> int:
        offset = await self._offsets.read_from_store(mq)
        if offset is not None:
            return offset
        where = self.config.consume_from_where
        # The retry topic from its start whatever consume_from_where says, as RocketMQ: it holds only this group's
        # failed messages, and from its end a member started after a send-back would skip them.
        if where == "CONSUME_FROM_FIRST_OFFSET" or mq.topic == self._retry_topic or (
                where == "CONSUME_FROM_LAST_OFFSET" and mq not in self._first_queues.get(mq.topic, (mq,))):
            # A queue created after we subscribed (a new topic, or more queues for ours) holds only messages sent
            # since: from its last offset, the ones sent before a rebalance found it were never consumed (RocketMQ's
            # broker answers offset 0 for a group's first query of a queue still starting at 0; ours answers
            # "none").
            offset = await self._api.min_offset(mq)
        elif where == "CONSUME_FROM_TIMESTAMP":
            ts = self.config.consume_timestamp_ms or int(time.time() * 1000) - 30 * 60 * 1000
            offset = await self._api.search_offset(mq, ts)
        else:
            offset = await self._api.max_offset(mq)
        self._offsets.update(mq, offset)
        # Written down before the first pull: until the group has an offset for the queue, each start is from
        # consume_from_where again, and from the last offset that is the queue's end at that moment. A member
        # killed before its first periodic commit (or a queue moved to another member before it) skipped every
        # message stored in between. RocketMQ's broker hides this for queues still starting at 0 by answering a
        # group's first query with 0; ours answers QUERY_NOT_FOUND, so the start itself is committed.
        await self._offsets.persist(mq)
        return offset

    async def _pull_loop(self, pq: ProcessQueue, send: trio.MemorySendChannel, offset: int | None) -> None:
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
        failures = 0  # pulls failed in a row
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
                failures += 1
                log_failed_pull(log, failures, pq.mq, offset, e)
                await trio.sleep(delay)
                continue
            failures = 0
            if result.status is PullStatus.FOUND:
                msgs = result.messages
                if pq.mq.topic == self._retry_topic:
                    msgs = _restore_retry_topic(msgs)
                pq.put(msgs)
                send.send_nowait((pq, msgs))
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
                return await self._api.pull(pq.mq, offset, self.config.pull_batch_size, subscription=sub,
                                            suspend_timeout_ms=self.config.broker_suspend_max_time_ms)
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
        something else, returned anything else, or ran past ``timeout_s`` and was cancelled)."""
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
                return ReconsumeLater()
        if scope.cancelled_caught:
            log.warning("handler cancelled after consume_timeout_min=%d, the message counts as failed topic=%s "
                        "broker_name=%s queue_id=%d offset=%d msg_id=%s", self.config.consume_timeout_min,
                        pq.mq.topic, pq.mq.broker_name, pq.mq.queue_id, msg.queue_offset, msg.msg_id)
            return ReconsumeLater()
        if result is None or result is ConsumeStatus.SUCCESS:
            return None
        if result is not ConsumeStatus.RECONSUME_LATER:
            self._unknown_result(result, pq, msg)
        return ReconsumeLater()

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


def _restore_retry_topic(msgs: Sequence[MessageExt]) -> tuple[MessageExt, ...]:
    """A message pulled from the retry topic as its handler knew it: its first topic (RocketMQ's
    resetRetryAndNamespace); ``reconsume_times`` tells how often it failed."""
    return tuple(dataclasses.replace(m, topic=origin) if (origin := m.properties.get(PROPERTY_RETRY_TOPIC)) else m
                 for m in msgs)


def _check_orderly(config: PushConsumerConfig, handler: Handler | None) -> None:
    if config.orderly and handler is None:
        # The iterator hands out messages of every queue through one channel and counts one as consumed only when
        # the next is asked for: it cannot hold a queue until its message is handled, nor retry it before the
        # next one, so it could not keep the promise.
        raise ValueError("orderly=True needs a handler (open_push_consumer(..., handler=async_fn, orderly=True)): "
                         "the iterator form cannot consume in order around a rebalance")


def _check_batch(config: PushConsumerConfig, handler: Handler | None, batch_handler: BatchHandler | None) -> None:
    """``batch_handler`` (a sequence of messages a call) instead of ``handler``, never both; only it takes more than
    one message a call, so a handler written for one message is never handed a sequence."""
    if batch_handler is None:
        if config.consume_message_batch_max_size > 1:
            raise ConfigError(f"consume_message_batch_max_size {config.consume_message_batch_max_size} needs "
                              f"batch_handler= (an async function taking a sequence of messages): handler= and the "
                              f"iterator take one message at a time")
        return
    if handler is not None:
        raise ValueError("give handler= (one message a call) or batch_handler= (a sequence of messages), not both")
    if config.orderly:
        raise ValueError("orderly=True handles one message at a time: it takes handler=, not batch_handler=")


def _check_handler(handler: Any, name: str = "handler", takes: str = "message") -> None:
    """A handler is an ``async def`` function or method, a ``functools.partial`` of one, or an object whose
    ``__call__`` is one, taking the message (a batch handler: the sequence of messages) as its one argument.
    Anything else failed each call, inside the consumer: every message was retried ``max_reconsume_times`` times,
    logged and skipped."""
    if not (inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(getattr(handler, "__call__", None))):
        raise TypeError(f"{name} must be an async function taking a {takes}, got {handler!r}")
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):
        return  # no signature to check (some builtins and extension types)
    try:
        signature.bind(None)
    except TypeError:
        raise TypeError(f"{name} must take the {takes} as its one argument, got {handler!r} with signature "
                        f"{signature}") from None


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
        _check_handler(handler)
    if batch_handler is not None:
        _check_handler(batch_handler, "batch_handler", "sequence of messages")
    _check_batch(config, handler, batch_handler)
    _check_orderly(config, handler)
    version = now_ms()  # RocketMQ's subVersion
    parsed = [parse_subscription(t, e, sub_version=version) for t, e in subs.items()]
    local_offsets = local_offset_store(config) if config.message_model == "BROADCASTING" else None
    server_requests = ServerRequests()
    with _claim_offset_file(local_offsets, config):
        async with open_remoting(config, server_requests) as remoting:
            async with open_client_nursery() as nursery:
                instance = ClientInstance(config, remoting, nursery)
                consumer = PushConsumer(config, instance, parsed, handler, local_offsets, batch_handler=batch_handler)
                # Before the first heartbeat: a consumer whose subscription a broker refuses never joins its group.
                await consumer.check_subscriptions()
                server_requests.on_consumer_ids_changed = (
                    lambda group: consumer.trigger_rebalance() if group in (None, config.consumer_group) else None)
                server_requests.on_reset_offset = consumer.offsets_reset
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
