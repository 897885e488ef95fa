"""A real ``raftmq`` process whose stdout reader went away (``raftmq dev | head -1``, ``raftmq admin cluster |
head -1``): the shell's 141 (``EXIT_BROKEN_PIPE``) and no traceback, whether the write that failed ran inside
trio (a server's ready line: the BrokenPipeError comes out in trio's exception groups) or in a rich table (rich
turns it into SystemExit(1), the admin commands' "the cluster refused")."""

from __future__ import annotations

import os
import subprocess

import pytest

from raftmq.cli import EXIT_BROKEN_PIPE
from tests.procs import raftmq_argv

pytestmark = pytest.mark.cluster


def _into_closed_pipe(*argv: str) -> subprocess.CompletedProcess:
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to write_end now fails with EPIPE
    try:
        return subprocess.run(raftmq_argv(*argv), stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)


def test_a_ready_line_written_inside_trio_to_a_closed_pipe_exits_141():
    # The name server prints its ready line from inside trio.run, as `raftmq dev` prints its banner: the
    # BrokenPipeError came out in a nursery's exception group, a traceback and exit 1.
    done = _into_closed_pipe("namesrv", "--listen", "127.0.0.1:0")
    assert done.returncode == EXIT_BROKEN_PIPE == 141, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr


def test_an_admin_table_written_to_a_closed_pipe_exits_141(spawn):
    # rich's Console answered the closed pipe with SystemExit(1): exit 1 is "the cluster refused".
    namesrv = spawn(raftmq_argv("namesrv", "--listen", "127.0.0.1:0")).fields["listen"]
    done = _into_closed_pipe("admin", "--namesrv", namesrv, "cluster")  # a table, without rows
    assert done.returncode == EXIT_BROKEN_PIPE, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr


def test_a_bench_table_written_to_a_closed_pipe_exits_141(tmp_path):
    # The benches and chaos print through rich too (raftmq/console.py): its SystemExit(1) said "a target was
    # missed" or "nothing was acknowledged" to a script that only took the first lines.
    done = _into_closed_pipe("bench", "store", "--messages", "2000", "--modes", "ASYNC_FLUSH", "--dir", str(tmp_path))
    assert done.returncode == EXIT_BROKEN_PIPE, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr
