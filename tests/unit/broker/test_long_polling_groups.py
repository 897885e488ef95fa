"""Held pulls know their consumer group (broker/long_polling.py): a group's subscription group narrowing wakes only
that group's held pulls (and holds that name no group, a POP's), and a pull held again after such a wake-up is
counted once in ``statistics().held``. The same against a real node: tests/integration/broker/
test_long_polling_narrowing.py."""

from __future__ import annotations

import types

import trio
import trio.testing

from broker.long_polling import PullRequestHoldService
from broker.subscription_group import SUBSCRIPTION_GROUP_TABLE, SubscriptionGroupConfig, SubscriptionGroupManager


def _recording(resumed: list[tuple[str, bool]]):
    def resume_fn(name):
        async def resume(timed_out, offset):
            resumed.append((name, timed_out))
        return resume
    return resume_fn


async def test_release_groups_resumes_the_named_groups_pulls_and_those_naming_none_only(autojump_clock):
    max_offsets = {("T", 0): 0, ("T", 1): 0}
    service = PullRequestHoldService(lambda t, q: max_offsets[(t, q)], check_interval_ms=1000)
    resumed: list[tuple[str, bool]] = []
    resume_fn = _recording(resumed)

    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        service.hold("T", 0, 0, 15.0, resume_fn("a0"), consumer_group="A")
        service.hold("T", 0, 0, 15.0, resume_fn("b0"), consumer_group="B")
        service.hold("T", 1, 0, 15.0, resume_fn("a1"), consumer_group="A")
        service.hold("T", 1, 0, 15.0, resume_fn("pop"))  # a POP's hold names no group
        service.release_groups(set())
        await trio.testing.wait_all_tasks_blocked()
        assert resumed == [] and service.held_now() == 4
        service.release_groups({"A"})
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(resumed) == [("a0", False), ("a1", False), ("pop", False)]
        assert service.held_now() == 1
        # B's pull is held as before: a message wakes it.
        max_offsets[("T", 0)] = 1
        service.notify_message_arriving("T", 0, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert resumed[-1] == ("b0", False) and service.held_now() == 0
        stats = service.statistics()
        assert (stats.held, stats.resumed_by_arrival, stats.resumed_by_timeout) == (4, 1, 0)  # releases: neither
        nursery.cancel_scope.cancel()


async def test_a_groups_narrowing_wakes_only_that_groups_held_pulls(autojump_clock):
    """Before, a narrowing (here: stopped) woke every held pull of the node, each pull of every other group re-run
    to be held again."""
    table = {"": 1, "stopped": SubscriptionGroupConfig("stopped").to_wire(),
             "running": SubscriptionGroupConfig("running").to_wire()}
    generation = [1]
    service = PullRequestHoldService(lambda t, q: 0, check_interval_ms=1000)
    node = types.SimpleNamespace(
        group=types.SimpleNamespace(metadata_generation=lambda name: generation[0],
                                    metadata=lambda name: dict(table) if name == SUBSCRIPTION_GROUP_TABLE else {}),
        hold=service)
    resumed: list[tuple[str, bool]] = []
    resume_fn = _recording(resumed)

    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        manager = SubscriptionGroupManager(node)
        service.hold("T", 0, 0, 15.0, resume_fn("stopped"), consumer_group="stopped")
        service.hold("T", 0, 0, 15.0, resume_fn("running"), consumer_group="running")
        table.update({"": 2, "stopped": SubscriptionGroupConfig("stopped", consume_enable=False).to_wire()})
        generation[0] = 2
        manager.metadata_applied()
        await trio.testing.wait_all_tasks_blocked()
        assert resumed == [("stopped", False)]
        assert service.held_now() == 1
        # Removed: its pulls too, and still no other group's.
        service.hold("T", 0, 0, 15.0, resume_fn("stopped again"), consumer_group="stopped")
        del table["stopped"]
        table[""] = 3
        generation[0] = 3
        manager.metadata_applied()
        await trio.testing.wait_all_tasks_blocked()
        assert resumed == [("stopped", False), ("stopped again", False)]
        nursery.cancel_scope.cancel()


async def test_a_pull_held_again_after_a_release_is_counted_once(autojump_clock):
    """The resume of a pull woken for nothing holds it again (``rehold``): it is one pull request held, as
    RocketMQ's PullRequestHoldService counts a pull it suspended once, and once answered, by what answered it."""
    max_offsets = {("T", 0): 0}
    service = PullRequestHoldService(lambda t, q: max_offsets[(t, q)], check_interval_ms=1000)
    answered: list[tuple[bool, int]] = []
    deadline = trio.current_time() + 15.0

    async def resume(timed_out, offset):
        left = deadline - trio.current_time()
        if not timed_out and left > 0 and max_offsets[("T", 0)] <= offset:
            service.hold("T", 0, offset, left, resume, consumer_group="G", rehold=True)
            return
        answered.append((timed_out, offset))

    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        service.hold("T", 0, 0, 15.0, resume, consumer_group="G")
        for _ in range(3):
            service.release_groups({"G"})
            await trio.testing.wait_all_tasks_blocked()
            assert service.held_now() == 1 and answered == []
        assert service.statistics().held == 1
        max_offsets[("T", 0)] = 1
        service.notify_message_arriving("T", 0, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert answered == [(False, 0)]
        stats = service.statistics()
        assert (stats.held, stats.resumed_by_arrival, stats.resumed_by_timeout) == (1, 1, 0)
        nursery.cancel_scope.cancel()
