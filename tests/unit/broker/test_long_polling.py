from __future__ import annotations

import trio
import trio.testing

from broker.long_polling import PullRequestHoldService


def _recording_into(resumed: list[tuple[str, bool, float]]):
    """resume_fn(name): a held pull's resume that notes (name, timed_out, when) in ``resumed``."""
    def resume_fn(name):
        async def resume(timed_out, offset):
            resumed.append((name, timed_out, trio.current_time()))
        return resume
    return resume_fn


async def test_held_pull_resumes_on_arrival_and_on_timeout(autojump_clock):
    max_offsets = {("T", 0): 0, ("T", 1): 0}
    service = PullRequestHoldService(lambda t, q: max_offsets[(t, q)], check_interval_ms=1000)
    resumed: list[tuple[str, bool, float]] = []
    resume_fn = _recording_into(resumed)

    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        start = trio.current_time()
        service.hold("T", 0, 0, 15.0, resume_fn("arrive"))
        service.hold("T", 1, 0, 5.0, resume_fn("timeout"))
        await trio.sleep(1.5)
        service.notify_message_arriving("T", 0, 0)  # not beyond the held offset
        service.notify_message_arriving("T", 0, 1)
        await trio.sleep(0.01)
        assert [r[:2] for r in resumed] == [("arrive", False)]
        await trio.sleep(5)
        assert [r[:2] for r in resumed] == [("arrive", False), ("timeout", True)]
        assert abs(resumed[1][2] - start - 5.0) < 0.01
        # A notification missed entirely is caught by the periodic check.
        service.hold("T", 1, 0, 15.0, resume_fn("missed"))
        max_offsets[("T", 1)] = 3
        await trio.sleep(1.1)
        assert resumed[-1][:2] == ("missed", False)
        # Already arrived when held: resumed at once.
        service.hold("T", 1, 2, 15.0, resume_fn("now"))
        await trio.sleep(0.01)
        assert resumed[-1][:2] == ("now", False)
        stats = service.statistics()
        assert (stats.held, stats.resumed_by_arrival, stats.resumed_by_timeout) == (3, 3, 1)
        nursery.cancel_scope.cancel()


async def test_a_held_pull_with_a_filter_is_woken_only_by_a_unit_it_wants_and_resumes_past_the_others(autojump_clock):
    """Before, every arrival woke every held pull of the queue: a consumer of a rare tag on a busy queue was
    answered "nothing for you" and pulled again once per arrival."""
    max_offsets = {("T", 0): 5}
    wanted = {7}  # the only queue offset whose unit carries a tags code the filter wants
    asked = []

    def matches(begin, end):
        asked.append((begin, end))
        return any(begin <= o < end for o in wanted)

    service = PullRequestHoldService(lambda t, q: max_offsets[(t, q)], check_interval_ms=1000)
    resumed = []

    async def resume(timed_out, offset):
        resumed.append((timed_out, offset))

    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        service.hold("T", 0, 3, 15.0, resume, matches)  # units 3 and 4 arrived before the hold: not wanted
        for end in (6, 7):
            max_offsets[("T", 0)] = end
            service.notify_message_arriving("T", 0, end)
        await trio.sleep(1.5)  # the periodic check sees nothing new either
        assert resumed == [] and asked == [(3, 5), (5, 6), (6, 7)]
        max_offsets[("T", 0)] = 9
        service.notify_message_arriving("T", 0, 9)
        await trio.sleep(0.01)
        assert resumed == [(False, 7)]  # from past the units it did not want
        # Without a filter, any arrival wakes it.
        service.hold("T", 0, 9, 15.0, resume)
        service.notify_message_arriving("T", 0, 10)
        await trio.sleep(0.01)
        assert resumed[-1] == (False, 9)
        # Timed out: resumed from where the unwanted units took it.
        service.hold("T", 0, 10, 2.0, resume, matches)
        service.notify_message_arriving("T", 0, 12)
        await trio.sleep(2.5)
        assert resumed[-1] == (True, 12)
        nursery.cancel_scope.cancel()


async def test_release_resumes_at_once_only_the_pulls_it_picks_and_counts_them_as_neither(autojump_clock):
    service = PullRequestHoldService(lambda t, q: 0, check_interval_ms=1000)
    resumed: list[tuple[str, bool, float]] = []
    resume_fn = _recording_into(resumed)

    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        start = trio.current_time()
        service.hold("Gone", 0, 0, 15.0, resume_fn("gone"))
        service.hold("T", 6, 0, 15.0, resume_fn("shrunk"))
        service.hold("T", 1, 0, 2.0, resume_fn("kept"))
        service.release(lambda topic, queue_id: topic == "Gone" or queue_id >= 4)
        await trio.sleep(0.01)
        assert sorted(r[:2] for r in resumed) == [("gone", False), ("shrunk", False)]
        assert all(r[2] - start < 0.02 for r in resumed)
        await trio.sleep(2)  # the released ones are gone from the deadline heap; the kept one times out alone
        assert sorted(r[:2] for r in resumed) == [("gone", False), ("kept", True), ("shrunk", False)]
        stats = service.statistics()
        assert (stats.held, stats.resumed_by_arrival, stats.resumed_by_timeout) == (3, 0, 1)
        nursery.cancel_scope.cancel()


async def test_a_held_pulls_filter_that_raises_wakes_the_pull_and_the_service_goes_on(autojump_clock, caplog):
    """A SQL92 filter raised on a property value (int() of 5,000 digits: ValueError) out of the periodic check, with
    nothing to catch it: the hold service ended, and the broker node with it. Now the pull is woken (its own read
    answers it) and logged, and other pulls are held and woken as before."""
    max_offsets = {("T", 0): 0, ("T", 1): 0}

    def failing(begin, end):
        raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")

    service = PullRequestHoldService(lambda t, q: max_offsets[(t, q)], check_interval_ms=1000)
    resumed = []

    def resume_as(name):
        async def resume(timed_out, offset):
            resumed.append((name, timed_out, offset))
        return resume

    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        service.hold("T", 0, 0, 15.0, resume_as("failing"), failing)
        service.hold("T", 1, 0, 15.0, resume_as("plain"))
        max_offsets[("T", 0)] = 1  # missed by notification: found by the periodic check
        await trio.sleep(1.5)
        assert resumed == [("failing", False, 0)]
        service.notify_message_arriving("T", 0, 2)  # nothing held there now
        max_offsets[("T", 1)] = 1
        service.notify_message_arriving("T", 1, 1)
        await trio.sleep(0.01)
        assert resumed[-1] == ("plain", False, 0)
        nursery.cancel_scope.cancel()
    assert any("held pull's filter failed" in r.getMessage() for r in caplog.records)
