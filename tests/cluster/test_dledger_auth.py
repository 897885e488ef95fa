"""A real member process: it refuses to start without a cluster secret, and a peer without the secret is
disconnected before anything it sends is unpickled (the crafted pickle would create a directory)."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import subprocess
import zlib

import pytest
import trio

from raftmq.bench.dledger import make_members, write_node_config
from remoting.transport import open_remoting_client
from tests.integration.dledger.cluster_support import DLedgerCluster, message
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


class _CreatesDirectory:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_member_refuses_to_start_without_a_secret(tmp_path):
    members = make_members(3)
    path = write_node_config(tmp_path / "n0.toml", self_id="n0", members=members, secret="", base_dir=tmp_path)
    done = subprocess.run(raftmq_argv("dledger-node", "--config", str(path)), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "dledger.secret must be at least 16 characters" in done.stderr
    assert not (tmp_path / "n0" / "dledger" / "raft.journal").exists()


def _attack(raft_address: str, frame: bytes) -> bool:
    host, port = raft_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=3) as sock:
        sock.sendall(frame)
        sock.settimeout(3)
        try:
            return sock.recv(1) == b""
        except ConnectionResetError:
            return True


async def test_unauthenticated_peer_is_refused_and_its_pickle_never_loaded(spawn, tmp_path):
    cluster = DLedgerCluster(spawn, tmp_path)
    cluster.start_all()
    target = tmp_path / "pwned"
    payload = zlib.compress(pickle.dumps(_CreatesDirectory(str(target)), protocol=2), 3)
    stock_frame = struct.pack("i", len(payload)) + payload
    raw = pickle.dumps(_CreatesDirectory(str(target)), protocol=5)
    forged_frame = struct.pack("i", 32 + len(raw)) + b"\x00" * 32 + raw
    async with open_remoting_client() as client:
        leader = await cluster.wait_leader(client)
        raft = next(m.raft_address for m in cluster.members if m.id == leader)
        for frame in (stock_frame, forged_frame):
            assert await trio.to_thread.run_sync(_attack, raft, frame)
        await trio.sleep(0.3)
        assert not target.exists()
        assert await cluster.wait_leader(client) == leader  # the group did not even notice
        await cluster.append(client, message("after-attack", 1))
    assert cluster.procs[leader].wait_output("raft frame rejected reason=bad_authentication", timeout_s=5)
