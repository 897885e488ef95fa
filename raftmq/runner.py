"""Running a trio server from the CLI: ready line, clean shutdown on SIGTERM/SIGINT.

Every server prints exactly one ready line once it is listening, ``ready kind=<kind> key=value ...``; the test
process fixtures and ``raftmq dev`` parse it to learn the bound ports (servers bind port 0 in tests).
"""

from __future__ import annotations

import gc
import logging
import os
import resource
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from remoting.config import ConfigError
from remoting.errors import FatalServerError

log = logging.getLogger(__name__)

# Exit status of a server stopped by a FatalServerError (2 is a usage or config error, as argparse's).
EXIT_FATAL = 3

# Set by a supervisor (``raftmq dev``, ``raftmq chaos``) to its own PID: the server shuts down cleanly once that
# process is no longer its parent. The children run in sessions of their own, so a Ctrl-C reaches only the
# supervisor, which stops them by PID; a supervisor killed outright (SIGKILL, a test's timeout) would otherwise
# leave them running, holding their ports and data directories.
PARENT_PID_ENV = "RAFTMQ_EXIT_WITH_PARENT"
PARENT_CHECK_INTERVAL_S = 0.5

# What a server does on SIGTERM/SIGINT before it stops serving, bounded by DRAIN_TIMEOUT_S (run_until_signalled).
Drain = Callable[[], Awaitable[None]]
# Well below the 10 s after which `raftmq dev` (its --stop-timeout) SIGKILLs a child that has not exited.
DRAIN_TIMEOUT_S = 5.0

# The cyclic GC's first threshold. Python's 700 net container allocations is far below what a busy leader keeps
# alive at once: every request in flight holds its frame, dicts and callbacks until its Raft commit. So the GC
# ran ~200 times a second, each time promoting in-flight objects that died a millisecond later, and a full
# collection (~13 ms) followed every half second: 5 % of the leader's CPU, and a pause of the whole group's
# pipeline each time. The servers' garbage is freed by reference counting; the rare cycle is still collected.
GC_GEN0_THRESHOLD = 20_000
# The soft limit on open files a server raises itself to when the hard limit is unlimited.
OPEN_FILES_TARGET = 1 << 20


def announce_ready(kind: str, **fields: Any) -> None:
    parts = [f"kind={kind}", f"pid={os.getpid()}"] + [f"{k}={v}" for k, v in fields.items()]
    print("ready " + " ".join(parts), flush=True)


def run_until_signalled(main: Callable[[trio.Nursery], Awaitable[Drain | None]], *,
                        stop_while_starting: bool = False) -> int:
    """Run ``main(nursery)`` (which starts the servers and returns) until SIGTERM or SIGINT, then cancel
    everything and return 0. Servers do their final flush in their own shielded ``finally`` blocks. A
    ``FatalServerError`` stops everything the same way and returns ``EXIT_FATAL`` after logging it.

    A ``ConfigError`` raised by ``main`` while it starts the servers (a listen address this host cannot bind:
    ``start_error`` turns such an OSError into one) leaves as itself, out of trio's exception groups, so the CLI
    ends with its one line and exit status 2 as for any other config error.

    ``main`` may return a *drain*: an async function run on the signal while everything still serves (a broker
    leader hands its leadership over), for at most ``DRAIN_TIMEOUT_S``; a second signal cuts it short.

    A signal that comes while ``main`` runs is held until it returns, unless ``stop_while_starting``: then ``main`` is
    cancelled at once (a supervisor such as ``raftmq dev``, whose start waits a minute and more for its children,
    stops what it started in its own ``except``/``finally``), and SIGINT ends with KeyboardInterrupt once trio has
    returned (the CLI's exit 130, as ``run_interruptible``), SIGTERM with 0."""

    raise_open_files_limit()
    started = False
    interrupted = False

    async def _run() -> None:
        nonlocal started, interrupted
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                drain: Drain | None = None

                async def _wait_signal() -> None:
                    nonlocal interrupted
                    received = signals.__aiter__()
                    signum = await received.__anext__()
                    log.info("shutting down signal=%s%s", signal.Signals(signum).name,
                             "" if started else " (while starting)")
                    if not started:
                        interrupted = signum == signal.SIGINT
                    elif drain is not None:
                        async with trio.open_nursery() as draining:
                            async def _cut_short() -> None:
                                again = await received.__anext__()
                                log.info("second signal=%s: stopping without waiting", signal.Signals(again).name)
                                draining.cancel_scope.cancel()

                            draining.start_soon(_cut_short)
                            with trio.move_on_after(DRAIN_TIMEOUT_S):
                                await drain()
                            draining.cancel_scope.cancel()
                    nursery.cancel_scope.cancel()

                def _watch() -> None:
                    nursery.start_soon(_wait_signal)
                    parent = _supervisor_pid()
                    if parent is not None:
                        nursery.start_soon(_exit_with_parent, parent, nursery.cancel_scope)

                if stop_while_starting:
                    _watch()
                drain = await main(nursery)
                started = True
                tune_gc()
                if not stop_while_starting:
                    _watch()

    try:
        trio.run(_run)
    except BaseExceptionGroup as group:
        config_errors = leaf_exceptions(group)
        if all(isinstance(e, ConfigError) for e in config_errors):
            raise config_errors[0] from None
        fatal, rest = group.split(FatalServerError)
        if fatal is None or rest is not None:
            raise
        # An expected way to stop (the error says what to do): one line for the operator, not a traceback.
        for error in leaf_exceptions(fatal):
            log.critical("stopping: %s", error)
        sys.stdout.flush()
        return EXIT_FATAL
    sys.stdout.flush()
    if interrupted:
        raise KeyboardInterrupt
    return 0


