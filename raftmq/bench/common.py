"""Shared pieces of the ``raftmq bench`` commands: latency statistics, a live progress bar, the results table,
and a server process spawned for a benchmark and stopped by PID.

A benchmark's client runs in trio, so the progress bar is refreshed by a trio task (``show_progress``) rather
than by rich's own refresh thread, which would take the GIL from the measured loop at its own pace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import selectors
import signal
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from client.instance import (ACCESS_KEY_ENV, NAMESRV_ADDR_ENV, SECRET_KEY_ENV, TLS_CA_FILE_ENV, TLS_ENABLE_ENV,
                             tls_settings)
from raftmq.runner import leaf_exceptions, run_interruptible
from remoting.config import ConfigError, check_text, parse_host_port
from remoting.tls import client_context

T = TypeVar("T")

__all__ = [
    "BenchError", "LatencySummary", "ReadyProcess", "add_credential_args", "add_tls_args", "check_credentials",
    "check_namesrv_arg", "check_range", "check_tls_args", "exported_credentials", "format_value", "json_safe",
    "make_dir", "namesrv_from_env", "percentile", "print_json", "print_json_error", "print_table", "run_bench",
    "show_progress", "spawn_ready_process", "summarize_latencies", "tls_context_from_args",
]


class BenchError(RuntimeError):
    """A bench that could not run against its cluster (nothing to reach, a phase that never ended): one
    sentence for the user, exit 1, instead of a trio.TooSlowError traceback."""


def machine_speed(rounds: int = 201) -> dict[str, float]:
    """Two reference timings of this machine, the median of ``rounds``, for a bench's report: a VM's speed drifts,
    and a figure is only comparable with one taken when these read the same (docs/benchmarks.md, twenty-third
    session: within an hour the mean 480 KiB copy went from 9.95 to 12.45 µs, and every process's CPU per
    message rose with it). ``copy_480k_us``: copying 480 KiB of bytes (an entry under batched sends; memory
    bound); ``python_loop_us``: a fixed loop of dict lookups and additions (interpreter bound). The median, not
    the best: the fastest copies are the cache-warm ones, which hid that drift (8.8 µs best, 10.1 median)."""
    if type(rounds) is not int or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    buf = bytearray(os.urandom(480 * 1024))  # random bytes: real pages, not the shared zero page
    table = {i: i for i in range(256)}

    def loop() -> int:
        total = 0
        for i in range(1000):
            total += table[i & 255]
        return total

    clock = time.perf_counter
    copies: list[float] = []
    loops: list[float] = []
    for _ in range(rounds):
        started = clock()
        bytes(buf)
        copies.append(clock() - started)
        started = clock()
        loop()
        loops.append(clock() - started)
    return {"copy_480k_us": round(statistics.median(copies) * 1e6, 2),
            "python_loop_us": round(statistics.median(loops) * 1e6, 2)}


def run_bench(name: str, main: Callable[[], Awaitable[T]], *, as_json: bool = False) -> T:
    """``trio.run(main)``; a ``BenchError`` raised anywhere in it (trio wraps what a nursery raises in
    exception groups) ends the command with ``raftmq bench NAME: error: ...`` and exit status 1 (and, with
    ``as_json``, its JSON line)."""
    try:
        return run_interruptible(main)
    except BaseException as e:
        leaves = leaf_exceptions(e)
        known = next((x for x in leaves if isinstance(x, BenchError)), None)
        if known is None:
            raise
        if as_json:
            print_json_error([str(known)], 1)
        raise SystemExit(f"raftmq bench {name}: error: {known}") from None


@dataclass(frozen=True, slots=True)
class LatencySummary:
    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, nearest-rank; NaN when there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q!r}")
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize_latencies(latencies_ns: Iterable[int]) -> LatencySummary:
    values = sorted(latencies_ns)
    if not values:
        return LatencySummary(0, math.nan, math.nan, math.nan, math.nan, math.nan)
    ms = 1e-6
    return LatencySummary(len(values), sum(values) / len(values) * ms, percentile(values, 50) * ms,
                          percentile(values, 90) * ms, percentile(values, 99) * ms, values[-1] * ms)


def check_range(name: str, value: float, lo: float, hi: float) -> None:
    """Reject an out-of-range option with a sentence naming it (the CLI turns ConfigError into exit 2)."""
    if not lo <= value <= hi:
        # Integral bounds in full: "{:g}" would print 4 MiB as 4.1943e+06.
        bounds = "..".join(str(int(b)) if float(b).is_integer() else f"{b:g}" for b in (lo, hi))
        raise ConfigError(f"{name} must be within {bounds}, got {value!r}")


def check_namesrv_arg(value: str, flag: str = "--namesrv") -> None:
    """``--namesrv HOST:PORT[,HOST:PORT...]`` of a command that dials name servers: each address parsed, and
    port 0 (which only means "any free port" to a listener) refused: it was dialled and came back as a
    connection refused, a cluster failure."""
    addrs = [a.strip() for a in value.replace(";", ",").split(",") if a.strip()]
    if not addrs:
        raise ConfigError(f"{flag} needs HOST:PORT, got {value!r}")
    for addr in addrs:
        parse_host_port(addr, key=flag, dial=True)


def add_credential_args(parser: Any, *, defaults: bool = True) -> None:
    """``--access-key`` / ``--secret-key`` of a command that talks to brokers with ACL on (docs/operations.md,
    "Access control (ACL)"). Left out, the client reads $RAFTMQ_ACCESS_KEY / $RAFTMQ_SECRET_KEY. ``defaults`` False
    adds them without defaults (argparse.SUPPRESS), for options repeated after a subcommand."""
    default = None if defaults else argparse.SUPPRESS
    parser.add_argument("--access-key", default=default, metavar="KEY",
                        help=f"ACL account to sign requests as (default: ${ACCESS_KEY_ENV})")
    parser.add_argument("--secret-key", default=default, metavar="SECRET",
                        help=f"the account's secret key (default: ${SECRET_KEY_ENV}; the variable keeps it out of "
                             f"the process list)")
    # TLS rides along: every command that takes credentials dials name servers and brokers (docs/operations.md,
    # "TLS"), and exported_credentials hands both to the clients it opens.
    add_tls_args(parser, defaults=defaults)


def add_tls_args(parser: Any, *, defaults: bool = True) -> None:
    """``--tls`` / ``--tls-ca-file`` (docs/operations.md, "TLS"), checked by ``check_tls_args``; ``defaults`` as
    for ``add_credential_args``. A command that opens its own remoting client (``raftmq verify``) builds its
    context with ``tls_context_from_args``."""
    parser.add_argument("--tls", action="store_true", default=False if defaults else argparse.SUPPRESS,
                        help=f"connect over TLS (default: ${TLS_ENABLE_ENV})")
    parser.add_argument("--tls-ca-file", default=None if defaults else argparse.SUPPRESS, metavar="PEM",
                        help=f"CA certificates the servers are verified against; implies --tls (default: "
                             f"${TLS_CA_FILE_ENV}, else the system's)")


def check_credentials(args: Any) -> None:
    """Resolve ``args.access_key`` / ``args.secret_key`` (each flag, else its variable, else "") and refuse one
    without the other, naming where each came from: the brokers would refuse every request, far from here."""
    sources = {}
    for name, env in (("access_key", ACCESS_KEY_ENV), ("secret_key", SECRET_KEY_ENV)):
        value = getattr(args, name, None)
        flag = "--" + name.replace("_", "-")
        if value is None:
            value, sources[name] = os.environ.get(env, ""), f"${env}"
        else:
            sources[name] = flag
            if not value.strip():
                raise ConfigError(f"{flag} must not be empty (leave it out for no ACL credentials)")
        # Signed as UTF-8 with every request: bytes that are not raised a UnicodeEncodeError from the signer.
        check_text(sources[name], value)
        setattr(args, name, value)
    if bool(args.access_key) != bool(args.secret_key):
        given, missing = ("access_key", "secret_key") if args.access_key else ("secret_key", "access_key")
        raise ConfigError(f"an ACL access key needs its secret key and the other way round: {sources[given]} is "
                          f"set but {sources[missing]} is not")
    check_tls_args(args)


def check_tls_args(args: Any) -> None:
    """Resolve ``args.tls`` (``--tls-ca-file`` implies it) and read the CA file now, refusing a bad one by its
    flag."""
    ca_file = getattr(args, "tls_ca_file", None)
    if ca_file is not None:
        if not ca_file.strip():
            raise ConfigError("--tls-ca-file must name a file (leave it out for the system's CAs)")
        args.tls = True
        try:
            client_context(ca_file=ca_file)  # read and checked now: a bad file is the one-line error naming it
        except ConfigError as e:
            raise ConfigError(str(e).replace("tls_ca_file", "--tls-ca-file", 1)) from None
    args.tls = bool(getattr(args, "tls", False))


def tls_context_from_args(args: Any) -> ssl.SSLContext | None:
    """The client TLS context of ``args`` (after ``check_tls_args``) for a command that opens a remoting client of
    its own rather than a ClientConfig's: ``--tls`` / ``--tls-ca-file``, else $RAFTMQ_TLS_ENABLE /
    $RAFTMQ_TLS_CA_FILE read as every client reads them (``client.instance.tls_settings``); None for plain TCP."""
    enable, ca_file = tls_settings(enable=True if args.tls else None, ca_file=args.tls_ca_file or None)
    if not enable:
        if ca_file:
            # Ignored, the command would talk plain TCP to a cluster its operator meant to reach over TLS.
            raise ConfigError(f"${TLS_CA_FILE_ENV} is set but TLS is not on: pass --tls (or set ${TLS_ENABLE_ENV}"
                              f"=true) to connect over TLS")
        return None
    return client_context(ca_file=ca_file or None)


@contextlib.contextmanager
def exported_credentials(args: Any) -> Iterator[None]:
    """Within the block, the credentials ``check_credentials`` resolved are the process's $RAFTMQ_ACCESS_KEY and
    $RAFTMQ_SECRET_KEY, which every client config built meanwhile reads (``client.instance.ClientConfig``): so the
    clients a command opens deep down (admin's message commands, a bench's producers) sign with them, none of them
    passed the flags by hand. Restored on exit."""
    saved = {env: os.environ.get(env) for env in (ACCESS_KEY_ENV, SECRET_KEY_ENV, TLS_ENABLE_ENV, TLS_CA_FILE_ENV)}
    os.environ[ACCESS_KEY_ENV], os.environ[SECRET_KEY_ENV] = args.access_key, args.secret_key
    if getattr(args, "tls", False):  # without --tls the variables (if set) decide, as for a client of one's own
        os.environ[TLS_ENABLE_ENV] = "true"
        if getattr(args, "tls_ca_file", None):
            os.environ[TLS_CA_FILE_ENV] = args.tls_ca_file
    try:
        yield
    finally:
        for env, value in saved.items():
            if value is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = value


def namesrv_from_env() -> str | None:
    """What ``NAMESRV_ADDR`` names, for a command's ``--namesrv`` left out (RocketMQ's mqadmin reads it too), or
    None when it is not set; set but empty or malformed, the ConfigError ``--namesrv`` would get, naming it (the
    CLI's exit 2): taken as unset, the command would quietly ask another cluster than the one meant."""
    value = os.environ.get(NAMESRV_ADDR_ENV)
    if value is not None:
        check_namesrv_arg(value, NAMESRV_ADDR_ENV)
    return value


def make_dir(path: Path, flag: str) -> None:
    """Create the directory an option names (parents too, an existing one is fine), or raise a ConfigError
    naming the option (the CLI turns it into exit 2): a file in the way came out as a FileExistsError or
    NotADirectoryError traceback from wherever the directory was first used."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"{flag} {str(path)!r} is a file, not a directory") from None
    except OSError as e:
        raise ConfigError(f"{flag} {str(path)!r} cannot be made: {e.strerror or e}") from None


async def show_progress(console: Console, description: str, total_s: float, completed: Callable[[], int],
                        *, interval_s: float = 0.5) -> None:
    """A progress bar over ``total_s`` seconds showing the running rate of ``completed()``; runs until
    cancelled. Prints nothing when the console is not a terminal (logs and pipes stay clean)."""
    if not console.is_terminal:
        await trio.sleep_forever()
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[rate]}"), console=console, auto_refresh=False, transient=True)
    with progress:
        task = progress.add_task(description, total=total_s, rate="")
        start = time.monotonic()
        last_t, last_n = start, completed()
        while True:
            await trio.sleep(interval_s)
            now, n = time.monotonic(), completed()
            rate = (n - last_n) / (now - last_t) if now > last_t else 0.0
            last_t, last_n = now, n
            progress.update(task, completed=min(now - start, total_s), rate=f"{rate:,.0f}/s")
            progress.refresh()


def print_table(console: Console, title: str, rows: Sequence[tuple[str, Any]]) -> None:
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, format_value(value))
    console.print(table)


def format_value(value: Any) -> str:
    """A table cell: floats to 3 places, integers with thousands separators, a flag as true/false (as in the
    JSON line; a bool is an int to Python, and ``live`` or ``auto_batch`` printed as 1 and 0)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:,.3f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def json_safe(value: Any) -> Any:
    """``value`` with every float that is not finite (a percentile of no samples, a rate over no time) replaced by
    None: ``json.dumps`` wrote them as ``NaN``/``Infinity``, which is not JSON, and strict parsers (jq, JavaScript)
    refuse the whole line."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def print_json(**fields: Any) -> None:
    """One JSON line on stdout, for scripts and tests (``--json``); a figure that is not a number is ``null``."""
    line = {k: asdict(v) if hasattr(v, "__dataclass_fields__") else v for k, v in fields.items()}
    print(json.dumps(json_safe(line), allow_nan=False), flush=True)


def print_json_error(messages: Sequence[str], exit_status: int) -> None:
    """With ``--json``, a failure is one JSON line too (its sentences also go to stderr): ``{"error": first,
    "errors": all, "exit_status": 1 or 2}``. A script reading the JSON line otherwise got nothing to parse."""
    print_json(error=messages[0], errors=list(messages), exit_status=exit_status)


class ReadyProcess:
    """A server started for a benchmark: its ready-line fields, stopped by PID (SIGTERM, then SIGKILL)."""

    def __init__(self, proc: subprocess.Popen[bytes], fields: dict[str, str]) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.fields = fields

    def stop(self, timeout_s: float = 5.0) -> int:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> ReadyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn_ready_process(args: Sequence[str], *, ready_timeout_s: float = 30.0) -> ReadyProcess:
    """Start ``python -m raftmq ARGS`` and wait for its ``ready ...`` line (see ``raftmq.runner``). Its
    stderr goes to ours, so its warnings stay visible (its own error line among them); it is killed if it is not
    ready in time. One that exits or is killed before it is ready is a ``BenchError`` (``run_bench``'s one line,
    not a traceback)."""
    argv = [sys.executable, "-m", "raftmq", *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, bufsize=0)
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + ready_timeout_s
    received = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            # Raw reads and our own line splitting: a buffered readline could hold the ready line in its
            # buffer while select() waits for bytes that never come.
            *lines, received = received.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                if line.startswith("ready "):
                    fields = dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
                    return ReadyProcess(proc, fields)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(remaining):
                ReadyProcess(proc, {}).stop()
                raise BenchError(f"{' '.join(argv)} printed no ready line within {ready_timeout_s:g} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                code = proc.wait(10)
                proc.stdout.close()
                raise BenchError(f"{' '.join(argv)} exited with status {code} before it was ready")
            received += chunk
