"""A member whose Raft data directory is gone but whose state machine still holds a log starts rejoining by
itself (dledger/patches.py, 19): its empty Raft log would otherwise grant any vote. The cluster-level outcome
(no acknowledged message lost) is tests/cluster/test_rejoin.py's ``raft_data`` case."""

from __future__ import annotations

import shutil

import pytest

from dledger.member import RaftMember
from tests.integration.dledger.helpers import make_configs, open_log


def _start(config, log) -> RaftMember:
    return RaftMember(config, log, notify=lambda kind, value: None)


@pytest.mark.parametrize("case, rejoining", [
    ("new member, empty log", False),
    ("log kept, Raft data kept", False),
    ("log kept, Raft data lost", True),
    ("log kept, Raft data lost, detection off", False),
])
def test_a_log_without_raft_data_rejoins(tmp_path, case, rejoining):
    config = make_configs(tmp_path, rejoin_without_raft_data="detection off" not in case)[0]
    log = open_log(tmp_path, config.self_id)
    member = _start(config, log)  # first start: creates the journal
    try:
        assert not member.rejoining
        if case != "new member, empty log":
            prepared = log.prepare_batch([b"acknowledged"], log.end_offset, 1, fresh=True)
            log.apply_batch(prepared.payload, 1, 0)
    finally:
        member.close()
    if "lost" in case:
        shutil.rmtree(config.data_dir)
    member = _start(config, log)
    try:
        assert member.rejoining is rejoining
    finally:
        member.close()
        log.close()
