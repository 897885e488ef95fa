"""The lite pull consumer's subscribe mode: its membership of the group (``subscribe``, ``unsubscribe``, the
rebalance that shares each subscribed topic's queues out, the heartbeat it sends, the offset resets the brokers
tell it) and the choice between assign and subscribe mode (RocketMQ's SubscriptionType), which the first call of
either fixes. ``client/lite_pull_consumer.py`` states the rules of both modes.

``LitePullSubscribe`` is a base class of ``client.lite_pull_consumer.LitePullConsumer``, not an object of its own:
a rebalance starts and drops the very queues, caches and offsets that assign mode, poll and the prefetch tasks work
on (declared below), and a second object would hold them twice or reach them through an attribute on every pull.
It is apart from ``client/lite_pull_consumer.py`` because an assign-mode consumer never runs any of it, and none of
it runs per message: it decides which queues are consumed, at ``subscribe``, on a timer and on the brokers' notices.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

from client.filter import SQL92, MessageSelector, Subscription, parse_subscription
from client.instance import ClientInstance, now_ms
from client.message import MessageQueue
from client.offset_store import RemoteOffsetStore
from client.pull_consumer import PullAPI
from client.rebalance import (AllocateStrategy, allocate_share, consumer_heartbeat_data, diff_assignment,
                              find_start_offsets, member_ids)
from remoting.errors import RaftMQError

if TYPE_CHECKING:
    from client.lite_pull_consumer import LitePullConsumerConfig, _AssignedQueue

__all__ = ["LitePullSubscribe", "ASSIGN", "SUBSCRIBE"]

# The lite pull consumer's logger, not this module's: these records are the consumer's, and operators and tests
# pick them by that name, as they did before subscribe mode moved here.
log = logging.getLogger("client.lite_pull_consumer")

# RocketMQ's SubscriptionType: fixed by the first assign()/set_sub_expression_for_assign() or subscribe().
ASSIGN, SUBSCRIBE = "assign", "subscribe"


class LitePullSubscribe:
    """Subscribe mode and the mode choice of a ``LitePullConsumer`` (its base class)."""

    # The consumer's state this half works on, all set by LitePullConsumer.__init__.
    config: LitePullConsumerConfig
    _instance: ClientInstance
    _api: PullAPI
    _offsets: RemoteOffsetStore
    _queues: dict[MessageQueue, _AssignedQueue]
    _paused: set[MessageQueue]
    _subs: dict[str, Subscription]
    _unchecked: dict[str, Subscription]
    _closed: bool
    _mode: str | None
    _lock: trio.Lock
    _rebalance_now: trio.Event
    _commit_now: trio.Event
    _allocate: AllocateStrategy
    _stray_queues: set[MessageQueue]
    _rebalances: int
    _nursery: trio.Nursery
    # Offset resets the brokers told and not yet applied to (or committed over) the queue they name.
    _resets_pending: dict[MessageQueue, int]
    # Each subscribed topic's read queues when it was subscribed (``_created_since_subscribed``).
    _first_queues: dict[str, frozenset[MessageQueue]]
    # and LitePullConsumer's _check_open, _start, _drop, _start_offset, _forget_unassigned and _restart_pulls are
    # called
    client_id: str

    # -- subscribe mode -------------------------------------------------------------------------------------------
    async def subscribe(self, topic: str, expression: str | MessageSelector = "*") -> None:
        """Join the group as a member consuming ``topic`` with ``expression`` (a tag expression or
        ``MessageSelector.by_sql(...)``; RocketMQ's DefaultLitePullConsumer.subscribe): a heartbeat tells the
        brokers, and a rebalance takes this member's share of the topic's queues, their starts found (and committed,
        if from ``consume_from_where``), before this returns. A topic already subscribed takes ``expression`` at
        once: its pulls in flight (long polls held on the broker with the old one) are cancelled and sent again with
        it; what is cached already stays. A SQL92 expression is first checked with a node of each broker group
        serving the topic: ``SubscriptionRefusedError`` (nothing changed) if one refuses it. ``RuntimeError`` in
        assign mode; ``ValueError`` for a bad topic or expression."""
        self._check_open("subscribe")
        self._check_mode(SUBSCRIBE, f"subscribe({topic!r})")
        # RocketMQ's subVersion, the time: the brokers keep the group's newest subscription of each topic.
        sub = parse_subscription(topic, expression, sub_version=now_ms())
        checked = await self._api.check_subscription(sub)  # refused: raises, before anything changes
        async with self._lock:
            self._check_open("subscribe")
            self._claim_mode(SUBSCRIBE, f"subscribe({topic!r})")
            old = self._subs.get(topic)
            self._subs[topic] = sub
            self._restart_pulls(topic, old, sub)
            if checked:
                self._unchecked.pop(topic, None)
            else:
                self._unchecked[topic] = sub  # no route yet: the next poll asks
            try:
                # Its route names the broker nodes the heartbeat must reach, and the queues that were there before
                # the subscription (kept from the first subscribe of the topic).
                route = await self._instance.routes.get(topic)
            except RaftMQError as e:
                log.warning("no route for subscribed topic yet topic=%s error=%s", topic, e)
                # Not when a name server the lookup cut short may know it (as the push consumer's).
                if getattr(e, "topic_unknown", False) and getattr(e, "unknown_for_sure", True):
                    self._first_queues.setdefault(topic, frozenset())
            else:
                self._first_queues.setdefault(topic, frozenset(route.read_queues()))
        log.info("subscribed group=%s topic=%s type=%s expression=%s was=%s", self.config.consumer_group, topic,
                 sub.expression_type, sub.expression, old.expression if old is not None else None)
        await self._instance.send_heartbeat_to_all()
        if old is None:
            await self._rebalance_now_or_later()

    async def unsubscribe(self, topic: str) -> None:
        """Stop consuming ``topic``: its queues stop prefetching, drop their cache and have their stored offsets
        committed (what ``commit`` or auto-commit took; messages polled since come again to whoever takes the
        queue), and a heartbeat tells the brokers. The consumer stays a member of its group. ``ValueError`` for a
        topic not subscribed; ``RuntimeError`` in assign mode."""
        self._check_open("unsubscribe")
        self._check_mode(SUBSCRIBE, f"unsubscribe({topic!r})")
        async with self._lock:
            self._check_open("unsubscribe")
            if self._mode != SUBSCRIBE or topic not in self._subs:
                subscribed = ", ".join(map(repr, sorted(self._subs))) or "none"
                raise ValueError(f"topic {topic!r} is not subscribed (subscribed: {subscribed})")
            del self._subs[topic]
            self._unchecked.pop(topic, None)
            self._first_queues.pop(topic, None)
            await self._take_away(sorted(mq for mq in self._queues if mq.topic == topic))
        log.info("unsubscribed group=%s topic=%s", self.config.consumer_group, topic)
        await self._instance.send_heartbeat_to_all()

    def subscriptions(self) -> dict[str, str | MessageSelector]:
        """Subscribe mode: each subscribed topic's tag expression or ``MessageSelector.by_sql``; else empty."""
        if self._mode != SUBSCRIBE:
            return {}
        return {t: MessageSelector.by_sql(s.expression) if s.expression_type == SQL92 else s.expression
                for t, s in sorted(self._subs.items())}

    def trigger_rebalance(self) -> None:
        """Rebalance at once rather than at the next ``rebalance_interval_ms`` (NOTIFY_CONSUMER_IDS_CHANGED)."""
        self._rebalance_now.set()

    async def serve_rebalance(self) -> None:
        """Subscribe mode: rebalance every ``rebalance_interval_ms`` and when asked (``trigger_rebalance``)."""
        while True:
            with trio.move_on_after(self.config.rebalance_interval_ms / 1000):
                await self._rebalance_now.wait()
            self._rebalance_now = trio.Event()
            await self._rebalance_now_or_later()

    async def _rebalance_now_or_later(self) -> None:
        try:
            await self.rebalance()
        except RaftMQError as e:
            log.info("rebalance failed group=%s error=%s", self.config.consumer_group, e)  # the next one tries again

    async def rebalance(self) -> None:
        """Subscribe mode: share each subscribed topic's readable queues out among the group's members by
        ``allocate_strategy``, drop the queues gone to others (their stored offsets committed first) and start the
        new ones (each from the group's committed offset, else ``consume_from_where``, that start committed at
        once: ``_start_offset``). Assign mode: nothing."""
        async with self._lock:
            if self._mode != SUBSCRIBE:
                return
            group = self.config.consumer_group
            for topic in list(self._subs):
                if self._closed:
                    return
                try:
                    route = await self._instance.routes.get(topic)
                except RaftMQError as e:
                    log.info("rebalance skipped topic=%s error=%s", topic, e)
                    continue
                mqs = route.read_queues()
                # Its route could not be read when subscribed (a name server down, not "unknown"): these queues,
                # the first known, were there before the subscription as far as anyone can tell.
                self._first_queues.setdefault(topic, frozenset(mqs))
                cids = await member_ids(self._instance, group, topic, self.client_id)
                if not cids:
                    log.info("no group members known yet group=%s topic=%s", group, topic)
                    continue
                wanted = allocate_share(self._allocate, group, self.client_id, topic, mqs, cids,
                                        warned=self._stray_queues, log=log, strategy_name=self.config.allocate_strategy)
                if wanted is None or self._closed:
                    continue
                current = [mq for mq in self._queues if mq.topic == topic]
                diff = diff_assignment(current, wanted)
                if not diff.changed:
                    continue
                self._rebalances += 1
                log.info("rebalance group=%s topic=%s client=%s added=%d removed=%d now=%d", group, topic,
                         self.client_id, len(diff.added), len(diff.removed),
                         len(current) - len(diff.removed) + len(diff.added))
                await self._take_away(diff.removed)
                starts = await self._start_offsets(diff.added)
                for mq in diff.added:
                    if not self._closed and mq not in self._queues:
                        self._start(mq, starts.get(mq))

    async def _take_away(self, queues: Sequence[MessageQueue]) -> None:
        """Stop consuming ``queues``, commit their stored offsets, so whoever takes them next starts there, and
        forget them whether or not the commit was taken (as RocketMQ's removeUnnecessaryMessageQueue: persist, then
        removeOffset; and as the push consumer's ``_remove_queue``)."""
        for mq in queues:
            aq = self._queues.pop(mq, None)
            if aq is not None:
                self._drop(aq)
            self._paused.discard(mq)
        if not queues:
            return
        try:
            await self._commit_leaving(queues)
        finally:
            # Kept to be sent again, a commit the leader did not take (it was moving) went out later from
            # serve_commits for a queue another member consumes now, and set that member's progress back; and were
            # the queue given back, it restarted from the stale value rather than the group's offset.
            for mq in queues:
                if mq not in self._queues:
                    self._offsets.remove(mq)
            self._forget_unassigned()

    # -- offset resets --------------------------------------------------------------------------------------------
    def offsets_reset(self, consumer_group: str, topic: str, broker_name: str, offsets: dict[int, int]) -> None:
        """The broker reset the group's offsets of ``topic`` on ``broker_name`` (``raftmq admin reset-offset``,
        ``clone-group-offset``; RESET_CONSUMER_CLIENT_OFFSET). Subscribe mode: the queues this member holds seek
        there (``_reset_queues``). Noted at once, before that runs under the consumer's lock: a queue given up
        meanwhile (a rebalance holding the lock, close) commits the reset offset, not its stored offset
        (``_commit_leaving``). Assign mode joins no group, and a broker never tells it."""
        if consumer_group != self.config.consumer_group or self._mode != SUBSCRIBE:
            return
        resets = {MessageQueue(topic, broker_name, q): o for q, o in offsets.items()}
        self._resets_pending.update(resets)  # also while closing: close's commits are maybe on their way
        if not self._closed:
            self._nursery.start_soon(self._reset_queues, resets)

    async def _reset_queues(self, resets: dict[MessageQueue, int]) -> None:
        # As the push consumer's (RocketMQ's resetOffset): what is cached of the queue is dropped and its next pull
        # and poll start at the new offset, as after a seek (no bounds asked: the broker has just checked them),
        # and the offset is stored and committed at once: the next auto-commit stores the position, the new offset
        # until poll hands out more, and a commit of an older one already on its way cannot stay the last word.
        async with self._lock:
            for mq, offset in sorted(resets.items()):
                if self._closed:
                    return  # close commits the pending resets of its queues
                if self._resets_pending.get(mq) == offset:
                    del self._resets_pending[mq]
                aq = self._queues.get(mq)
                if aq is None:
                    continue  # another member's queue (it resets its own), or one given up under this lock
                self._drop(aq)
                self._start(mq, offset)
                self._offsets.update(mq, offset)
                log.info("offset reset group=%s mq=%s offset=%d", self.config.consumer_group, mq, offset)
                await self._offsets.persist(mq)

    async def _commit_leaving(self, queues: Sequence[MessageQueue] | None = None) -> int:
        """Commit the stored offsets not committed yet (of ``queues``, given up; None: every one, on close); returns
        how many failed. A reset told for one of them and not applied yet wins over its stored offset: the reset
        offset is committed instead, and the commits are sent again when a reset is told while they are on their
        way (the broker may have taken them after its reset, which it set before telling)."""
        while True:
            named = list(self._offsets.snapshot()) if queues is None else queues
            resets = {mq: self._resets_pending[mq] for mq in named if mq in self._resets_pending}
            for mq, offset in resets.items():
                self._offsets.update(mq, offset)
            failed = await self._offsets.persist_all(queues)
            if all(self._resets_pending.get(mq) == resets.get(mq) for mq in named):
                return failed

    async def _start_offsets(self, queues: Sequence[MessageQueue]) -> dict[MessageQueue, int]:
        """Where each new queue starts, found and committed before the rebalance returns, so ``subscribe`` from the
        last offset misses nothing sent after it returned, even should the member go before its first commit, and a
        queue that appeared after it (``_created_since_subscribed``) nothing at all. One not found now is left to
        its prefetch task, which retries."""
        if not queues or self._closed:
            return {}
        return await find_start_offsets(queues, self._start_offset, log)

    def _created_since_subscribed(self, mq: MessageQueue) -> bool:
        """Whether ``mq`` is not among its topic's read queues when the topic was subscribed (none if no name
        server knew the topic): a new topic, or queues added to it. All it holds was sent after the subscription,
        so from the last offset it starts at its min offset, as the push consumer's: from its max offset, whatever
        was sent to it before a rebalance found it was never consumed. Assign mode: never."""
        return mq not in self._first_queues.get(mq.topic, (mq,))

    async def _commit_start(self, mq: MessageQueue, offset: int) -> None:
        """Commit ``offset``, where ``mq`` starts from ``consume_from_where`` (the group has no offset for it),
        before its first pull, as the push consumer's ``_compute_pull_from``: until the group has an offset, each
        start is found again, and from the last offset that is the queue's end at that moment. A member gone before
        its first commit (or, committing by hand, with none), or a queue moved to another member before it, skipped
        every message stored in between. A commit not taken is sent again by ``serve_commits``."""
        self._offsets.update(mq, offset)
        if not await self._offsets.persist(mq):
            self._commit_now.set()

    def _heartbeat_data(self) -> dict[str, Any]:
        if self._mode != SUBSCRIBE:
            return {}  # send_heartbeat sends nothing
        # CONSUME_ACTIVELY (RocketMQ's "PULL"): the application pulls; CLUSTERING, the only model offered here. No
        # retry topic: a lite pull consumer sends nothing back (as RocketMQ's, which does not subscribe to it).
        return consumer_heartbeat_data(self.config.consumer_group, "CONSUME_ACTIVELY", "CLUSTERING",
                                       self.config.consume_from_where, self._subs.values())

    # -- mode -----------------------------------------------------------------------------------------------------
    def _check_mode(self, mode: str, what: str) -> None:
        if self._mode is not None and self._mode != mode:
            raise RuntimeError(f"{what}: this lite pull consumer of group {self.config.consumer_group!r} is in "
                               f"{self._mode} mode, and assign and subscribe are mutually exclusive (as RocketMQ's); "
                               f"open another consumer for {mode} mode")

    def _claim_mode(self, mode: str, what: str) -> None:
        self._check_mode(mode, what)
        self._mode = mode
