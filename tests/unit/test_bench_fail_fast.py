"""The benches give up at once on what cannot work, in one line, instead of a 30 s wait and a flood or a traceback:
``bench dledger`` on a used ``--data-dir`` (hung 30 s, then a 71-line trio.TooSlowError traceback), and
``bench produce|consume`` at a ``--namesrv`` where nothing listens (101 stderr lines over 30 s) or where
something else answers, such as an HTTP port (199 lines over 30 s)."""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import subprocess
import threading
from collections.abc import Iterator

import pytest
import trio

from raftmq.bench.common import BenchError
from raftmq.bench.produce import ensure_topic
from tests.procs import raftmq_argv


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on leaving: nothing listens there now


@contextlib.contextmanager
def http_server() -> Iterator[int]:
    """A port that accepts and answers every connection with an HTTP response (as a /metrics port would)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def run_bench_cli(kind: str, namesrv: str) -> subprocess.CompletedProcess[str]:
    extra = ["--warmup-seconds", "0", "--concurrency", "4"] if kind == "produce" else ["--messages", "10"]
    # No clock in the checks (the suite measures no speed): the error each ends with is only raised by the path
    # that gives up early, and the 30 s wait it replaced would have logged ~100 lines.
    return subprocess.run(raftmq_argv("bench", kind, "--namesrv", namesrv, "--seconds", "1", *extra),
                          capture_output=True, text=True, timeout=60)


def test_bench_dledger_refuses_a_used_data_dir_before_starting_anything(tmp_path, capsys):
    from raftmq.cli import main

    used = tmp_path / "used"
    (used / "n0" / "dledger").mkdir(parents=True)
    (used / "n1.toml").write_text("left by an earlier run\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "dledger", "--seconds", "1", "--warmup-seconds", "0", "--concurrency", "8",
              "--data-dir", str(used)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--data-dir {str(used)!r} is not empty" in err
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in used.iterdir()) == ["n0", "n1.toml"]  # nothing written or removed


def test_bench_dledger_help_says_the_data_dir_must_be_new_or_empty(capsys):
    from raftmq.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "dledger", "--help"])
    assert "must be new or empty" in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["produce", "consume"])
def test_a_name_server_port_nothing_listens_on_fails_fast_in_a_few_lines(kind):
    port = closed_port()
    done = run_bench_cli(kind, f"127.0.0.1:{port}")
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) <= 4, done.stderr  # was 101: an INFO line per 0.3 s retry
    assert lines[-1].startswith(f"raftmq bench {kind}: error: no name server at 127.0.0.1:{port} answered within "
                                f"5 s: could not connect to 127.0.0.1:{port}")


@pytest.mark.parametrize("kind", ["produce", "consume"])
def test_a_name_server_port_speaking_another_protocol_fails_at_once_in_a_few_lines(kind):
    with http_server() as port:
        done = run_bench_cli(kind, f"127.0.0.1:{port}")
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) <= 4, done.stderr  # was 199: the transport's bad-frame WARNING and an INFO line per retry
    assert lines[-1].startswith(f"raftmq bench {kind}: error: name server 127.0.0.1:{port} does not speak the "
                                f"raftmq protocol: the connection to 127.0.0.1:{port} closed before the response "
                                f"arrived: bad frame")


async def test_the_waiting_is_logged_once_while_its_reason_stays_the_same(caplog):
    caplog.set_level(logging.INFO, logger="raftmq.bench.produce")
    with pytest.raises(BenchError, match="did not take topic 'BenchTopic' within 2 s"):
        await ensure_topic(f"127.0.0.1:{closed_port()}", "BenchTopic", 8, timeout_s=2)
    waiting = [r for r in caplog.records if r.name == "raftmq.bench.produce" and "waiting for" in r.getMessage()]
    assert len(waiting) == 1, [r.getMessage() for r in waiting]  # was one per 0.3 s retry


async def test_a_name_server_that_answers_is_waited_for_until_the_cluster_takes_the_topic(nursery):
    # A cluster just started: its name server answers, no broker group has registered yet. The bench must keep
    # asking for the whole timeout (brokers register within seconds), not stop when the name-server grace ends.
    from namesrv import NamesrvConfig, serve_namesrv

    host, port = await nursery.start(functools.partial(serve_namesrv, NamesrvConfig(listen="127.0.0.1:0")))
    started = trio.current_time()
    with pytest.raises(BenchError, match="did not take topic 'BenchTopic' within 1.5 s; last error: no broker "
                                         "group is registered"):
        await ensure_topic(f"{host}:{port}", "BenchTopic", 8, timeout_s=1.5, namesrv_grace_s=0.3)
    assert trio.current_time() - started >= 1.4


async def test_a_name_server_port_that_accepts_and_never_answers_fails_after_the_grace(nursery):
    # A hung process, or a port that takes connections and waits for its peer to speak first: each request times
    # out instead of being refused, and the bench must still give up when the grace ends, naming the silence.
    async def hold(stream: trio.SocketStream) -> None:
        while await stream.receive_some(65536):
            pass

    listeners = await nursery.start(functools.partial(trio.serve_tcp, hold, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    with pytest.raises(BenchError, match=rf"^no name server at 127\.0\.0\.1:{port} answered within 0\.3 s: "
                                         rf"127\.0\.0\.1:{port} did not answer"):
        await ensure_topic(f"127.0.0.1:{port}", "BenchTopic", 8, timeout_s=30, namesrv_grace_s=0.3)
