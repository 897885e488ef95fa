"""``raftmq bench rpc``: request/response throughput and latency of the wire protocol alone.

An echo server runs in a separate process (``raftmq bench rpc-server``, spawned here and stopped by PID), the
client runs in this process on ONE connection with ``--concurrency`` requests in flight, each an ECHO request
with a ``--size``-byte body answered with the same body. This is the ceiling every other benchmark sits under:
no store, no Raft, just frames, the codec and trio. A warm-up (not measured) precedes the ``--seconds`` window;
a request that failed is counted in the phase it started in (``errors`` for the window, which make the exit status
1; ``warmup_errors`` apart).

Example: ``raftmq bench rpc --size 1024 --concurrency 256 --seconds 10``
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import psutil
import trio
from rich.console import Console
from raftmq.bench.common import (
    BenchError,
    LatencySummary,
    check_range,
    print_json,
    print_table,
    run_bench,
    show_progress,
    spawn_ready_process,
    summarize_latencies,
)
from raftmq.console import PipeConsole
from raftmq.runner import announce_ready, leaf_exceptions, run_until_signalled, start_error
from remoting.codec import DEFAULT_MAX_FRAME_SIZE, Frame, make_request, make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.config import parse_host_port
from remoting.errors import RaftMQError
from remoting.transport import RemotingConnection, open_remoting_client, serve_remoting

log = logging.getLogger(__name__)

# The measured loop allows a slow server this long per request before counting it as an error.
REQUEST_TIMEOUT_S = 10.0


class EchoHandler:
    """Answers ECHO with SUCCESS, the request's ext and body; any other code with REQUEST_CODE_NOT_SUPPORTED."""

    async def handle(self, request: Frame, conn: RemotingConnection) -> Frame:
        if request.code == RequestCode.ECHO:
            return make_response(request, ResponseCode.SUCCESS, ext=request.ext, body=request.body)
        return make_response(request, ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                             remark=f"the echo server only serves ECHO ({int(RequestCode.ECHO)}), "
                                    f"not request code {request.code}")


@dataclass(frozen=True, slots=True)
class RpcResult:
    requests: int
    errors: int
    """Requests started in the measured window that failed; the exit status is 1 when there are any."""
    seconds: float
    requests_per_s: float
    latency: LatencySummary
    client_cpu_us_per_request: float | None
    """CPU time of this (client) process per request over the measured window; None when it was not sampled."""
    server_cpu_us_per_request: float | None
    """The same for the server process; None when its PID is unknown (``--server``)."""
    cpu_bound_requests_per_s: float | None
    """1 s / the busier side's CPU per request: the rate if each process had a core to itself. On a shared
    machine this says more about the code than requests_per_s does."""
    warmup_errors: int = 0
    """Requests started during the warm-up that failed: reported apart, they do not fail the run."""


def _process_cpu_s(pid: int | None) -> float | None:
    if pid is None:
        return time.process_time()
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


async def run_rpc_client(addr: str, *, size: int, concurrency: int, seconds: float, warmup_s: float,
                         console: Console | None = None, server_pid: int | None = None) -> RpcResult:
    """Drive ``addr`` with ECHO requests on one connection; returns what was measured after the warm-up."""
    body = os.urandom(size)
    request = make_request(RequestCode.ECHO, body=body)
    latencies: list[int] = []
    errors = warmup_errors = 0
    completed = 0
    async with open_remoting_client() as client:
        conn = await client.get_connection(addr)
        first = await conn.invoke(request, REQUEST_TIMEOUT_S)
        if first.code != ResponseCode.SUCCESS or first.body != body:
            raise BenchError(f"{addr} is not an echo server (raftmq bench rpc-server): it answered code "
                             f"{first.code} ({first.remark or 'no remark'})")
        perf_ns = time.perf_counter_ns
        measure_start = perf_ns() + int(warmup_s * 1e9)
        end = measure_start + int(seconds * 1e9)

        def failed(t0: int) -> None:
            # A failure belongs to the phase its request started in: the warm-up's are not the window's.
            nonlocal errors, warmup_errors
            if t0 >= measure_start:
                errors += 1
            else:
                warmup_errors += 1

        async def worker() -> None:
            nonlocal completed
            invoke, record = conn.invoke, latencies.append
            while True:
                t0 = perf_ns()
                if t0 >= end:
                    return
                try:
                    response = await invoke(request, REQUEST_TIMEOUT_S)
                except Exception as e:  # counted, and the first one is shown: a bench must finish its report
                    if not errors + warmup_errors:
                        log.warning("request failed: %s", e)
                    failed(t0)
                    if conn.closed:
                        return
                    continue
                t1 = perf_ns()
                if response.code != ResponseCode.SUCCESS or len(response.body) != size:
                    failed(t0)
                    continue
                if t0 >= measure_start:
                    record(t1 - t0)
                if measure_start <= t1 <= end:
                    completed += 1

        cpu: dict[str, float | None] = {}

        async def sample_cpu() -> None:
            # CPU time of both processes over exactly the measured window.
            await trio.sleep_until(trio.current_time() + (measure_start - perf_ns()) / 1e9)
            cpu["client0"], cpu["server0"] = _process_cpu_s(None), _process_cpu_s(server_pid)
            await trio.sleep_until(trio.current_time() + (end - perf_ns()) / 1e9)
            cpu["client1"], cpu["server1"] = _process_cpu_s(None), _process_cpu_s(server_pid)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample_cpu)
            if console is not None:
                nursery.start_soon(partial(show_progress, console, f"rpc x{concurrency}", warmup_s + seconds,
                                           lambda: completed))
            async with trio.open_nursery() as workers:
                for _ in range(concurrency):
                    workers.start_soon(worker)
            with trio.move_on_after(1):
                while "client1" not in cpu:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    done = max(completed, 1)
    client_us = server_us = None
    if cpu.get("client1") is not None and cpu.get("client0") is not None:
        client_us = (cpu["client1"] - cpu["client0"]) / done * 1e6
    if server_pid is not None and cpu.get("server1") is not None and cpu.get("server0") is not None:
        server_us = (cpu["server1"] - cpu["server0"]) / done * 1e6
    busiest = max(u for u in (client_us, server_us, 0.0) if u is not None)
    return RpcResult(completed, errors, seconds, completed / seconds, summarize_latencies(latencies), client_us,
                     server_us, 1e6 / busiest if busiest > 0 else None, warmup_errors)


