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
