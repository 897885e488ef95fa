"""raftmq.ports: free ports come from below the kernel's ephemeral range, where no outgoing connection can take
one between the choice and the bind."""

from __future__ import annotations

import socket

from raftmq import ports


def test_ports_are_bindable_distinct_and_below_the_ephemeral_range():
    low = ports._ephemeral_low()
    given = [ports.free_port() for _ in range(300)]
    assert len(set(given)) == len(given)
    if low - 1 > ports.LOWEST_PORT:
        assert all(ports.LOWEST_PORT <= p < low for p in given)
    with socket.socket() as s:
        s.bind(("127.0.0.1", given[-1]))  # still free


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = iter([taken, taken + 1 if taken < 65535 else taken - 1])
        monkeypatch.setattr(ports.random, "randint", lambda a, b: next(picks))
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65536)
        monkeypatch.setattr(ports, "LOWEST_PORT", 1)
        assert ports.free_port() != taken
