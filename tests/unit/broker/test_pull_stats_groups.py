"""PullStats against the subscription-group table: a group gone takes its figures, pulls of a group the table does not
hold are pending (not in the totals) until it comes, bounded in number and in time."""

from __future__ import annotations

import types

import pytest

from broker.pull_stats import PENDING_S, PullStats
from broker.subscription_group import SubscriptionGroupManager


def test_a_group_gone_takes_its_figures_and_only_its_own():
    stats = PullStats(clock=lambda: 1000.0)
    stats.add("gone", "T", 3, 300)
    stats.add("gone", "U", 1, 100)
    stats.add("kept", "T", 2, 200)
    stats.groups_changed(lambda group: group == "kept", {"gone", "never-pulled"})
    assert stats.totals() == {("kept", "T"): (2, 200)}
    assert stats.tps("gone", "T") == 0.0 and stats.tps("kept", "T") == 2.0
    stats.add("gone", "T", 1, 10)  # created again: counted from 0, as a new counter
    assert stats.totals()[("gone", "T")] == (1, 10)


def test_pulls_of_an_unknown_group_count_once_it_comes_with_those_made_before():
    now = [1000.0]
    stats = PullStats(clock=lambda: now[0])
    stats.add("late", "T", 3, 300, known=False)
    stats.add("late", "T", 2, 200, known=False)
    assert stats.totals() == {}
    assert stats.tps("late", "T") == 5.0  # the group's consume TPS does not wait for its config
    stats.groups_changed(lambda group: group == "other", set())
    assert stats.totals() == {}
    stats.groups_changed(lambda group: group == "late", set())
    assert stats.totals() == {("late", "T"): (5, 500)}
    now[0] += PENDING_S * 2
    stats.prune()  # admitted: no longer pending, kept as any group's
    assert stats.totals() == {("late", "T"): (5, 500)}


def test_pending_figures_are_bounded_and_dropped_when_their_group_does_not_come():
    now = [1000.0]
    stats = PullStats(clock=lambda: now[0], max_pending=3)
    for i in range(200):  # made-up names, as a client pulling under a new name each time
        stats.add(f"rand{i}", "T", 1, 10, known=False)
    assert stats.totals() == {} and len(stats._totals) == 3  # rand0..rand2; the others not counted at all
    stats.add("rand1", "T", 1, 10, known=False)  # one already pending still counts
    stats.add("real", "T", 4, 40)  # a known group is never refused for the bound
    now[0] += PENDING_S / 2
    stats.groups_changed(lambda group: group == "real", {"rand0"})
    stats.add("rand9", "T", 1, 10, known=False)  # room again
    stats.prune()
    assert set(stats._totals) == {("rand1", "T"), ("rand2", "T"), ("rand9", "T"), ("real", "T")}
    now[0] += PENDING_S / 2
    stats.prune()  # rand1 and rand2 pulled PENDING_S ago without their group coming: dropped; rand9 not yet
    assert set(stats._totals) == {("rand9", "T"), ("real", "T")}
    now[0] += PENDING_S / 2
    stats.prune()
    assert stats.totals() == {("real", "T"): (4, 40)} and set(stats._totals) == {("real", "T")}
    assert not stats._pending and not stats._buckets.keys() - {("real", "T")}


def test_a_deleted_topic_also_drops_pending_figures():
    stats = PullStats(clock=lambda: 1000.0, max_pending=1)
    stats.add("late", "Gone", 1, 10, known=False)
    stats.forget_topics(lambda topic: topic == "Gone")
    stats.add("late", "T", 1, 10, known=False)  # the bound counts what is pending now
    stats.groups_changed(lambda group: True, set())
    assert stats.totals() == {("late", "T"): (1, 10)}


def test_a_negative_bound_is_refused_naming_it():
    with pytest.raises(ValueError, match="max_pending must be >= 0, got -1"):
        PullStats(max_pending=-1)


def test_the_group_managers_changes_reach_the_pull_figures_whatever_changed_the_table():
    # One applied change that lost two groups (a deletion, a snapshot load) and gained one, on whichever node.
    generation = [1]
    replicated = {"": 1, "a": {"group_name": "a"}, "b": {"group_name": "b"}, "c": {"group_name": "c"}}
    released: list[set[str]] = []
    node = types.SimpleNamespace(group=types.SimpleNamespace(metadata_generation=lambda table: generation[0],
                                                             metadata=lambda table: dict(replicated)),
                                 hold=types.SimpleNamespace(release_groups=released.append))
    stats = PullStats(clock=lambda: 1000.0)
    for group in ("a", "b", "c"):
        stats.add(group, "T", 1, 10, known=True)
    stats.add("d", "T", 1, 10, known=False)
    stats.add("e", "T", 1, 10, known=False)
    manager = SubscriptionGroupManager(node, on_groups_changed=stats.groups_changed)
    del replicated["b"], replicated["c"]
    replicated.update({"": 2, "d": {"group_name": "d"}})
    generation[0] = 2
    manager.metadata_applied()
    assert released == [{"b", "c"}]
    assert stats.totals() == {("a", "T"): (1, 10), ("d", "T"): (1, 10)}  # e is still pending
