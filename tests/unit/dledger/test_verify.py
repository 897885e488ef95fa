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


def test_a_bad_max_lag_exits_2_naming_it(capsys):
    from raftmq.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "--group", "g", "--members", "127.0.0.1:1,127.0.0.1:2", "--max-lag-bytes", "-1"])
    assert exit_info.value.code == 2
    assert "--max-lag-bytes must be within 0..4611686018427387904, got -1" in capsys.readouterr().err


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


def _members(monkeypatch, ends: dict[str, int]) -> None:
    """Members at ``127.0.0.1:N`` (id ``nN``) whose logs agree byte for byte, each ending at ``ends[addr]``: the
    checksums of a member cover its log up to what it was asked, as a real member's do."""
    import raftmq.commands.verify as verify

    async def fake_status(client, address, group, *, checksum_up_to=None, timeout_s=3.0):
        end = ends[address]
        status = {"self_id": "n" + address.rsplit(":", 1)[1], "role": "FOLLOWER", "term": 2, "committed_index": 9,
                  "end_offset": end}
        up_to = end if checksum_up_to is None else min(end, checksum_up_to)
        return status, ([(0, up_to, 0xAA)] if up_to else [])

    monkeypatch.setattr(verify, "get_raft_status", fake_status)


async def test_an_empty_member_is_behind_not_identical(monkeypatch):
    # Compared up to the smallest end, 0: no segment compared, and the group was "identical".
    import raftmq.commands.verify as verify

    _members(monkeypatch, {"127.0.0.1:1": 5000, "127.0.0.1:2": 5000, "127.0.0.1:3": 0})
    report = await verify.verify_group("g", ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    assert report["identical"] is False and report["lagging"] == {"127.0.0.1:3": 0}
    assert report["divergent"] == [] and report["up_to"] == 0 and report["furthest"] == 5000


def test_a_member_behind_by_more_than_max_lag_bytes_exits_1_naming_it_and_its_end(monkeypatch, capsys):
    from raftmq.cli import main

    members = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"
    _members(monkeypatch, {"127.0.0.1:1": 50_000_000, "127.0.0.1:2": 49_000_000, "127.0.0.1:3": 10_000_000})
    assert main(["verify", "--group", "broker-a", "--members", members]) == 1
    out = capsys.readouterr().out
    assert "BEHIND: member n3 at 127.0.0.1:3 has end_offset 10000000, the furthest member 50000000 (more than " \
           "--max-lag-bytes 16777216 behind)" in out
    assert "n2 at 127.0.0.1:2 has" not in out  # 1 MB behind: in flight, not a failure
    # What may be in flight is the caller's to say: a group at rest has every end equal.
    assert main(["verify", "--group", "broker-a", "--members", members, "--max-lag-bytes", "50000000"]) == 0
    assert main(["verify", "--group", "broker-a", "--members", members, "--max-lag-bytes", "0"]) == 1
    assert "BEHIND: member n2 at 127.0.0.1:2 has end_offset 49000000" in capsys.readouterr().out


def test_an_empty_member_fails_whatever_the_max_lag(monkeypatch, capsys):
    from raftmq.cli import main

    _members(monkeypatch, {"127.0.0.1:1": 100, "127.0.0.1:2": 0})
    assert main(["verify", "--group", "g", "--members", "127.0.0.1:1,127.0.0.1:2", "--max-lag-bytes", "1000"]) == 1
    assert "member n2 at 127.0.0.1:2 has end_offset 0, the furthest member 100 (empty while another member holds " \
           "data)" in capsys.readouterr().out
    # Every member empty: a new group, identical.
    _members(monkeypatch, {"127.0.0.1:1": 0, "127.0.0.1:2": 0})
    assert main(["verify", "--group", "g", "--members", "127.0.0.1:1,127.0.0.1:2"]) == 0


def test_lagging_members_rule():
    from raftmq.commands.verify import lagging_members

    assert lagging_members({"a": 100, "b": 90, "c": 100}, 10) == {}
    assert lagging_members({"a": 100, "b": 89, "c": 100}, 10) == {"b": 89}
    assert lagging_members({"a": 5, "b": 0}, 100) == {"b": 0}
    assert lagging_members({"a": 0, "b": 0}, 0) == {}
    with pytest.raises(ValueError, match="max_lag_bytes must be >= 0, got -1"):
        lagging_members({"a": 1}, -1)
