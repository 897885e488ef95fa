"""A node whose disk fills up, with real processes: node n3's data lives on a small tmpfs the test mounts, and a
file the test writes there leaves it a few MiB, which the load then takes.

The node must stop with exit status 3 and one CRITICAL line naming the full disk. Before, a write through a
mapping into a sparse file (its Raft journal, its consume queues) died of SIGBUS without a word, and a failed
apply was retried on every tick. The group must go on: a follower's loss costs no send, a leader's costs an
election. Once the filler is removed and the node is started again, it must catch up; the three commit logs
must be identical, and every acknowledged message must be consumed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from dledger.service import transfer_leadership
from remoting.transport import open_remoting_client
from tests.cluster.test_e2e_produce_consume import GROUP, Cluster, start_cluster, under_load, verify_output
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.load, pytest.mark.slow]

TOPIC = "DiskFullTopic"
VICTIM = "n3"
TMPFS_BYTES = 64 << 20
LEFT_FREE_BYTES = 6 << 20
# Small files, so the node's own files take little of the tmpfs before the filler; appends are never refused
# for disk usage (disk_reject_ratio 1.0), so the leader runs out too instead of refusing sends first.
OVERRIDES = {
    "store.segment_size_bytes": str(2 << 20), "store.max_message_size": str(64 << 10),
    "store.index_hash_slots": "1000", "store.index_max_entries": "20000",
    "store.consume_queue_units_per_file": "20000", "store.disk_reject_ratio": "1.0",
}


def _mount_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "mount/umount not found"
    return None


@contextlib.contextmanager
def _tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                          capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        reason = f"mount -t tmpfs failed: {done.stderr.strip()}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, timeout=10).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)


def _fill(mount: Path, leave_bytes: int) -> Path:
    """A file taking all but ``leave_bytes`` of the file system at ``mount``."""
    st = os.statvfs(mount)
    free = st.f_bavail * st.f_frsize
    filler = mount / "filler"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.posix_fallocate(fd, 0, max(free - leave_bytes, 1))
    finally:
        os.close(fd)
    return filler


@pytest.mark.timeout(240)
@pytest.mark.parametrize("role", ["follower", "leader"])
async def test_a_node_whose_disk_fills_stops_cleanly_and_catches_up_once_freed(spawn, tmp_path, figure, role):
    reason = _mount_unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the disk-full test must run in CI: {reason}")
        pytest.skip(reason)
    victim_dir = tmp_path / "cluster" / GROUP / VICTIM  # where write_broker_configs puts n3's data
    with _tmpfs(victim_dir, TMPFS_BYTES):
        cluster: Cluster | None = None
        try:
            cluster = await start_cluster(spawn, tmp_path, OVERRIDES)
            await _fill_the_victim_under_load(cluster, victim_dir, figure, role)
        finally:
            if cluster is not None and VICTIM in cluster.nodes:
                await trio.to_thread.run_sync(cluster.nodes[VICTIM].stop)  # its files hold the mount


async def _fill_the_victim_under_load(cluster: Cluster, victim_dir: Path, figure, role: str) -> None:
    await cluster.create_topic(TOPIC, 4)
    victim_addr = cluster.addr_of[VICTIM]
    leader_addr = await cluster.leader_addr()
    wanted_leader = victim_addr if role == "leader" else min(a for a in cluster.addr_of.values()
                                                              if a != victim_addr)
    if leader_addr != wanted_leader:
        async with open_remoting_client() as rpc:
            await transfer_leadership(rpc, leader_addr, GROUP, cluster.node_at(wanted_leader), timeout_s=10)
        with trio.fail_after(20):
            while await cluster.leader_addr() != wanted_leader:
                await trio.sleep(0.1)

    victim = cluster.nodes[VICTIM]
    # 4 KiB bodies, so the load fills the disk's last MiBs within a second or two.
    async with under_load(cluster, TOPIC, "disk_full_group", body_size=4000, pause_s=0.001) as load:
        await trio.sleep(1)
        filler = _fill(victim_dir, LEFT_FREE_BYTES)
        filled_at = time.monotonic()
        with trio.move_on_after(60):
            while victim.alive:
                await trio.sleep(0.05)
        exited_after = time.monotonic() - filled_at
        rc = await trio.to_thread.run_sync(victim.stop)
        acked_at_exit, failed_at_exit = len(load.acked), len(load.failed)
        await trio.sleep(2)  # the two others go on without it
        acked_without_it = len(load.acked) - acked_at_exit
        failed_without_it = len(load.failed) - failed_at_exit
        filler.unlink()
        await trio.to_thread.run_sync(cluster.start, VICTIM)
        await trio.sleep(2)  # it catches up under load

    verified = await verify_output(raftmq_argv("verify", "--group", GROUP, "--members",
                                               ",".join(cluster.addr_of.values())))
    critical = [line.strip() for line in victim.output if " CRITICAL " in line]
    figure(f"{role} {VICTIM}'s disk filled: it exited with status {rc} {exited_after:.2f} s later; "
           f"{acked_without_it} acked and {failed_without_it} failed in the 2 s after; {len(load.acked)} acked in "
           f"all, {len(load.failed)} failed ({dict(Counter(load.failed))}), {load.duplicates()} duplicates; "
           f"{critical[-1] if critical else 'no CRITICAL line'}")
    assert rc == 3, f"{VICTIM} ended with status {rc}, not 3 (a negative status is the signal that killed it)"
    assert critical and "No space left on device" in critical[-1], critical
    assert acked_without_it > 0, "nothing was acknowledged after the node stopped"
    if role == "follower":
        assert failed_without_it == 0, f"{failed_without_it} sends failed while only a follower was gone"
    assert not load.missing(), f"{len(load.missing())} acknowledged messages were never consumed"
    assert b"are identical" in verified, verified
