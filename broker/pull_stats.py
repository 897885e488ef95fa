"""Messages pulled per consumer group and topic: over the last minute, the ``consume_tps`` of consumer progress;
since the node started, the ``rocketmq_messages_out_total`` and ``rocketmq_throughput_out_total`` of the metrics.

RocketMQ's consumerProgress reports a group's consume TPS from the broker's per-group pull counters
(``BrokerStatsManager``'s GROUP_GET_NUMS). Here every pull that returns messages adds its count to the current
10-second bucket of its (group, topic); a rate is what the buckets of the last minute hold, divided by the
time they span (less than a minute for a group that started pulling a moment ago). The same pull adds its
messages and bytes to the (group, topic)'s totals, which are never pruned (a counter must not go back). Two dict
lookups per pull, not per message.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

__all__ = ["PullStats"]

BUCKET_S = 10.0
WINDOW_S = 60.0


class PullStats:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # (group, topic) -> deque of [bucket start, messages], oldest first; plus when counting began
        self._buckets: dict[tuple[str, str], collections.deque[list[float]]] = {}
        self._since: dict[tuple[str, str], float] = {}
        self._totals: dict[tuple[str, str], list[int]] = {}  # (group, topic) -> [messages, bytes] since start

    def add(self, group: str, topic: str, messages: int, size_bytes: int) -> None:
        """A pull by ``group`` from ``topic`` returned ``messages`` records taking ``size_bytes``."""
        now = self._clock()
        key = (group, topic)
        totals = self._totals.get(key)
        if totals is None:
            totals = self._totals[key] = [0, 0]
        totals[0] += messages
        totals[1] += size_bytes
        buckets = self._buckets.get(key)
        if buckets is None:
            buckets = self._buckets[key] = collections.deque()
            self._since[key] = now
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
        recent = sum(count for start, count in buckets if now - start < WINDOW_S)
        span = min(WINDOW_S, max(1.0, now - self._since[key]))
        return recent / span

    def totals(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(group, topic): (messages, bytes)}`` pulled since the node started."""
        return {key: (messages, size) for key, (messages, size) in self._totals.items()}

    def forget_topics(self, gone: Callable[[str], bool]) -> None:
        """Drop every figure of a topic for which ``gone(topic)`` holds (deleted): with topics created and deleted
        by the thousand, the totals would grow for as long as the process runs."""
        for key in [k for k in self._totals if gone(k[1])]:
            del self._totals[key]
            self._buckets.pop(key, None)
            self._since.pop(key, None)

    def prune(self) -> None:
        """Forget groups that pulled nothing for a whole window (called now and then, not per pull)."""
        now = self._clock()
        for key in [k for k, b in self._buckets.items() if not b or now - b[-1][0] >= WINDOW_S + BUCKET_S]:
            del self._buckets[key]
            del self._since[key]
