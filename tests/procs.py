"""Real server processes for cluster tests.

``ServerProcess`` starts ``python -m raftmq ...`` (or any argv), waits for its ready line, exposes the parsed
fields (``proc.fields["listen"]``), and is always stopped by PID, with SIGKILL if it does not exit after SIGTERM.
Use it through the ``spawn`` fixture in ``tests/conftest.py`` so it is cleaned up even when a test fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from raftmq import ports
from raftmq.runner import PARENT_PID_ENV

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (outside the ephemeral range: ``raftmq.ports``); prefer binding port 0 in the
    server and reading the ready line."""
    return ports.free_port(host)


class ServerProcess:
    def __init__(self, argv: list[str], *, cwd: Path | None = None, env: dict | None = None,
                 ready_timeout_s: float = 30.0, log_path: Path | None = None) -> None:
        self.argv = argv
        self.log_path = log_path
        self.output: list[str] = []
        self.fields: dict[str, str] = {}
        self._ready = threading.Event()
        full_env = dict(os.environ)
        full_env["PYTHONUNBUFFERED"] = "1"
        # A server stops by itself once this process is gone: a test process killed outright (a pytest-xdist
        # worker when the run is interrupted, a SIGKILL) never reaches the teardown that stops it by PID.
        full_env[PARENT_PID_ENV] = str(os.getpid())
        full_env.update(env or {})
        self._log_file = open(log_path, "a", encoding="utf-8") if log_path else None
        self.proc = subprocess.Popen(argv, cwd=cwd or REPO_ROOT, env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.pid = self.proc.pid
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(ready_timeout_s):
            self.kill()
            raise RuntimeError(f"{argv} did not print a ready line within {ready_timeout_s}s; output:\n"
                               + "".join(self.output[-50:]))
        if not self.fields:
            raise RuntimeError(f"{argv} exited before it was ready (rc={self.proc.poll()}); output:\n"
                               + "".join(self.output[-50:]))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if len(self.output) > 5000:
                del self.output[:1000]
            if self._log_file:
                self._log_file.write(line)
                self._log_file.flush()
            if line.startswith("ready ") and not self.fields:
                self.fields = dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
                self._ready.set()
        self._ready.set()

    def address(self, key: str = "listen") -> tuple[str, int]:
        host, _, port = self.fields[key].rpartition(":")
        return host, int(port)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.alive:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it lingers; returns the exit code."""
        if self.alive:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._reader.join(5)
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()  # else a ResourceWarning, an error under filterwarnings=error
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        return self.proc.returncode

    def wait_output(self, needle: str, timeout_s: float = 10.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.output):
                if needle in line:
                    return line
            time.sleep(0.02)
        raise AssertionError(f"{needle!r} not seen in output of {self.argv}:\n" + "".join(self.output[-50:]))


@contextlib.contextmanager
def spawner(log_dir: Path) -> Iterator[Callable[..., ServerProcess]]:
    """``spawn(argv, **kw)`` starts a ``ServerProcess`` (its log in ``log_dir`` unless ``log_path`` is given); every
    process it started is stopped on leaving the block, pass or fail. The ``spawn`` fixture is one per test; a
    module's shared cluster uses one in its module-scoped fixture."""
    started: list[ServerProcess] = []

    def spawn(argv: list[str], **kw) -> ServerProcess:
        kw.setdefault("log_path", log_dir / f"proc-{len(started)}.log")
        proc = ServerProcess(argv, **kw)
        started.append(proc)
        return proc

    try:
        yield spawn
    finally:
        for proc in reversed(started):
            proc.stop(timeout_s=5)


def raftmq_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "raftmq", *args]
