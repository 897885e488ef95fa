"""``raftmq bench produce``: acknowledged sends per second, MB/s and send latency percentiles (of the sends
answered SEND_OK, one per request: with ``--batch``, per batch; failed sends are counted apart, in ``errors``).

``--concurrency`` sends are in flight at once (each a task looping send → ack → send), all over the producer's
shared connections; ``--batch N`` makes each send a ``send_batch`` of N messages; ``--concurrency 1`` measures
the latency of one send at a time; ``--auto-batch`` turns on the producer's auto-batching (single ``send`` calls
share batch requests, each still acknowledged on its own; the report counts the requests). Without
``--namesrv`` the bench uses the name servers ``NAMESRV_ADDR`` names, and without either it starts its own cluster
(``raftmq dev`` in a temporary directory) and stops it afterwards. Every loop is bounded by ``--seconds`` and
``--messages``. Only a send answered SEND_OK is acknowledged; what the figures count is ``SendLoad``'s to say.

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
from collections.abc import AsyncIterator, Awaitable, Callable

import trio

from broker.topic_config import TopicConfigError, check_sendable_topic, validate_topic_name
from client import Message, SendFailedError, SendResult, SendStatus, open_admin, open_producer
from raftmq.bench.common import (BenchError, LatencySummary, add_credential_args, check_credentials,
                                 check_namesrv_arg, check_range, exported_credentials, machine_speed,
                                 namesrv_from_env, print_json, print_table, run_bench, show_progress,
                                 spawn_ready_process, summarize_latencies)
from raftmq.console import PipeConsole
from remoting.config import ConfigError
from remoting.errors import ConnectionClosedError, RaftMQError, RemotingError, TopicNotExistError

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
    # Failed sends of the warm-up, apart: ``errors`` counts only the measured window's.
    warmup_errors: int = 0
    warmup_error_kinds: dict[str, int] = dataclasses.field(default_factory=dict)

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
                   error_kinds=r.error_kinds, warmup_errors=r.warmup_errors, warmup_error_kinds=r.warmup_error_kinds,
                   cpu_us_per_msg=r.cpu_us_per_msg, machine=r.machine)
        return
    # Latencies are of the requests answered with success only (a failed or timed-out one is counted in errors),
    # one per request: with --batch, per batch.
    # bench consume's (--live) are end to end, from the born time to the handler, of the messages consumed.
    batch = r.params.get("batch", 1)
    if r.kind != "produce":
        what = "(consumed, end to end)"
    elif isinstance(batch, int) and batch > 1:
        what = f"(acknowledged batches of {batch})"
    else:
        what = "(acknowledged)"
    rows = [*((k, v) for k, v in r.params.items()), ("messages", r.messages), ("seconds", r.elapsed_s),
            ("msgs/s", r.msgs_per_s), ("MB/s", r.mb_per_s), (f"latency p50 ms {what}", r.latency.p50_ms),
            (f"latency p99 ms {what}", r.latency.p99_ms), (f"latency max ms {what}", r.latency.max_ms),
            ("errors", r.errors),
            *((f"errors: {kind}", n) for kind, n in sorted(r.error_kinds.items())),
            *((("warm-up errors", r.warmup_errors),) if r.warmup_errors else ()),
            *((f"warm-up errors: {kind}", n) for kind, n in sorted(r.warmup_error_kinds.items())),
            *((f"CPU µs/msg {label}", us) for label, us in r.cpu_us_per_msg.items()),
            *((f"machine {name}", value) for name, value in r.machine.items())]
    print_table(PipeConsole(), f"raftmq bench {r.kind}", rows)


async def progress(label: str, seconds: float, done: Callable[[], int]) -> None:
    """The shared progress bar, stopped after ``seconds``."""
    with trio.move_on_after(seconds):
        await show_progress(PipeConsole(stderr=True), label, seconds, done)


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namesrv", default=None,
                        help="name server HOST:PORT; default: $NAMESRV_ADDR, else start a cluster (raftmq dev) for "
                             "the run")
    parser.add_argument("--topic", default="BenchTopic",
                        help="topic (created if no name server routes it, else used as it is; default BenchTopic)")
    parser.add_argument("--queues", type=int, default=8,
                        help="queues of the topic when the bench creates it (default 8)")
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
    if args.namesrv is None:
        # The cluster started for the run takes free ports from $RAFTMQ_PORT_RANGE: a malformed one is named now
        # (exit 2), not as a child that exited before it was ready.
        from raftmq.commands.dev import check_base_port
        check_base_port(0)


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
    parser.add_argument("--messages", type=int, default=10_000_000,
                        help="stop after exactly this many acknowledged messages (the window ends with the last)")
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
    """Create ``topic`` (``queues`` queues) on every broker group unless a name server routes it already (then it
    is left as it is: refused if it takes no sends), retrying for up to ``timeout_s``: a cluster
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
                    route = await admin.get_route(topic)
                except TopicNotExistError:
                    route = None
                except RaftMQError as e:
                    last = e
                    note(f"the route of topic {topic}", e)
                    await trio.sleep(0.3)
                    continue
                if route is not None and route.queue_datas:
                    # An existing topic is measured as it is: created again, it was rewritten with --queues queues,
                    # read-write and unordered (a read-only topic took the bench's messages, and those in queues
                    # past --queues were left to no consumer).
                    if not route.write_queues():
                        raise BenchError(f"topic {topic!r} exists and takes no sends (no writable queue in its "
                                         f"route): name another --topic, or make it writable")
                    counts = sorted({q.write_queue_nums for q in route.queue_datas})
                    if counts != [queues]:
                        log.info("topic %s exists with %s write queues per group; --queues %d applies only to a "
                                 "topic the bench creates", topic, "/".join(map(str, counts)), queues)
                    return
                try:
                    await admin.create_topic(topic, read_queue_nums=queues, write_queue_nums=queues)
                    return
                except RaftMQError as e:
                    last = e
                    note(f"the cluster to take topic {topic}", e)
                    await trio.sleep(0.3)
    raise BenchError(f"the cluster behind name server {namesrv} did not take topic {topic!r} within "
                     f"{timeout_s:g} s; last error: {last or 'none (each attempt was still waiting)'}")


