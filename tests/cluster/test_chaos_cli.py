"""``raftmq chaos`` end to end: the command starts a cluster of its own, kills or stops its nodes under load, and
reports. Its report is checked against what must have happened (leadership moved after each leader kill, and
only then; the killed node was started again), and afterwards none of its processes may be left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.load, pytest.mark.slow, pytest.mark.timeout(240)]


def _processes_of(data_dir: Path) -> list[int]:
    """Live raftmq processes of the cluster under ``data_dir``: the brokers name their config files there, the
    name server its port (in ``cluster.json``), the chaos command its ``--data-dir``."""
    needles = [str(data_dir)]
    state = data_dir / "cluster.json"
    if state.exists():
        needles.append(f"127.0.0.1:{json.loads(state.read_text())['ports']['namesrv']}")
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if "raftmq" in cmdline and any(needle in cmdline for needle in needles):
            pids.append(int(entry.name))
    return pids


def _chaos(figure, data_dir: Path, *args: str) -> dict:
    """Run ``raftmq chaos --json`` to completion; its report, which must say it passed. Whatever it leaves
    running fails the test, and is killed (by PID: every one of them was started for this test)."""
    argv = raftmq_argv("chaos", "--json", "--data-dir", str(data_dir), "--keep-data", "--size", "128", *args)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    finally:
        leftovers = _processes_of(data_dir)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"raftmq chaos left processes running: {leftovers}"
    assert done.stdout.strip(), f"no report (rc={done.returncode}); stderr:\n{done.stderr[-3000:]}"
    report = json.loads(done.stdout.strip().splitlines()[-1])
    figure(f"raftmq chaos {' '.join(args)}: {json.dumps(report)}")
    assert done.returncode == (0 if report["ok"] else 1), (done.returncode, report)
    assert report["ok"], done.stderr[-3000:]
    return report


def _ready_lines(log: Path) -> int:
    return sum(1 for line in log.read_text(errors="replace").splitlines() if line.startswith("ready kind=broker"))


def test_chaos_kills_the_leader_twice_and_nothing_acknowledged_is_lost(tmp_path, figure):
    data_dir = tmp_path / "chaos"
    report = _chaos(figure, data_dir, "--rounds", "2", "--fault", "kill", "--target", "leader",
                    "--down-seconds", "1", "--settle-seconds", "1.5")
    assert report["missing"] == 0 and report["logs_identical"] and report["acks_resumed_after_every_fault"]
    assert report["acked"] > 0 and report["consumed"] >= report["acked"]
    # Survival, not only delivery: every acknowledged message read back from the topic afterwards, and the logs
    # compared to the same non-zero end on every member.
    assert report["lost"] == 0 and report["read_back_error"] is None and report["read_back"] >= report["acked"]
    assert report["logs_behind"] == {} and report["logs_compared_up_to"] > 0
    assert len(report["rounds"]) == 2
    for r in report["rounds"]:
        assert r["role"] == "leader" and r["fault"] == "kill"
        assert r["first_ack_by_another_s"] is not None, r  # the clients found a new leader
        assert r["leader_after"] != r["victim"] and r["term_after"] > r["term"], r
        # The killed node was started again on its data: a second ready line in its log.
        assert _ready_lines(data_dir / "logs" / f"broker-a-{r['victim']}.log") >= 2, r


def test_chaos_stops_a_follower_and_the_leader_stays(tmp_path, figure):
    data_dir = tmp_path / "chaos"
    report = _chaos(figure, data_dir, "--rounds", "1", "--fault", "stop", "--target", "follower",
                    "--down-seconds", "2", "--settle-seconds", "1.5")
    [r] = report["rounds"]
    assert r["role"] == "follower" and r["fault"] == "stop"
    assert r["first_ack_by_another_s"] is None  # nothing to fail over: the leader kept acknowledging
    # Pre-vote: the follower back from its stop does not depose the healthy leader.
    assert r["victim"] != r["leader"] and (r["leader_after"], r["term_after"]) == (r["leader"], r["term"]), r
    assert report["missing"] == 0 and report["logs_identical"]


def test_chaos_rebuilds_the_leader_empty_and_nothing_acknowledged_is_lost(tmp_path, figure):
    data_dir = tmp_path / "chaos"
    report = _chaos(figure, data_dir, "--rounds", "1", "--fault", "rebuild", "--target", "leader",
                    "--down-seconds", "1", "--settle-seconds", "1.5")
    [r] = report["rounds"]
    assert r["role"] == "leader" and r["fault"] == "rebuild" and r["first_ack_by_another_s"] is not None, r
    assert report["missing"] == 0 and report["logs_identical"] and report["acks_resumed_after_every_fault"]
    # Its data went aside, and it came back empty, told by a peer that the group is not new (no --rejoin).
    aside = data_dir / "aside" / f"round1-{r['victim']}"
    assert sorted(p.name for p in aside.iterdir()) == ["dledger", "store"]
    log_path = data_dir / "logs" / f"broker-a-{r['victim']}.log"
    assert _ready_lines(log_path) >= 2
    log = log_path.read_text(errors="replace")
    assert "a rebuilt member; rejoining as with --rejoin" in log and "rejoined: heard from the leader" in log


def test_chaos_restarts_the_leader_cleanly_and_it_hands_its_leadership_over(tmp_path, figure):
    data_dir = tmp_path / "chaos"
    report = _chaos(figure, data_dir, "--rounds", "1", "--fault", "restart", "--target", "leader",
                    "--down-seconds", "1", "--settle-seconds", "1.5")
    [r] = report["rounds"]
    assert r["role"] == "leader" and r["fault"] == "restart" and r["exit_status"] == 0, r
    assert r["leader_after"] != r["victim"] and r["term_after"] > r["term"], r
    assert r["first_ack_by_another_s"] is not None, r
    assert report["missing"] == 0 and report["logs_identical"] and report["clean_exits"]
    log_path = data_dir / "logs" / f"broker-a-{r['victim']}.log"
    assert _ready_lines(log_path) >= 2
    assert "handed leadership over before stopping" in log_path.read_text(errors="replace")
