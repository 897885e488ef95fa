"""Free loopback ports for processes started by ``raftmq dev``, ``raftmq bench`` and the tests.

Binding port 0 and handing the number to a process that binds it later leaves a gap, and the kernel takes port
0's answer from its ephemeral range: the range it also takes the source port of every outgoing connection
from. A connection opened in the gap (a client of a cluster already running, a server dialling a peer) can
then hold the port, and the process that was given it fails to bind (seen in the cluster tests:
``could not bind the Raft port``). So ports come from below the ephemeral range, where no outgoing
connection is ever given one, and each is handed out once per process.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port"]

EPHEMERAL_RANGE_PATH = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10_000  # below are the well-known and registered services a developer may run
_given: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open(EPHEMERAL_RANGE_PATH, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port of ``host`` that nothing listens on now, outside the ephemeral range, not handed out before by
    this process; a port-0 bind's answer if no such port is found (an ephemeral range that starts low)."""
    high = _ephemeral_low() - 1
    if high > LOWEST_PORT:
        for _ in range(200):
            port = random.randint(LOWEST_PORT, high)
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
