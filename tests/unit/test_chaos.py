"""``raftmq chaos`` without a cluster: the accounting its verdict rests on, and the options it refuses."""

from __future__ import annotations

import pytest

from raftmq.cli import main
from raftmq.commands.chaos import Ledger
from remoting.message import create_msg_id

A, B = ("127.0.0.1", 10911), ("127.0.0.1", 10921)


def _ledger(acks: list[tuple[float, str, tuple[str, int]]]) -> Ledger:
    ledger = Ledger()
    for at, msg_id, host in acks:
        ledger.ack(msg_id, create_msg_id(host, 4096))
        ledger.ack_times[-1] = at  # the clock is the test's
    return ledger


def test_a_message_acknowledged_but_never_consumed_is_missing_and_redeliveries_are_duplicates():
    ledger = _ledger([(1.0, "m1", A), (2.0, "m2", A), (3.0, "m3", B)])
    ledger.consumed.update(["m1", "m1", "m1", "m3"])
    assert ledger.missing() == {"m2"}
    assert ledger.duplicates() == 2
    ledger.consumed["m2"] += 1
    assert ledger.missing() == set()


def test_the_failover_gap_counts_only_acknowledgements_stored_by_another_node():
    # Acks from the old leader after the fault (committed before it, answered late) do not end the gap.
    ledger = _ledger([(1.0, "m1", A), (5.0, "m2", A), (5.5, "m3", A), (6.25, "m4", B), (7.0, "m5", B)])
    assert ledger.first_ack_after(5.0, not_by="127.0.0.1:10911") == 6.25
    assert ledger.first_ack_after(0.0, not_by="127.0.0.1:10921") == 1.0
    assert ledger.first_ack_after(7.0, not_by="127.0.0.1:10911") is None


def test_the_longest_pause_includes_the_window_edges():
    ledger = _ledger([(1.0, "m1", A), (2.0, "m2", A), (6.0, "m3", B), (6.5, "m4", B)])
    assert ledger.longest_pause(1.5, 7.0) == pytest.approx(4.0)   # 2.0 -> 6.0
    assert ledger.longest_pause(6.5, 10.0) == pytest.approx(3.5)  # nothing after the last ack
    assert ledger.longest_pause(3.0, 5.0) == pytest.approx(2.0)   # no ack at all in the window
    # Where it began: a gap right after the fault is a failover, one later a stall after the node came back.
    assert ledger.longest_pause_span(1.5, 7.0) == (pytest.approx(4.0), 2.0)
    assert ledger.longest_pause_span(6.5, 10.0) == (pytest.approx(3.5), 6.5)
    assert ledger.longest_pause_span(0.0, 6.2) == (pytest.approx(4.0), 2.0)
    assert ledger.acks_between(1.5, 6.5) == 3


