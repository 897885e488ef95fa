"""``--json`` promises one JSON line, a bad argument included: one argparse itself refuses (an int that is not one,
a missing command) printed only its usage on stderr, nothing on stdout for a script to parse. And a closed pipe
beside another error in trio's exception group is not passed off as the quiet 141."""

from __future__ import annotations

import json

import pytest

from raftmq import cli

CLOSED = "127.0.0.1:1"


def _usage_error(capsys, *argv: str) -> tuple[str, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr()


@pytest.mark.parametrize("argv, message", [
    (["admin", "--namesrv", CLOSED, "--json", "create-topic", "T3", "--read-queues", "abc"],
     "argument --read-queues: invalid int value: 'abc'"),
    # --json after the command, and abbreviated as argparse takes it.
    (["admin", "--namesrv", CLOSED, "create-topic", "T3", "--read-queues", "abc", "--js"],
     "argument --read-queues: invalid int value: 'abc'"),
    (["admin", "--json"], "the following arguments are required: COMMAND"),
    (["admin", "--json", "route"], "the following arguments are required: topic"),
    (["admin", "--json", "topics", "extra"], "unrecognized arguments: extra"),
    (["bench", "produce", "--json", "--size", "abc"], "argument --size: invalid int value: 'abc'"),
])
def test_with_json_an_argparse_error_is_one_json_line_too(argv, message, capsys):
    out, err = _usage_error(capsys, *argv)
    assert json.loads(out) == {"error": message, "errors": [message], "exit_status": 2}
    assert len(out.splitlines()) == 1
    # The usage and the message still go to stderr, as without --json.
    assert err.startswith("usage: raftmq") and err.rstrip().endswith(f"error: {message}")


@pytest.mark.parametrize("argv", [
    ["admin", "--namesrv", CLOSED, "create-topic", "T3", "--read-queues", "abc"],  # no --json
    ["admin", "--namesrv", CLOSED, "topics", "extra", "--", "--json"],  # after "--", an argument, not the option
    ["broker", "--json"],  # a command that takes no --json promises no JSON line
])
def test_without_json_an_argparse_error_prints_nothing_on_stdout(argv, capsys):
    out, err = _usage_error(capsys, *argv)
    assert out == "" and "error: " in err


def test_a_closed_pipe_beside_another_error_is_not_hidden(monkeypatch):
    # Only a group of closed pipes is the quiet 141: another error in it is one of its own, shown as raised.
    from raftmq.commands import admin

    def failed(args):
        raise BaseExceptionGroup("nursery", [BrokenPipeError(32, "Broken pipe"), KeyError("lost")])

    monkeypatch.setattr(admin, "run", failed)
    with pytest.raises(BaseExceptionGroup) as raised:
        cli.main(["admin", "topics"])
    assert [type(e) for e in raised.value.exceptions] == [BrokenPipeError, KeyError]