def run_interruptible(async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """``trio.run(async_fn, *args)`` for a command: Ctrl-C (SIGINT) cancels the run, and KeyboardInterrupt is
    raised once trio has returned (the CLI exits 130). Left to trio, the KeyboardInterrupt is raised wherever
    the signal lands; one that landed in trio's own bookkeeping of a task ending came out as TrioInternalError
    with a traceback and exit 1 (``tests/unit/test_cli_output.py``, once under ``make test``). What ``async_fn``
    raises leaves as itself, not in an exception group. Off the main thread (a command run from a test's worker
    thread), or with SIGINT not Python's default (ignored, as in a background job), this is ``trio.run``: only the
    main thread can take signals, and an ignored Ctrl-C stays ignored."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        return trio.run(async_fn, *args)
    interrupted = False

    async def _main() -> Any:
        watching = trio.Event()
        with trio.CancelScope() as scope:
            async def _watch() -> None:
                nonlocal interrupted
                with trio.open_signal_receiver(signal.SIGINT) as signals:
                    watching.set()
                    async for _ in signals:
                        interrupted = True
                        scope.cancel()
                        return

            trio.lowlevel.spawn_system_task(_watch)
            await watching.wait()
            return await async_fn(*args)
        return None

    result = trio.run(_main)
    if interrupted:
        raise KeyboardInterrupt
    return result


def start_error(what: str, group: BaseExceptionGroup[OSError]) -> ConfigError:
    """The ConfigError for a server that could not start because the host refused what its config asks (an
    address in use or not this host's, a name that does not resolve, a directory it may not write): ``what``
    says which server and config value."""
    error = leaf_exceptions(group)[0]
    if isinstance(error, OSError) and error.strerror:  # "[Errno 98] ..." says nothing an operator needs
        reason = error.strerror if error.filename is None else f"{error.strerror}: {str(error.filename)!r}"
    else:
        reason = str(error)
    return ConfigError(f"{what}: {reason}")


def _supervisor_pid() -> int | None:
    value = os.environ.get(PARENT_PID_ENV)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        log.warning("ignoring %s=%r: not a process id", PARENT_PID_ENV, value)
        return None


async def _exit_with_parent(parent: int, scope: trio.CancelScope) -> None:
    while os.getppid() == parent:
        await trio.sleep(PARENT_CHECK_INTERVAL_S)
    log.warning("shutting down: the supervising process %d is gone", parent)
    scope.cancel()


def raise_open_files_limit() -> None:
    """Raise the soft limit on open files to the hard one. Client connections, the store's files and the Raft
    links share one descriptor table; the soft limit is often 1,024, which a burst of client connections can
    use up, and a node that still cannot open its next store file after a short wait stops (status 3).
    RocketMQ's guides raise it with ``ulimit -n``; this does it for every server, as far as the hard limit
    allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, OPEN_FILES_TARGET)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open files limit from %d to %d: %s", soft, target, e)
            return
        log.info("open files limit raised from %d to %d", soft, target)


def tune_gc() -> None:
    """For a server that has finished starting: what it built so far (modules, config, tables) lives as long as
    the process, so it moves out of the collector's sight (``gc.freeze``), and young collections wait for
    ``GC_GEN0_THRESHOLD`` allocations."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


def leaf_exceptions(error: BaseException) -> list[BaseException]:
    """Every exception in ``error`` that is not itself a group, however deeply nested (trio nests them);
    ``[error]`` for an exception that is no group."""
    if not isinstance(error, BaseExceptionGroup):
        return [error]
    out: list[BaseException] = []
    for e in error.exceptions:
        out += leaf_exceptions(e)
    return out
