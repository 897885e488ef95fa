"""How a server process ends: 0 on a signal, EXIT_FATAL with one CRITICAL line on a FatalServerError, and any
other error raised as it is (a bug keeps its traceback); and how it tunes the collector once started."""

from __future__ import annotations

import gc
import logging
import os
import signal

import pytest
import trio

from dledger import MemberDivergedError
from raftmq.runner import (EXIT_FATAL, GC_GEN0_THRESHOLD, PARENT_PID_ENV, _supervisor_pid, run_interruptible,
                           run_until_signalled, start_error)
from remoting.config import ConfigError


@pytest.fixture(autouse=True)
def _restore_gc():
    # run_until_signalled tunes the collector of the process it runs in: this one, here.
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_a_started_server_freezes_what_it_built_and_collects_young_objects_less_often():
    seen = {}

    async def main(nursery: trio.Nursery) -> None:
        seen["threshold during startup"] = gc.get_threshold()[0]

        async def look_then_stop() -> None:
            await trio.sleep(0.01)
            seen["threshold once started"] = gc.get_threshold()[0]
            seen["frozen"] = gc.get_freeze_count()
            os.kill(os.getpid(), signal.SIGTERM)
        nursery.start_soon(look_then_stop)

    gc.unfreeze()
    assert run_until_signalled(main) == 0
    assert seen["threshold during startup"] != GC_GEN0_THRESHOLD
    assert seen["threshold once started"] == GC_GEN0_THRESHOLD
    assert seen["frozen"] > 1000  # the modules, classes and functions loaded so far


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


def test_a_server_the_host_cannot_start_raises_one_config_error_out_of_the_groups():
    async def serve(*, task_status) -> None:
        async with trio.open_nursery():  # the error comes out of a server's own nursery, wrapped
            raise OSError(98, "Address already in use")

    async def main(nursery: trio.Nursery) -> None:
        try:
            await nursery.start(serve)
        except* OSError as group:
            raise start_error("cannot listen on 127.0.0.1:9876", group) from None

    with pytest.raises(ConfigError, match=r"^cannot listen on 127.0.0.1:9876: Address already in use$"):
        run_until_signalled(main)


def test_start_error_names_the_file_an_os_error_is_about():
    group = BaseExceptionGroup("start", [PermissionError(13, "Permission denied", "/var/lib/raftmq/store")])
    assert str(start_error("broker broker-a node 1 could not start", group)) == (
        "broker broker-a node 1 could not start: Permission denied: '/var/lib/raftmq/store'")


def test_a_signal_stops_the_server_with_status_0():
    async def main(nursery: trio.Nursery) -> None:
        async def signal_soon() -> None:
            await trio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
        nursery.start_soon(signal_soon)

    assert run_until_signalled(main) == 0


def test_a_drain_runs_on_the_signal_while_the_servers_still_serve():
    events = []

    async def main(nursery: trio.Nursery):
        async def serve() -> None:
            try:
                await trio.sleep_forever()
            finally:
                events.append("server cancelled")

        async def signal_soon() -> None:
            await trio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)

        async def drain() -> None:
            events.append("drain started")
            await trio.sleep(0.05)
            events.append("drain done")

        nursery.start_soon(serve)
        nursery.start_soon(signal_soon)
        return drain

    assert run_until_signalled(main) == 0
    assert events == ["drain started", "drain done", "server cancelled"]


@pytest.mark.timeout(60)  # liveness: with the drain's own bound out of reach, only the second signal ends it
def test_a_second_signal_cuts_the_drain_short(monkeypatch):
    import raftmq.runner

    monkeypatch.setattr(raftmq.runner, "DRAIN_TIMEOUT_S", 3600.0)  # so its end is the signal's, not the bound's
    events = []

    async def main(nursery: trio.Nursery):
        async def signal_twice() -> None:
            await trio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
            await trio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)

        async def drain() -> None:
            events.append("drain started")
            try:
                await trio.sleep_forever()
            finally:
                events.append("drain cut short")

        nursery.start_soon(signal_twice)
        return drain

    assert run_until_signalled(main) == 0
    assert events == ["drain started", "drain cut short"]


@pytest.mark.timeout(30)  # without the watch it would serve for ever
def test_a_server_whose_supervisor_is_gone_stops_with_status_0(monkeypatch, caplog):
    # RAFTMQ_EXIT_WITH_PARENT names a process that is not our parent (as after the supervisor died and we were
    # adopted): the server stops as on a signal.
    monkeypatch.setenv(PARENT_PID_ENV, str(os.getppid() + 1_000_000))
    served = []

    async def main(nursery: trio.Nursery) -> None:
        async def serve() -> None:
            served.append("started")
            await trio.sleep_forever()

        nursery.start_soon(serve)

    with caplog.at_level(logging.WARNING, logger="raftmq.runner"):
        assert run_until_signalled(main) == 0
    assert served == ["started"]
    assert "the supervising process" in caplog.text


def test_a_malformed_supervisor_pid_is_ignored_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv(PARENT_PID_ENV, "not-a-pid")
    with caplog.at_level(logging.WARNING, logger="raftmq.runner"):
        assert _supervisor_pid() is None
    assert "not a process id" in caplog.text
    monkeypatch.setenv(PARENT_PID_ENV, str(os.getppid()))
    assert _supervisor_pid() == os.getppid()


def test_a_server_raises_its_open_files_limit_to_the_hard_limit():
    import resource

    from raftmq.runner import raise_open_files_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, 256) if hard == resource.RLIM_INFINITY else min(hard, 256)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        raise_open_files_limit()
        raised, same_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert same_hard == hard
        assert raised == (hard if hard != resource.RLIM_INFINITY else max(lowered, 1 << 20))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_command_run_interruptibly_is_cancelled_by_ctrl_c_and_raises_keyboard_interrupt_after_trio():
    # Trio raises KeyboardInterrupt wherever SIGINT lands; once it landed in trio's bookkeeping of an ending task
    # (TrioInternalError, exit 1 instead of 130). Here the signal only cancels, and the interrupt comes after.
    seen: list[str] = []

    async def command(delay: float) -> str:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            await trio.sleep(delay)
        except trio.Cancelled:
            seen.append("cancelled")
            raise
        return "done"

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's process, whatever runs us
    try:
        with pytest.raises(KeyboardInterrupt):
            run_interruptible(command, 5)
        assert seen == ["cancelled"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back once trio returned
    finally:
        signal.signal(signal.SIGINT, previous)

    async def fails() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):  # as itself, not in an exception group
        run_interruptible(fails)

    async def answers(x: int) -> int:
        await trio.sleep(0)
        return x * 2

    assert run_interruptible(answers, 21) == 42


def test_a_command_run_off_the_main_thread_or_with_sigint_ignored_is_a_plain_trio_run():
    # Only the main thread can take signals (tests call the CLI from worker threads), and a background job's
    # ignored SIGINT must stay ignored.
    import threading

    async def answers() -> str:
        await trio.sleep(0)
        return "ok"

    results: list[object] = []
    worker = threading.Thread(target=lambda: results.append(run_interruptible(answers)))
    worker.start()
    worker.join(10)
    assert results == ["ok"]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert run_interruptible(answers) == "ok"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
