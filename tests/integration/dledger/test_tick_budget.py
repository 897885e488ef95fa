"""RaftMember.tick's time budget: a wake-up of the tick task ticks again while its polls deliver events, but not
for longer than TICK_BUDGET_S, so the trio side (requests waiting to be read, answers to send) gets its turn."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import pytest

from dledger import member as member_module
from tests.integration.dledger.helpers import open_groups, ready_leader

pytestmark = pytest.mark.timeout(60)


async def test_a_wake_up_stops_ticking_at_the_budget_and_asks_to_tick_again(tmp_path):
    async with AsyncExitStack() as stack:
        _, logs, groups = await open_groups(stack, tmp_path)
        leader = await ready_leader(groups)
        await leader.append(b"first")
        member = leader.member
        calls = []
        do_tick = member.doTick

        def slow_tick(timeout: float) -> None:
            # As slow as a leader's tick that sends a follower back from a restart its backlog (~50 ms before
            # patches 26's send budget), and its poll delivered events every time, as it does then.
            calls.append(timeout)
            do_tick(timeout)
            time.sleep(member_module.TICK_BUDGET_S * 0.4)
            member._poller.handled = 1

        member.doTick = slow_tick
        try:
            assert member.tick() is True  # stopped with work left
            ticks_in_a_wake_up = len(calls)
            assert leader._tick_once() == 0  # the tick task then ticks again after a checkpoint, not a wait
        finally:
            del member.doTick
        # Before the budget: 8 ticks in a row whatever they cost (0.4-0.5 s of a leader sending a backlog).
        assert 2 <= ticks_in_a_wake_up <= 3, calls
        # A wake-up with nothing more to read ends as before, and the tick task waits for the next event.
        await leader.append(b"second")
        calls.clear()
        member.doTick = lambda timeout: (calls.append(timeout), do_tick(timeout))
        try:
            member._poller.poll(0.0)  # whatever is left in the sockets, read now
            more = member.tick()
        finally:
            del member.doTick
        assert more is False and len(calls) < 8
    for log in logs:
        log.close()
