"""A leader cut off with entries in flight, whose entries another leader overwrote while it followed, that leads
again: those entries never commit, and must not keep counting as in flight."""

from __future__ import annotations

import time
from types import SimpleNamespace

import trio

from dledger.errors import DLedgerError
from tests.integration.dledger.helpers import leader_cut_off, ready_leader


async def _overwritten_while_following(nursery, tmp_path, *, puts: int, flights: int) -> SimpleNamespace:
    """A group whose leader had ``puts`` metadata puts, then ``flights`` appends in flight, when its sends were cut:
    it stepped down, the others elected a leader whose entries replaced its own, and it follows that one again,
    connected. ``append(name, timeout_s)`` appends to the cut-off member, recording the index or error in
    ``outcomes``."""
    leader, runners, _logs = await leader_cut_off(nursery, tmp_path, leader_fallback_timeout_ms=1000,
                                                  connection_timeout_ms=1000, max_batch_delay_ms=1)
    outcomes: dict[str, BaseException | int] = {}

    async def append(name: str, timeout_s: float) -> None:
        try:
            outcomes[name] = (await leader.append(name.encode(), timeout_s=timeout_s)).index
        except DLedgerError as e:
            outcomes[name] = e

    async def put() -> None:
        try:
            await leader.put_metadata("t", {"k": 1}, timeout_s=1.0)
        except DLedgerError:
            pass

    for _ in range(puts):
        nursery.start_soon(put)
        await trio.sleep(0.05)
    for i in range(flights):
        nursery.start_soon(append, f"in-flight-{i}", 1.0)
        await trio.sleep(0.05)
    assert leader.statistics().in_flight_batches >= 2
    member = leader.member
    member._SyncObj__transport.send = lambda *args, **kwargs: False  # its sends lost: it steps down
    with trio.fail_after(10):
        while leader.is_leader:
            await trio.sleep(0.05)
    others = [await runner.start() for nid, runner in runners.items() if nid != leader.config.self_id]
    new_leader = await ready_leader(others)
    with trio.fail_after(10):  # it follows the new leader, whose entries replace its own
        while leader.leader_id != new_leader.config.self_id or \
                leader.member.raftLastApplied < new_leader.member.raftLastApplied:
            await trio.sleep(0.05)
    del member._SyncObj__transport.send
    await trio.sleep(1.5)  # connected again
    return SimpleNamespace(leader=leader, others=others, new_leader=new_leader, outcomes=outcomes, append=append)


async def test_a_leader_again_counts_no_entry_another_leader_overwrote_and_takes_appends(tmp_path):
    # They stayed counted in flight (pysyncobj answers their callbacks only once their indexes are written again):
    # the batcher waited for them to drain before it replanned, every append was refused busy, and a transfer away
    # said the entries in flight did not commit, until unrelated writes filled those indexes.
    async with trio.open_nursery() as nursery:
        g = await _overwritten_while_following(nursery, tmp_path, puts=0, flights=4)
        leader = g.leader
        await g.new_leader.transfer_leadership(leader.config.self_id, timeout_s=5)
        await leader.wait_ready_leader()
        with trio.fail_after(10):
            while leader.statistics().in_flight_batches:
                await trio.sleep(0.05)
        await g.append("after", 3.0)
        assert isinstance(g.outcomes["after"], int), g.outcomes["after"]
        assert all(f"in-flight-{i}" in g.outcomes for i in range(4)), g.outcomes  # all answered
        nursery.cancel_scope.cancel()


async def test_stale_flights_are_dropped_by_a_proposal_made_before_a_tick_saw_the_new_no_op(tmp_path, monkeypatch):
    # The tick checked for stale flights before it published the role: when one tick won the election and applied
    # its no-op (followers' acks read within it, as between processes), a proposal before the next tick took the
    # stale flights for this leadership's, and they stayed counted for ever again. Here the metadata puts make the
    # new leader's entries overwrite no flight (so nothing answers one DISCARDED and forces a replan).
    async with trio.open_nursery() as nursery:
        g = await _overwritten_while_following(nursery, tmp_path, puts=3, flights=3)  # a slot stays free
        leader, member = g.leader, g.leader.member

        # The tick that makes it leader also reads the followers' acks and applies the no-op; then the Raft socket
        # stays quiet for a tick interval, so the batcher proposes before the next tick.
        original_tick, followers = member.tick, [other.member for other in g.others]
        idle = [False]

        def tick():
            more = original_tick()
            if member._isLeader() and member.noop_index is not None and member.raftLastApplied < member.noop_index:
                end = time.monotonic() + 2
                while member.raftLastApplied < member.noop_index and time.monotonic() < end:
                    for follower in followers:
                        follower.tick()
                    time.sleep(0.002)
                    original_tick()
                member.tick = original_tick
                idle[0] = True
            return more

        member.tick = tick
        original_wait_readable, fd = trio.lowlevel.wait_readable, member.tick_fd

        async def wait_readable(f):
            if f == fd and idle[0]:
                idle[0] = False
                await trio.sleep(1)  # cut to the tick interval by the tick loop
            return await original_wait_readable(f)

        monkeypatch.setattr(trio.lowlevel, "wait_readable", wait_readable)

        async def append_once_leader() -> None:
            while not leader.is_leader:
                await leader.wait_changed()
            await g.append("first", 3.0)

        nursery.start_soon(append_once_leader)
        await g.new_leader.transfer_leadership(leader.config.self_id, timeout_s=5)
        await leader.wait_ready_leader()
        with trio.fail_after(10):
            while "first" not in g.outcomes:
                await trio.sleep(0.05)
        await g.append("after", 3.0)
        assert isinstance(g.outcomes["first"], int) and isinstance(g.outcomes["after"], int), g.outcomes
        assert leader.statistics().in_flight_batches == 0
        nursery.cancel_scope.cancel()
