"""`raftmq bench rpc` end to end (a real spawned echo server), and the shared bench helpers."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from raftmq.bench.common import percentile, summarize_latencies
from raftmq.cli import main
from tests.procs import REPO_ROOT, raftmq_argv


@pytest.mark.cluster
def test_bench_rpc_runs_and_stops_its_server():
    done = subprocess.run(raftmq_argv("bench", "rpc", "--size", "100", "--concurrency", "8", "--seconds", "1",
                                      "--warmup-seconds", "0.2", "--json"),
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    result = report["result"]
    assert report["bench"] == "rpc" and report["size"] == 100 and report["concurrency"] == 8
    assert result["errors"] == 0 and result["requests"] > 100
    assert result["requests_per_s"] == pytest.approx(result["requests"] / result["seconds"])
    latency = result["latency"]
    assert 0 < latency["p50_ms"] <= latency["p99_ms"] <= latency["max_ms"]
    assert result["client_cpu_us_per_request"] > 0 and result["server_cpu_us_per_request"] > 0
    assert result["cpu_bound_requests_per_s"] == pytest.approx(
        1e6 / max(result["client_cpu_us_per_request"], result["server_cpu_us_per_request"]))
    with pytest.raises(ProcessLookupError):  # stopped by PID and reaped
        os.kill(report["server_pid"], 0)


@pytest.mark.parametrize("args,message", [
    (["--concurrency", "0"], "--concurrency must be within 1..100000, got 0"),
    (["--seconds", "-1"], "--seconds must be within 0.1..3600, got -1.0"),
    (["--server", "nohost"], "--server must look like HOST:PORT, got 'nohost'"),
])
def test_bench_rpc_rejects_bad_options(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "rpc", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_percentiles():
    values = list(range(1, 101))
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile(values, 0) == 1
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="within 0..100"):
        percentile(values, 101)
    summary = summarize_latencies([3_000_000, 1_000_000, 2_000_000])
    assert (summary.count, summary.p50_ms, summary.max_ms, summary.mean_ms) == (3, 2.0, 3.0, 2.0)
    assert summarize_latencies([]).count == 0
