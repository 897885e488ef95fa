from __future__ import annotations

import pytest

from tests.procs import ServerProcess


@pytest.fixture
def spawn(tmp_path):
    """``spawn(argv, **kw)`` starts a ``ServerProcess``; every process it started is stopped at teardown,
    pass or fail."""
    started: list[ServerProcess] = []

    def _spawn(argv, **kw) -> ServerProcess:
        kw.setdefault("log_path", tmp_path / f"proc-{len(started)}.log")
        proc = ServerProcess(argv, **kw)
        started.append(proc)
        return proc

    yield _spawn
    for proc in reversed(started):
        proc.stop(timeout_s=5)
