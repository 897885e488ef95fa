"""Free loopback ports for processes started by ``raftmq dev``, ``raftmq bench`` and the tests.

Binding port 0 and handing the number to a process that binds it later leaves a gap, and the kernel takes port
0's answer from its ephemeral range: the range it also takes the source port of every outgoing connection
from. A connection opened in the gap (a client of a cluster already running, a server dialling a peer) can
then hold the port, and the process that was given it fails to bind (seen in the cluster tests:
``could not bind the Raft port``). So ports come from below the ephemeral range, where no outgoing
connection is ever given one, and each is handed out once per process.
"""

from __future__ import annotations

import os
import random
import socket

__all__ = ["PORT_RANGE_ENV", "free_port", "port_range"]

EPHEMERAL_RANGE_PATH = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10_000  # below are the well-known and registered services a developer may run
PORT_RANGE_ENV = "RAFTMQ_PORT_RANGE"
_given: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open(EPHEMERAL_RANGE_PATH, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def port_range() -> tuple[int, int]:
    """The inclusive range ``free_port`` picks from: ``RAFTMQ_PORT_RANGE`` if set, else from ``LOWEST_PORT`` to
    just below the ephemeral range (empty, low > high, when that range starts low). Raises ``ValueError``
    naming a malformed ``RAFTMQ_PORT_RANGE``."""
    text = os.environ.get(PORT_RANGE_ENV)
    if not text:
        return LOWEST_PORT, _ephemeral_low() - 1
    low_text, sep, high_text = text.partition("-")
    try:
        low, high = int(low_text), int(high_text)
    except ValueError:
        low = high = -1
    if not sep or not 1024 <= low <= high <= 65535:
        raise ValueError(f"{PORT_RANGE_ENV}={text!r}: expected LOW-HIGH with 1024 <= LOW <= HIGH <= 65535")
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A port of ``host`` that nothing listens on now, within ``port_range()``, not handed out before by this
    process; a port-0 bind's answer if no such port is found there (an ephemeral range that starts low, or a
    ``RAFTMQ_PORT_RANGE`` used up)."""
    low, high = port_range()
    if high >= low:
        for _ in range(200):
            port = random.randint(low, high)
            if port in _given:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _given.add(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    _given.add(port)
    return port
