"""``raftmq bench produce|consume`` against a cluster it cannot use: one sentence and exit 1, not a
trio.TooSlowError traceback out of nested exception groups (what an unreachable --namesrv gave after 30 s)."""

from __future__ import annotations

import pytest
import trio

from raftmq.bench.common import BenchError, run_bench
from raftmq.bench.produce import ensure_topic


def test_an_unreachable_name_server_ends_the_bench_with_one_sentence():
    async def main() -> None:
        await ensure_topic("127.0.0.1:1", "BenchTopic", 8, timeout_s=0.5)  # nothing listens on port 1

    with pytest.raises(SystemExit) as exit_info:
        run_bench("produce", main)
    message = str(exit_info.value.code)
    assert message.startswith("raftmq bench produce: error: the cluster behind name server 127.0.0.1:1 did not "
                              "take topic 'BenchTopic' within 0.5 s; last error: could not connect to 127.0.0.1:1")


def test_a_bench_error_inside_a_nursery_is_found_and_anything_else_is_raised():
    async def nested() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            raise BenchError("the backlog of 10 messages was not produced within 1 s (3 sent)")

    with pytest.raises(SystemExit, match=r"^raftmq bench consume: error: the backlog of 10 messages"):
        run_bench("consume", nested)

    async def broken() -> None:
        raise KeyError("a bug stays a traceback")

    with pytest.raises(KeyError):
        run_bench("consume", broken)


@pytest.mark.parametrize("argv, named", [
    # A topic the brokers refuse was retried by ensure_topic for 30 s, then reported as the cluster's failure.
    (["produce", "--topic", "bad topic"], "--topic 'bad topic' contains illegal characters"),
    (["produce", "--topic", "rmq_sys_x"], "--topic 'rmq_sys_x' is reserved for the broker"),
    (["consume", "--topic", "bad topic"], "--topic 'bad topic' contains illegal characters"),
    (["consume", "--queues", "0"], "--queues must be within 1..1024, got 0"),
    (["consume", "--namesrv", "nowhere"], "--namesrv must look like HOST:PORT, got 'nowhere'"),
    (["consume", "--simple", "-1"], "--simple must be within 0..256, got -1"),
    (["consume", "--simple", "4", "--pull-batch", "64"], "--pull-batch must be within 1..32, got 64"),  # POP's limit
    (["consume", "--ack-batch"], "--ack-batch acks what a simple consumer receives: it needs --simple N"),
    (["produce", "--namesrv", "127.0.0.1:0"], "--namesrv needs a fixed port (it is dialed"),
    (["produce", "--warmup-seconds", "-1"], "--warmup-seconds must be within 0..600, got -1.0"),
    # Ran explicit batches with auto_batch on and nothing for it to do, and reported it as on.
    (["produce", "--auto-batch", "--batch", "4"], "--auto-batch batches single sends; --batch 4 sends batches"),
])
def test_a_bad_option_exits_2_naming_it_before_any_cluster_is_asked(argv, named, capsys):
    from raftmq.cli import main

    if "--namesrv" not in argv:
        argv = [*argv, "--namesrv", "127.0.0.1:1"]  # nothing listens: a check that let it through would wait 30 s
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_with_json_a_failure_is_one_json_line_too(capsys):
    """``--json`` promises one JSON line: a bad option or a cluster it cannot use printed nothing on stdout."""
    import json

    from raftmq.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "produce", "--json", "--namesrv", "127.0.0.1:1", "--size", "0"])
    assert exit_info.value.code == 2
    assert json.loads(capsys.readouterr().out) == {"error": "--size must be within 1..4194304, got 0",
                                                   "errors": ["--size must be within 1..4194304, got 0"],
                                                   "exit_status": 2}

    async def main_() -> None:
        await ensure_topic("127.0.0.1:1", "BenchTopic", 8, timeout_s=0.2)

    with pytest.raises(SystemExit):
        run_bench("produce", main_, as_json=True)
    data = json.loads(capsys.readouterr().out)
    assert data["exit_status"] == 1 and data["error"].startswith("the cluster behind name server 127.0.0.1:1")


@pytest.mark.parametrize("argv, named", [
    (["store", "--modes", "", "--messages", "1"], "--modes must list ASYNC_FLUSH and/or SYNC_FLUSH, got ''"),
    (["store", "--modes", "ASYNC_FLUSH,async_flush", "--messages", "1"],
     "--modes names ASYNC_FLUSH more than once, got 'ASYNC_FLUSH,async_flush'"),
    (["store", "--dir", "{tmp}/missing", "--messages", "1"], "--dir '{tmp}/missing' is not an existing directory"),
    (["dledger", "--data-dir", "{tmp}/afile", "--seconds", "0.5"], "--data-dir '{tmp}/afile' is a file"),
    (["dledger", "--data-dir", "{tmp}/afile/x", "--seconds", "0.5"],
     "--data-dir '{tmp}/afile/x' cannot be made: Not a directory"),
])
def test_a_directory_it_cannot_use_exits_2_naming_it(argv, named, tmp_path, capsys):
    # Were tracebacks from tempfile.mkdtemp / Path.mkdir (exit 1); an empty --modes measured nothing, exit 0.
    from raftmq.cli import main

    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *(a.format(tmp=tmp_path) for a in argv)])
    assert exit_info.value.code == 2
    assert named.format(tmp=tmp_path) in capsys.readouterr().err


def test_an_echo_server_it_cannot_reach_ends_the_rpc_bench_with_one_sentence():
    # Was a ConnectError traceback out of trio.run.
    from raftmq.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "rpc", "--server", "127.0.0.1:1", "--seconds", "0.5", "--warmup-seconds", "0"])
    assert str(exit_info.value.code).startswith("raftmq bench rpc: error: echo server 127.0.0.1:1: could not "
                                                "connect to 127.0.0.1:1")


def test_an_echo_server_at_port_0_exits_2_naming_it(capsys):
    # Port 0 only tells a listener to pick a free port: it was dialled and came back as "could not connect".
    from raftmq.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "rpc", "--server", "127.0.0.1:0", "--seconds", "0.5", "--warmup-seconds", "0"])
    assert exit_info.value.code == 2
    assert "--server needs a fixed port (it is dialed; port 0 only tells a listening server to pick any free one), " \
           "got '127.0.0.1:0'" in capsys.readouterr().err


def test_an_echo_server_that_cannot_listen_exits_2_naming_the_address(capsys):
    # Was an exception-group traceback, exit 1 (as raftmq namesrv was).
    import socket

    from raftmq.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = "127.0.0.1:%d" % busy.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "rpc-server", "--listen", taken])
    assert exit_info.value.code == 2
    assert f"raftmq: error: cannot listen on {taken}: Address already in use" in capsys.readouterr().err


def test_an_empty_namesrv_is_refused_not_taken_for_no_namesrv():
    # produce/consume read a falsy --namesrv as "start a cluster of your own": '' started one.
    from raftmq.bench.common import check_namesrv_arg
    from remoting.config import ConfigError

    with pytest.raises(ConfigError, match="--namesrv needs HOST:PORT, got ''"):
        check_namesrv_arg("")
