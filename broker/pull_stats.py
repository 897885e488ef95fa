"""Messages pulled per consumer group and topic: over the last minute, the ``consume_tps`` of consumer progress;
since the node started, the ``rocketmq_messages_out_total`` and ``rocketmq_throughput_out_total`` of the metrics.

RocketMQ's consumerProgress reports a group's consume TPS from the broker's per-group pull counters
(``BrokerStatsManager``'s GROUP_GET_NUMS). Here every pull that returns messages adds its count to the current
10-second bucket of its (group, topic); a rate is what the buckets begun in the last minute hold, divided by the
time they span (from the oldest one's start: less than a minute just after a bucket left the window, or for a group
that started pulling a moment ago). The same pull adds its
messages and bytes to the (group, topic)'s totals, which the window does not prune (a counter must not go back).
Two dict lookups per pull, not per message.

Figures are kept only for what the node's tables hold, following the tables as they change on every node (the
topic table and the subscription-group table are replicated, and a follower serves pulls too): a topic deleted takes its
figures (``forget_topics``), and so does a group that leaves the subscription-group table (``groups_changed``,
deleted or gone with a snapshot). A pull of a group the table does not hold (yet) is counted apart, as **pending**:
with auto-create on, any name a client pulls with is served, and on a follower, or on a leader whose auto-creations
are all under way, nothing creates it, so these totals grew with every made-up name. Pending figures are not in
``totals()`` (not exported); once the group's config is applied (``groups_changed``) they are, with the pulls made
before it, so a real group whose first pulls beat its config's replication to this node still shows them. At most
``MAX_PENDING`` (group, topic) pairs are pending at once (a pull of one more is not counted) and each is dropped
``PENDING_S`` after its first pull if its group never came (``prune``).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Collection

__all__ = ["PullStats"]

BUCKET_S = 10.0
WINDOW_S = 60.0
# Pending (group, topic) pairs: pulls of groups the subscription-group table does not hold (module docstring).
MAX_PENDING = 1024
PENDING_S = 60.0


class PullStats:
    def __init__(self, clock: Callable[[], float] = time.monotonic, *, max_pending: int = MAX_PENDING) -> None:
        if max_pending < 0:
            raise ValueError(f"max_pending must be >= 0, got {max_pending}")
        self._clock = clock
        self._max_pending = max_pending
        # (group, topic) -> deque of [bucket start, messages], oldest first
        self._buckets: dict[tuple[str, str], collections.deque[list[float]]] = {}
        self._totals: dict[tuple[str, str], list[int]] = {}  # (group, topic) -> [messages, bytes] since start
        # Pairs of _totals whose group the table did not hold at their first pull -> when that was; oldest first.
        self._pending: dict[tuple[str, str], float] = {}

    def add(self, group: str, topic: str, messages: int, size_bytes: int, *, known: bool = True) -> None:
        """A pull by ``group`` from ``topic`` returned ``messages`` records taking ``size_bytes``; ``known``: the
        node's subscription-group table holds ``group`` (else the figures are pending, module docstring)."""
        now = self._clock()
        key = (group, topic)
        totals = self._totals.get(key)
        if totals is None:
            if not known:
                if len(self._pending) >= self._max_pending:
                    return
                self._pending[key] = now
            totals = self._totals[key] = [0, 0]
        totals[0] += messages
        totals[1] += size_bytes
        buckets = self._buckets.get(key)
        if buckets is None:
            buckets = self._buckets[key] = collections.deque()
        if buckets and now - buckets[-1][0] < BUCKET_S:
            buckets[-1][1] += messages
            return
        buckets.append([now, messages])
        while buckets and now - buckets[0][0] >= WINDOW_S + BUCKET_S:
            buckets.popleft()

    def tps(self, group: str, topic: str) -> float:
        """Messages per second pulled by ``group`` from ``topic`` over the last minute (0 if none)."""
        now = self._clock()
        key = (group, topic)
        buckets = self._buckets.get(key)
        if not buckets:
            return 0.0
        recent = 0
        oldest = now
        for start, count in buckets:
            if now - start < WINDOW_S:
                recent += count
                oldest = min(oldest, start)
        # Over the time the kept buckets span, not a full minute: a bucket that began 60 s ago is dropped whole
        # (its last seconds fall inside the minute), and divided by 60 s a steady rate read up to 1/6 low, in a
        # 10-second saw-tooth. A group that started a moment ago: at least a second.
        return recent / max(1.0, now - oldest)

    def totals(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(group, topic): (messages, bytes)}`` pulled since the node started, of the groups the table holds
        (pending figures left out)."""
        pending = self._pending
        return {key: (messages, size) for key, (messages, size) in self._totals.items() if key not in pending}

    def forget_topics(self, gone: Callable[[str], bool]) -> None:
        """Drop every figure of a topic for which ``gone(topic)`` holds (deleted): with topics created and deleted
        by the thousand, the totals would grow for as long as the process runs."""
        for key in [k for k in self._totals if gone(k[1])]:
            self._drop(key)

    def groups_changed(self, held: Callable[[str], bool], gone: Collection[str]) -> None:
        """The node applied a change of its subscription-group table, which now holds the groups for which
        ``held(group)`` holds: every figure of the groups ``gone`` (no longer in it) is dropped, in one walk however
        many went at once (a snapshot load), and the pending figures of groups it holds now count as any group's,
        with the pulls made before (a walk of the pending ones only, at most ``max_pending``)."""
        if gone:
            for key in [k for k in self._totals if k[0] in gone]:
                self._drop(key)
        for key in [k for k in self._pending if held(k[0])]:
            del self._pending[key]

    def prune(self) -> None:
        """Forget groups that pulled nothing for a whole window, and the pending figures of groups that did not
        come within ``PENDING_S`` (called now and then, not per pull)."""
        now = self._clock()
        for key in [k for k, b in self._buckets.items() if not b or now - b[-1][0] >= WINDOW_S + BUCKET_S]:
            del self._buckets[key]
        expired = []
        for key, first_pull in self._pending.items():  # oldest first: stops at the first one still young
            if now - first_pull < PENDING_S:
                break
            expired.append(key)
        for key in expired:
            self._drop(key)

    def _drop(self, key: tuple[str, str]) -> None:
        del self._totals[key]
        self._pending.pop(key, None)
        self._buckets.pop(key, None)
