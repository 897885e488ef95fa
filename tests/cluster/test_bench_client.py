"""``raftmq bench produce`` and ``raftmq bench consume`` against a real ``raftmq dev``: short runs that report
every figure the issue asks for (msgs/s, MB/s, p50/p99), the CPU each process spent per message, and a bad
argument refused with a message naming it."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.load, pytest.mark.slow, pytest.mark.timeout(180)]


def _bench(*args: str, status: int | None = 0) -> dict:
    done = subprocess.run(raftmq_argv("--log-level", "WARNING", "bench", *args, "--json"), capture_output=True,
                          text=True, timeout=150)
    if status is not None:
        assert done.returncode == status, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return {**report, "_status": done.returncode}


def _check_cpu(cpu: dict) -> None:
    nodes = {label: us for label, us in cpu.items() if label.startswith("broker-a/")}
    assert len(nodes) == 3, cpu
    assert sum(label.endswith(" leader") for label in nodes) == 1, cpu
    assert all(us > 0 for us in nodes.values()) and cpu["client"] > 0
    assert cpu["total"] == pytest.approx(sum(nodes.values()) + cpu["client"])


def test_bench_produce_and_consume_report_rates_latencies_and_cpu(spawn, tmp_path):
    dev = spawn(raftmq_argv("--log-level", "WARNING", "dev", "--data-dir", str(tmp_path / "dev"), "--base-port", "0"),
                ready_timeout_s=90)
    namesrv = dev.fields["namesrv"]

    single = _bench("produce", "--namesrv", namesrv, "--seconds", "1", "--warmup-seconds", "0.3",
                    "--concurrency", "16")
    assert single["errors"] == 0 and single["messages"] > 0 and single["msgs_per_s"] > 0
    assert single["mb_per_s"] == pytest.approx(single["msgs_per_s"] * 1024 / 1e6)
    assert single["latency"]["count"] == single["messages"]
    assert 0 < single["latency"]["p50_ms"] <= single["latency"]["p99_ms"]
    _check_cpu(single["cpu_us_per_msg"])
    # How fast the machine was: the reference timings of machine_speed(), taken before the run.
    assert set(single["machine"]) == {"copy_480k_us", "python_loop_us"}
    assert all(0 < v < 100_000 for v in single["machine"].values()), single["machine"]

    batch = _bench("produce", "--namesrv", namesrv, "--seconds", "1", "--warmup-seconds", "0.3",
                   "--concurrency", "4", "--batch", "32", "--size", "256")
    assert batch["params"]["batch"] == 32 and batch["messages"] == 32 * batch["latency"]["count"]
    _check_cpu(batch["cpu_us_per_msg"])

    # Stopped at exactly --messages (it overshot by up to --concurrency - 1), long before --seconds.
    bounded = _bench("produce", "--namesrv", namesrv, "--seconds", "60", "--warmup-seconds", "0", "--concurrency",
                     "16", "--messages", "200")
    assert bounded["messages"] == 200 and bounded["latency"]["count"] == 200
    assert bounded["elapsed_s"] == pytest.approx(200 / bounded["msgs_per_s"])

    # A timeout shorter than a round trip: the failures are counted, and by the error that ended each send. When
    # none was acknowledged (the usual case) the bench fails, naming them: it exited 0 with 0 msgs/s.
    hurried = _bench("produce", "--namesrv", namesrv, "--seconds", "0.5", "--warmup-seconds", "0",
                     "--concurrency", "8", "--send-timeout-ms", "1", status=None)
    if hurried["_status"] == 1:
        match = re.fullmatch(r"no send was acknowledged in the [0-9.]+ s measured: (\d+) failed \((.*)\)",
                             hurried["error"])
        assert match, hurried
        kinds = {kind: int(n) for n, kind in (part.split(" ", 1) for part in match[2].split(", "))}
        hurried = {**hurried, "errors": int(match[1]), "error_kinds": kinds}
    assert hurried["_status"] in (0, 1), hurried
    assert hurried["errors"] > 0 and sum(hurried["error_kinds"].values()) == hurried["errors"]
    # The wait for a response runs out, or (before the route is known) the deadline passes before any attempt. On a
    # loaded machine (make test's other worker) the leader can be silent past SILENT_CLOSE_MIN_S while sends time
    # out: the client then closes that connection, a reconnect does not fit in 1 ms (ConnectError), and asking a
    # follower where the leader is answers NOT_LEADER (seen once: 1 and 1 of 230). Each is still the error that
    # ended its send, which is what is checked here. Under heavier load a 1 ms deadline can pass before any attempt
    # on every send, the route cached or not (TooSlowError: 30 of 48 in one snapshot run beside seven other
    # engineers' test runs, no RequestTimeoutError), so one of the two timeouts must be among them, not a given one.
    assert {"RequestTimeoutError", "TooSlowError"} & set(hurried["error_kinds"]), hurried["error_kinds"]
    assert set(hurried["error_kinds"]) <= {"RequestTimeoutError", "TooSlowError", "ConnectError", "NotLeaderError"}, \
        hurried["error_kinds"]
    assert single["error_kinds"] == {}

    consumed = _bench("consume", "--namesrv", namesrv, "--messages", "3000", "--size", "128", "--seconds", "60")
    assert consumed["messages"] == 3000 and consumed["errors"] == 0 and consumed["msgs_per_s"] > 0
    _check_cpu(consumed["cpu_us_per_msg"])
    assert set(consumed["machine"]) == {"copy_480k_us", "python_loop_us"}
    # The same through a simple consumer (POP): each message received, then acked, by 4 concurrent loops.
    popped = _bench("consume", "--namesrv", namesrv, "--messages", "300", "--size", "128", "--seconds", "60",
                    "--simple", "4", "--pull-batch", "16")
    assert popped["messages"] == 300 and popped["errors"] == 0 and popped["params"]["simple"] == 4
    _check_cpu(popped["cpu_us_per_msg"])
    # Acked with one batch ack per receive (BATCH_ACK_MESSAGE: one replicated write for each).
    batched = _bench("consume", "--namesrv", namesrv, "--messages", "300", "--size", "128", "--seconds", "60",
                     "--simple", "4", "--pull-batch", "16", "--ack-batch")
    assert batched["messages"] == 300 and batched["errors"] == 0 and batched["params"]["ack_batch"] is True
    _check_cpu(batched["cpu_us_per_msg"])

    bad = subprocess.run(raftmq_argv("bench", "produce", "--namesrv", namesrv, "--batch", "0"), capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--batch" in bad.stderr and "0" in bad.stderr
