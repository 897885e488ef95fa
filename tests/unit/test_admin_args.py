"""``raftmq admin``'s argument checks: a bad value exits 2 with one line naming it, before anything is sent
(``--namesrv`` points at a closed port, so a value that slipped through would end in exit 1 instead)."""

from __future__ import annotations

import pytest

from raftmq.cli import main

CLOSED = "127.0.0.1:1"


def _refused(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["admin", "--namesrv", CLOSED, "--timeout", "2", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("args, named", [
    # The brokers take a signed 64-bit time: bigger values raised ValueError from the client (a traceback).
    (["reset-offset", "G", "T", "--to", "99999999999999999999999"],
     "--to in milliseconds must be at most 9223372036854775807 (or latest), got '99999999999999999999999'"),
    # str.isdigit takes other scripts' digits: "٣" was read as 3 ms since the epoch.
    (["reset-offset", "G", "T", "--to", "٣"], "--to must be earliest, latest, now, milliseconds since the epoch"),
    (["query-msg-key", "T", "k", "--begin-ms", "99999999999999999999"],
     "--begin-ms and --end-ms must satisfy 0 <= begin <= end <= 9223372036854775807, got 99999999999999999999"),
    (["query-msg-key", "T", "k", "--end-ms", "99999999999999999999"],
     "--begin-ms and --end-ms must satisfy 0 <= begin <= end <= 9223372036854775807, got 0 and "
     "99999999999999999999"),
])
def test_a_time_out_of_range_exits_2_naming_it(args, named, capsys):
    assert named in _refused(capsys, *args)


@pytest.mark.parametrize("command", ["route", "create-topic", "delete-topic"])
@pytest.mark.parametrize("topic, named", [
    ("bad topic!", "TOPIC 'bad topic!' contains illegal characters"),
    ("", "TOPIC must be a non-empty string, got ''"),
    ("x" * 200, "is 200 characters long; at most 127 are allowed"),
])
def test_a_bad_topic_name_exits_2_naming_it(command, topic, named, capsys):
    # Was sent as is: the name server's or broker's INVALID_REQUEST, exit 1, as if the cluster had refused.
    assert named in _refused(capsys, command, topic)


def test_a_system_topic_is_refused_before_the_broker_refuses_it(capsys):
    assert "TOPIC 'rmq_sys_x' is reserved for the broker (prefix 'rmq_sys_')" in _refused(
        capsys, "create-topic", "rmq_sys_x")
    # The brokers refuse creating every name producers may not send to (86046f3), not only the prefix: these
    # went out and came back INVALID_REQUEST, exit 1.
    for reserved in ("TBW102", "SCHEDULE_TOPIC_XXXX"):
        assert f"TOPIC {reserved!r} is reserved for the broker" in _refused(capsys, "create-topic", reserved)


def test_times_within_range_pass_the_checks(capsys):
    # Past the checks, the closed name server answers: exit 1, naming it.
    for args in (["reset-offset", "G", "T", "--to", "9223372036854775807"],
                 ["query-msg-key", "T", "k", "--end-ms", "9223372036854775807"]):
        assert main(["admin", "--namesrv", CLOSED, "--timeout", "2", *args]) == 1
        assert "could not connect to 127.0.0.1:1" in capsys.readouterr().err


MSG_ID = "7F000001000073FF00000000015DB836"


@pytest.mark.parametrize("body_file, named", [
    # Was learnt only after the query, as "[Errno 2] ..." and exit 1 (a cluster refusal); '' was ignored.
    ("{tmp}/missing/body.bin", "--body-file '{tmp}/missing/body.bin': directory '{tmp}/missing' does not exist"),
    ("{tmp}", "--body-file '{tmp}' is a directory, not a file"),
    ("", "--body-file must name a file, got ''"),
])
def test_a_body_file_it_cannot_write_exits_2_before_the_query(body_file, named, tmp_path, capsys):
    err = _refused(capsys, "query-msg-id", MSG_ID, "--body-file", body_file.format(tmp=tmp_path))
    assert named.format(tmp=tmp_path) in err


def test_with_json_a_failure_is_one_json_line_too(capsys):
    """``--json`` promises one JSON line: a failure printed only sentences on stderr, nothing to parse."""
    import json

    with pytest.raises(SystemExit) as exit_info:
        main(["admin", "--namesrv", CLOSED, "--json", "route", "bad topic"])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert json.loads(out) == {"error": err.strip().removeprefix("raftmq: error: "),
                               "errors": [err.strip().removeprefix("raftmq: error: ")], "exit_status": 2}

    assert main(["admin", "--namesrv", CLOSED, "--timeout", "2", "--json", "cluster"]) == 1
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["exit_status"] == 1 and data["error"].startswith("could not connect to 127.0.0.1:1")
    assert f"raftmq admin cluster: {data['error']}" in err


def test_a_key_with_a_space_exits_2_saying_no_key_can_hold_one(capsys):
    # Keys are stored split on spaces: the query ran and answered "no message with key 'k1 k2'", exit 1.
    assert "KEY 'k1 k2' holds a space: a message's keys are stored split on spaces" in _refused(
        capsys, "query-msg-key", "T", "k1 k2")


@pytest.mark.parametrize("args, named", [
    # Port 0 means "any free port" only to a listener: it was dialled and reported as a refused connection.
    (["--namesrv", "127.0.0.1:0", "cluster"], "--namesrv needs a fixed port (it is dialed; port 0 only tells a "
                                               "listening server to pick any free one), got '127.0.0.1:0'"),
    (["--namesrv", "127.0.0.1:9876,h:0", "cluster"], "--namesrv needs a fixed port (it is dialed; port 0 only tells a "
                                                     "listening server to pick any free one), got 'h:0'"),
    (["status", "--addr", "127.0.0.1:0"], "--addr needs a fixed port (it is dialed; port 0 only tells a listening "
                                          "server to pick any free one), got '127.0.0.1:0'"),
    (["delay-offsets", "--addr", "127.0.0.1:0"], "--addr needs a fixed port (it is dialed; port 0 only tells a "
                                                 "listening server to pick any free one), got '127.0.0.1:0'"),
])
def test_port_0_is_refused_where_an_address_is_dialled(args, named, capsys):
    argv = ["admin", "--timeout", "2", *args] if args[0] == "--namesrv" else ["admin", "--namesrv", CLOSED, *args]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_the_admin_options_are_taken_after_the_command_too(capsys):
    """``raftmq admin topic-status T --json``: 'unrecognized arguments: --json', though every command takes it.
    After the command an option wins over the same one before it; left out, the one before it stands."""
    from raftmq.cli import build_parser

    args = build_parser().parse_args(["admin", "--namesrv", CLOSED, "topic-status", "T", "--json", "--timeout", "3"])
    assert (args.namesrv, args.timeout, args.json) == (CLOSED, 3.0, True)
    args = build_parser().parse_args(["admin", "--namesrv", CLOSED, "--json", "topics"])
    assert (args.namesrv, args.timeout, args.json) == (CLOSED, 10.0, True)
    args = build_parser().parse_args(["admin", "--namesrv", "127.0.0.1:2", "topics", "--namesrv", CLOSED])
    assert args.namesrv == CLOSED and args.json is False
    assert "--timeout must be within (0, 3600] seconds, got nan" in _refused(capsys, "topics", "--timeout", "nan")


@pytest.mark.parametrize("args, named", [
    # Looked up and reported as unknown to the name servers (exit 1), though no broker can bear such a name.
    (["create-topic", "T", "--broker", "broker-a", "--broker", "a b"], "--broker 'a b' must be letters, digits"),
    (["delete-topic", "T", "--cluster", "prod.eu"], "--cluster 'prod.eu' must be letters, digits"),
    (["status", "--broker", ""], "--broker '' must be letters, digits"),
    (["delay-offsets", "--broker", "a b"], "--broker 'a b' must be letters, digits"),
    (["consumer-progress", "G", "--cluster", "a/b"], "--cluster 'a/b' must be letters, digits"),
])
def test_an_illegal_cluster_or_group_name_exits_2_naming_it(args, named, capsys):
    assert named in _refused(capsys, *args)


def test_more_write_queues_than_read_queues_exits_2(capsys):
    # The admin client raises ValueError for it (queues no consumer reads): that was a traceback here.
    assert "--write-queues 8 must not exceed --read-queues 4" in _refused(
        capsys, "create-topic", "T", "--read-queues", "4", "--write-queues", "8")


@pytest.mark.parametrize("ms, shown", [(0, "1970-01-01 00:00:00.000"), (2**62, "4611686018427387904 ms (not a date)"),
                                       (2**63 - 1, "9223372036854775807 ms (not a date)")])
def test_a_time_no_date_can_show_is_printed_as_its_number(ms, shown):
    # A producer may set any born_timestamp 0..2^63-1 and the broker keeps it: past year 9999, datetime raised
    # ValueError out of query-msg-id's table and the command ended in a traceback.
    from raftmq.commands.admin import _utc

    assert _utc(ms) == shown


@pytest.mark.parametrize("args, named", [
    # Taken as no --addr at all: the group leaders answered instead of the node asked for, exit 0.
    (["status", "--addr", ""], "--addr"),
    (["delay-offsets", "--addr", ""], "--addr"),
    # With --topic it is looked up as a unique id: the admin client's ValueError came out as a traceback.
    (["query-msg-id", "", "--topic", "T"], "MSG_ID must not be empty"),
    # 32 hex digits, but naming no port and offset a broker writes: "not an offset message id (32 hex digits)"
    # said nothing.
    (["query-msg-id", "7F000001FFFF0000FFFFFFFFFFFFFFFF"],
     "is not an offset message id (msg_id '7F000001FFFF0000FFFFFFFFFFFFFFFF' names port 4294901760 and "
     "commit-log offset -1"),
])
def test_an_empty_or_unusable_target_exits_2_naming_it(args, named, capsys):
    assert named in _refused(capsys, *args)


def test_a_node_asked_with_addr_that_does_not_answer_is_the_one_named(capsys):
    # "no answer within --timeout 1 s (name servers ...)": the name servers were never asked, the node was.
    import socket

    with socket.socket() as silent:  # takes the connection, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        addr = "127.0.0.1:%d" % silent.getsockname()[1]
        assert main(["admin", "--namesrv", CLOSED, "--timeout", "1", "status", "--addr", addr]) == 1
    assert capsys.readouterr().err.strip() == f"raftmq admin status: no answer within --timeout 1 s (node {addr})"


async def test_fewer_read_queues_than_hold_messages_is_done_with_a_warning_naming_them(capsys):
    # Lowering --read-queues of a topic with messages in the queues dropped hid them from every consumer, exit 0,
    # without a word (RocketMQ allows it too: it is how a drained topic shrinks).
    import argparse

    from client.admin import TopicQueueStatus
    from client.message import MessageQueue
    from raftmq.commands.admin import _create

    class Admin:
        created = None

        async def topic_status(self, topic):
            return [TopicQueueStatus(MessageQueue(topic, "broker-a", q), 0, n, None) for q, n in enumerate((2, 0, 5))]

        async def create_topic(self, topic, **options):
            self.created = options

    admin = Admin()
    args = argparse.Namespace(topic="T", read_queues=1, write_queues=1, perm=6, order=False, cluster=None,
                              broker=None)
    assert (await _create(admin, args))["created"] and admin.created["read_queue_nums"] == 1
    assert capsys.readouterr().err.splitlines() == [
        "raftmq admin create-topic: warning: broker-a queue 2 of T holds 5 message(s) that --read-queues 1 leaves to "
        "no consumer until the read queues are raised again"]