# A sender whose send failed pauses before its next one, doubling from the first to the last: a cluster that
# refuses everything was asked as fast as the loop could spin, and the failures crowded out the measurement.
ERROR_PAUSE_FIRST_S = 0.01
ERROR_PAUSE_MAX_S = 1.0


@dataclasses.dataclass
class SendTally:
    """What the sends of one phase (warm-up or measured window) saw. Acknowledged means answered SEND_OK: a
    FLUSH_SLAVE_TIMEOUT (the broker's Raft commit timed out) or another status leaves the outcome unknown, and is
    counted with the errors under its status name, as a failed send is under its error's class."""

    acked: int = 0
    latencies: list[int] = dataclasses.field(default_factory=list)  # ns, one per acknowledged send
    errors: int = 0
    error_kinds: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def failed(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] += 1


class SendLoad:
    """The senders of ``bench produce``, apart from the producer: ``send(n)`` makes one send of ``n`` messages
    (a single send, or a batch of ``n``) and returns its SendResult or raises.

    The rules the figures rest on: a phase's time ends when its last sender has returned (the window of a run
    bounded by ``limit`` ends with its last acknowledgement, not at ``seconds``); a sender reserves its messages
    before it sends them and gives back what was not acknowledged, so a run stops at exactly ``limit`` messages
    (the last send of a batch run may be a partial batch); only SEND_OK counts as acknowledged; after a failure
    a sender pauses (``ERROR_PAUSE_FIRST_S`` doubling up to ``ERROR_PAUSE_MAX_S``, never past the phase's end)."""

    def __init__(self, send: Callable[[int], Awaitable[SendResult]], *, batch: int) -> None:
        self.send = send
        self.batch = batch

    async def run(self, concurrency: int, seconds: float, *, limit: int | None = None,
                  progress_label: str | None = None) -> tuple[SendTally, float]:
        """``concurrency`` senders for ``seconds`` (or until ``limit`` messages are acknowledged); the tally and
        the seconds from the start to the last sender's return."""
        tally = SendTally()
        reserved = 0  # messages acknowledged or in flight

        async def sender(deadline: float) -> None:
            nonlocal reserved
            pause = 0.0
            while trio.current_time() < deadline:
                n = self.batch
                if limit is not None:
                    n = min(n, limit - reserved)
                    if n <= 0:
                        return
                    reserved += n
                started = time.perf_counter_ns()
                try:
                    result = await self.send(n)
                    kind = None if result.send_status is SendStatus.SEND_OK else result.send_status.name
                except (SendFailedError, RaftMQError) as e:
                    kind = type(getattr(e, "last_error", None) or e).__name__
                    log.debug("send failed: %s", e)
                if kind is None:
                    tally.latencies.append(time.perf_counter_ns() - started)
                    tally.acked += n
                    pause = 0.0
                    continue
                if limit is not None:
                    reserved -= n
                tally.failed(kind)
                pause = min(max(2 * pause, ERROR_PAUSE_FIRST_S), ERROR_PAUSE_MAX_S)
                await trio.sleep(min(pause, max(0.0, deadline - trio.current_time())))

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            if progress_label is not None:
                nursery.start_soon(progress, progress_label, seconds, lambda: tally.acked)
            async with trio.open_nursery() as senders:
                for _ in range(concurrency):
                    senders.start_soon(sender, started + seconds)
            elapsed = trio.current_time() - started
            nursery.cancel_scope.cancel()  # the progress bar: it would hold the window open until ``seconds``
        return tally, elapsed


