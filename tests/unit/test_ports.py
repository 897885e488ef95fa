"""raftmq.ports: free ports come from below the kernel's ephemeral range, where no outgoing connection can take
one between the choice and the bind."""

from __future__ import annotations

import random
import socket

import pytest

from raftmq import ports


@pytest.fixture(autouse=True)
def _no_range_of_our_own(monkeypatch):
    # The suite's parallel workers each set one (tests/conftest.py); these tests set their own or none.
    monkeypatch.delenv(ports.PORT_RANGE_ENV, raising=False)


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
        # The busy port first, then random ones: a fixed second pick could be in use too, or handed out already
        # by this process (a worker that ran other tests first), and the picks ran out.
        rng = random.Random()
        tried: list[int] = []

        def pick(low: int, high: int) -> int:
            tried.append(taken if not tried else rng.randint(max(low, 1024), high))
            return tried[-1]

        monkeypatch.setattr(ports.random, "randint", pick)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65536)
        monkeypatch.setattr(ports, "LOWEST_PORT", 1)
        assert ports.free_port() != taken
        assert tried[0] == taken


def test_a_range_of_ones_own_is_kept_to(monkeypatch):
    monkeypatch.setenv(ports.PORT_RANGE_ENV, "21000-21099")
    given = [ports.free_port() for _ in range(50)]
    assert len(set(given)) == 50 and all(21000 <= p <= 21099 for p in given)


@pytest.mark.parametrize("text", ["21000", "21000-", "b-c", "21099-21000", "80-90", "60000-70000"])
def test_a_malformed_range_is_named(monkeypatch, text):
    monkeypatch.setenv(ports.PORT_RANGE_ENV, text)
    with pytest.raises(ValueError, match=f"RAFTMQ_PORT_RANGE={text!r}"):
        ports.free_port()