@pytest.mark.parametrize("argv, named", [
    (["--rounds", "0"], "--rounds must be within 1..100, got 0"),
    (["--senders", "1000"], "--senders must be within 1..256, got 1000"),
    (["--down-seconds", "-1"], "--down-seconds must be within 0..600, got -1.0"),
    (["--size", "0"], "--size must be within 1..4194304, got 0"),
])
def test_a_bad_option_exits_2_naming_it(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["chaos", *argv])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_a_data_dir_with_something_in_it_is_refused_and_left_alone(tmp_path, capsys):
    (tmp_path / "precious").write_bytes(b"keep me")
    with pytest.raises(SystemExit) as exit_info:
        main(["chaos", "--data-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"--data-dir {str(tmp_path)!r} is not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["precious"]
    assert (tmp_path / "precious").read_bytes() == b"keep me"


def test_a_malformed_port_range_exits_2_before_a_data_dir_is_made(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAFTMQ_PORT_RANGE", "9000-")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where chaos would make its temporary data directory
    with pytest.raises(SystemExit) as exit_info:
        main(["chaos"])
    assert exit_info.value.code == 2
    assert "RAFTMQ_PORT_RANGE='9000-'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_bad_override_exits_2_before_a_data_dir_is_made(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["chaos", "--set", "long_polling_timeout_ms=0"])
    assert exit_info.value.code == 2
    assert "long_polling_timeout_ms must be >= 1, got 0" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


class _Producer:
    """Answers sends with the statuses given, in order, then stops the load."""

    def __init__(self, statuses, stop) -> None:
        self.statuses, self.stop = list(statuses), stop

    async def send(self, message):
        from client import MessageQueue, SendResult, SendStatus

        status = self.statuses.pop(0)
        if not self.statuses:
            self.stop.set()
        ok = status is SendStatus.SEND_OK
        return SendResult(status, f"uniq-{len(self.statuses)}", create_msg_id(A, 4096) if ok else "",
                          MessageQueue("ChaosTopic", "broker-a", 0), 0)


async def test_a_send_of_unknown_outcome_is_neither_acknowledged_nor_missing(autojump_clock):
    # FLUSH_SLAVE_TIMEOUT: the leader's Raft commit timed out; answered, not raised, with no stored message id (the
    # ledger's ack crashed the run on it). It may be committed and consumed later, or never.
    import trio

    from client import SendStatus
    from raftmq.commands.chaos import _send_until

    ledger, stop = Ledger(), trio.Event()
    producer = _Producer([SendStatus.SEND_OK, SendStatus.FLUSH_SLAVE_TIMEOUT, SendStatus.SEND_OK], stop)
    await _send_until(producer, ledger, stop, 0, b"x", 0.0)
    assert ledger.acked == {"uniq-2", "uniq-0"} and ledger.unknown == {"uniq-1"}
    assert ledger.failed == {"FLUSH_SLAVE_TIMEOUT": 1} and ledger.ack_nodes == ["127.0.0.1:10911"] * 2
    ledger.consumed.update(["uniq-2", "uniq-0"])
    assert ledger.missing() == set()  # the unknown one was never consumed, and is not missing
    with pytest.raises(ValueError, match="acknowledgement of 'm' without the id of the stored message"):
        ledger.ack("m", "")


def _chaos():
    import argparse
    import types

    from rich.console import Console

    from raftmq.commands.chaos import Chaos

    args = argparse.Namespace(seed=1, tls_ca_file=None, json=True, fault="kill", target="leader")
    chaos = Chaos(args, types.SimpleNamespace(tls=None), Console())
    chaos.addr_of = {"n1": "127.0.0.1:1", "n2": "127.0.0.1:2", "n3": "127.0.0.1:3"}
    return chaos


def test_a_message_consumed_and_then_lost_fails_the_run_and_is_counted_apart():
    from raftmq.commands.chaos import ReadBack

    chaos = _chaos()
    ledger = chaos.ledger = _ledger([(1.0, "m1", A), (2.0, "m2", A), (3.0, "m3", B)])
    ledger.consumed.update(["m1", "m2", "m3"])  # delivered, every one: the old check passed
    rounds = [{"first_ack_by_another_s": 0.5, "acks_resumed": True, "longest_pause_s": 0.5}]
    logs = {"identical": True, "up_to": 4096, "divergent": []}
    report = chaos._report(rounds, logs, ReadBack({"m1", "m3", "other"}, None))
    assert report["missing"] == 0 and report["lost"] == 1 and report["lost_after_consumed"] == 1
    assert report["lost_sample"] == ["m2"] and report["ok"] is False
    assert chaos._report(rounds, logs, ReadBack({"m1", "m2", "m3"}, None))["ok"] is True
    # A read-back that did not finish proves nothing: not a pass.
    unfinished = chaos._report(rounds, logs, ReadBack({"m1", "m2", "m3"}, "not every queue was read back"))
    assert unfinished["ok"] is False and unfinished["read_back_error"] == "not every queue was read back"


def _member_ends(monkeypatch, end_of) -> None:
    """Members whose logs agree byte for byte, ``end_of(addr)`` ending each (asked at every status request)."""
    import raftmq.commands.verify as verify

    async def fake_status(client, address, group, *, checksum_up_to=None, timeout_s=3.0):
        end = end_of(address)
        up_to = end if checksum_up_to is None else min(end, checksum_up_to)
        return {"self_id": address, "end_offset": end}, ([(0, up_to, 0xAA)] if up_to else [])

    monkeypatch.setattr(verify, "get_raft_status", fake_status)


async def test_the_logs_are_not_identical_while_a_member_is_empty_and_the_laggard_is_named(monkeypatch,
                                                                                             autojump_clock):
    import trio

    chaos = _chaos()
    _member_ends(monkeypatch, lambda addr: 0 if addr == "127.0.0.1:3" else 8192)
    report = await chaos._verify_logs(trio.current_time() + 10)
    # Compared up to the smallest end (0), it was "identical" at once, with nothing compared.
    assert report["identical"] is False and report["behind"] == {"n3": 0}
    assert report["error"] == "member n3 has applied up to 0, another up to 8,192"


async def test_the_logs_are_compared_once_every_member_has_the_same_end(monkeypatch, autojump_clock):
    import trio

    chaos = _chaos()
    start = trio.current_time()
    # n3 catches up 3 s after the drain; n2 is a record behind until then.
    _member_ends(monkeypatch, lambda addr: 8192 if trio.current_time() - start >= 3 or addr == "127.0.0.1:1"
                 else {"127.0.0.1:2": 8000, "127.0.0.1:3": 4096}[addr])
    report = await chaos._verify_logs(start + 10)
    assert report["identical"] is True and report["up_to"] == 8192 and report["error"] is None
    assert trio.current_time() - start >= 3


class _ReadBackConsumer:
    """A pull consumer whose every request fails with a retriable error the first time (or always): a member
    settling after the drain, a connection closed under the read-back."""

    def __init__(self, *, always: bool = False) -> None:
        self.always = always
        self.failed: set[str] = set()

    def _fail_once(self, what: str) -> None:
        from remoting.errors import ConnectionClosedError, NotLeaderError

        if self.always or what not in self.failed:
            self.failed.add(what)
            if what == "pull":
                raise NotLeaderError("the member is settling")
            raise ConnectionClosedError("127.0.0.1:1", f"closed under the {what}")

    async def fetch_queues(self, topic):
        from client import MessageQueue

        self._fail_once("route")
        return [MessageQueue(topic, "broker-a", 0)]

    async def min_offset(self, mq):
        self._fail_once("min")
        return 0

    async def max_offset(self, mq):
        self._fail_once("max")
        return 2

    async def pull(self, mq, offset, max_nums):
        import types

        from client import PullStatus

        self._fail_once("pull")
        return types.SimpleNamespace(status=PullStatus.FOUND, next_begin_offset=2, min_offset=0, max_offset=2,
                                     messages=(types.SimpleNamespace(msg_id="m0"), types.SimpleNamespace(msg_id="m1")))


def _open_consumer(monkeypatch, consumer: _ReadBackConsumer) -> None:
    import contextlib

    from raftmq.commands import chaos

    @contextlib.asynccontextmanager
    async def open_pull_consumer(namesrv, **options):
        yield consumer

    monkeypatch.setattr(chaos, "open_pull_consumer", open_pull_consumer)


async def test_the_read_back_retries_every_request_that_fails_retriably(monkeypatch, autojump_clock):
    # Only the pulls were retried: a failed route or min/max offset escaped as an ExceptionGroup and the run lost
    # its whole report.
    from raftmq.commands.chaos import read_back

    consumer = _ReadBackConsumer()
    _open_consumer(monkeypatch, consumer)
    result = await read_back("127.0.0.1:1", {}, timeout_s=30)
    assert consumer.failed == {"route", "min", "max", "pull"}
    assert result.ids == {"m0", "m1"} and result.error is None


async def test_a_read_back_that_keeps_failing_reports_the_bound_and_the_last_failure(monkeypatch, autojump_clock):
    from raftmq.commands.chaos import read_back

    _open_consumer(monkeypatch, _ReadBackConsumer(always=True))
    result = await read_back("127.0.0.1:1", {}, timeout_s=5)
    assert result.ids == set()
    assert result.error.startswith("not every queue was read back within 5 s (last failure: route of ChaosTopic: ")
