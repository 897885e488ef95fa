"""``raftmq bench produce|consume`` without ``--namesrv`` start a ``raftmq dev`` cluster of their own: what stops it
from starting is one line, not a RuntimeError traceback (exit 1 after the child's own error): a malformed
``RAFTMQ_PORT_RANGE`` is named before anything starts (exit 2, as ``bench dledger`` and ``chaos`` do), and a child
that exits before its ready line ends the bench with ``raftmq bench KIND: error: ...``."""

from __future__ import annotations

import pytest

from raftmq.bench.common import run_bench, spawn_ready_process
from raftmq.cli import main


@pytest.mark.parametrize("kind", ["produce", "consume"])
def test_a_malformed_port_range_exits_2_naming_it_before_a_cluster_is_started(kind, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("NAMESRV_ADDR", raising=False)
    monkeypatch.setenv("RAFTMQ_PORT_RANGE", "9000-")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the bench would make its cluster's directory
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", kind, "--seconds", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == ("raftmq: error: RAFTMQ_PORT_RANGE='9000-': expected LOW-HIGH with 1024 <= LOW <= HIGH "
                           "<= 65535"), err
    assert list(tmp_path.iterdir()) == []


def test_a_process_that_exits_before_it_is_ready_ends_the_bench_with_one_line(tmp_path, capfd):
    async def start() -> None:
        # A real `raftmq dev` that refuses its options: it exits 2 after its own error line.
        spawn_ready_process(["dev", "--data-dir", str(tmp_path / "dev"), "--base-port", "-3"])

    with pytest.raises(SystemExit) as exit_info:
        run_bench("produce", start)
    assert str(exit_info.value.code).startswith("raftmq bench produce: error: ")
    assert str(exit_info.value.code).endswith(" dev --data-dir " + str(tmp_path / "dev") + " --base-port -3 exited "
                                              "with status 2 before it was ready")
    assert "--base-port -3 puts a port outside 1..65535" in capfd.readouterr().err  # the child's own line
