"""``raftmq bench dledger`` runs end to end (short) and reports every figure the issue asks for."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.load, pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.mark.parametrize("state_machine", ["byte_log", "message_store"])
def test_bench_dledger_reports_rate_latency_memory_and_terms(state_machine):
    done = subprocess.run(raftmq_argv("--log-level", "WARNING", "bench", "dledger", "--seconds", "1",
                                      "--warmup-seconds", "0.5", "--concurrency", "16", "--state-machine",
                                      state_machine, "--json"),
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["messages"] > 0 and result["msgs_per_s"] > 0 and result["mb_per_s"] > 0
    assert result["latency"]["p50_ms"] > 0 and result["latency"]["p99_ms"] >= result["latency"]["p50_ms"]
    assert set(result["rss_mb"]) == {"n0", "n1", "n2"} and set(result["term_start"]) == {"n0", "n1", "n2"}
    assert result["term_unchanged"] is True
    assert result["failed_batches"] == 0
