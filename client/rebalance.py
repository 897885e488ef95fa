"""Queue allocation across the members of a consumer group (clustering mode).

Every member computes the same answer on its own from the same two sorted lists (all queues of the topic, all
client ids of the group), so no coordinator is needed; members that briefly disagree (one has seen a join, the
other not yet) may both pull a queue for a moment, which at-least-once delivery tolerates. The strategy is
RocketMQ's ``AllocateMessageQueueAveragely``: contiguous blocks, the first ``len(queues) % len(members)``
members take one extra queue.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from client.message import MessageQueue

__all__ = ["allocate_average", "RebalanceDiff", "diff_assignment"]


def allocate_average(consumer_group: str, current_client_id: str, queues: Iterable[MessageQueue],
                     client_ids: Iterable[str]) -> list[MessageQueue]:
    """The queues ``current_client_id`` should consume. Both inputs are sorted here, so callers may pass any
    order; a client id missing from ``client_ids`` (heartbeat not seen yet) gets nothing."""
    if not current_client_id:
        raise ValueError(f"consumer group {consumer_group!r}: current client id must not be empty")
    mq_all = sorted(set(queues))
    cid_all = sorted(set(client_ids))
    if not mq_all or current_client_id not in cid_all:
        return []
    index = cid_all.index(current_client_id)
    n_mq, n_cid = len(mq_all), len(cid_all)
    mod = n_mq % n_cid
    if n_mq <= n_cid:
        average = 1
    elif mod > 0 and index < mod:
        average = n_mq // n_cid + 1
    else:
        average = n_mq // n_cid
    start = index * average if mod > 0 and index < mod else index * average + mod
    count = min(average, n_mq - start)
    return [mq_all[(start + i) % n_mq] for i in range(max(count, 0))]


@dataclasses.dataclass(frozen=True, slots=True)
class RebalanceDiff:
    added: tuple[MessageQueue, ...]
    removed: tuple[MessageQueue, ...]

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed)


def diff_assignment(current: Iterable[MessageQueue], wanted: Sequence[MessageQueue]) -> RebalanceDiff:
    cur, want = set(current), set(wanted)
    return RebalanceDiff(tuple(sorted(want - cur)), tuple(sorted(cur - want)))
