"""How a server process ends: 0 on a signal, EXIT_FATAL with one CRITICAL line on a FatalServerError, and any
other error raised as it is (a bug keeps its traceback)."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import trio

from dledger import MemberDivergedError
from raftmq.runner import EXIT_FATAL, run_until_signalled


def test_a_fatal_server_error_ends_the_process_with_one_line_and_its_own_status(caplog):
    async def main(nursery: trio.Nursery) -> None:
        async def fail() -> None:
            await trio.sleep(0.01)
            raise MemberDivergedError("broker-a", "n2", 4096, "queue T:1 expects 7")
        nursery.start_soon(fail)

    with caplog.at_level(logging.CRITICAL, logger="raftmq.runner"):
        assert run_until_signalled(main) == EXIT_FATAL
    (record,) = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert record.getMessage().startswith("stopping: member n2 of group broker-a has diverged from the group at "
                                          "commit-log offset 4096 (queue T:1 expects 7)")
    assert record.exc_info is None


def test_other_errors_keep_their_traceback():
    async def main(nursery: trio.Nursery) -> None:
        async def fail() -> None:
            raise KeyError("a bug")
        nursery.start_soon(fail)

    with pytest.raises(BaseExceptionGroup) as info:
        run_until_signalled(main)
    assert info.group_contains(KeyError)


def test_a_signal_stops_the_server_with_status_0():
    async def main(nursery: trio.Nursery) -> None:
        async def signal_soon() -> None:
            await trio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
        nursery.start_soon(signal_soon)

    assert run_until_signalled(main) == 0
