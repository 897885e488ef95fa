"""The lite pull consumer (RocketMQ's ``DefaultLitePullConsumer``): the queues are picked by the application
(assign mode) or shared out among the group's members (subscribe mode), the consumer prefetches them in the
background, and the application polls, seeks and commits.

    async with open_lite_pull_consumer(namesrv, consumer_group="G") as consumer:
        consumer.assign(await consumer.fetch_queues("TopicTest"))   # or: await consumer.subscribe("TopicTest", "*")
        while True:
            for msg in await consumer.poll():
                ...

The rules:

- **One mode.** The first ``assign`` (or ``set_sub_expression_for_assign``) or ``subscribe`` fixes the mode; a call
  of the other raises ``RuntimeError`` (RocketMQ throws too: the two are mutually exclusive).
- **Assign mode: no group membership.** The consumer sends no heartbeat, registers no subscription and takes part
  in no rebalance: the group's name only keys its offsets on the brokers. RocketMQ's client does register an
  assign-mode consumer (its heartbeat lists the group with an empty subscription set), so its brokers count it as a
  member, and subscribe-mode members of the same group allocate queues to it that nobody then consumes. Here an
  assign-mode consumer is invisible to them; do not mix the two modes in one group all the same, or both consume
  (and commit) the same queues.
- **Subscribe mode: a member of the group**, as a push consumer is (``client/rebalance.py`` holds what they share;
  the code is in ``client/lite_pull_subscribe.py``).
  ``await subscribe(topic, expression)`` (a tag expression or ``MessageSelector.by_sql``; a SQL92 one is first
  checked with CHECK_CLIENT_CONFIG, and a refusal raises ``SubscriptionRefusedError`` with nothing changed) sends a
  heartbeat (consume type ``CONSUME_ACTIVELY``, RocketMQ's "PULL"; no retry topic, since a lite pull consumer sends
  nothing back, as RocketMQ's) and rebalances before it returns, the new queues' starts found (and committed, see
  below). A rebalance every ``rebalance_interval_ms``, and at once on NOTIFY_CONSUMER_IDS_CHANGED, shares each
  topic's readable queues out by ``allocate_strategy``: a queue taken away stops prefetching, drops its cache and
  has its *stored* offset (what auto-commit or ``commit`` took) committed before the rebalance goes on, so the next
  member starts there (what poll handed out since comes again: at least once); then its offset is forgotten, taken
  or not (as RocketMQ's): a commit resent later would set back the progress of the member that has the queue now,
  and a queue given back starts at the group's offset. Members that briefly disagree both pull a queue for a moment.
  ``await unsubscribe(topic)`` takes the topic's queues away the same way; the consumer stays a member. Closing
  commits, then unregisters, so the others take its queues at once. ``assignment()``, ``pause``, ``seek``,
  ``commit`` and the rest work on the queues this member holds now. An offset reset (``raftmq admin reset-offset``,
  ``clone-group-offset``: the broker sets the group's offsets, then tells its members, RESET_CONSUMER_CLIENT_OFFSET)
  moves each queue it names that this member holds as a seek does (its cache dropped, poll hands out from the new
  offset), and the new offset is stored and committed at once, so no later commit of positions undoes it (RocketMQ's
  client does this for push consumers only). A queue being given up when told commits the reset offset instead of
  its stored one, also when told while that commit is on its way. Assign mode is no member: the broker tells it
  nothing.
- **One prefetch task per assigned queue**, long polling the broker group (``broker_suspend_max_time_ms``), following
  leader changes through ``PullAPI`` (a pull falls back to the followers while the leader cannot be reached), and
  pausing ``pull_time_delay_ms_when_exception`` after a failed pull (refusals in a row: doubling, up to 3 s). A
  queue's first pull starts at the group's committed offset, or where ``consume_from_where`` says if the group has
  none (as RocketMQ's computePullFromWhere; ``await position(mq)`` waits until that start is found). A start found
  so is committed at once: in subscribe mode before the queue's first pull (and before ``subscribe`` returns), with
  or without auto-commit, as the push consumer's, so a member gone before its first commit, or a queue moved to
  another member, skips nothing stored in between; in assign mode with auto-commit only, in the background. In subscribe
  mode from the last offset, a queue not among its topic's read queues when the topic was subscribed (a topic no
  name server knew then, or queues added to it since) starts at its min offset, as the push consumer's: all it
  holds was sent after the subscription, and from its max offset what was sent before a rebalance found the queue
  was never consumed. Every message is pulled (``*``), unless ``set_sub_expression_for_assign`` gives a topic a
  tag expression or a ``MessageSelector.by_sql`` (RocketMQ 5's setSubExpressionForAssign). A new expression for a
  topic (``set_sub_expression_for_assign`` or ``subscribe`` again) applies at once: the pulls of its queues in
  flight are cancelled and sent again with it, as the push consumer's (held on the broker with the old expression,
  they brought in what it selects and nothing the new one does for up to ``broker_suspend_max_time_ms``); what is
  cached already stays. A SQL92 expression is checked by the next ``poll``, before it hands anything out:
  CHECK_CLIENT_CONFIG to a node of each broker group serving the topic, and ``SubscriptionRefusedError`` naming the
  group and the reason if one refuses it (a node without ``enable_property_filter``), again at each poll until the
  expression is replaced or accepted (its pulls are refused meanwhile). A topic with no route yet, or a group none of
  whose nodes answered, is not checked (as RocketMQ's). An offset beyond the queue's end (committed past it, a wiped
  store) follows the leader's correction as a seek.
- **Bounds.** A queue's next pull waits while it caches ``pull_threshold_for_queue`` messages or
  ``pull_threshold_size_for_queue_mib`` MiB of bodies not yet polled, or while the whole consumer caches
  ``pull_threshold_for_all`` messages or ``pull_threshold_size_for_all_mib`` MiB (the application picks the queues,
  and a thousand of them under the per-queue bounds alone could cache 100 GiB); one pull may go past a bound by
  its size. A paused queue is not pulled either. Whatever drops cached messages (``unsubscribe``, a rebalance, a
  seek, ``assign``, an offset reset) wakes the queues waiting for space. A body stored compressed is inflated up to
  ``max_inflated_body_size_bytes`` (4 MiB): one that would inflate further is logged and handed out as stored.
- **poll** hands out at most ``max_messages`` (``poll_max_messages``, 32) messages of the assigned queues that are
  not paused, each queue's in offset order, taking the queues that have messages in turn (a queue that still has
  some after a poll goes to the back). It waits up to ``timeout_s`` for the first; after that, an empty list.
  One task polls at a time (another gets ``trio.BusyResourceError``).
- **Positions and offsets.** A queue's position is the offset of the next message poll would hand out of it: the
  first one cached, else where the next pull starts. ``commit()`` stores every assigned queue's position and has
  it sent at once in the background; ``await commit_sync()`` sends it and raises if the broker did not take it
  (both also take an explicit ``{queue: offset}``). Commits go to the group's leader (UPDATE_CONSUMER_OFFSET),
  which replicates them through Raft.
- **Auto-commit** (``auto_commit``, the default): each ``poll`` first takes the positions as they are, so what
  the previous polls handed out counts as consumed once the application asks for more (RocketMQ's and Kafka's
  rule), and those positions are sent every ``auto_commit_interval_ms``. Leaving the ``async with`` block normally
  commits everything poll handed out; leaving it by an exception commits only up to the start of the last poll,
  whose messages are then delivered again. Delivery is at least once.
- **seek** moves a queue to an offset within ``[min_offset, max_offset]`` (RocketMQ refuses others too): its
  cache and any pull in flight are dropped and the next poll hands out from there. The new position is committed
  like any other (by the next auto-commit or ``commit``). ``assign`` replaces the assignment: queues no longer
  assigned stop prefetching and drop their cache (their positions, already stored by auto-commit or ``commit``,
  are sent at once); queues kept keep their cache, position and pause.
- **Message trace** (``enable_msg_trace``, RocketMQ's DefaultLitePullConsumer enableMsgTrace; ``client/trace.py``
  states the rules): ``poll`` records, per queue of what it returns, a SubBefore and then a SubAfter (success) per
  message before it returns, as RocketMQ's poll runs its consume hook's before and after; the application's own
  work on them is not seen. The contexts go to ``trace_topic`` through an inner producer opened before the
  consumer and flushed after it closes. Off, ``poll`` pays one attribute test per queue it takes from.

Layout: subscribe mode (``subscribe``, ``unsubscribe``, the rebalance, the heartbeat) and the assign/subscribe mode
choice are ``LitePullSubscribe``, the base class of ``LitePullConsumer``, in ``client/lite_pull_subscribe.py``; what
stays here is what both modes share: assignment, positions, poll, the prefetch tasks and commits.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import trio

from client.errors import ClientClosedError
from client.filter import SUB_ALL, TAG, MessageSelector, Subscription, parse_subscription
from client.instance import (HOUR_MS, ClientConfig, ClientInstance, ServerRequests, build_config, open_client_nursery,
                             open_remoting)
from client.message import (DEFAULT_MAX_INFLATED_BODY, I32_MAX, I64_MAX, MAX_INFLATED_BODY, MessageExt, MessageQueue,
                            PullResult, PullStatus, check_int_arg, check_queue, check_seconds)
from client.lite_pull_subscribe import ASSIGN, SUBSCRIBE, LitePullSubscribe
from client.offset_store import RemoteOffsetStore
from client.pull_consumer import FailedPulls, PullAPI, pull_should_wait
from client.push_consumer_config import CONSUME_FROM
from client.rebalance import (DEFAULT_ALLOCATE_STRATEGY, AllocateStrategy, allocate_strategy_problem,
                              resolve_allocate_strategy)
from client.consume_hook import ConsumeHook, told_pull
from client.running_info import attach_lite_pull_consumer
from client.trace import TRACE_TOPIC, ConsumeTracer, open_trace_dispatcher
from remoting.config import bounded
from remoting.errors import RaftMQError
from remoting.message import group_problem, topic_problem

__all__ = ["LitePullConsumerConfig", "LitePullConsumer", "LitePullStatistics", "open_lite_pull_consumer"]

log = logging.getLogger(__name__)

# How long closing may take to send the last offsets and leave the group (as the push consumer's close).
CLOSE_COMMIT_S = 3.0


@dataclasses.dataclass(frozen=True)
class LitePullConsumerConfig(ClientConfig):
    consumer_group: str = bounded("DEFAULT_CONSUMER", check=group_problem)
    consume_from_where: str = bounded("CONSUME_FROM_LAST_OFFSET", choices=CONSUME_FROM,
                                      doc="start of a newly assigned queue the group has no offset for")
    consume_timestamp_ms: int = bounded(0, min=0, max=I64_MAX,
                                        doc="start time for CONSUME_FROM_TIMESTAMP; 0: 30 min ago")
    auto_commit: bool = bounded(True, doc="commit what earlier polls handed out, every auto_commit_interval_ms")
    auto_commit_interval_ms: int = bounded(5_000, min=10, max=HOUR_MS)
    # RocketMQ's LitePull asks for 10 per pull and hands out one pull per poll; one pull of 32 (the push consumer's)
    # takes a third of the round trips, and poll_max_messages bounds what one poll returns on its own.
    pull_batch_size: int = bounded(32, min=1, max=1024, doc="messages asked for per PULL_MESSAGE")
    poll_max_messages: int = bounded(32, min=1, max=65_535, doc="default bound of what one poll returns")
    pull_threshold_for_queue: int = bounded(1000, min=1, max=65_535, doc="flow control: messages cached per queue")
    pull_threshold_size_for_queue_mib: int = bounded(100, min=1, max=1 << 20,
                                                     doc="flow control: MiB of message bodies cached per queue")
    pull_threshold_for_all: int = bounded(10_000, min=1, max=1 << 24,
                                          doc="flow control: messages cached across all assigned queues")
    pull_threshold_size_for_all_mib: int = bounded(1024, min=1, max=1 << 20,
                                                   doc="flow control: MiB of message bodies cached across all queues")
    # A Java int on the wire, as the push consumer's: the broker holds at most its own long_polling_timeout_ms.
    broker_suspend_max_time_ms: int = bounded(15_000, min=0, max=I32_MAX, doc="long-polling hold on the broker")
    # RocketMQ waits 1000 ms; a leader usually moves within a second, so sooner (as the push consumer).
    pull_time_delay_ms_when_exception: int = bounded(200, min=10, max=HOUR_MS,
                                                     doc="pause after a failed pull, before the next")
    check_crc: bool = bounded(False, doc="recompute each pulled body's crc32c")
    # The pull thresholds count bodies once inflated, after the fact: this bounds what one pulled body may cost.
    max_inflated_body_size_bytes: int = bounded(DEFAULT_MAX_INFLATED_BODY, min=1, max=MAX_INFLATED_BODY,
                                                doc="most a compressed body is inflated to; a larger one is "
                                                    "delivered as stored, compressed, and logged")
    # Subscribe mode only, as the push consumer's (RocketMQ's LitePull rebalances every 20 s by its client instance).
    rebalance_interval_ms: int = bounded(5_000, min=10, max=HOUR_MS,
                                         doc="subscribe mode: how often the group's queues are shared out again")
    allocate_strategy: str | AllocateStrategy = bounded(
        DEFAULT_ALLOCATE_STRATEGY, check=allocate_strategy_problem,
        doc="subscribe mode: how the group's members split each topic's queues, by a RocketMQ strategy's name "
            "(client.rebalance.ALLOCATE_STRATEGIES) or a function like client.rebalance.allocate_average; every member "
            "of a group must use the same")
    # RocketMQ's enableMsgTrace / customizedTraceTopic, as the push consumer's (client/trace.py).
    enable_msg_trace: bool = bounded(False, doc="record the trace of each message poll returns (SubBefore, then "
                                                "SubAfter) and send it to trace_topic")
    trace_topic: str = bounded(TRACE_TOPIC, check=topic_problem, doc="the topic traces go to")


@dataclasses.dataclass(frozen=True, slots=True)
class LitePullStatistics:
    assigned_queues: int
    paused_queues: int
    cached: int  # messages pulled and not yet polled, all queues
    cached_bytes: int
    polled: int  # messages handed out by poll
    pulls: int
    pull_errors: int
    rebalances: int = 0  # subscribe mode: rebalances that changed this member's queues


class _AssignedQueue:
    """One assigned queue's prefetch state. A seek (or the broker's correction of an offset beyond the queue's end)
    replaces it with a new one, so a pull still in flight for the old position can only fill a dropped object."""

    __slots__ = ("mq", "msgs", "msg_bytes", "pull_offset", "started", "cancel_scope", "pull_scope", "dropped",
                 "in_ready")

    def __init__(self, mq: MessageQueue, start: int | None) -> None:
        self.mq = mq
        self.msgs: collections.deque[MessageExt] = collections.deque()
        self.msg_bytes = 0
        self.pull_offset = start  # where the next pull starts; None until the start is found
        self.started = trio.Event()
        if start is not None:
            self.started.set()
        self.cancel_scope = trio.CancelScope()
        self.pull_scope: trio.CancelScope | None = None  # the pull in flight's, while there is one
        self.dropped = False
        self.in_ready = False  # in the consumer's round of queues with messages to poll

    def position(self) -> int:
        """The offset of the next message poll hands out of this queue (only once ``started``)."""
        assert self.pull_offset is not None
        return self.msgs[0].queue_offset if self.msgs else self.pull_offset


class LitePullConsumer(LitePullSubscribe):
    def __init__(self, config: LitePullConsumerConfig, instance: ClientInstance, nursery: trio.Nursery, *,
                 tracer: ConsumeTracer | None = None) -> None:
        self.config = config
        self._instance = instance
        self._nursery = nursery
        self._api = PullAPI(instance, config.consumer_group, check_crc=config.check_crc,
                            max_inflated_body_size_bytes=config.max_inflated_body_size_bytes)
        self._offsets = RemoteOffsetStore(self._api.fetch_consume_offset, self._api.commit_consume_offset)
        self._queues: dict[MessageQueue, _AssignedQueue] = {}
        self._paused: set[MessageQueue] = set()
        self._subs: dict[str, Subscription] = {}  # topic -> its expression (set_sub_expression_for_assign)
        # SQL92 expressions the next poll asks the brokers about (set_sub_expression_for_assign is not async).
        self._unchecked: dict[str, Subscription] = {}
        self._ready: collections.deque[_AssignedQueue] = collections.deque()
        self._cached = 0
        self._cached_bytes = 0
        # Replaced each time they fire: prefetch tasks wait on _space (a bound freed, a queue resumed), poll on
        # _arrived (messages cached in a queue it may take from).
        self._space = trio.Event()
        self._arrived = trio.Event()
        self._commit_now = trio.Event()
        self._polling = False
        self._closed = False
        self._polled = 0
        self._pulls = 0
        self._pull_errors = 0
        # Subscribe mode: _subs holds the subscriptions, and a rebalance (under _lock) decides the queues.
        self._mode: str | None = None  # ASSIGN or SUBSCRIBE once chosen
        self._lock = trio.Lock()
        self._rebalance_now = trio.Event()
        self._allocate = resolve_allocate_strategy(config.allocate_strategy)
        self._stray_queues: set[MessageQueue] = set()  # named by the strategy, not in the route (warned once each)
        self._rebalances = 0
        self._resets_pending: dict[MessageQueue, int] = {}  # subscribe mode: offset resets told, not yet applied
        # Subscribe mode: each topic's read queues when it was subscribed (empty: no name server knew it then).
        self._first_queues: dict[str, frozenset[MessageQueue]] = {}
        # Told of every pull and of what poll hands out (client/consume_hook.py); None until something
        # subscribes (consume_hook()).
        self._hook: ConsumeHook | None = None
        if tracer is not None:  # enable_msg_trace (client/trace.py): SubBefore/SubAfter per message poll returns
            tracer.subscribe_to(self.consume_hook())
        # Nothing is sent until subscribe(): an assign-mode consumer is no member of its group.
        instance.heartbeat_data = self._heartbeat_data

    @property
    def client_id(self) -> str:
        return self._instance.client_id

    def consume_hook(self) -> ConsumeHook:
        """The hook this consumer's pulls and what ``poll`` hands out are told to (running info subscribes to it).
        Made on first asking."""
        if self._hook is None:
            self._hook = ConsumeHook()
        return self._hook

    @property
    def mode(self) -> str | None:
        """``"assign"`` or ``"subscribe"`` once the first call chose it, else None."""
        return self._mode

    def statistics(self) -> LitePullStatistics:
        return LitePullStatistics(len(self._queues), len(self._paused), self._cached, self._cached_bytes,
                                  self._polled, self._pulls, self._pull_errors, self._rebalances)

    # -- assignment -----------------------------------------------------------------------------------------------
    async def fetch_queues(self, topic: str) -> list[MessageQueue]:
        """The readable queues of ``topic`` as the name servers route them now (RocketMQ's fetchMessageQueues)."""
        self._check_open("fetch_queues")
        if not isinstance(topic, str) or not topic:
            raise ValueError(f"topic must be a non-empty string, got {topic!r}")
        return await self._api.fetch_subscribe_queues(topic)

    def assign(self, queues: Iterable[MessageQueue]) -> None:
        """Consume exactly ``queues`` from now on (an empty collection: none). Queues no longer assigned stop
        prefetching and drop their cache; new ones start at the group's committed offset, else at
        ``consume_from_where``."""
        self._check_open("assign")
        wanted = set(_checked_queues("queues", queues))
        self._claim_mode(ASSIGN, "assign()")
        removed = [mq for mq in self._queues if mq not in wanted]
        for mq in removed:
            self._drop(self._queues.pop(mq))
            self._paused.discard(mq)
        added = sorted(mq for mq in wanted if mq not in self._queues)
        for mq in added:
            self._start(mq, None)
        if removed or added:
            log.info("assignment changed group=%s added=%d removed=%d now=%d", self.config.consumer_group,
                     len(added), len(removed), len(self._queues))
        if removed:
            # Their last stored positions go now: whoever consumes them next starts there.
            self._commit_now.set()

    def assignment(self) -> frozenset[MessageQueue]:
        self._check_open("assignment")
        return frozenset(self._queues)

    def set_sub_expression_for_assign(self, topic: str, expression: str | MessageSelector) -> None:
        """Pull the queues of ``topic`` with ``expression``, a tag expression or ``MessageSelector.by_sql(...)``
        (``*``: every message), at once: pulls in flight with another expression are cancelled and sent again with
        this one; what is cached already stays. ``ValueError`` names a bad topic or expression now, not in every
        pull. A SQL92 expression is checked with the brokers by the next ``poll``, which raises
        ``SubscriptionRefusedError`` if a broker group refuses it."""
        self._check_open("set_sub_expression_for_assign")
        sub = parse_subscription(topic, expression)
        self._claim_mode(ASSIGN, f"set_sub_expression_for_assign({topic!r})")
        old = self._subs.get(topic)
        self._subs[topic] = sub
        self._restart_pulls(topic, old, sub)
        if sub.expression_type == TAG:
            self._unchecked.pop(topic, None)  # every broker serves it: nothing to ask
        else:
            self._unchecked[topic] = sub
        log.info("expression set group=%s topic=%s type=%s expression=%s", self.config.consumer_group, topic,
                 sub.expression_type, sub.expression)

    def pause(self, queues: Iterable[MessageQueue]) -> None:
        """Stop handing out and prefetching ``queues`` (assigned ones); what they cache stays for ``resume``."""
        self._check_open("pause")
        self._paused.update(self._assigned_among("pause", queues))

    def resume(self, queues: Iterable[MessageQueue]) -> None:
        self._check_open("resume")
        for mq in self._assigned_among("resume", queues):
            self._paused.discard(mq)
            self._make_ready(self._queues[mq])
        self._space_freed()

    def paused(self) -> frozenset[MessageQueue]:
        self._check_open("paused")
        return frozenset(self._paused)

    # -- positions ------------------------------------------------------------------------------------------------
    async def seek(self, mq: MessageQueue, offset: int) -> None:
        """Hand out ``mq`` from ``offset`` on, which must lie within the queue's ``[min_offset, max_offset]``."""
        self._check_open("seek")
        check_queue("mq", mq)
        check_int_arg("offset", offset, 0, I64_MAX)
        self._check_assigned("seek", mq)
        lo, hi = await self._api.min_offset(mq), await self._api.max_offset(mq)
        if not lo <= offset <= hi:
            raise ValueError(f"seek offset {offset} of {mq} is outside the queue: min_offset {lo}, max_offset {hi}")
        self._seek(mq, offset)

    async def seek_to_begin(self, mq: MessageQueue) -> None:
        self._check_open("seek_to_begin")
        self._check_assigned("seek_to_begin", check_queue("mq", mq))
        self._seek(mq, await self._api.min_offset(mq))

    async def seek_to_end(self, mq: MessageQueue) -> None:
        self._check_open("seek_to_end")
        self._check_assigned("seek_to_end", check_queue("mq", mq))
        self._seek(mq, await self._api.max_offset(mq))

    def _seek(self, mq: MessageQueue, offset: int) -> None:
        # Checked again: the assignment may have changed, or the consumer closed, while the bounds were asked for.
        self._check_open("seek")
        self._check_assigned("seek", mq)
        self._drop(self._queues[mq])
        self._start(mq, offset)
        log.info("seek group=%s mq=%s offset=%d", self.config.consumer_group, mq, offset)

    async def position(self, mq: MessageQueue) -> int:
        """The offset of the next message ``poll`` hands out of ``mq``; waits until its start is found."""
        self._check_open("position")
        self._check_assigned("position", check_queue("mq", mq))
        while True:
            self._check_open("position")
            aq = self._queues.get(mq)
            if aq is None:
                raise ValueError(f"{mq} was unassigned while its position was awaited")
            if aq.started.is_set():
                return aq.position()
            await aq.started.wait()

    async def committed(self, mq: MessageQueue) -> int | None:
        """The group's offset for ``mq`` on the broker group, None if it never committed one."""
        self._check_open("committed")
        return await self._api.fetch_consume_offset(check_queue("mq", mq))

    def commit(self, offsets: Mapping[MessageQueue, int] | None = None) -> None:
        """Commit every assigned queue's position (or ``offsets``, of assigned queues), sent in the background now;
        one the broker does not take is sent again every ``auto_commit_interval_ms``."""
        self._check_open("commit")
        self._store(self._offsets_to_commit("commit", offsets))
        self._commit_now.set()

    async def commit_sync(self, offsets: Mapping[MessageQueue, int] | None = None) -> None:
        """Commit every assigned queue's position (or ``offsets``) and wait until the broker groups took them;
        raises the first failure (what was not taken stays to be sent in the background)."""
        self._check_open("commit_sync")
        wanted = self._offsets_to_commit("commit_sync", offsets)
        self._store(wanted)
        for mq, offset in sorted(wanted.items()):
            try:
                await self._api.commit_consume_offset(mq, offset)
            except RaftMQError:
                self._commit_now.set()
                raise
            self._offsets.mark_clean(mq, offset)

    def _offsets_to_commit(self, what: str, offsets: Mapping[MessageQueue, int] | None) -> dict[MessageQueue, int]:
        if offsets is None:
            return self._positions()
        if not isinstance(offsets, Mapping):
            raise TypeError(f"{what}: offsets must map MessageQueue to offset, got {offsets!r}")
        for mq, offset in offsets.items():
            check_queue(f"{what}: offsets key", mq)
            check_int_arg(f"{what}: offset of {mq}", offset, 0, I64_MAX)
        self._check_assigned(what, *offsets)
        return dict(offsets)

    def _positions(self) -> dict[MessageQueue, int]:
        return {mq: aq.position() for mq, aq in self._queues.items() if aq.pull_offset is not None}

    def _store(self, offsets: Mapping[MessageQueue, int]) -> None:
        for mq, offset in offsets.items():
            self._offsets.update(mq, offset)

    # -- polling --------------------------------------------------------------------------------------------------
    async def poll(self, timeout_s: float = 5.0, max_messages: int | None = None) -> list[MessageExt]:
        """Up to ``max_messages`` messages of the assigned queues that are not paused, each queue's in offset order;
        waits up to ``timeout_s`` for the first, then returns an empty list."""
        self._check_open("poll")
        check_seconds("timeout_s", timeout_s, allow_zero=True)
        if max_messages is None:
            max_messages = self.config.poll_max_messages
        check_int_arg("max_messages", max_messages, 1, 65_535)
        if self._polling:
            raise trio.BusyResourceError("another task is already polling this lite pull consumer")
        self._polling = True
        try:
            # First: a poll that raises here hands out nothing and, with auto-commit, does not take the last
            # poll's messages for consumed.
            for topic, sub in list(self._unchecked.items()):
                await self._api.check_subscription(sub)  # refused: raises, and the next poll asks again
                if self._unchecked.get(topic) is sub:
                    del self._unchecked[topic]
            if self.config.auto_commit:
                # Asking for more means done with what the last poll returned: it counts as consumed now.
                self._store(self._positions())
            # _ready may hold only queues sought, paused or unassigned since they came in (_take skips them): wait on
            # until one gives something, or the time is up (found by review: such an entry returned [] at once).
            with trio.move_on_after(timeout_s):
                while not (taken := self._take(max_messages)):
                    await self._arrived.wait()
                    self._check_open("poll")
                return taken
            self._check_open("poll")
            return self._take(max_messages)
        finally:
            self._polling = False

    def _take(self, max_messages: int) -> list[MessageExt]:
        out: list[MessageExt] = []
        ready = self._ready
        while ready and len(out) < max_messages:
            aq = ready.popleft()
            aq.in_ready = False
            if aq.dropped or aq.mq in self._paused:
                continue  # resume puts a paused queue back
            msgs = aq.msgs
            n = min(max_messages - len(out), len(msgs))
            size = 0
            for _ in range(n):
                m = msgs.popleft()
                out.append(m)
                size += len(m.body)
            aq.msg_bytes -= size
            self._cached -= n
            self._cached_bytes -= size
            if n and self._hook is not None:
                hook = self._hook
                hook.handed_out(aq.mq, n)
                if hook.holds_heard:
                    # Held and consumed at once, as RocketMQ's poll runs its hook's before and after: what the
                    # application does with them next is its own.
                    hook.hold_ended(hook.hold_started(aq.mq, out[-n:]))
            if msgs:  # its turn again after the others'
                aq.in_ready = True
                ready.append(aq)
        if out:
            self._polled += len(out)
            self._space_freed()
        return out

    # -- prefetch -------------------------------------------------------------------------------------------------
    def _start(self, mq: MessageQueue, start: int | None) -> None:
        aq = _AssignedQueue(mq, start)
        self._queues[mq] = aq
        self._nursery.start_soon(self._prefetch, aq)

    def _drop(self, aq: _AssignedQueue) -> None:
        aq.dropped = True
        aq.cancel_scope.cancel()
        aq.started.set()  # a position() waiting on it looks again
        self._cached -= len(aq.msgs)
        self._cached_bytes -= aq.msg_bytes
        aq.msgs.clear()
        aq.msg_bytes = 0
        # Here, not in the callers: the other queues may wait for the consumer-wide bounds, which these messages
        # filled; unsubscribe once dropped a full cache without it, and they never pulled again.
        self._space_freed()

    def _restart_pulls(self, topic: str, old: Subscription | None, new: Subscription) -> None:
        """``topic``'s expression went from ``old`` (None: none set, its pulls take ``*``) to ``new`` (``_subs``
        holds it already): cancel its queues' pulls in flight, which their prefetch tasks send again at once with
        ``new``. Held on the broker with ``old`` (up to ``broker_suspend_max_time_ms``, 15 s), they would bring in
        what it selects and nothing ``new`` does until they returned. A cancelled pull took nothing: it asks for
        the same offset again."""
        was = (old.expression_type, old.expression) if old is not None else (TAG, SUB_ALL)
        if was == (new.expression_type, new.expression):
            return
        for aq in self._queues.values():
            if aq.mq.topic == topic and aq.pull_scope is not None:
                aq.pull_scope.cancel()

    def _make_ready(self, aq: _AssignedQueue) -> None:
        if aq.msgs and not aq.in_ready and not aq.dropped and aq.mq not in self._paused:
            aq.in_ready = True
            self._ready.append(aq)
            self._arrived.set()
            self._arrived = trio.Event()

    def _space_freed(self) -> None:
        self._space.set()
        self._space = trio.Event()

    def _may_pull(self, aq: _AssignedQueue) -> bool:
        cfg = self.config
        return (aq.mq not in self._paused
                and len(aq.msgs) < cfg.pull_threshold_for_queue
                and aq.msg_bytes < cfg.pull_threshold_size_for_queue_mib << 20
                and self._cached < cfg.pull_threshold_for_all
                and self._cached_bytes < cfg.pull_threshold_size_for_all_mib << 20)

    async def _start_offset(self, mq: MessageQueue) -> int:
        # Ours first: an offset this consumer stored and may not have sent yet (assign mode: the queue was unassigned
        # and assigned again) is newer than the broker's. Subscribe mode keeps none of a queue taken away: another
        # member may have moved it on meanwhile.
        offset = self._offsets.read_cached(mq)
        if offset is None:
            offset = await self._offsets.read_from_store(mq)
        if offset is not None:
            return offset
        where = self.config.consume_from_where
        if where == "CONSUME_FROM_FIRST_OFFSET" or (where == "CONSUME_FROM_LAST_OFFSET"
                                                    and self._created_since_subscribed(mq)):
            offset = await self._api.min_offset(mq)
        elif where == "CONSUME_FROM_TIMESTAMP":
            ts = self.config.consume_timestamp_ms or int(time.time() * 1000) - 30 * 60 * 1000
            offset = await self._api.search_offset(mq, ts)
        else:
            offset = await self._api.max_offset(mq)
        if self._mode == SUBSCRIBE:
            await self._commit_start(mq, offset)
        return offset

    async def _prefetch(self, aq: _AssignedQueue) -> None:
        cfg = self.config
        delay = cfg.pull_time_delay_ms_when_exception / 1000
        mq = aq.mq
        with aq.cancel_scope:
            while aq.pull_offset is None:
                try:
                    aq.pull_offset = await self._start_offset(mq)
                except RaftMQError as e:
                    log.info("cannot find start offset mq=%s error=%s", mq, e)
                    await trio.sleep(delay)
            if self.config.auto_commit and self._offsets.read_cached(mq) is None:
                # Assign mode (subscribe mode committed it in _start_offset already): a start found from
                # consume_from_where is committed at once, as the push consumer's: else, until the first auto-commit,
                # each start is found again, and from the last offset that is the queue's end *then*, past the
                # messages sent in between.
                self._offsets.update(mq, aq.pull_offset)
                self._commit_now.set()
            aq.started.set()
            failed = FailedPulls(delay)
            while True:
                while not self._may_pull(aq):
                    await self._space.wait()
                offset = aq.pull_offset
                try:
                    result = await self._pull_once(aq, offset)
                except RaftMQError as e:
                    if self._closed or aq.dropped:
                        return  # closed under it (a close right after a seek): nothing to report
                    self._pull_errors += 1
                    await trio.sleep(failed.record(log, mq, offset, e))
                    continue
                if result is None:
                    continue  # cancelled by a new expression for the topic: sent again with it
                failed.clear()
                if aq.dropped:
                    return  # unassigned or sought while the answer was on its way: it is for a position gone
                if result.status is PullStatus.FOUND and result.messages:
                    size = sum(len(m.body) for m in result.messages)
                    aq.msgs.extend(result.messages)
                    aq.msg_bytes += size
                    self._cached += len(result.messages)
                    self._cached_bytes += size
                    self._make_ready(aq)
                elif result.status is PullStatus.OFFSET_ILLEGAL:
                    log.warning("pull offset moved mq=%s offset=%d next=%d", mq, offset, result.next_begin_offset)
                    if result.next_begin_offset < offset:
                        # Beyond the queue's end (an offset committed past it, a wiped store): the leader names where
                        # to go on, back to its min offset. What is cached lies before, and would come again after
                        # it: start afresh from there, as a seek does.
                        self._seek(mq, result.next_begin_offset)
                        return
                if pull_should_wait(result, offset, cfg.broker_suspend_max_time_ms):
                    await trio.sleep(delay)
                aq.pull_offset = max(offset, result.next_begin_offset)

    async def _pull_once(self, aq: _AssignedQueue, offset: int) -> PullResult | None:
        """One pull of ``aq``'s queue from ``offset`` with its topic's expression as it is now; None if a new
        expression cancelled it on its way (``_restart_pulls``: the broker's late answer is dropped)."""
        # No checkpoint between reading the expression and registering the scope: a change from then on finds the
        # scope and cancels this pull.
        sub = self._subs.get(aq.mq.topic)
        with trio.CancelScope() as scope:
            aq.pull_scope = scope
            try:
                self._pulls += 1
                return await told_pull(self._hook, aq.mq, self._api.pull(
                    aq.mq, offset, self.config.pull_batch_size, subscription=sub,
                    suspend_timeout_ms=self.config.broker_suspend_max_time_ms))
            finally:
                aq.pull_scope = None
        return None

    # -- background commits and close -----------------------------------------------------------------------------
    async def serve_commits(self) -> None:
        """Send stored offsets: at once when asked (``commit``, an unassignment), else every
        ``auto_commit_interval_ms`` with auto-commit on or while a commit is still to be sent again."""
        interval_s = self.config.auto_commit_interval_ms / 1000
        while True:
            wait_s = interval_s if self.config.auto_commit or self._offsets.dirty() else math.inf
            with trio.move_on_after(wait_s):
                await self._commit_now.wait()
            self._commit_now = trio.Event()
            await self._persist()

    async def _persist(self) -> None:
        await self._offsets.persist_all()
        self._forget_unassigned()

    def _forget_unassigned(self) -> None:
        # Forget queues no longer assigned once their offsets are on the broker: a later assignment asks it (in
        # subscribe mode another member may have moved it on meanwhile).
        for mq in list(self._offsets.snapshot()):
            if mq not in self._queues and mq not in self._offsets.dirty():
                self._offsets.remove(mq)

    async def close(self, *, consumed_all: bool = True) -> None:
        """Stop prefetching and commit: with auto-commit, every position poll reached if ``consumed_all`` (the block
        ended normally), else (an exception) those stored at the start of the last poll. Commits asked for with
        ``commit`` are sent either way."""
        if self._closed:
            return
        if self.config.auto_commit and consumed_all:
            self._store(self._positions())
        self._closed = True
        for aq in self._queues.values():
            self._drop(aq)
        self._arrived.set()  # a poll waiting in another task wakes up to a ClientClosedError
        with trio.move_on_after(CLOSE_COMMIT_S) as scope:
            scope.shield = True
            failed = await self._commit_leaving()  # persist_all, a reset told meanwhile winning
            if self._mode == SUBSCRIBE:
                # After the commits: the others, told at once, start the queues at the offsets just sent.
                await self._instance.unregister(None, self.config.consumer_group)
        if failed or scope.cancelled_caught:
            log.warning("offsets not committed on close group=%s queues=%d", self.config.consumer_group,
                        len(self._offsets.dirty()))

    # -- checks ---------------------------------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClientClosedError(f"{what}: the lite pull consumer of group {self.config.consumer_group!r} is "
                                    f"closed", consumer_group=self.config.consumer_group)

    def _check_assigned(self, what: str, *queues: MessageQueue) -> None:
        missing = sorted({mq for mq in queues if mq not in self._queues})
        if missing:
            hint = ("subscribe mode: a rebalance may have moved it to another member" if self._mode == SUBSCRIBE
                    else "assign() it first")
            raise ValueError(f"{what}: {', '.join(map(str, missing))} {'is' if len(missing) == 1 else 'are'} not "
                             f"assigned to this consumer ({hint})")

    def _assigned_among(self, what: str, queues: Iterable[MessageQueue]) -> list[MessageQueue]:
        mqs = _checked_queues("queues", queues)
        self._check_assigned(what, *mqs)
        return mqs


