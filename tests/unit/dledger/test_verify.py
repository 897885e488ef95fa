"""``raftmq verify``'s comparison: identical members pass; a differing or missing segment is reported."""

from __future__ import annotations

import pytest

from raftmq.commands.verify import compare_checksums


def test_identical_members():
    sums = {m: [(0, 100, 0xAA), (100, 50, 0xBB)] for m in ("a", "b", "c")}
    assert compare_checksums(sums) == (2, [])


def test_divergent_and_missing_segments_are_reported():
    sums = {"a": [(0, 100, 0xAA), (100, 50, 0xBB)],
            "b": [(0, 100, 0xAA), (100, 50, 0xBC)],
            "c": [(0, 100, 0xAA)]}
    segments, divergent = compare_checksums(sums)
    assert segments == 2
    assert divergent == [(100, {"a": 0xBB, "b": 0xBC})]


@pytest.mark.parametrize("timeout", ["-1", "nan", "0"])
def test_a_bad_timeout_exits_2_naming_it(timeout, capsys):
    # Was passed on to the remoting client, whose ValueError came out as a traceback (exit 1).
    from raftmq.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "--group", "broker-a", "--members", "127.0.0.1:1,127.0.0.1:2", "--timeout", timeout])
    assert exit_info.value.code == 2
    assert f"--timeout must be within 0.1..3600, got {float(timeout)!r}" in capsys.readouterr().err


def test_a_member_it_cannot_ask_is_reported_on_stderr(capsys):
    from raftmq.cli import main

    assert main(["verify", "--group", "broker-a", "--members", "127.0.0.1:1,127.0.0.1:2", "--timeout", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "verify: could not ask every member of group broker-a: could not connect" in err


def test_a_repeated_member_address_exits_2_naming_it(capsys):
    # Was asked once and compared with itself: "1 segment(s) ... are identical", exit 0, for one member.
    from raftmq.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "--group", "broker-a", "--members", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--members names 127.0.0.1:1 more than once" in err and len(err.strip().splitlines()) == 1


def test_port_0_exits_2_naming_it(capsys):
    # Port 0 only tells a listener to pick a free port: it was dialled and reported as a member it could not ask.
    from raftmq.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "--group", "broker-a", "--members", "127.0.0.1:1,127.0.0.1:0"])
    assert exit_info.value.code == 2
    assert "--members needs a fixed port (it is dialed; port 0 only tells a listening server to pick any free one), " \
           "got '127.0.0.1:0'" in capsys.readouterr().err


async def test_one_member_under_two_addresses_is_refused(monkeypatch):
    # localhost:P and 127.0.0.1:P are one member; compared with itself it was always "identical".
    import raftmq.commands.verify as verify
    from remoting.config import ConfigError

    async def fake_status(client, address, group, *, checksum_up_to=None, timeout_s=3.0):
        member_id = {"localhost:1": "n1", "127.0.0.1:1": "n1", "127.0.0.1:2": "n2"}[address]
        return {"self_id": member_id, "end_offset": 10}, [(0, 10, 0xAA)]

    monkeypatch.setattr(verify, "get_raft_status", fake_status)
    with pytest.raises(ConfigError, match=r"names member n1 twice \(localhost:1 and 127.0.0.1:1\)"):
        await verify.verify_group("g", ["localhost:1", "127.0.0.1:2", "127.0.0.1:1"])
