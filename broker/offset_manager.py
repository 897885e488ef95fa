"""Consumer offsets: RocketMQ's ConsumerOffsetManager, replicated through the group and batched.

Consumers commit offsets often (every pull carries ``commit_offset``, plus a periodic UPDATE_CONSUMER_OFFSET), and a
Raft proposal per commit would cost more than the messages themselves. So the leader keeps the newest offset per
(consumer_group, topic, queue_id) in a *pending* map and proposes the whole map as one metadata command every
``consumer_offset_flush_interval_ms``; every node applies that command to its *committed* table. Queries on the
leader read pending first, so a consumer always sees its own last commit; consumers ask only the leader (a
follower's committed table may be behind: GET_CONSUME_STATS shows it). Losing the pending map when a leader dies
costs re-consumption of at most one interval of messages, which RocketMQ's at-least-once contract already allows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)

OffsetKey = tuple[str, str, int]  # (consumer_group, topic, queue_id)


def consumer_lag(broker_offset: int, min_offset: int, consumer_offset: int | None) -> int:
    """Messages still stored in a queue that a group has not consumed: none before the queue's min offset (retention
    removed them), all of those kept when the group committed nothing (None)."""
    start = min_offset if consumer_offset is None else max(consumer_offset, min_offset)
    return max(0, broker_offset - start)


class ConsumerOffsetTable:
    """``read_committed(group, topic, queue_id)`` and ``read_group(group)``, when given, read the committed
    offsets from the replicated metadata directly (the broker node's case); without them the table keeps its own
    committed map."""

    def __init__(self, read_committed: Callable[[str, str, int], int | None] | None = None,
                 read_group: Callable[[str], dict[tuple[str, int], int]] | None = None) -> None:
        self._read_committed = read_committed
        self._read_group = read_group
        self._committed: dict[OffsetKey, int] = {}
        self._pending: dict[OffsetKey, int] = {}
        # Taken by a flush and not applied yet: still what queries answer, else a consumer asking while its last
        # commit is being replicated got the offset before it (a test saw 2 after committing 4).
        self._flushing: dict[OffsetKey, int] = {}

    # --- leader side: collect, then hand a batch to replication -------------------------------------------
    def commit(self, consumer_group: str, topic: str, queue_id: int, offset: int) -> None:
        self._pending[(consumer_group, topic, queue_id)] = offset

    def has_pending(self) -> bool:
        return bool(self._pending)

    def take_pending(self) -> list[tuple[str, str, int, int]]:
        """The pending updates as a command payload; the map is cleared (re-queued by ``requeue`` on failure).
        Queries answer them until ``flushed`` (one flush at a time)."""
        batch = [(g, t, q, o) for (g, t, q), o in self._pending.items()]
        self._flushing = self._pending
        self._pending = {}
        return batch

    def flushed(self) -> None:
        """The batch taken last is applied (the committed table answers for it now), requeued or dropped."""
        self._flushing = {}

    def requeue(self, batch: Iterable[tuple[str, str, int, int]]) -> None:
        """Put back a batch whose proposal failed, unless a newer commit for the same key arrived meanwhile (the
        flush then ends with ``flushed``, as every flush does)."""
        for group, topic, queue_id, offset in batch:
            self._pending.setdefault((group, topic, queue_id), offset)

    def drop_pending(self) -> None:
        """On losing leadership: the new leader's table is the truth from now on."""
        self._pending.clear()
        self._flushing = {}

    # --- every node: apply in log order --------------------------------------------------------------------
    def apply_batch(self, batch: Iterable[Any]) -> None:
        for group, topic, queue_id, offset in batch:
            self._committed[(group, topic, int(queue_id))] = int(offset)

    def apply_delete_topic(self, topic: str) -> None:
        for key in [k for k in self._committed if k[1] == topic]:
            del self._committed[key]
        for pending in (self._pending, self._flushing):
            for key in [k for k in pending if k[1] == topic]:
                del pending[key]

    def apply_delete_group(self, consumer_group: str) -> set[OffsetKey]:
        """Forget ``consumer_group``'s offsets here (committed, pending, being flushed); returns the keys that were
        pending or being flushed (the replicated ones are removed by the caller)."""
        for key in [k for k in self._committed if k[0] == consumer_group]:
            del self._committed[key]
        dropped: set[OffsetKey] = set()
        for pending in (self._pending, self._flushing):
            for key in [k for k in pending if k[0] == consumer_group]:
                del pending[key]
                dropped.add(key)
        return dropped

    # --- reads ---------------------------------------------------------------------------------------------
    def query(self, consumer_group: str, topic: str, queue_id: int) -> int | None:
        key = (consumer_group, topic, queue_id)
        if key in self._pending:
            return self._pending[key]
        if key in self._flushing:
            return self._flushing[key]
        if self._read_committed is not None:
            return self._read_committed(consumer_group, topic, queue_id)
        return self._committed.get(key)

    def offsets_of_group(self, consumer_group: str) -> dict[tuple[str, int], int]:
        """``{(topic, queue_id): offset}`` of one group, its pending commits (on the leader) included."""
        if self._read_group is not None:
            merged = self._read_group(consumer_group)
        else:
            merged = {(t, q): o for (g, t, q), o in self._committed.items() if g == consumer_group}
        for pending in (self._flushing, self._pending):
            merged.update({(t, q): o for (g, t, q), o in pending.items() if g == consumer_group})
        return merged

    def __len__(self) -> int:
        return len(self._committed)

    def snapshot(self) -> list[tuple[str, str, int, int]]:
        return [(g, t, q, o) for (g, t, q), o in self._committed.items()]

    def restore(self, snap: Iterable[Any]) -> None:
        self._committed = {}
        self.apply_batch(snap)

    def restore_mapping(self, snap: Mapping[OffsetKey, int]) -> None:
        self._committed = dict(snap)
