"""Arguments the CLI refuses before anything is sent, with exit 2 and one line naming the argument and the value:
text that is not UTF-8 (the bytes a shell passes undecoded, surrogate escapes to Python), in every argument of
every command, and ``admin update-broker-config`` values the nodes would refuse. ``--namesrv`` and ``--addr``
point at a closed port, so an argument that slipped through ends in exit 1 instead."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from raftmq.cli import BYTES_ARGS, build_parser, check_text_args, main
from raftmq.commands import admin
from remoting.config import ConfigError

CLOSED = "127.0.0.1:1"
NOT_UTF8 = os.fsdecode(b"x\xff")  # what Python makes of the argument bytes x, 0xff
NOT_UTF8_SHOWN = r"got the bytes b'x\xff'"


def _refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def _admin(*args: str) -> list[str]:
    return ["admin", "--namesrv", CLOSED, "--timeout", "2", *args]


@pytest.mark.parametrize("key, value, named", [
    # Each was sent, refused by every node, and reported as "not changed on 3 of 3 node(s) ... run the command
    # again once it is back": exit 1, the advice for a node that is down.
    ("broker_permission", "5", "--value '5' refused: broker_permission must be one of 2, 4, 6, got 5"),
    ("max_transfer_count", "abc", "--value 'abc' refused: max_transfer_count must be an integer, got 'abc'"),
    ("max_transfer_count", "1e3", "--value '1e3' refused: max_transfer_count must be an integer, got 1000.0"),
    ("long_polling_timeout_ms", '"15000"',
     "--value '\"15000\"' refused: long_polling_timeout_ms must be an integer, got '15000'"),
    ("max_transfer_count", "0", "--value '0' refused: max_transfer_count must be >= 1, got 0"),
    ("auto_create_topic_enable", "1", "--value '1' refused: auto_create_topic_enable must be true or false, got 1"),
    ("max_batch_messages", "7\nbroker_permission = 4", "max_batch_messages must be one value on one line"),
])
def test_a_value_the_nodes_would_refuse_exits_2_naming_it(key, value, named, capsys):
    err = _refused(capsys, _admin("update-broker-config", "--addr", CLOSED, "-k", key, "-v", value))
    assert named in err


def test_a_value_the_nodes_take_is_sent(capsys):
    # Checks across keys (max_transfer_bytes against max_frame_size) depend on each node's config: not made here.
    for key, value in (("broker_permission", "4"), ("max_transfer_bytes", "67108864"),
                       ("enable_property_filter", "true")):
        assert main(_admin("update-broker-config", "--addr", CLOSED, "-k", key, "-v", value)) == 1
        assert "could not connect to 127.0.0.1:1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (_admin("update-broker-config", "--addr", CLOSED, "-k", "broker_permission", "-v", NOT_UTF8), "--value"),
    (_admin("--access-key", NOT_UTF8, "--secret-key", "s", "topics"), "--access-key"),
    (_admin("topics", "--access-key", "a", "--secret-key", NOT_UTF8), "--secret-key"),
    (_admin("query-msg-key", "T", NOT_UTF8), "KEY"),
    (_admin("query-msg-id", NOT_UTF8, "--topic", "T"), "MSG_ID"),
    (_admin("consumer-status", "-g", "g", "-i", NOT_UTF8), "--client-id"),
    (_admin("consume-message", "T", "--tags", NOT_UTF8), "--tags"),
    (_admin("send-message", "T", "--body", "b", "--keys", NOT_UTF8), "--keys"),
    (_admin("query-msg-trace", "--msg-id", NOT_UTF8), "--msg-id"),
    (_admin("route", NOT_UTF8), "TOPIC"),
    (_admin("create-topic", "T", "--broker", "a", "--broker", NOT_UTF8), "--broker"),
    (["admin", "--namesrv", NOT_UTF8, "cluster"], "--namesrv"),
    (["broker", "--config", "b.toml", "--set", NOT_UTF8], "--set"),
    (["namesrv", "--listen", NOT_UTF8], "--listen"),
    (["verify", "--group", NOT_UTF8, "--members", CLOSED], "--group"),
    (["bench", "produce", "--topic", NOT_UTF8], "--topic"),
])
def test_an_argument_that_is_not_utf8_exits_2_naming_it(argv, flag, capsys):
    # Were tracebacks (UnicodeEncodeError from CBOR or the ACL signer), exit 1 as a cluster refusal ("header field
    # 'ext' cannot be encoded as CBOR"), or exit 2 naming no argument ("'utf-16-be' codec can't encode ...").
    assert f"raftmq: error: {flag} must be UTF-8 text, {NOT_UTF8_SHOWN}" in _refused(capsys, argv)


def test_with_json_an_argument_that_is_not_utf8_is_one_json_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(_admin("--json", "query-msg-key", "T", NOT_UTF8))
    assert exit_info.value.code == 2
    assert json.loads(capsys.readouterr().out)["error"] == f"KEY must be UTF-8 text, {NOT_UTF8_SHOWN}"


def test_credentials_from_the_environment_that_are_not_utf8_exit_2_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("RAFTMQ_ACCESS_KEY", "a")
    monkeypatch.setenv("RAFTMQ_SECRET_KEY", NOT_UTF8)
    assert f"$RAFTMQ_SECRET_KEY must be UTF-8 text, {NOT_UTF8_SHOWN}" in _refused(capsys, _admin("topics"))


def test_a_body_is_taken_as_the_bytes_the_shell_passed():
    # --body alone is bytes, not text: its bytes are the message's body as given.
    parser = build_parser("admin")
    args = parser.parse_args(_admin("send-message", "T", "--body", NOT_UTF8))
    check_text_args(parser, args)
    admin._check(args)
    assert args.body_bytes == b"x\xff"


def _text_arguments(parser: argparse.ArgumentParser,
                    chosen: dict[str, str]) -> Iterator[tuple[dict[str, str], argparse.Action]]:
    """Every argument taking text of every command under ``parser``, with the sub-command choices leading to it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _text_arguments(sub, {**chosen, action.dest: name})
        elif action.nargs != 0 and action.choices is None and action.type in (None, str, Path) \
                and action.dest not in BYTES_ARGS:
            yield chosen, action


def test_every_text_argument_of_every_command_is_checked():
    parser = build_parser()
    seen = 0
    for chosen, action in _text_arguments(parser, {}):
        args = argparse.Namespace(**chosen, **{action.dest: NOT_UTF8})
        with pytest.raises(ConfigError, match="must be UTF-8 text"):
            check_text_args(parser, args)
        seen += 1
    assert seen > 50  # every command's: admin's, bench's, the servers'
