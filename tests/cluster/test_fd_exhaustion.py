"""A node that runs out of file descriptors for a moment, with real processes.

A burst of client connections can take every descriptor a broker process may open; its Raft listener shares
them. Stock pysyncobj closed its listener for good on a failed accept (EMFILE), and its connections go one way
(the member with the greater address connects), so the member with the smallest address was cut off from each
peer whose connection dropped afterwards: a restarted peer never reached it again (dledger/patches.py, 18).
Here that member's limit is lowered to a few descriptors above what it holds, a flood of connections to its
remoting port takes them, one connection to its Raft port meets the failed accept, and the flood is closed and
the limit put back.
A peer restarted afterwards must be connected to it again, and the group must commit with all three.
"""

from __future__ import annotations

import os
import resource
import socket
import time
import tomllib

import pytest
import trio

from client import Message, open_producer
from dledger.service import get_raft_status
from remoting.transport import open_remoting_client
from tests.cluster.test_e2e_produce_consume import GROUP, Cluster, start_cluster, verify_output
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.load, pytest.mark.slow]

TOPIC = "FdTopic"
HEADROOM = 12  # descriptors above what the node holds when its limit is lowered


def _raft_addresses(cluster: Cluster) -> dict[str, str]:
    members = tomllib.loads(cluster.paths["n1"].read_text())["dledger"]["members"]
    return {m["id"]: m["raft_address"] for m in members}


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _connected_peers(addr: str) -> tuple[str, ...]:
    async with open_remoting_client() as rpc:
        status, _ = await get_raft_status(rpc, addr, GROUP)
    return tuple(status["connected_peers"])


@pytest.mark.timeout(120)
async def test_a_member_out_of_descriptors_keeps_its_raft_listener(spawn, tmp_path, figure):
    cluster = await start_cluster(spawn, tmp_path)
    await cluster.create_topic(TOPIC, 4)
    raft = _raft_addresses(cluster)
    # pysyncobj: the member with the greater address connects, so every peer connects to the smallest one.
    victim = min(raft, key=lambda nid: raft[nid])
    peer = max(raft, key=lambda nid: raft[nid])
    proc = cluster.nodes[victim]
    held = _open_fds(proc.pid)
    limit = held + HEADROOM
    original_limit = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (limit, original_limit[1]))  # the soft limit only

    flood: list[socket.socket] = []
    probe = None
    try:
        host, port = proc.address()
        with trio.fail_after(20):
            while _open_fds(proc.pid) < limit:  # trio's accept loop takes them until it meets EMFILE
                flood.append(socket.create_connection((host, port)))
                await trio.sleep(0.01)
        raft_host, raft_port = raft[victim].rsplit(":", 1)
        probe = socket.create_connection((raft_host, int(raft_port)))
        await trio.sleep(1.0)  # its accept fails (EMFILE), again and again while the flood lasts
        full_output = "".join(proc.output)
    finally:
        for s in flood:
            s.close()
        if probe is not None:
            probe.close()
        # The burst is over: the store's next files and the peers' connections need descriptors again.
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, original_limit)
    await trio.sleep(0.5)

    await trio.to_thread.run_sync(cluster.nodes[peer].kill)
    await trio.to_thread.run_sync(cluster.start, peer)
    reconnected_after = None
    restarted_at = time.monotonic()
    with trio.move_on_after(20):
        while peer not in await _connected_peers(cluster.addr_of[victim]):
            await trio.sleep(0.2)
        reconnected_after = time.monotonic() - restarted_at

    async with open_producer(cluster.namesrv) as producer:
        for i in range(50):
            await producer.send(Message(TOPIC, b"after the flood %d" % i))
    verified = await verify_output(raftmq_argv("verify", "--group", GROUP, "--members",
                                               ",".join(cluster.addr_of.values())))
    figure(f"{victim} limited to {limit} descriptors ({held} held), flooded with {len(flood)} connections; "
           f"restarted {peer} "
           + (f"connected to it again {reconnected_after:.2f} s later" if reconnected_after is not None
              else "never connected to it again"))
    assert reconnected_after is not None, f"{peer}, restarted, never connected to {victim} again"
    # Else the test proved nothing: the flood must have made the Raft accept fail.
    assert "raft listener: accept failed" in full_output, "the flood never made the Raft accept fail"
    assert b"are identical" in verified, verified
