"""NAMESRV_ADDR for ``raftmq admin`` and ``raftmq bench`` (as mqadmin and RocketMQ's benchmarks read it), and
``raftmq admin update-topic-perm``'s arguments: refused with exit 2 and one line naming them, nothing sent."""

from __future__ import annotations

import json

import pytest

from raftmq.bench import produce
from raftmq.cli import build_parser, main
from raftmq.commands import admin


def _refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1, captured.err
    return captured.err + captured.out


def test_admin_and_bench_take_the_name_servers_of_NAMESRV_ADDR_when_not_given(monkeypatch):
    monkeypatch.setenv("NAMESRV_ADDR", "10.0.0.1:9876;10.0.0.2:9876")
    for argv, check in [(["admin", "cluster"], admin._check), (["admin", "topics", "--json"], admin._check),
                        (["bench", "produce"], produce._check), (["bench", "consume"], produce.check_cluster_args)]:
        args = build_parser().parse_args(argv)
        check(args)
        assert args.namesrv == "10.0.0.1:9876;10.0.0.2:9876", argv
    for argv, check in [(["admin", "--namesrv", "10.0.0.3:9876", "cluster"], admin._check),
                        (["admin", "cluster", "--namesrv", "10.0.0.3:9876"], admin._check),
                        (["bench", "produce", "--namesrv", "10.0.0.3:9876"], produce._check)]:
        args = build_parser().parse_args(argv)
        check(args)
        assert args.namesrv == "10.0.0.3:9876", argv  # an explicit one wins
    monkeypatch.delenv("NAMESRV_ADDR")
    args = build_parser().parse_args(["admin", "cluster"])
    admin._check(args)
    assert args.namesrv == "127.0.0.1:9876"
    args = build_parser().parse_args(["bench", "produce"])
    produce._check(args)
    assert args.namesrv is None  # the bench starts a cluster of its own


@pytest.mark.parametrize("value, named", [
    ("", "NAMESRV_ADDR needs HOST:PORT, got ''"),
    ("nohost", "NAMESRV_ADDR must look like HOST:PORT, got 'nohost'"),
    ("127.0.0.1:0", "NAMESRV_ADDR needs a fixed port"),
])
# The benches' topic is bad too: NAMESRV_ADDR must be refused first (where it was ignored, a bench started a
# cluster of its own and ran, instead of exiting 2 at once).
@pytest.mark.parametrize("argv", [["admin", "cluster"], ["admin", "--json", "topics"],
                                  ["bench", "produce", "--topic", "bad topic!"],
                                  ["bench", "consume", "--json", "--topic", "bad topic!"]])
def test_a_bad_NAMESRV_ADDR_exits_2_naming_it(value, named, argv, monkeypatch, capsys):
    monkeypatch.setenv("NAMESRV_ADDR", value)
    out = _refused(capsys, argv)
    assert named in out
    if "--json" in argv:
        assert json.loads(out.strip().splitlines()[-1])["exit_status"] == 2


@pytest.mark.parametrize("perm", ["0", "1", "3", "5", "7", "8"])
def test_update_topic_perm_takes_2_4_or_6(perm, capsys):
    out = _refused(capsys, ["admin", "--namesrv", "127.0.0.1:1", "update-topic-perm", "T", "--perm", perm])
    assert f"--perm must be 2 (write only), 4 (read only) or 6 (read and write), as mqadmin updateTopicPerm " \
           f"takes, got {perm}" in out


def test_update_topic_perm_refuses_a_topic_the_broker_keeps_for_itself(capsys):
    for topic, named in [("rmq_sys_x", "TOPIC 'rmq_sys_x' is reserved for the broker (prefix 'rmq_sys_')"),
                         ("TBW102", "TOPIC 'TBW102' is reserved for the broker"),
                         ("bad topic!", "TOPIC 'bad topic!' contains illegal characters")]:
        assert named in _refused(capsys, ["admin", "--namesrv", "127.0.0.1:1", "update-topic-perm", topic, "--perm",
                                          "6"])
