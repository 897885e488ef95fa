"""The CLI's output going nowhere: a reader that closed its end of the pipe (``raftmq admin ... | head -1``)
ends the command quietly with the shell's SIGPIPE status, not a BrokenPipeError traceback."""

from __future__ import annotations

import os
import subprocess

from raftmq.cli import EXIT_BROKEN_PIPE
from tests.procs import raftmq_argv


def test_a_closed_stdout_ends_the_command_quietly():
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to write_end now fails with EPIPE
    try:
        # Port 1: nothing listens, so --json prints its one error line, straight into the closed pipe.
        done = subprocess.run(raftmq_argv("admin", "--namesrv", "127.0.0.1:1", "--timeout", "2", "--json", "topics"),
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert done.returncode == EXIT_BROKEN_PIPE == 141
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr
