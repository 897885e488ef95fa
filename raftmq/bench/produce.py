"""``raftmq bench produce``: acknowledged sends per second, MB/s and send latency percentiles.

``--concurrency`` sends are in flight at once (each a task looping send → ack → send), all over the producer's
shared connections; ``--batch N`` makes each send a ``send_batch`` of N messages; ``--concurrency 1`` measures
the latency of one send at a time; ``--auto-batch`` turns on the producer's auto-batching (single ``send`` calls
share batch requests, each still acknowledged on its own; the report counts the requests). Without
``--namesrv`` the bench uses the name servers ``NAMESRV_ADDR`` names, and without either it starts its own cluster
(``raftmq dev`` in a temporary directory) and stops it afterwards. Every loop is bounded by ``--seconds`` and
``--messages``.

The report ends with the CPU time per message over the measured window: each broker node's process (as it
reports it in GET_BROKER_RUNTIME_INFO) and this client process (progress bar included), and their total. On a
machine where everything shares the cores, the total bounds the rate: 2 cores at 20 µs per message is 100k/s.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Callable

import trio
from rich.console import Console

from broker.topic_config import TopicConfigError, check_sendable_topic, validate_topic_name
from client import Message, SendFailedError, open_admin, open_producer
from raftmq.bench.common import (BenchError, LatencySummary, add_credential_args, check_credentials,
                                 check_namesrv_arg, check_range, exported_credentials, machine_speed,
                                 namesrv_from_env, print_json, print_table, run_bench, show_progress,
                                 spawn_ready_process, summarize_latencies)
from remoting.config import ConfigError
from remoting.errors import ConnectionClosedError, RaftMQError, RemotingError

log = logging.getLogger(__name__)


# -- shared with raftmq.bench.consume ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CpuSample:
    """Process CPU seconds (user + system, every thread) of the bench client and of each broker node."""

    client_s: float
    nodes: dict[str, tuple[str, float]]  # "broker-a/1" -> (role, CPU seconds)


async def cpu_sample(namesrv: str) -> CpuSample:
    """Each node reports its own ``time.process_time()`` (GET_BROKER_RUNTIME_INFO), so this works against
    any cluster; a node that does not answer is left out (and every node, if the name server does not)."""
    nodes: dict[str, tuple[str, float]] = {}
    async with open_admin(namesrv) as admin:
        try:
            info = await admin.cluster_info()
        except RaftMQError as e:  # the run's figures must not be lost to a name server that went away
            log.warning("no CPU figures: cluster info unavailable: %s", e)
            return CpuSample(time.process_time(), nodes)
        for name, addrs in sorted(info.broker_addrs.items()):
            for addr in sorted(set(addrs.values())):  # the leader is listed twice: under id 0 and its own id
                try:
                    status = await admin.broker_status(addr)
                except RaftMQError as e:
                    log.warning("no CPU figure from %s (%s): %s", name, addr, e)
                    continue
                if isinstance(status.get("process_cpu_s"), (int, float)):
                    label = f"{name}/{status.get('broker_id', addr)}"
                    nodes[label] = (str(status.get("role", "?")), float(status["process_cpu_s"]))
    return CpuSample(time.process_time(), nodes)


def cpu_per_message(before: CpuSample, after: CpuSample, messages: int) -> dict[str, float]:
    """µs of CPU per message over the measured window: each node (labelled with its role at the end), the
    client, and their total."""
    if not messages:
        return {}
    out = {f"{label} {after.nodes[label][0].lower()}": (after.nodes[label][1] - cpu) * 1e6 / messages
           for label, (_, cpu) in sorted(before.nodes.items()) if label in after.nodes}
    out["client"] = (after.client_s - before.client_s) * 1e6 / messages
    out["total"] = sum(out.values())
    return out


@dataclasses.dataclass(frozen=True)
class BenchReport:
    kind: str
    messages: int
    payload_bytes: int
    elapsed_s: float
    latency: LatencySummary
    errors: int
    params: dict
    # Why sends failed: the class of the last attempt's error (a SendFailedError's last_error) → count.
    error_kinds: dict[str, int] = dataclasses.field(default_factory=dict)
    cpu_us_per_msg: dict[str, float] = dataclasses.field(default_factory=dict)
    # machine_speed() just before the run: how fast this machine was when the figures were taken.
    machine: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def msgs_per_s(self) -> float:
        return self.messages / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.payload_bytes / self.elapsed_s / 1e6 if self.elapsed_s else 0.0


def report(r: BenchReport, *, as_json: bool = False) -> None:
    if as_json:
        print_json(kind=r.kind, params=r.params, messages=r.messages, elapsed_s=r.elapsed_s,
                   msgs_per_s=r.msgs_per_s, mb_per_s=r.mb_per_s, latency=r.latency, errors=r.errors,
                   error_kinds=r.error_kinds, cpu_us_per_msg=r.cpu_us_per_msg, machine=r.machine)
        return
    rows = [*((k, v) for k, v in r.params.items()), ("messages", r.messages), ("seconds", r.elapsed_s),
            ("msgs/s", r.msgs_per_s), ("MB/s", r.mb_per_s), ("latency p50 ms", r.latency.p50_ms),
            ("latency p99 ms", r.latency.p99_ms), ("latency max ms", r.latency.max_ms), ("errors", r.errors),
            *((f"errors: {kind}", n) for kind, n in sorted(r.error_kinds.items())),
            *((f"CPU µs/msg {label}", us) for label, us in r.cpu_us_per_msg.items()),
            *((f"machine {name}", value) for name, value in r.machine.items())]
    print_table(Console(), f"raftmq bench {r.kind}", rows)


async def progress(label: str, seconds: float, done: Callable[[], int]) -> None:
    """The shared progress bar, stopped after ``seconds``."""
    with trio.move_on_after(seconds):
        await show_progress(Console(stderr=True), label, seconds, done)


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namesrv", default=None,
                        help="name server HOST:PORT; default: $NAMESRV_ADDR, else start a cluster (raftmq dev) for "
                             "the run")
    parser.add_argument("--topic", default="BenchTopic", help="topic (created if missing; default BenchTopic)")
    parser.add_argument("--queues", type=int, default=8, help="queues of the topic when created (default 8)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    add_credential_args(parser)


def check_cluster_args(args: argparse.Namespace) -> None:
    """The options of ``add_cluster_args``, checked before a cluster is started or asked: a topic the brokers
    refuse was retried by ``ensure_topic`` for 30 s and then reported as the cluster's failure."""
    if args.namesrv is None:
        args.namesrv = namesrv_from_env()
        if args.namesrv is not None:  # said, as a bench of a cluster someone else uses is no private measurement
            log.info("benchmarking the cluster of NAMESRV_ADDR namesrv=%s", args.namesrv)
    if args.namesrv is not None:
        check_namesrv_arg(args.namesrv)
    if args.topic is not None:
        try:
            validate_topic_name(args.topic)
            check_sendable_topic(args.topic)
        except TopicConfigError as e:
            raise ConfigError(str(e).replace("topic ", "--topic ", 1)) from None
    check_range("--queues", args.queues, 1, 1024)
    check_credentials(args)
    if args.tls and args.namesrv is None:
        raise ConfigError("--tls needs --namesrv (or $NAMESRV_ADDR): the cluster a bench starts for itself serves "
                          "plain TCP")


@contextlib.asynccontextmanager
async def bench_cluster(args: argparse.Namespace) -> AsyncIterator[str]:
    """The name server address to use: ``--namesrv``, or a ``raftmq dev`` cluster started (and stopped by
    PID) for this run in a temporary directory."""
    if args.namesrv:
        yield args.namesrv
        return
    with tempfile.TemporaryDirectory(prefix="raftmq-bench-") as tmp:
        dev = await trio.to_thread.run_sync(lambda: spawn_ready_process(
            ["--log-level", "WARNING", "dev", "--data-dir", tmp, "--base-port", "0"], ready_timeout_s=120))
        try:
            yield dev.fields["namesrv"]
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(lambda: dev.stop(timeout_s=30))


def register(subparsers) -> None:
    parser = subparsers.add_parser("produce", help="acknowledged sends against a cluster (msgs/s, MB/s, p50/p99)")
    add_cluster_args(parser)
    parser.add_argument("--size", type=int, default=1024, help="message body bytes (default 1024)")
    parser.add_argument("--concurrency", type=int, default=256, help="sends in flight (default 256)")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to send (default 30)")
    parser.add_argument("--batch", type=int, default=1, help="messages per send_batch (default 1: single sends)")
    parser.add_argument("--auto-batch", action="store_true",
                        help="producer auto_batch=True: concurrent single sends share batch requests")
    parser.add_argument("--send-timeout-ms", type=int, default=None,
                        help="the producer's send_msg_timeout_ms (default the producer's, 3000)")
    parser.add_argument("--messages", type=int, default=10_000_000, help="stop after this many messages")
    parser.add_argument("--warmup-seconds", type=float, default=1.0, help="sends before measuring (default 1)")
    parser.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    check_range("--size", args.size, 1, 4 * 1024 * 1024)
    check_range("--concurrency", args.concurrency, 1, 10_000)
    check_range("--batch", args.batch, 1, 1024)
    check_range("--messages", args.messages, 1, 10**9)
    check_range("--seconds", args.seconds, 0.1, 3600)
    check_range("--warmup-seconds", args.warmup_seconds, 0, 600)
    check_cluster_args(args)
    if args.send_timeout_ms is not None:
        check_range("--send-timeout-ms", args.send_timeout_ms, 1, 3_600_000)
    if args.auto_batch and args.batch > 1:
        # Measured explicit batches with auto_batch on and nothing for it to do, and reported it as on.
        raise ConfigError(f"--auto-batch batches single sends; --batch {args.batch} sends batches already "
                          f"(use one or the other)")


