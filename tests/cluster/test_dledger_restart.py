"""Real 3-process DLedger groups: all members killed at once and restarted lose nothing acknowledged; a
follower stopped across several compactions catches up (snapshot + commit-log byte copy) and ends
byte-identical."""

from __future__ import annotations

import pytest
import trio

from raftmq.commands.verify import verify_group
from remoting.errors import RaftMQError
from remoting.transport import open_remoting_client
from tests.integration.dledger.cluster_support import FAST_ELECTIONS, DLedgerCluster, message
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(180)]


async def test_all_members_killed_at_once_lose_nothing_acknowledged(spawn, tmp_path):
    cluster = DLedgerCluster(spawn, tmp_path)
    cluster.start_all()
    acked = []
    async with open_remoting_client(connect_timeout_s=0.5) as client:
        await cluster.wait_leader(client)
        stop = False

        async def writer(w: int) -> None:
            i = 0
            while not stop:
                i += 1
                try:
                    acked.append(await cluster.append(client, message(f"w{w}", i), timeout_s=5))
                except (RaftMQError, trio.TooSlowError):
                    await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            for w in range(8):
                nursery.start_soon(writer, w)
            await trio.sleep(2.0)
            for member_id in cluster.ids:  # as close to "at once" as three kill(2) calls get
                cluster.procs[member_id].proc.kill()
            for member_id in cluster.ids:
                cluster.procs[member_id].proc.wait(10)
            stop = True
            nursery.cancel_scope.cancel()
        count_at_kill = len(acked)
        assert count_at_kill > 50
        for member_id in cluster.ids:
            await trio.to_thread.run_sync(cluster.start, member_id)
        await cluster.wait_leader(client, timeout_s=15)
        acked.append(await cluster.append(client, message("after-restart", 0)))
        await cluster.wait_converged(client, acked[-1].phy_offset)
    for member_id in cluster.ids:
        cluster.procs[member_id].stop()
    cluster.verify_stores(acked)


async def test_stopped_follower_catches_up_after_compactions(spawn, tmp_path):
    cluster = DLedgerCluster(spawn, tmp_path, dledger=dict(FAST_ELECTIONS, log_compaction_min_entries=40))
    cluster.start_all()
    acked = []
    async with open_remoting_client(connect_timeout_s=0.5) as client:
        leader = await cluster.wait_leader(client)
        for i in range(20):
            acked.append(await cluster.append(client, message("before", i)))
        follower = next(m for m in cluster.ids if m != leader)
        cluster.procs[follower].stop()
        for i in range(300):  # one in flight: ~one entry each, several compactions of 40 entries
            acked.append(await cluster.append(client, message("while-down", i)))
        await trio.to_thread.run_sync(cluster.start, follower)
        end = await cluster.wait_converged(client, acked[-1].phy_offset, timeout_s=30)
        proc = cluster.procs[follower]
        await trio.to_thread.run_sync(lambda: proc.wait_output("catch-up finished", timeout_s=10))
        status = await cluster.status(client, follower)
        assert status["serving_reads"] and int(status["end_offset"]) == end
        report = await verify_group(cluster.group, [cluster.address(m) for m in cluster.ids])
        assert report["identical"]
        members = ",".join(cluster.address(m) for m in cluster.ids)
        done = await trio.run_process(raftmq_argv("verify", "--group", cluster.group, "--members", members),
                                      capture_stdout=True, check=False)
        assert done.returncode == 0, done.stdout
        assert b"are identical" in done.stdout and done.stdout.count(b"member n") == 3
    for member_id in cluster.ids:
        cluster.procs[member_id].stop()
    cluster.verify_stores(acked)
