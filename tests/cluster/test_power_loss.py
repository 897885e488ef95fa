"""A power loss of the whole group after Raft log compaction, simulated with real processes.

A power loss keeps of the commit log what was fdatasync'd, and perhaps some pages written after; SIGKILL keeps
it all (the page cache survives a killed process). So the test kills the three nodes of broker-a after a load
with log compaction on, then takes from each member's commit log what a power loss could have: everything from
the first page after the smaller of

- the offset its store had fdatasync'd (``commit_log_flushed_offset``, read from the node before the kill; the
  store flushes only when asked here, its periodic flushes being an hour apart), and
- the end offset recorded in its Raft snapshot (``raft.snapshot``),

and starts them again. The Raft journal is kept whole: it is what SYNC_FLUSH (``dledger.flush_disk_type``)
syncs before any entry is acknowledged, and after a compaction it holds only the entries after the snapshot.
But each journal gets one more append torn by the loss (its header counting a record whose pages never landed):
before ``dledger/patches.py`` 25 no member started again (``struct.error`` reading ``raft.journal``).

Before the fix, a snapshot recorded the applied end offset whatever had been synced: with ASYNC_FLUSH every
member came back with a snapshot past the end of its commit log, closed its apply gate to copy the missing bytes
from a peer, and no peer had them: no member served reads again (nor applied, so no send could be answered). Now
a snapshot is put in place only once the commit log is on disk up to its end (``dledger/snapshot.py``), so the
smaller of the two is the snapshot's end, the worst a power loss can leave: the journal writes the rest again,
the group serves every acknowledged message at the queue offset its send returned, and the members' logs are
identical. (With SYNC_FLUSH the leader had synced every message it acknowledged, so here the followers copied
from it even before the fix; its own snapshot could run ahead of its flush only for the moment between an apply
and that send's fdatasync, too short to hit on purpose.)
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import trio

from client import open_admin, open_producer
from dledger.member import read_snapshot
from tests.cluster.test_damaged_store import OVERRIDES, QUEUES, STORE, TOPIC, _check_store, _send
from tests.cluster.test_e2e_produce_consume import GROUP, start_cluster, verify_output
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PAGE = 4096
HOUR_MS = str(3_600_000)
# Compaction every 40 entries (and not by time); the store syncs only when asked (a SYNC_FLUSH send, a snapshot).
POWER_LOSS = {**OVERRIDES, "dledger.log_compaction_min_entries": "40", "dledger.log_compaction_min_time_s": "3600",
              "store.flush_interval_ms": HOUR_MS, "store.flush_consume_queue_interval_ms": HOUR_MS}


def _tear_journal(journal: Path) -> None:
    """One more append in flight at the loss: the header's end offset (bytes 36..40) landed, the record did not."""
    with open(journal, "r+b") as f:
        f.seek(36)
        (end,) = struct.unpack("<I", f.read(4))
        f.seek(0, os.SEEK_END)
        if f.tell() < end + 2 * PAGE:
            f.truncate(end + 2 * PAGE)
        f.seek(end)
        f.write(bytes(PAGE))
        f.seek(36)
        f.write(struct.pack("<I", end + PAGE))


def _lose_unsynced(store_dir: Path, keep: int) -> None:
    """Zero the commit log from the first page boundary at or after ``keep``: the rest of the page holding
    ``keep`` may have been written with it, nothing later was (segments stay at their full size, as created)."""
    segment = STORE["segment_size_bytes"]
    zero_from = -(-keep // PAGE) * PAGE
    for name in sorted(os.listdir(store_dir / "commitlog")):
        start = int(name)
        if start + segment <= zero_from:
            continue
        path = store_dir / "commitlog" / name
        with open(path, "r+b") as f:
            skip = max(zero_from - start, 0)
            f.seek(skip)
            f.write(bytes(segment - skip))


async def _settled(admin, addrs: dict[str, str], snapshot: dict[str, Path]) -> dict[str, tuple[int, int, int]]:
    """Once every member has applied the same log and a snapshot, and nothing moved for a second: per member its
    snapshot's end offset, its synced offset and its end."""
    def snapshot_end(nid: str) -> int | None:
        try:
            return read_snapshot(snapshot[nid])["end_offset"]
        except (OSError, ValueError):
            return None

    last = None
    with trio.fail_after(60):
        while True:
            now = {}
            for nid, addr in addrs.items():
                status = await admin.broker_status(addr)
                now[nid] = (snapshot_end(nid), status["commit_log_flushed_offset"], status["commit_log_max_offset"])
            if now == last and all(end is not None for end, _, _ in now.values()) \
                    and len({top for _, _, top in now.values()}) == 1:
                return now
            last = now
            await trio.sleep(1.0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flush", ["ASYNC_FLUSH", "SYNC_FLUSH"])
async def test_a_group_whose_members_all_lost_power_after_compaction_serves_every_message_again(spawn, tmp_path,
                                                                                                  flush):
    overrides = {**POWER_LOSS, "store.flush_disk_type": f'"{flush}"', "dledger.flush_disk_type": f'"{flush}"'}
    cluster = await start_cluster(spawn, tmp_path, overrides)
    await cluster.create_topic(TOPIC, QUEUES)
    acked: dict[str, tuple[int, int, bytes]] = {}
    async with open_producer(cluster.namesrv, send_msg_timeout_ms=10_000) as producer:
        await _send(producer, "before", 100, acked)
    node_dir = {nid: tmp_path / "cluster" / GROUP / nid for nid in cluster.nodes}
    async with open_admin(cluster.namesrv) as admin:
        state = await _settled(admin, cluster.addr_of, {nid: d / "dledger" / "raft.snapshot"
                                                         for nid, d in node_dir.items()})
    for proc in cluster.nodes.values():
        proc.kill()
    kept = {}
    for nid, (snapshot_end, synced, end) in state.items():
        kept[nid] = min(snapshot_end, synced)
        _lose_unsynced(node_dir[nid] / "store", kept[nid])
        _tear_journal(node_dir[nid] / "dledger" / "raft.journal")
    print(f"{flush}: per member (snapshot end, synced, end) {state}; commit logs kept up to {kept}")
    assert all(0 < snapshot_end for snapshot_end, _, _ in state.values()), state  # compaction ran on each
    for nid in cluster.nodes:
        await trio.to_thread.run_sync(cluster.start, nid)

    members = ",".join(cluster.addr_of[nid] for nid in cluster.nodes)
    async with open_admin(cluster.namesrv) as admin:
        with trio.move_on_after(30):
            while True:
                status = {nid: await admin.broker_status(addr) for nid, addr in cluster.addr_of.items()}
                if all(s["serving_reads"] for s in status.values()):
                    break
                await trio.sleep(0.5)
    stuck = {nid: (s["commit_log_max_offset"], s["last_applied_index"]) for nid, s in status.items()
             if not s["serving_reads"]}
    assert not stuck, f"members still waiting, 30 s after the restart, to copy commit-log bytes no peer holds " \
                      f"(commit log end, applied index): {stuck}"
    await cluster.leader_addr()
    async with open_producer(cluster.namesrv, send_msg_timeout_ms=10_000) as producer:
        await _send(producer, "after", 20, acked)
    output = await verify_output(raftmq_argv("verify", "--group", GROUP, "--members", members), timeout_s=30)
    assert b"are identical" in output, output
    for nid, proc in cluster.nodes.items():
        assert proc.alive, (nid, proc.output[-20:])
        proc.stop()
    for nid in cluster.nodes:
        problems = await trio.to_thread.run_sync(_check_store, node_dir[nid] / "store", acked)
        assert not problems, (nid, problems[:10])