def register(kinds: Any) -> None:
    parser = kinds.add_parser("rpc", help="wire-protocol throughput: echo requests on one connection",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="request and response body size in bytes")
    parser.add_argument("--concurrency", type=int, default=256, help="requests in flight on the connection")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured duration (after the warm-up)")
    parser.add_argument("--warmup-seconds", type=float, default=1.0, help="unmeasured warm-up duration")
    parser.add_argument("--server", metavar="HOST:PORT",
                        help="use a running echo server instead of spawning `raftmq bench rpc-server`")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    parser.set_defaults(func=run)
    # Hidden from the KIND list (no help=): the server half of `bench rpc`, also used by the bad-frame tests.
    server = kinds.add_parser("rpc-server", description="echo server for `raftmq bench rpc`; prints a ready line")
    server.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT")
    server.add_argument("--max-frame-size", type=int, default=DEFAULT_MAX_FRAME_SIZE)
    server.set_defaults(func=run_server)


def run(args: argparse.Namespace) -> int:
    check_range("--size", args.size, 0, DEFAULT_MAX_FRAME_SIZE - 1024)
    check_range("--concurrency", args.concurrency, 1, 100_000)
    check_range("--seconds", args.seconds, 0.1, 3600)
    check_range("--warmup-seconds", args.warmup_seconds, 0, 600)
    if args.server is not None:
        parse_host_port(args.server, key="--server", dial=True)
    console = PipeConsole(stderr=args.json)
    server = None
    try:
        if args.server is None:
            server = spawn_ready_process(["--log-level", "WARNING", "bench", "rpc-server", "--listen",
                                          "127.0.0.1:0"])
            addr = server.fields["listen"]
        else:
            addr = args.server
        async def main() -> RpcResult:
            try:
                return await run_rpc_client(addr, size=args.size, concurrency=args.concurrency,
                                            seconds=args.seconds, warmup_s=args.warmup_seconds,
                                            console=None if args.json else console,
                                            server_pid=None if server is None else server.pid)
            except* (RaftMQError, OSError) as group:  # a --server nobody listens on: was a traceback
                raise BenchError(f"echo server {addr}: {leaf_exceptions(group)[0]}") from None

        result = run_bench("rpc", main, as_json=args.json)
    finally:
        if server is not None:
            server.stop()
    if args.json:
        print_json(bench="rpc", size=args.size, concurrency=args.concurrency, server=addr,
                   server_pid=None if server is None else server.pid, result=result)
    else:
        lat = result.latency
        print_table(console, f"raftmq bench rpc: {args.size} B echo, {args.concurrency} in flight, one connection",
                    [("requests/s", round(result.requests_per_s)), ("p50 latency ms", lat.p50_ms),
                     ("p90 latency ms", lat.p90_ms), ("p99 latency ms", lat.p99_ms),
                     ("max latency ms", lat.max_ms), ("requests", result.requests), ("errors", result.errors),
                     ("warm-up errors", result.warmup_errors),
                     ("client CPU µs/request", "n/a" if result.client_cpu_us_per_request is None
                      else result.client_cpu_us_per_request),
                     ("server CPU µs/request", "n/a" if result.server_cpu_us_per_request is None
                      else result.server_cpu_us_per_request),
                     ("requests/s if CPU-bound", "n/a" if result.cpu_bound_requests_per_s is None
                      else round(result.cpu_bound_requests_per_s)),
                     ("seconds", result.seconds), ("server", addr if server is None else f"{addr} pid {server.pid}")])
    return 1 if result.errors else 0


def run_server(args: argparse.Namespace) -> int:
    host, port = parse_host_port(args.listen, key="--listen")
    check_range("--max-frame-size", args.max_frame_size, 1024, 2**31 - 1)

    async def main(nursery: trio.Nursery) -> None:
        try:
            bound_host, bound_port = await nursery.start(
                partial(serve_remoting, EchoHandler(), host, port, max_frame_size=args.max_frame_size))
        except* OSError as group:
            raise start_error(f"cannot listen on {args.listen}", group) from None
        announce_ready("rpc-server", listen=f"{bound_host}:{bound_port}")

    return run_until_signalled(main)