def _checked_queues(name: str, queues: Any) -> list[MessageQueue]:
    """``queues`` as a list, each checked: a lone MessageQueue, a string or a mapping is refused, not iterated."""
    if isinstance(queues, (MessageQueue, str, bytes, Mapping)) or not isinstance(queues, Iterable):
        raise TypeError(f"{name} must be a collection of MessageQueue, got {queues!r}")
    return [check_queue(f"{name}[{i}]", mq) for i, mq in enumerate(queues)]


@contextlib.asynccontextmanager
async def open_lite_pull_consumer(namesrv: str | Sequence[str] | None = None,
                                  **options: Any) -> AsyncIterator[LitePullConsumer]:
    """Open a lite pull consumer; options are ``LitePullConsumerConfig`` fields. It consumes nothing until ``assign``
    or ``await subscribe``."""
    if namesrv is not None:
        options["namesrv"] = namesrv
    config: LitePullConsumerConfig = build_config(LitePullConsumerConfig, options)
    async with contextlib.AsyncExitStack() as stack:
        # Outside the consumer: closed after it, so the traces of its last polls are sent too.
        tracer = None
        if config.enable_msg_trace:
            dispatcher = await stack.enter_async_context(open_trace_dispatcher(config, config.trace_topic))
            tracer = ConsumeTracer(dispatcher, config.consumer_group, config.client_ip)
        async with _open_consumer(config, tracer) as consumer:
            yield consumer


