"""Members whose commit log lost a tail that their Raft journal still holds, with real processes.

After a power loss the Raft journal and the commit log may keep different amounts of what was written last (each
is synced on its own schedule), and the last page of the commit log may read as zeros. The test kills nodes of
broker-a after a load, zeroes the end of their last segment (the last 5,000 to 15,000 bytes: a cut inside a
record, and so inside a Raft entry) and removes their checkpoint, so recovery verifies and cuts the tail, then
starts them again: one follower, the leader, or all three at once with a different loss each.

Every node must end with the group's log: identical segments, every acknowledged message at the queue offset its
send returned, in its own commit log, ConsumeQueue and index. Before, the entry the cut fell in was replayed as a
duplicate (it started before the end), so its last records were never written again, and every later entry
started past the end and was rejected, for good: the node served a short log as a follower, or, elected, planned
new entries on it. And recovery kept the record the cut fell in when only its keys were zeroed, so the node's log
differed from the group's at that record.

A node whose log holds, where an entry it replays goes, a record the group never wrote (here: one body byte
changed, its CRC made to match) stops with one CRITICAL line naming the offset, and exit status 3: before, the
entry was skipped as a duplicate and the node served that record.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
from crc32c import crc32c

from client import open_producer
from tests.cluster.test_damaged_store import OVERRIDES, QUEUES, TOPIC, _check_store, _send
from tests.cluster.test_e2e_produce_consume import GROUP, Cluster, start_cluster, verify_output
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# No Raft log compaction: a member then gets back what recovery cut by replaying its journal. (With a snapshot
# past its end it copies from a peer instead, which tests/cluster/test_dledger_restart.py covers; a snapshot past
# every member's end would name bytes no member holds.)
NO_COMPACTION = {**OVERRIDES, "dledger.log_compaction_min_entries": "1000000",
                 "dledger.log_compaction_min_time_s": "86400"}


def _last_segment(store_dir: Path) -> tuple[Path, bytes, int]:
    """The last commit-log segment, its bytes and where its data ends."""
    path = store_dir / "commitlog" / sorted(os.listdir(store_dir / "commitlog"))[-1]
    data = path.read_bytes()
    return path, data, len(data.rstrip(b"\x00"))


def _lose_tail(store_dir: Path, nbytes: int) -> None:
    path, data, used = _last_segment(store_dir)
    with open(path, "r+b") as f:
        f.seek(used - nbytes)
        f.write(bytes(nbytes))
    os.unlink(store_dir / "checkpoint")


async def _kill_and_restart(cluster: Cluster, victims: list[str], damage) -> None:
    for nid in victims:
        cluster.nodes[nid].kill()
    for i, nid in enumerate(victims):
        damage(i, nid)
    for nid in victims:
        await trio.to_thread.run_sync(cluster.start, nid)


async def _loaded_cluster(spawn, tmp_path, acked: dict[str, tuple[int, int, bytes]]) -> tuple[Cluster, str]:
    """A group without log compaction holding 300 acknowledged messages (noted in ``acked``), and its leader."""
    cluster: Cluster = await start_cluster(spawn, tmp_path, NO_COMPACTION)
    await cluster.create_topic(TOPIC, QUEUES)
    async with open_producer(cluster.namesrv, send_msg_timeout_ms=10_000) as producer:
        await _send(producer, "before", 300, acked)
    return cluster, cluster.node_at(await cluster.leader_addr())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("who", ["a_follower", "the_leader", "all_three"])
async def test_members_that_lost_a_tail_write_it_again_from_the_group(spawn, tmp_path, who):
    acked: dict[str, tuple[int, int, bytes]] = {}
    cluster, leader = await _loaded_cluster(spawn, tmp_path, acked)
    victims = {"a_follower": [next(n for n in cluster.nodes if n != leader)], "the_leader": [leader],
               "all_three": list(cluster.nodes)}[who]
    store_dir = {nid: tmp_path / "cluster" / GROUP / nid / "store" for nid in cluster.nodes}
    await _kill_and_restart(cluster, victims, lambda i, nid: _lose_tail(store_dir[nid], 5000 * (i + 1)))
    await cluster.leader_addr()
    async with open_producer(cluster.namesrv, send_msg_timeout_ms=10_000) as producer:
        await _send(producer, "after", 100, acked)
    members = ",".join(cluster.addr_of[nid] for nid in cluster.nodes)
    output = await verify_output(raftmq_argv("verify", "--group", GROUP, "--members", members), timeout_s=30)
    assert b"are identical" in output, output
    for nid, proc in cluster.nodes.items():
        assert proc.alive, (nid, proc.output[-20:])
        assert not [line for line in proc.output if "batch rejected" in line], nid
        proc.stop()
    for nid, path in store_dir.items():
        problems = await trio.to_thread.run_sync(_check_store, path, acked)
        assert not problems, (nid, problems[:10])


@pytest.mark.timeout(300)
async def test_a_member_holding_a_record_the_group_never_wrote_stops_naming_its_offset(spawn, tmp_path):
    acked: dict[str, tuple[int, int, bytes]] = {}
    cluster, leader = await _loaded_cluster(spawn, tmp_path, acked)
    follower = next(n for n in cluster.nodes if n != leader)
    store_dir = tmp_path / "cluster" / GROUP / follower / "store"

    def change_a_record_then_lose_the_tail(_i: int, _nid: str) -> None:
        # The second-to-last record gets another body byte (and the CRC that goes with it), and the tail is lost
        # from inside the last record: recovery keeps the changed record, valid as it is, and the Raft journal
        # replays the entry that holds it over it.
        path, data, used = _last_segment(store_dir)
        records, pos = [], 0
        while pos < used:
            size = int.from_bytes(data[pos:pos + 4], "big")
            records.append(pos)
            pos += size
        changed, last = records[-2], records[-1]
        body_len = int.from_bytes(data[changed + 84:changed + 88], "big")
        body = bytearray(data[changed + 88:changed + 88 + body_len])
        body[0] ^= 0x20
        with open(path, "r+b") as f:
            f.seek(changed + 8)
            f.write(crc32c(bytes(body)).to_bytes(4, "big"))
            f.seek(changed + 88)
            f.write(bytes(body))
            f.seek(last + 100)
            f.write(bytes(used - last - 100))
        os.unlink(store_dir / "checkpoint")

    await _kill_and_restart(cluster, [follower], change_a_record_then_lose_the_tail)
    proc = cluster.nodes[follower]
    with trio.fail_after(30):
        while proc.alive:
            await trio.sleep(0.1)
    critical = [line for line in proc.output if "CRITICAL" in line]
    assert proc.proc.returncode == 3 and len(critical) == 1, proc.output[-20:]
    assert f"member {follower} of group {GROUP} has diverged from the group at commit-log offset" in critical[0]
    assert "holds other bytes than the committed entry" in critical[0]
