"""``raftmq bench produce``: acknowledged sends per second, MB/s and send latency percentiles.

``--concurrency`` sends are in flight at once (each a task looping send → ack → send), all over the producer's
shared connections; ``--batch N`` makes each send a ``send_batch`` of N messages; ``--concurrency 1`` measures
the latency of one send at a time. Without ``--namesrv`` the bench starts its own cluster (``raftmq dev`` in a
temporary directory) and stops it afterwards. Every loop is bounded by ``--seconds`` and ``--messages``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable

import trio
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from client import Message, SendFailedError, open_admin, open_producer
from remoting.errors import RaftMQError

log = logging.getLogger(__name__)


# -- shared with raftmq.bench.consume ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BenchReport:
    kind: str
    messages: int
    payload_bytes: int
    elapsed_s: float
    latencies_s: list[float]
    errors: int
    params: dict

    def percentile(self, p: float) -> float:
        if not self.latencies_s:
            return float("nan")
        xs = sorted(self.latencies_s)
        return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def report(r: BenchReport) -> None:
    params = " ".join(f"{k}={v}" for k, v in r.params.items())
    rate = r.messages / r.elapsed_s if r.elapsed_s else 0.0
    mbs = r.payload_bytes / r.elapsed_s / 1e6 if r.elapsed_s else 0.0
    Console().print(
        f"[bold]{r.kind}[/bold] {params}: {r.messages} msgs in {r.elapsed_s:.1f}s = [bold]{rate:,.0f} msgs/s[/bold], "
        f"{mbs:.1f} MB/s, latency p50 {r.percentile(50) * 1000:.2f} ms p99 {r.percentile(99) * 1000:.2f} ms, "
        f"errors {r.errors}")


async def progress(label: str, seconds: float, done: Callable[[], int], deadline: float) -> None:
    """A rich progress bar over the run's duration, showing messages so far; ends at ``deadline``."""
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[msgs]:>10,} msgs"),
               TimeRemainingColumn())
    with Progress(*columns, transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(label, total=seconds, msgs=0)
        start = deadline - seconds
        while True:
            now = time.monotonic()
            bar.update(task, completed=min(now - start, seconds), msgs=done())
            if now >= deadline:
                return
            await trio.sleep(min(0.25, deadline - now))


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namesrv", default=None,
                        help="name server HOST:PORT; default: start a cluster (raftmq dev) for the run")
    parser.add_argument("--topic", default="BenchTopic", help="topic (created if missing; default BenchTopic)")
    parser.add_argument("--queues", type=int, default=8, help="queues of the topic when created (default 8)")


@contextlib.asynccontextmanager
async def bench_cluster(args: argparse.Namespace) -> AsyncIterator[str]:
    """The name server address to use: ``--namesrv``, or a ``raftmq dev`` cluster started (and stopped by
    PID) for this run in a temporary directory."""
    if args.namesrv:
        yield args.namesrv
        return
    with tempfile.TemporaryDirectory(prefix="raftmq-bench-") as tmp:
        proc = subprocess.Popen([sys.executable, "-m", "raftmq", "--log-level", "WARNING", "dev",
                                 "--data-dir", tmp, "--base-port", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            namesrv = await trio.to_thread.run_sync(_wait_dev_ready, proc)
            yield namesrv
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    await trio.to_thread.run_sync(proc.wait, 15)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(5)


def _wait_dev_ready(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        if line.startswith("ready "):
            fields = dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
            addr = fields.get("namesrv") or fields.get("listen")
            if addr:
                # Keep draining stdout in the background so the cluster never blocks on a full pipe.
                threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
                return addr.split(",")[0].split(";")[0]
        if time.monotonic() > deadline:
            break
    raise SystemExit(f"raftmq dev did not become ready (exit code {proc.poll()})")


def register(subparsers) -> None:
    parser = subparsers.add_parser("produce", help="acknowledged sends against a cluster (msgs/s, MB/s, p50/p99)")
    add_cluster_args(parser)
    parser.add_argument("--size", type=int, default=1024, help="message body bytes (default 1024)")
    parser.add_argument("--concurrency", type=int, default=256, help="sends in flight (default 256)")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to send (default 30)")
    parser.add_argument("--batch", type=int, default=1, help="messages per send_batch (default 1: single sends)")
    parser.add_argument("--messages", type=int, default=10_000_000, help="stop after this many messages")
    parser.add_argument("--warmup-seconds", type=float, default=1.0, help="sends before measuring (default 1)")
    parser.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    for name, lo in (("size", 0), ("concurrency", 1), ("batch", 1), ("messages", 1)):
        if getattr(args, name) < lo:
            raise SystemExit(f"raftmq bench produce: --{name} must be >= {lo}, got {getattr(args, name)}")
    if not 0 < args.seconds <= 3600:
        raise SystemExit(f"raftmq bench produce: --seconds must be within (0, 3600], got {args.seconds}")


async def ensure_topic(namesrv: str, topic: str, queues: int) -> None:
    async with open_admin(namesrv) as admin:
        with trio.fail_after(30):
            while True:
                try:
                    await admin.create_topic(topic, read_queue_nums=queues, write_queue_nums=queues)
                    return
                except RaftMQError as e:
                    log.info("waiting for the cluster to take topic %s: %s", topic, e)
                    await trio.sleep(0.3)


async def produce(namesrv: str, args: argparse.Namespace) -> BenchReport:
    await ensure_topic(namesrv, args.topic, args.queues)
    body = b"x" * args.size
    latencies: list[float] = []
    counters = {"sent": 0, "errors": 0, "measuring": False}
    async with open_producer(namesrv, producer_group="bench_producer") as producer:
        async def worker(deadline: float) -> None:
            while time.monotonic() < deadline and counters["sent"] < args.messages:
                started = time.perf_counter()
                try:
                    if args.batch > 1:
                        await producer.send_batch([Message(args.topic, body) for _ in range(args.batch)])
                    else:
                        await producer.send(Message(args.topic, body))
                except (SendFailedError, RaftMQError) as e:
                    counters["errors"] += 1
                    log.debug("send failed: %s", e)
                    continue
                if counters["measuring"]:
                    latencies.append(time.perf_counter() - started)
                    counters["sent"] += args.batch

        if args.warmup_seconds > 0:
            async with trio.open_nursery() as nursery:
                for _ in range(min(args.concurrency, 64)):
                    nursery.start_soon(worker, time.monotonic() + args.warmup_seconds)
        counters["measuring"] = True
        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            deadline = started + args.seconds
            for _ in range(args.concurrency):
                nursery.start_soon(worker, deadline)
            nursery.start_soon(progress, "producing", args.seconds, lambda: counters["sent"], deadline)
        elapsed = time.monotonic() - started
    return BenchReport("produce", counters["sent"], counters["sent"] * args.size, elapsed, latencies,
                       counters["errors"], {"size": args.size, "concurrency": args.concurrency, "batch": args.batch})


def run(args: argparse.Namespace) -> int:
    _check(args)

    async def main() -> BenchReport:
        async with bench_cluster(args) as namesrv:
            return await produce(namesrv, args)

    report(trio.run(main))
    return 0
