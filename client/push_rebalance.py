"""The push consumer's membership of its group: what it subscribes to and which queues it holds (RocketMQ's
RebalancePushImpl, with the subscription table its RebalanceImpl keeps).

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
- **Offset resets** (``raftmq admin reset-offset``, ``clone-group-offset``): the broker sets the offsets, then tells
  every online member; each drops the named queues it holds, commits the new offsets at once and pulls from them.
  A reset wins over the position of a queue this member is giving up (taken away, unsubscribed, its lock lost, or
  closing: ``_commit_leaving``): the reset offset is committed instead of the position, also when the reset is told
  while that commit is on its way (the broker may have taken it after the reset), so the next holder starts at the
  reset offset. An orderly queue whose handler still finishes a message when told commits the reset offset on
  release, once the handler is done.

``PushRebalance`` is a base class of ``client.push_consumer.PushConsumer``, not an object of its own: it works on
the consumer's queues, subscriptions, lock and offset store (declared below), which the pull loop reads on every
pull; a separate object would cost it an attribute lookup each time, or have to hold the same state twice. It is
apart from ``client/push_consumer.py`` because it changes what is consumed and never consumes: it runs at open, on
a timer, on the brokers' notices and in ``subscribe``/``unsubscribe``, and hands each queue it starts to
``PushConsumer._add_queue``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

from client.errors import SubscriptionRefusedError
from client.filter import SQL92, MessageSelector, Subscription, parse_subscription
from client.instance import ClientInstance, now_ms
from client.message import MessageQueue
from client.offset_store import RemoteOffsetStore
from client.process_queue import ProcessQueue
from client.pull_consumer import PullAPI
from client.rebalance import (AllocateStrategy, allocate_share, consumer_heartbeat_data, diff_assignment,
                              find_consumer_ids, find_start_offsets, member_ids)
from remoting.errors import RaftMQError

if TYPE_CHECKING:
    from client.orderly import OrderlyService
    from client.push_consumer_config import PushConsumerConfig

__all__ = ["PushRebalance", "LOCK_RETRY_S"]

# The push consumer's logger, not this module's: these records are the consumer's, and operators and tests pick
# them by that name, as they did before the rebalance moved here.
log = logging.getLogger("client.push_consumer")

# A queue another member still holds is asked for again this soon (RocketMQ's rebalanceLater(500)).
LOCK_RETRY_S = 0.5


class PushRebalance:
    """Subscriptions, rebalance, start offsets and offset resets of a ``PushConsumer`` (its base class)."""

    # The consumer's state this half works on, all set by PushConsumer.__init__.
    config: PushConsumerConfig
    _instance: ClientInstance
    _api: PullAPI
    _subs: dict[str, Subscription]
    _retry_topic: str | None
    _offsets: Any  # RemoteOffsetStore, or a BROADCASTING member's LocalFileOffsetStore
    _pqs: dict[MessageQueue, ProcessQueue]
    _lock: trio.Lock
    _rebalance_now: trio.Event
    _rebalances: int
    _nursery: trio.Nursery | None
    _closing: bool
    _pull_scopes: dict[trio.CancelScope, str]
    _first_queues: dict[str, frozenset[MessageQueue]]
    _allocate: AllocateStrategy
    _stray_queues: set[MessageQueue]
    _unchecked: dict[str, Subscription]
    _orderly: OrderlyService | None
    # Offset resets told (offsets_reset) and not yet applied to, or committed over, the queue they name.
    _resets_pending: dict[MessageQueue, int]
    client_id: str  # and PushConsumer's _check_open, _add_queue and _flush_offset are called

    # -- subscriptions --------------------------------------------------------------------------------------------
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

    # -- rebalance ------------------------------------------------------------------------------------------------
    async def _note_first_queues(self, topic: str) -> None:
        """Remember the read queues ``topic``'s route has as it is subscribed (``_compute_pull_from``)."""
        try:
            route = await self._instance.routes.get(topic)
        except RaftMQError as e:
            # Subscribing before the topic exists is allowed: the periodic rebalance picks it up. The retry
            # topic exists only once a member sent a message back.
            log.log(logging.INFO if topic == self._retry_topic else logging.WARNING,
                    "no route for subscribed topic yet topic=%s error=%s", topic, e)
            # Not when a name server the route lookup cut short may know it (NoRouteError.unknown_for_sure): the
            # next rebalance takes the queues it finds as those of before the subscription.
            if getattr(e, "topic_unknown", False) and getattr(e, "unknown_for_sure", True):
                self._first_queues[topic] = frozenset()
        else:
            self._first_queues[topic] = frozenset(route.read_queues())

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
                    cids = await member_ids(self._instance, self.config.consumer_group, topic, self.client_id)
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
        await self._commit_leaving([mq])
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
        if not queues or self._closing:
            return {}
        return await find_start_offsets(queues, self._compute_pull_from, log)

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

    # -- offset resets --------------------------------------------------------------------------------------------
    def offsets_reset(self, consumer_group: str, topic: str, broker_name: str, offsets: dict[int, int]) -> None:
        """The broker reset the group's offsets of ``topic`` on ``broker_name`` (``raftmq admin reset-offset``,
        ``clone-group-offset``). Noted at once, before the reset runs under the consumer's lock: a queue given up
        meanwhile (a rebalance holding the lock, an orderly release, close) commits the reset offset, not its
        position (``_commit_leaving``)."""
        if consumer_group != self.config.consumer_group or self._nursery is None:
            return
        # Any topic, not only those subscribed: an unsubscribed topic's queues may still be on their way out.
        resets = {MessageQueue(topic, broker_name, q): o for q, o in offsets.items()}
        self._resets_pending.update(resets)
        self._nursery.start_soon(self._reset_queues, resets)

    def reset_settled(self, mq: MessageQueue, offset: int | None = None) -> None:
        """``mq``'s pending reset (to ``offset``; None: whichever) is applied or committed: forget it."""
        if offset is None or self._resets_pending.get(mq) == offset:
            self._resets_pending.pop(mq, None)

    async def _commit_leaving(self, queues: Sequence[MessageQueue], *, dirty_only: bool = False) -> int:
        """Commit the offsets of ``queues``, which this member gives up (taken away, or on close; their positions
        flushed to the offset store already), so whoever consumes them next starts there: each one (``dirty_only``:
        those not committed yet). Returns how many commits failed. A reset told for one of them and not applied yet
        wins over its position: the reset offset is committed instead, and the commits are sent again when a reset
        is told while they are on their way (the broker may have taken them after its reset, which it set before
        telling): a position from before a reset is never the last word."""
        while True:
            resets = {mq: self._resets_pending[mq] for mq in queues if mq in self._resets_pending}
            for mq, offset in resets.items():
                self._offsets.update(mq, offset)  # also back: the reset may move the group back
            if dirty_only:
                failed = await self._offsets.persist_all(queues)
            else:
                failed = 0
                for mq in queues:
                    failed += not await self._offsets.persist(mq)
            if all(self._resets_pending.get(mq) == resets.get(mq) for mq in queues):
                return failed

    async def _reset_queues(self, offsets: dict[MessageQueue, int]) -> None:
        # RocketMQ's resetOffset: drop the queue (its pull, its cached messages, its handler), store the new offset
        # and pull again from it. The new offset is committed at once, so a commit of the old position that was
        # already on its way to the broker cannot stay the last word.
        async with self._lock:
            for mq, offset in sorted(offsets.items()):
                if self._closing:
                    return  # close commits the pending resets of its queues (_commit_leaving)
                pq = self._pqs.pop(mq, None)
                if pq is None:
                    # An orderly queue being released commits the reset when its handler is done (and forgets
                    # it then); a concurrent one taken away did under this lock; another member's resets its own.
                    if self._orderly is None or mq not in self._orderly.releasing:
                        self.reset_settled(mq, offset)
                    continue
                self.reset_settled(mq, offset)
                # Orderly: the handler stops too, and the queue keeps its lock for the new start (no commit of the
                # old position, no unlock).
                pq.reset = True
                pq.handler_scope.cancel()
                pq.drop()
                self._offsets.update(mq, offset)
                log.info("offset reset group=%s mq=%s offset=%d", self.config.consumer_group, mq, offset)
                await self._offsets.persist(mq)
                self._add_queue(mq, after=pq)