async def ensure_topic(namesrv: str, topic: str, queues: int, timeout_s: float = 30.0, *,
                       namesrv_grace_s: float = 5.0, log_every_s: float = 5.0) -> None:
    """Create ``topic`` (``queues`` queues) on every broker group, retrying for up to ``timeout_s``: a cluster
    just started answers before its groups have elected and registered. A name server that has not answered at
    all within ``namesrv_grace_s`` (nothing listens, or it stays silent), or that answers in another protocol,
    is no starting cluster: the bench ends then, not after 30 s. The waiting is logged when its reason changes
    and at most once per ``log_every_s`` otherwise (it was a line per 0.3 s retry: 100 lines for 30 s)."""
    last: RaftMQError | None = None
    answered = False  # has any name server answered a request, in our protocol?
    namesrv_deadline = trio.current_time() + namesrv_grace_s
    logged: tuple[str, float] | None = None

    def note(what: str, e: RaftMQError) -> None:
        nonlocal logged
        now = trio.current_time()
        if logged is None or logged[0] != str(e) or now - logged[1] >= log_every_s:
            log.info("waiting for %s: %s", what, e)
            logged = (str(e), now)

    async with open_admin(namesrv) as admin:
        with trio.move_on_after(timeout_s):
            while True:
                if not answered:
                    try:
                        await admin.cluster_info()
                    except RemotingError as e:
                        last = e
                        # The peer speaks another protocol (an HTTP metrics port, say): waiting would not change
                        # that.
                        if isinstance(e, ConnectionClosedError) and e.bad_frame:
                            raise BenchError(f"name server {namesrv} does not speak the raftmq protocol: "
                                             f"{e}") from None
                        if trio.current_time() >= namesrv_deadline:
                            raise BenchError(f"no name server at {namesrv} answered within {namesrv_grace_s:g} s: "
                                             f"{e}") from None
                        note(f"name server {namesrv} to answer", e)
                        await trio.sleep(0.3)
                        continue
                    except RaftMQError:
                        pass  # an error response is an answer: create_topic reports it below
                    answered = True
                try:
                    await admin.create_topic(topic, read_queue_nums=queues, write_queue_nums=queues)
                    return
                except RaftMQError as e:
                    last = e
                    note(f"the cluster to take topic {topic}", e)
                    await trio.sleep(0.3)
    raise BenchError(f"the cluster behind name server {namesrv} did not take topic {topic!r} within "
                     f"{timeout_s:g} s; last error: {last or 'none (each attempt was still waiting)'}")


async def produce(namesrv: str, args: argparse.Namespace) -> BenchReport:
    machine = machine_speed()
    await ensure_topic(namesrv, args.topic, args.queues)
    body = b"x" * args.size
    latencies: list[int] = []
    counters = {"sent": 0, "errors": 0, "measuring": False}
    error_kinds: collections.Counter[str] = collections.Counter()
    options = {} if args.send_timeout_ms is None else {"send_msg_timeout_ms": args.send_timeout_ms}
    async with open_producer(namesrv, producer_group="bench_producer", auto_batch=args.auto_batch,
                             **options) as producer:
        async def worker(deadline: float) -> None:
            while time.monotonic() < deadline and counters["sent"] < args.messages:
                started = time.perf_counter_ns()
                try:
                    if args.batch > 1:
                        await producer.send_batch([Message(args.topic, body) for _ in range(args.batch)])
                    else:
                        await producer.send(Message(args.topic, body))
                except (SendFailedError, RaftMQError) as e:
                    counters["errors"] += 1
                    error_kinds[type(getattr(e, "last_error", None) or e).__name__] += 1
                    log.debug("send failed: %s", e)
                    continue
                if counters["measuring"]:
                    latencies.append(time.perf_counter_ns() - started)
                    counters["sent"] += args.batch

        if args.warmup_seconds > 0:
            async with trio.open_nursery() as nursery:
                for _ in range(min(args.concurrency, 64)):
                    nursery.start_soon(worker, time.monotonic() + args.warmup_seconds)
        cpu_before = await cpu_sample(namesrv)
        counters["measuring"] = True
        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            deadline = started + args.seconds
            for _ in range(args.concurrency):
                nursery.start_soon(worker, deadline)
            nursery.start_soon(progress, "producing", args.seconds, lambda: counters["sent"])
        elapsed = time.monotonic() - started
        cpu = cpu_per_message(cpu_before, await cpu_sample(namesrv), counters["sent"])
        params = {"size": args.size, "concurrency": args.concurrency, "batch": args.batch}
        if args.auto_batch:
            params["auto_batch"] = True
            params["requests (with warm-up)"] = producer.statistics().auto_batches
    return BenchReport("produce", counters["sent"], counters["sent"] * args.size, elapsed,
                       summarize_latencies(latencies), counters["errors"], params, dict(error_kinds),
                       cpu_us_per_msg=cpu, machine=machine)


def run(args: argparse.Namespace) -> int:
    _check(args)

    async def main() -> BenchReport:
        async with bench_cluster(args) as namesrv:
            return await produce(namesrv, args)

    with exported_credentials(args):
        result = run_bench("produce", main, as_json=args.json)
    report(result, as_json=args.json)
    return 0
