"""Kill -9 the leader of a 3-process DLedger group under a steady append load, 10 times in a row: a new leader
is elected, appends resume, every acknowledged message is on every member and the members are byte-identical.
Reports the gap from kill to the first successful append (median, max)."""

from __future__ import annotations

import statistics
import time

import pytest
import trio

from raftmq.commands.verify import verify_group
from remoting.transport import open_remoting_client
from tests.integration.dledger.cluster_support import DLedgerCluster

pytestmark = [pytest.mark.cluster, pytest.mark.load, pytest.mark.slow, pytest.mark.timeout(240)]

KILLS = 10
WRITERS = 8


async def test_leader_killed_ten_times_under_load(spawn, tmp_path, figure):
    cluster = DLedgerCluster(spawn, tmp_path)
    cluster.start_all()
    acked = []
    gaps = []
    async with open_remoting_client(connect_timeout_s=0.5) as client:
        await cluster.wait_leader(client)
        async with cluster.writing(client, acked, writers=WRITERS, timeout_s=15):
            for round_ in range(KILLS):
                await trio.sleep(0.6)
                leader = await cluster.wait_leader(client)
                before = len(acked)
                assert before > 0
                killed_at = time.monotonic()
                cluster.kill(leader)
                with trio.move_on_after(15):
                    while not any(a.started >= killed_at for a in acked[before:]):
                        await trio.sleep(0.005)
                if not any(a.started >= killed_at for a in acked[before:]):
                    raise AssertionError(f"kill {round_ + 1} ({leader}): no append acknowledged within 15 s; "
                                         f"members:\n{cluster.describe()}")
                first = min(a.finished for a in acked[before:] if a.started >= killed_at)
                gaps.append(first - killed_at)
                await trio.to_thread.run_sync(cluster.start, leader)
        end = await cluster.wait_converged(client, max(a.phy_offset for a in acked))
        report = await verify_group(cluster.group, [cluster.address(m) for m in cluster.ids])
        assert report["identical"] and report["up_to"] == end
    for member_id in cluster.ids:
        cluster.procs[member_id].stop()
    cluster.verify_stores(acked)
    median, worst = statistics.median(gaps), max(gaps)
    figure(f"dledger failover: {KILLS} leader kills, {len(acked)} acknowledged appends, kill->first append "
           f"gap median {median:.3f} s, max {worst:.3f} s, all gaps {[round(g, 3) for g in gaps]}")
    # The gap is a speed figure (target median <= 1.0 s, max <= 2.0 s): it is reported above and recorded in
    # docs/benchmarks.md, never asserted, so a loaded machine cannot fail this test. What is asserted is that
    # every failover completed (within 15 s, above) and that nothing acknowledged was lost.
    assert len(gaps) == KILLS
