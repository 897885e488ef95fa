"""Held pulls are bounded per connection and dropped when their connection closes (broker/long_polling.py)."""

from __future__ import annotations

import dataclasses

import trio

from broker.long_polling import PullRequestHoldService


@dataclasses.dataclass(eq=False)
class FakeConn:
    closed: bool = False


async def test_a_connection_holds_at_most_its_share_and_its_oldest_is_answered_first(autojump_clock):
    """Before, one connection sending suspended pulls in a loop had every one of them held (some 2 KB each) until
    its deadline: nothing bounded how many."""
    service = PullRequestHoldService(lambda t, q: 0, check_interval_ms=1000, max_held_per_connection=3)
    resumed: list[tuple[str, bool]] = []

    def resume_fn(name):
        async def resume(timed_out, offset):
            resumed.append((name, timed_out))
        return resume

    greedy, other = FakeConn(), FakeConn()
    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        for i in range(5):
            service.hold("T", i % 2, 0, 60.0, resume_fn(f"greedy-{i}"), conn=greedy)
        service.hold("T", 0, 0, 60.0, resume_fn("other-0"), conn=other)
        service.hold("T", 1, 0, 60.0, resume_fn("other-1"), conn=other)
        await trio.sleep(0.01)
        # The two oldest of the greedy connection answered as at their deadline (PULL_NOT_FOUND: pull again).
        assert resumed == [("greedy-0", True), ("greedy-1", True)]
        assert service.held_now() == 3 + 2
        # The others are still held and answer on arrival as before.
        service.notify_message_arriving("T", 0, 1)
        await trio.sleep(0.01)
        assert sorted(resumed[2:]) == [("greedy-2", False), ("greedy-4", False), ("other-0", False)]
        assert service.held_now() == 2
        nursery.cancel_scope.cancel()


async def test_the_pulls_of_a_closed_connection_are_dropped_unanswered(autojump_clock):
    """Before, a closed connection's held pulls stayed until their deadlines (up to long_polling_timeout_ms), and
    each was then executed again to answer no one."""
    executed: list[str] = []

    def resume_fn(name):
        async def resume(timed_out, offset):
            executed.append(name)
        return resume

    service = PullRequestHoldService(lambda t, q: 0, check_interval_ms=1000)
    gone, live = FakeConn(), FakeConn()
    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        for i in range(100):
            service.hold("T", i % 4, 0, 30.0, resume_fn("gone"), conn=gone)
        service.hold("T", 0, 0, 30.0, resume_fn("live"), conn=live)
        assert service.held_now() == 101
        gone.closed = True
        await trio.sleep(1.5)  # one periodic check
        assert service.held_now() == 1 and executed == []
        service.notify_message_arriving("T", 0, 1)
        await trio.sleep(0.01)
        assert executed == ["live"]
        await trio.sleep(60)  # past every deadline: the dropped pulls never run
        assert executed == ["live"]
        assert service.statistics().resumed_by_timeout == 0
        nursery.cancel_scope.cancel()