def error_summary(kinds: collections.Counter[str] | dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))


async def produce(namesrv: str, args: argparse.Namespace) -> BenchReport:
    machine = machine_speed()
    await ensure_topic(namesrv, args.topic, args.queues)
    body = b"x" * args.size
    options = {} if args.send_timeout_ms is None else {"send_msg_timeout_ms": args.send_timeout_ms}
    async with open_producer(namesrv, producer_group="bench_producer", auto_batch=args.auto_batch,
                             **options) as producer:
        async def send(n: int) -> SendResult:
            if args.batch > 1:
                return await producer.send_batch([Message(args.topic, body) for _ in range(n)])
            return await producer.send(Message(args.topic, body))

        load = SendLoad(send, batch=args.batch)
        warmup = SendTally()
        if args.warmup_seconds > 0:
            warmup, _ = await load.run(min(args.concurrency, 64), args.warmup_seconds)
        cpu_before = await cpu_sample(namesrv)
        tally, elapsed = await load.run(args.concurrency, args.seconds, limit=args.messages,
                                        progress_label="producing")
        # Taken as the last sender returns: a run that reached --messages was charged CPU (and seconds) up to
        # --seconds, idle time included.
        cpu = cpu_per_message(cpu_before, await cpu_sample(namesrv), tally.acked)
        params = {"size": args.size, "concurrency": args.concurrency, "batch": args.batch}
        if args.auto_batch:
            params["auto_batch"] = True
            params["requests (with warm-up)"] = producer.statistics().auto_batches
    if not tally.acked:
        raise BenchError(f"no send was acknowledged in the {elapsed:.1f} s measured: {tally.errors} failed "
                         f"({error_summary(tally.error_kinds)})")
    return BenchReport("produce", tally.acked, tally.acked * args.size, elapsed, summarize_latencies(tally.latencies),
                       tally.errors, params, dict(tally.error_kinds), cpu_us_per_msg=cpu, machine=machine,
                       warmup_errors=warmup.errors, warmup_error_kinds=dict(warmup.error_kinds))


def run(args: argparse.Namespace) -> int:
    _check(args)

    async def main() -> BenchReport:
        async with bench_cluster(args) as namesrv:
            return await produce(namesrv, args)

    with exported_credentials(args):
        result = run_bench("produce", main, as_json=args.json)
    report(result, as_json=args.json)
    return 0
