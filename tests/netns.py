"""Hosts in network namespaces that one test makes for itself, so it can cut links between real processes.

Killing or stopping a process never tests what a network partition does: the process runs on and talks to
whoever it can still reach. ``NetLab`` builds a small private network inside network namespaces created for the
test (the network rule allows those besides loopback) and deletes them afterwards:

- a hub namespace holding a bridge, and one namespace per host with a veth whose other end is on the bridge;
  host ``i`` (in the order given) gets ``10.77.0.<i+1>/24``. Every namespace is new and empty, so servers may
  bind fixed ports there, and nothing outside the lab can reach them or be reached.
- ``cut(a, b)`` drops every frame between two hosts, silently in both directions, like a switch that lost a
  path: each side's neighbour entry for the other points at a MAC no one has, so TCP sees no reset and no error,
  only silence. ``heal()`` removes those entries. (No iptables/nftables on these machines; neighbour entries
  need nothing but iproute2.)
- ``argv(host, argv)`` runs a command in a host's namespace (``ip netns exec`` execs it, so the PID is the
  command's own and the ``spawn`` fixture stops it by PID as usual); ``entered(host)`` moves the *calling
  thread* into a host's namespace for the duration of a ``with``, so a test's trio client can talk to the lab
  (a network namespace is per thread; sockets keep the namespace they were made in).

Namespaces are named ``rmq<pid>-<host>``; a new lab first deletes those of test processes that are gone (a
pytest killed with SIGKILL never runs its teardown). Making namespaces needs root and iproute2.
``unavailable()`` says why a machine cannot; ``require()`` skips the test then on a developer's machine and
fails it in CI (``CI`` set), where it must run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SUBNET = "10.77.0"
_CLONE_NEWNET = 0x40000000
_NOWHERE_MAC = "02:00:00:00:00:99"  # locally administered, unused: frames sent to it reach no one


def unavailable() -> str | None:
    """Why this machine cannot build a lab (None: it can)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def require() -> None:
    """Skip the calling test where no lab can be built, except in CI (``CI`` set), where it fails."""
    reason = unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"tests on a lab network must run in CI: {reason}")
        pytest.skip(reason)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")


def _remove_stale_labs() -> None:
    """Delete the namespaces of labs whose test process is gone (a pytest killed with SIGKILL never ran its
    teardown): named ``rmq<pid>-<host>`` with no such process alive."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        owner, sep, _ = name.partition("-")
        if sep and owner.startswith("rmq") and owner[3:].isdigit() and not os.path.exists(f"/proc/{owner[3:]}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def _threads_outside(home: str) -> list[str]:
    """This process's threads (``tid name``) whose network namespace is not ``home``."""
    strays = []
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.readlink(f"/proc/self/task/{tid}/ns/net") != home:
                strays.append(f"{tid} {Path(f'/proc/self/task/{tid}/comm').read_text().strip()}")
        except FileNotFoundError:  # ended meanwhile
            pass
    return strays


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class NetLab:
    def __init__(self, hosts: list[str], *, prefix: str | None = None) -> None:
        # The PID keeps concurrent test runs apart (only namespace names carry it; veth names, limited to 15
        # bytes, are p0, p1, ... and eth0 inside the namespaces).
        _remove_stale_labs()
        self.prefix = prefix or f"rmq{os.getpid()}"
        self.hosts = list(hosts)
        self.ip = {h: f"{SUBNET}.{i + 1}" for i, h in enumerate(self.hosts)}
        self._namespaces: list[str] = []
        self._cuts: set[tuple[str, str]] = set()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        hub = f"{self.prefix}-hub"
        self._add_ns(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            ns = self.ns(host)
            self._add_ns(ns)
            port = f"p{i}"
            # Made inside the hub, the peer moved into the host: nothing is ever created in the caller's namespace.
            _ip("-n", hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", hub, "link", "set", port, "master", "br0")
            _ip("-n", hub, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.ip[host]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def argv(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def cut(self, a: str, b: str) -> None:
        """Silently drop everything between hosts ``a`` and ``b`` (both directions) until ``heal()``."""
        for src, dst in ((a, b), (b, a)):
            _ip("-n", self.ns(src), "neigh", "replace", self.ip[dst], "lladdr", _NOWHERE_MAC, "dev", "eth0",
                "nud", "permanent")
            self._cuts.add((src, dst))

    def heal(self) -> None:
        for src, dst in sorted(self._cuts):
            _ip("-n", self.ns(src), "neigh", "del", self.ip[dst], "dev", "eth0")
        self._cuts.clear()

    @contextlib.contextmanager
    def entered(self, host: str) -> Iterator[None]:
        """The calling thread in ``host``'s namespace, and back in its own afterwards.

        A thread inherits the namespace of the thread that starts it, so one started inside (trio starts its
        worker threads on demand, e.g. for ``trio.run_process``) stays in the lab, and trio's thread cache
        would hand it to later tests: their servers would start in a deleted namespace. Start no thread inside;
        on leaving, this waits for any such thread to end (trio's idle workers exit after 10 s) and fails if
        one outlives that."""
        own_path = "/proc/thread-self/ns/net"
        home = os.readlink(own_path)
        own = os.open(own_path, os.O_RDONLY)
        try:
            target = os.open(Path("/run/netns") / self.ns(host), os.O_RDONLY)
            try:
                _setns(target)
            finally:
                os.close(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(own)
        deadline = time.monotonic() + 15
        while strays := _threads_outside(home):
            if time.monotonic() > deadline:
                raise RuntimeError(f"threads started inside the lab's namespace are still alive: {strays}")
            time.sleep(0.2)

    def close(self) -> None:
        """Delete every namespace this lab made (their veths go with them). Processes still inside keep their
        namespace alive until they exit; the ``spawn`` fixture stops them by PID."""
        for name in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        self._namespaces.clear()
