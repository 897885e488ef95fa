"""A second ``raftmq dev`` on a running one's ``--data-dir`` is refused before it writes anything
(raftmq.commands.dev.lock_data_dir), both processes real."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from raftmq.commands.dev import GROUP, NODE_IDS
from remoting.dirlock import DirectoryLock
from tests.procs import raftmq_argv


def _state_files(data_dir: Path) -> dict[str, bytes]:
    names = ["cluster.json", "secret", *(f"{GROUP}-{nid}.toml" for nid in NODE_IDS)]
    return {name: (data_dir / name).read_bytes() for name in names}


@pytest.mark.cluster
def test_a_second_dev_on_a_running_ones_data_dir_is_refused_before_it_writes(tmp_path, spawn):
    # It rewrote cluster.json and the three configs with new ports, then failed on the nodes' store locks (exit 1):
    # the running cluster's files named ports nothing listened on, and the next `raftmq dev` started on those.
    data_dir = tmp_path / "dev"
    first = spawn(raftmq_argv("dev", "--data-dir", str(data_dir), "--base-port", "0"), ready_timeout_s=120)
    before = _state_files(data_dir)
    for again in (["--base-port", "0"], []):
        r = subprocess.run(raftmq_argv("dev", "--data-dir", str(data_dir), *again), capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip() == (f"raftmq: error: --data-dir {str(data_dir)!r} is in use by another process "
                                    f"(pid {first.pid}): two processes writing one directory would corrupt "
                                    f"it"), r.stderr
        assert "ready" not in r.stdout
        assert _state_files(data_dir) == before
    assert first.alive
    first.stop()
    DirectoryLock(data_dir, "--data-dir", "dev.lock").release()  # let go with the process
