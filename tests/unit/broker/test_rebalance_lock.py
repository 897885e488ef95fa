"""The queue locks of orderly consumers (RocketMQ's RebalanceLockManager), on a clock the tests move."""

from __future__ import annotations

import pytest

from broker.rebalance_lock import RebalanceLockManager


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _manager(life_ms: int = 60_000) -> tuple[RebalanceLockManager, Clock]:
    clock = Clock()
    return RebalanceLockManager(life_ms, clock=clock), clock


def _lock(locks: RebalanceLockManager, group: str, client: str, *queues: tuple[str, int]) -> list[tuple[str, int]]:
    """A lock request as the node serves it: renewals and grants (replication left out)."""
    plan = locks.plan(group, client, queues)
    locks.grant(group, client, plan.free)
    return sorted(plan.held + plan.free)


def test_a_free_queue_is_granted_and_another_clients_live_lock_is_refused():
    locks, _ = _manager()
    assert _lock(locks, "cg", "c1", ("T", 0), ("T", 1)) == [("T", 0), ("T", 1)]
    plan = locks.plan("cg", "c2", [("T", 1), ("T", 2)])
    assert plan.held == () and plan.free == (("T", 2),) and plan.refused == (("T", 1),)
    assert locks.holder("cg", ("T", 1)) == "c1"
    # Groups are apart: the same queue in another group is another lock.
    assert _lock(locks, "other", "c2", ("T", 1)) == [("T", 1)]


def test_a_lock_lapses_a_whole_life_after_its_last_request_and_a_renewal_keeps_it():
    locks, clock = _manager(60_000)
    _lock(locks, "cg", "c1", ("T", 0))
    clock.now += 59.0
    assert locks.plan("cg", "c2", [("T", 0)]).refused == (("T", 0),)
    assert _lock(locks, "cg", "c1", ("T", 0)) == [("T", 0)]  # renewed at 59 s: good until 119 s
    clock.now += 60.0
    assert locks.holder("cg", ("T", 0)) == "c1"
    assert locks.plan("cg", "c2", [("T", 0)]).refused == (("T", 0),)
    clock.now += 0.5  # 60.5 s after the renewal: lapsed
    assert locks.holder("cg", ("T", 0)) is None
    assert _lock(locks, "cg", "c2", ("T", 0)) == [("T", 0)]
    assert locks.holder("cg", ("T", 0)) == "c2"
    assert locks.plan("cg", "c1", [("T", 0)]).refused == (("T", 0),)


def test_its_holder_gets_a_lapsed_lock_back_without_a_change_of_holder():
    locks, clock = _manager(1_000)
    _lock(locks, "cg", "c1", ("T", 0))
    clock.now += 5
    plan = locks.plan("cg", "c1", [("T", 0)])
    assert plan.held == (("T", 0),) and plan.free == ()  # nothing to replicate
    assert locks.holder("cg", ("T", 0)) == "c1"


def test_unlock_releases_only_the_callers_own_locks_and_an_unknown_group_is_no_error():
    locks, clock = _manager(1_000)
    _lock(locks, "cg", "c1", ("T", 0), ("T", 1))
    _lock(locks, "cg", "c2", ("T", 2))
    assert locks.release("cg", "c2", [("T", 0), ("T", 2), ("T", 9)]) == [("T", 2)]
    assert locks.holder("cg", ("T", 0)) == "c1" and locks.holder("cg", ("T", 2)) is None
    clock.now += 5  # a lapsed lock is still its holder's to release
    assert locks.held_by("cg", "c1", [("T", 0), ("T", 1)]) == [("T", 0), ("T", 1)]
    assert locks.release("cg", "c1", [("T", 0), ("T", 1)]) == [("T", 0), ("T", 1)]
    assert len(locks) == 0
    assert locks.release("never-seen", "c1", [("T", 0)]) == []
    assert locks.holder("never-seen", ("T", 0)) is None
    assert locks.plan("never-seen", "c1", []).held == ()


def test_restored_holders_are_renewed_at_the_restore_and_lapsed_locks_are_taken_out():
    locks, clock = _manager(10_000)
    _lock(locks, "cg", "old", ("T", 5))
    clock.now += 100
    # A new leader's term: the replicated holders, each as if renewed now (the old table is replaced).
    locks.restore([("cg", "T", 0, "c1"), ("cg", "T", 1, "c2")])
    assert locks.holder("cg", ("T", 5)) is None
    assert locks.plan("cg", "c3", [("T", 0), ("T", 1)]).refused == (("T", 0), ("T", 1))
    assert _lock(locks, "cg", "c1", ("T", 0)) == [("T", 0)]  # its holder goes on through the failover
    clock.now += 10.5
    # c1 renewed at the restore too (same moment), so both lapse now; nothing lapsed stays in the table.
    assert sorted(locks.take_lapsed()) == [("cg", ("T", 0)), ("cg", ("T", 1))]
    assert len(locks) == 0 and locks.take_lapsed() == []


def test_a_lock_life_must_be_positive():
    with pytest.raises(ValueError, match="max_live_time_ms must be > 0"):
        RebalanceLockManager(0)
