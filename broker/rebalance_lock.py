"""RocketMQ's RebalanceLockManager: which member of a consumer group holds each queue, for orderly consumption.

An orderly consumer (``open_push_consumer(..., orderly=True)``) consumes a queue only while it holds the queue's
lock on the queue's broker group (LOCK_BATCH_MQ, renewed every ``rebalance_lock_interval_ms``) and gives it back
(UNLOCK_BATCH_MQ) only once its last message is handled and its offset committed. Members compute the queue
allocation each on its own, at their own moments, so around a join or a leave two of them may want one queue at
once; the lock lets only one consume it, and the next one starts where the last committed.

The rules, per (consumer_group, topic, queue_id):

- A lock names the client id holding it, and lives ``max_live_time_ms`` after the holder's last request for it
  (the acquisition or a renewal). Past that it has *lapsed*: whoever asks next gets it. A member killed without
  unlocking therefore holds its queues that long (RocketMQ's ``rebalanceLockMaxLiveTime``, 60 s).
- The holder's request renews its lock, lapsed or not (no one else has taken it); another client's live lock is
  refused; a queue with no live holder is granted.
- Only a change of holder is replicated (``BrokerNode.lock_queues`` replicates it before it answers, an unlock
  too), renewals stay in the leader's memory. When a node's term as leader starts, it restores the replicated
  holders, each as if renewed that moment: a holder goes on consuming through a failover (its next renewal finds
  it holding), and no other member gets its queues before the holder has been silent for a whole life *on this
  leader*. RocketMQ keeps locks in the master's memory only, so a new master grants every queue at once, to
  whoever asks first, while the old holders still consume.

This module is sans-IO (the clock is injected); the node adds the replication and the leader's term.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

__all__ = ["RebalanceLockManager", "LockPlan", "QueueKey"]

log = logging.getLogger(__name__)

QueueKey = tuple[str, int]  # (topic, queue_id)


@dataclasses.dataclass(slots=True)
class _LockEntry:
    client_id: str
    last_update_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class LockPlan:
    """What a lock request gets: ``held`` were the client's already (now renewed), ``free`` have no live holder
    (the client's once the change is replicated: ``grant``), ``refused`` are another client's."""

    held: tuple[QueueKey, ...]
    free: tuple[QueueKey, ...]
    refused: tuple[QueueKey, ...]


class RebalanceLockManager:
    def __init__(self, max_live_time_ms: int = 60_000, *, clock: Callable[[], float] = time.monotonic) -> None:
        if max_live_time_ms <= 0:
            raise ValueError(f"max_live_time_ms must be > 0, got {max_live_time_ms}")
        self.max_live_time_ms = max_live_time_ms
        self._life_s = max_live_time_ms / 1000
        self._clock = clock
        self._groups: dict[str, dict[QueueKey, _LockEntry]] = {}

    def _lapsed(self, entry: _LockEntry, now: float) -> bool:
        return now - entry.last_update_s > self._life_s

    def plan(self, consumer_group: str, client_id: str, queues: Iterable[QueueKey]) -> LockPlan:
        """Renew ``client_id``'s locks among ``queues`` and sort the others into free and refused."""
        now = self._clock()
        table = self._groups.get(consumer_group, {})
        held, free, refused = [], [], []
        for queue in sorted(set(queues)):
            entry = table.get(queue)
            if entry is not None and entry.client_id == client_id:
                entry.last_update_s = now
                held.append(queue)
            elif entry is None or self._lapsed(entry, now):
                free.append(queue)
            else:
                refused.append(queue)
        if refused:
            # DEBUG: a member waiting for a killed one's locks to lapse asks every half second.
            log.debug("queue locks refused consumer_group=%s client_id=%s queues=%s", consumer_group, client_id,
                     ", ".join(f"{t}:{q}@{table[(t, q)].client_id}" for t, q in refused[:8]))
        return LockPlan(tuple(held), tuple(free), tuple(refused))

    def grant(self, consumer_group: str, client_id: str, queues: Iterable[QueueKey]) -> None:
        """``client_id`` holds ``queues`` from now (their change of holder is replicated)."""
        now = self._clock()
        table = self._groups.setdefault(consumer_group, {})
        for queue in queues:
            old = table.get(queue)
            if old is not None and old.client_id != client_id:
                log.info("queue lock lapsed, taken over consumer_group=%s topic=%s queue_id=%d from=%s to=%s",
                         consumer_group, queue[0], queue[1], old.client_id, client_id)
            table[queue] = _LockEntry(client_id, now)

    def held_by(self, consumer_group: str, client_id: str, queues: Iterable[QueueKey]) -> list[QueueKey]:
        """Which of ``queues`` name ``client_id`` as holder, lapsed or not: what its unlock releases."""
        table = self._groups.get(consumer_group, {})
        return sorted(q for q in set(queues) if (e := table.get(q)) is not None and e.client_id == client_id)

    def release(self, consumer_group: str, client_id: str, queues: Iterable[QueueKey]) -> list[QueueKey]:
        """Remove ``client_id``'s locks among ``queues``; another client's are left alone. Returns those removed."""
        mine = self.held_by(consumer_group, client_id, queues)
        table = self._groups.get(consumer_group)
        if table is not None:
            for queue in mine:
                del table[queue]
            if not table:
                del self._groups[consumer_group]
        return mine

    def holder(self, consumer_group: str, queue: QueueKey) -> str | None:
        """The client holding ``queue`` now, None if no one does (never locked, unlocked, or lapsed)."""
        entry = self._groups.get(consumer_group, {}).get(queue)
        return entry.client_id if entry is not None and not self._lapsed(entry, self._clock()) else None

    def take_lapsed(self) -> list[tuple[str, QueueKey]]:
        """Forget the locks that have lapsed, returning them, so the table does not keep every queue a member
        killed long ago once held."""
        now = self._clock()
        gone = []
        for group, table in list(self._groups.items()):
            for queue, entry in list(table.items()):
                if self._lapsed(entry, now):
                    del table[queue]
                    gone.append((group, queue))
            if not table:
                del self._groups[group]
        return gone

    def restore(self, holders: Iterable[tuple[str, str, int, str]]) -> None:
        """Replace the table with ``(consumer_group, topic, queue_id, client_id)`` holders, each renewed now."""
        now = self._clock()
        self._groups = {}
        for group, topic, queue_id, client_id in holders:
            self._groups.setdefault(group, {})[(topic, queue_id)] = _LockEntry(client_id, now)

    def __len__(self) -> int:
        return sum(len(table) for table in self._groups.values())
