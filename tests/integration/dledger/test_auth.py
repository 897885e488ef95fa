"""The Raft port, over real sockets: an unauthenticated peer is disconnected and nothing it sends is
unpickled; members with different secrets never form a group."""

from __future__ import annotations

import pickle
import socket
import struct
import zlib

import pytest
import trio

from dledger import open_dledger_group
from dledger.patches import FrameAuthenticator, encode_frame
from tests.integration.dledger.helpers import make_configs, open_log

pytestmark = pytest.mark.timeout(60)


class _CreatesDirectory:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        import os
        return (os.mkdir, (self.path,))


def _send_and_wait_close(address: str, frame: bytes) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=3) as sock:
        sock.sendall(frame)
        sock.settimeout(3)
        try:
            return sock.recv(1) == b""
        except ConnectionResetError:
            return True


async def test_crafted_frames_are_refused_and_never_unpickled(tmp_path):
    configs = make_configs(tmp_path)
    log = open_log(tmp_path, configs[0].self_id)
    target = tmp_path / "pwned"
    evil = _CreatesDirectory(str(target))
    stock = zlib.compress(pickle.dumps(evil, protocol=2), 3)
    frames = [
        struct.pack("i", len(stock)) + stock,  # stock pysyncobj wire, no secret
        encode_frame(FrameAuthenticator("not-the-cluster-secret"), evil),  # our wire, wrong secret
        struct.pack("i", 40) + b"\x00" * 32 + pickle.dumps(evil)[:8],  # our wire, forged tag
    ]
    async with open_dledger_group(configs[0], log) as group:
        raft = configs[0].self_member.raft_address
        for frame in frames:
            closed = await trio.to_thread.run_sync(_send_and_wait_close, raft, frame)
            assert closed, "the member must drop an unauthenticated connection"
        await trio.sleep(0.3)
        assert not target.exists()
        # Still ticking: alone (its peers are not started), its election timer keeps firing pre-vote rounds. (A
        # term >= 0 was checked before, which a stopped member reports too.)
        ticked = group.statistics().pre_votes
        with trio.fail_after(10):
            while group.statistics().pre_votes <= ticked:
                await trio.sleep(0.05)
    log.close()


async def test_members_with_different_secrets_never_elect(tmp_path):
    configs = make_configs(tmp_path)
    configs[1] = configs[1].replace(secret="a-different-secret-0000")
    logs = [open_log(tmp_path, c.self_id) for c in configs[:2]]
    async with open_dledger_group(configs[0], logs[0]) as g0, open_dledger_group(configs[1], logs[1]) as g1:
        await trio.sleep(2.0)  # several election timeouts (200-500 ms)
        assert not g0.is_leader and not g1.is_leader
        assert g0.leader_id is None and g1.leader_id is None
    for log in logs:
        log.close()


async def test_a_taken_raft_port_is_a_clear_error(tmp_path, caplog):
    """One error naming the port and the bind's reason; pysyncobj's own ERROR "failed to perform initialization"
    and its traceback, logged before it (it was), are dropped, and only for that start."""
    import logging
    import socket as socket_module

    from dledger.member import RaftPortError

    configs = make_configs(tmp_path)
    host, port = configs[0].self_member.raft_address.rsplit(":", 1)
    with socket_module.socket() as squatter:
        squatter.bind((host, int(port)))
        squatter.listen()
        log = open_log(tmp_path, configs[0].self_id)
        caplog.set_level(logging.DEBUG)
        with pytest.raises(RaftPortError, match="could not bind the Raft port") as info:
            async with open_dledger_group(configs[0], log):
                pass
        log.close()
    assert info.value.reason and "in use" in info.value.reason, info.value
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert not [r for r in caplog.records if r.name.startswith("pysyncobj")], caplog.text
    assert not logging.getLogger("pysyncobj.syncobj").filters  # the filter went with the start
