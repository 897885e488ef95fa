"""``LocalCluster.stop_all`` (``raftmq dev``'s and ``raftmq chaos``'s shutdown): the brokers get SIGTERM at once and
share one ``--stop-timeout``; waited one after the other with the whole timeout each, hung ones were killed at
T, 2T, 3T. Real processes that ignore SIGTERM stand in for hung brokers."""

from __future__ import annotations

import signal
import sys

from raftmq.commands.dev import NODE_IDS, Child, LocalCluster, plan_ports

# Prints its ready line only once SIGTERM is ignored, so the SIGTERM that follows is surely ignored.
HUNG = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready kind=hung', flush=True); "
        "time.sleep(120)")


def test_hung_brokers_are_all_killed_at_the_one_deadline(tmp_path, monkeypatch):
    cluster = LocalCluster(tmp_path, plan_ports(tmp_path, 0), stop_timeout_s=1.0)
    waits: list[tuple[str, float]] = []
    stop = Child.stop

    def recorded_stop(self: Child, timeout_s: float) -> int | None:
        waits.append((self.name, timeout_s))
        return stop(self, timeout_s)

    monkeypatch.setattr(Child, "stop", recorded_stop)
    try:
        for nid in NODE_IDS:
            cluster.nodes[nid] = Child(nid, [sys.executable, "-c", HUNG], tmp_path / f"{nid}.log")
        for child in cluster.nodes.values():
            child.wait_ready(30)
        cluster.stop_all()
    finally:
        for child in cluster.nodes.values():
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
    assert [name for name, _ in waits] == ["n3", "n2", "n1"]
    # The first wait runs to the deadline; the others are left no time past it.
    assert 0 < waits[0][1] <= 1.0
    assert [timeout for _, timeout in waits[1:]] == [0.0, 0.0]
    assert [child.proc.returncode for child in cluster.nodes.values()] == [-signal.SIGKILL] * 3
