"""``raftmq dev`` and ``raftmq chaos`` stopped while they start: Ctrl-C (and for dev SIGTERM) stops every child they
started at once, by PID, and they exit as a stopped command does, instead of waiting up to a minute for a child that
is not getting ready (it is SIGSTOPped here) and then failing with "did not become ready"."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.procs import REPO_ROOT, raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def _children(pid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # gone meanwhile
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(entry.name))
    return out


def _is_broker(pid: int) -> bool:
    try:
        return b"broker" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stop_a_starting_broker_then_signal(argv: list[str], signum: int) -> tuple[subprocess.CompletedProcess, set]:
    """Run ``argv``, SIGSTOP the first broker it starts (so it never gets ready), send ``signum`` a second later;
    its result and every child it had. Whatever is left is killed (by PID: each was started for this test)."""
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: set[int] = set()
    victim = None
    try:
        while victim is None and proc.poll() is None:
            children |= _children(proc.pid)
            victim = next((pid for pid in children if _is_broker(pid)), None)
            if victim is not None:
                os.kill(victim, signal.SIGSTOP)
            time.sleep(0.01)
        assert victim is not None, proc.communicate()
        time.sleep(1)
        children |= _children(proc.pid)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), children


def _left_running(children: set[int]) -> list[int]:
    deadline = time.monotonic() + 10  # a child killed by the command may take a moment to be reaped by init
    while (alive := [pid for pid in children if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@pytest.mark.parametrize("signum, status, said", [
    (signal.SIGINT, 130, "raftmq dev: interrupted while starting; every process it started is stopped"),
    (signal.SIGTERM, 0, "raftmq dev: stopped while starting (SIGTERM); every process it started is stopped"),
])
def test_dev_stops_what_it_started_on_a_signal_while_starting(signum, status, said, tmp_path):
    done, children = _stop_a_starting_broker_then_signal(
        raftmq_argv("dev", "--data-dir", str(tmp_path / "dev"), "--base-port", "0", "--stop-timeout", "2"), signum)
    assert done.returncode == status, done.stderr[-3000:]
    assert said in done.stderr and "did not become ready" not in done.stderr, done.stderr[-3000:]
    assert "ready kind=dev" not in done.stdout
    assert len(children) >= 2  # the name server and at least the broker stopped
    assert _left_running(children) == []


def test_chaos_stops_what_it_started_on_ctrl_c_while_starting(tmp_path):
    data_dir = tmp_path / "chaos"
    done, children = _stop_a_starting_broker_then_signal(
        raftmq_argv("chaos", "--data-dir", str(data_dir), "--rounds", "1"), signal.SIGINT)
    assert done.returncode == 130, done.stderr[-3000:]
    assert f"raftmq chaos: interrupted; data and logs kept in {data_dir}" in done.stderr, done.stderr[-3000:]
    assert "did not become ready" not in done.stderr, done.stderr[-3000:]
    assert _left_running(children) == []
