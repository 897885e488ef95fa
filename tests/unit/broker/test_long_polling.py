from __future__ import annotations

import trio
import trio.testing

from broker.long_polling import PullRequestHoldService


async def test_held_pull_resumes_on_arrival_and_on_timeout(autojump_clock):
    max_offsets = {("T", 0): 0, ("T", 1): 0}
    service = PullRequestHoldService(lambda t, q: max_offsets[(t, q)], check_interval_ms=1000)
    resumed = []

    def resume_fn(name):
        async def resume(timed_out):
            resumed.append((name, timed_out, trio.current_time()))
        return resume

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
