"""A leader cut off with entries in flight, whose entries another leader overwrote while it followed, that leads
again: those entries never commit, and must not keep counting as in flight."""

from __future__ import annotations

import trio

from dledger.errors import DLedgerError
from tests.integration.dledger.helpers import leader_cut_off, ready_leader


async def test_a_leader_again_counts_no_entry_another_leader_overwrote_and_takes_appends(tmp_path):
    # They stayed counted in flight (pysyncobj answers their callbacks only once their indexes are written again):
    # the batcher waited for them to drain before it replanned, every append was refused busy, and a transfer away
    # said the entries in flight did not commit, until unrelated writes filled those indexes.
    async with trio.open_nursery() as nursery:
        leader, runners, _logs = await leader_cut_off(nursery, tmp_path, leader_fallback_timeout_ms=1000,
                                                      connection_timeout_ms=1000, max_batch_delay_ms=1)
        cut_off = leader.config.self_id
        outcomes: dict[str, BaseException | int] = {}

        async def append(name: str, timeout_s: float) -> None:
            try:
                outcomes[name] = (await leader.append(name.encode(), timeout_s=timeout_s)).index
            except DLedgerError as e:
                outcomes[name] = e

        for i in range(4):
            nursery.start_soon(append, f"in-flight-{i}", 1.0)
            await trio.sleep(0.05)
        assert leader.statistics().in_flight_batches >= 2
        member = leader.member
        member._SyncObj__transport.send = lambda *args, **kwargs: False  # its sends lost: it steps down
        with trio.fail_after(10):
            while leader.is_leader:
                await trio.sleep(0.05)
        others = [await runner.start() for nid, runner in runners.items() if nid != cut_off]
        new_leader = await ready_leader(others)
        with trio.fail_after(10):  # it follows the new leader, whose entries replace its own
            while leader.leader_id != new_leader.config.self_id or \
                    leader.member.raftLastApplied < new_leader.member.raftLastApplied:
                await trio.sleep(0.05)
        del member._SyncObj__transport.send
        await trio.sleep(1.5)  # connected again
        await new_leader.transfer_leadership(cut_off, timeout_s=5)
        await leader.wait_ready_leader()
        with trio.fail_after(10):
            while leader.statistics().in_flight_batches:
                await trio.sleep(0.05)
        await append("after", 3.0)
        assert isinstance(outcomes["after"], int), outcomes["after"]
        assert all(name in outcomes for name in (f"in-flight-{i}" for i in range(4))), outcomes  # all answered
        nursery.cancel_scope.cancel()