@contextlib.asynccontextmanager
async def _open_consumer(config: LitePullConsumerConfig, tracer: ConsumeTracer | None
                         ) -> AsyncIterator[LitePullConsumer]:
    server_requests = ServerRequests()
    async with open_remoting(config, server_requests) as remoting:
        async with open_client_nursery() as nursery:
            # The instance refreshes routes and watches leaders; it heartbeats only once subscribe() made the
            # consumer a member of its group (assign mode: no heartbeat data, none sent).
            instance = ClientInstance(config, remoting, nursery)
            consumer = LitePullConsumer(config, instance, nursery, tracer=tracer)
            server_requests.on_consumer_ids_changed = (
                lambda group: consumer.trigger_rebalance() if group in (None, config.consumer_group) else None)
            server_requests.on_reset_offset = consumer.offsets_reset  # subscribe mode only
            server_requests.on_consumer_running_info = attach_lite_pull_consumer(consumer)  # consumer-status
            instance.start_background()
            # Both stopped before close() sends the last offsets itself (and leaves the group).
            commits, rebalances = trio.CancelScope(), trio.CancelScope()
            nursery.start_soon(_run_in, commits, consumer.serve_commits)
            nursery.start_soon(_run_in, rebalances, consumer.serve_rebalance)
            consumed_all = True
            try:
                yield consumer
            except BaseException:
                consumed_all = False
                raise
            finally:
                instance.stop_background()
                commits.cancel()
                rebalances.cancel()
                await consumer.close(consumed_all=consumed_all)
                instance.closed = True
                nursery.cancel_scope.cancel()


async def _run_in(scope: trio.CancelScope, fn: Any) -> None:
    with scope:
        await fn()
