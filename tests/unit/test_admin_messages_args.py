"""``raftmq admin send-message``, ``consume-message`` and ``query-msg-offset``: a bad argument exits 2 with one
line naming it before anything is sent (``--namesrv`` points at a closed port, so a value that slipped through
would end in exit 1 instead); what was sent is reported when a send fails or --timeout ends the command; reading
never commits an offset."""

from __future__ import annotations

import argparse
import contextlib
import json

import pytest
import trio

from client.errors import ClientError
from client.message import MessageExt, MessageQueue, PullResult, PullStatus, SendResult, SendStatus
from raftmq.cli import main
from raftmq.commands import admin_messages
from tests.unit.test_admin_args import CLOSED, _refused



SEND = ["send-message", "T", "--body", "b"]


@pytest.mark.parametrize("args, named", [
    ([*SEND, "--count", "0"], "--count must be within 1..10000, got 0"),
    ([*SEND, "--count", "10001"], "--count must be within 1..10000, got 10001"),
    ([*SEND, "--delay-level", "-1"], "--delay-level must be within 0..64 (0: not delayed;"),
    ([*SEND, "--delay-level", "65"], "got 65"),
    (["send-message", "T", "--body", ""], "--body must not be empty: the brokers refuse an empty body"),
    ([*SEND, "--keys", "a,,b"], "--keys 'a,,b' has an empty key: give keys separated by commas, K1,K2"),
    ([*SEND, "--keys", "a,b c"], "--keys: key 'b c' holds a space; keys are stored split on spaces"),
    ([*SEND, "--tags", "A||B"], "--tags 'A||B' cannot be named by a tag expression"),
    ([*SEND, "--tags", "*"], "--tags '*' cannot be named by a tag expression"),
    ([*SEND, "--broker", "broker-a"], "--broker 'broker-a' needs --queue: a send goes to one queue"),
    ([*SEND, "--queue", "0"], "--queue 0 needs --broker: queue ids are per broker group"),
    ([*SEND, "--broker", "broker-a", "--queue", "-1"], "--queue must be within 0..2147483647, got -1"),
    ([*SEND, "--broker", "bad name!", "--queue", "0"], "--broker 'bad name!' must be letters, digits, - or _"),
    (["send-message", "TBW102", "--body", "b"], "TOPIC 'TBW102' is reserved for the broker; producers may not send"),
    (["send-message", "bad topic", "--body", "b"], "TOPIC 'bad topic' contains illegal characters"),
    # A key list whose properties cannot be encoded is refused by Message itself, worded as such.
    ([*SEND, "--keys", ",".join(["k" * 100] * 400)], "the message cannot be sent: Message properties"),
])
def test_a_bad_send_argument_exits_2_naming_it(args, named, capsys):
    assert named in _refused(capsys, *args)


@pytest.mark.parametrize("make, named", [
    (lambda tmp: str(tmp / "missing.bin"), "--body-file '{tmp}/missing.bin' is no file that exists"),
    (lambda tmp: str(tmp), "--body-file '{tmp}' is a directory, not a file"),
    (lambda tmp: _sparse(tmp / "empty.bin", 0),
     "--body-file '{tmp}/empty.bin' is empty: the brokers refuse an empty body"),
    (lambda tmp: _sparse(tmp / "big.bin", 4 * 1024 * 1024 + 1),
     "--body-file '{tmp}/big.bin' holds 4194305 bytes, more than the producer's max_message_size_bytes 4194304"),
])
def test_a_body_file_it_cannot_send_exits_2(make, named, tmp_path, capsys):
    err = _refused(capsys, "send-message", "T", "--body-file", make(tmp_path))
    assert named.format(tmp=tmp_path) in err


def _sparse(path, size: int) -> str:
    with open(path, "wb") as f:
        f.truncate(size)
    return str(path)


CONSUME = ["consume-message", "T"]


@pytest.mark.parametrize("args, named", [
    ([*CONSUME, "--count", "0"], "--count must be within 1..10000, got 0"),
    ([*CONSUME, "--count", "20000"], "--count must be within 1..10000, got 20000"),
    ([*CONSUME, "--offset", "3"], "--offset 3 needs --broker and --queue: offsets are per queue"),
    ([*CONSUME, "--broker", "broker-a", "--offset", "3"], "--offset 3 needs --broker and --queue"),
    ([*CONSUME, "--broker", "broker-a", "--queue", "0", "--offset", "-1"],
     "--offset must be within 0..9223372036854775807, got -1"),
    ([*CONSUME, "--queue", "1"], "--queue 1 needs --broker"),
    ([*CONSUME, "--begin-ms", "10", "--end-ms", "5"],
     "--begin-ms and --end-ms must satisfy 0 <= begin <= end <= 9223372036854775807, got 10 and 5"),
    ([*CONSUME, "--end-ms", "-5"], "--begin-ms and --end-ms must satisfy 0 <= begin <= end"),
    ([*CONSUME, "--tags", "A ||"], "--tags 'A ||' has an empty tag"),
    ([*CONSUME, "--tags", "*||A"], "--tags '*||A' mixes '*' with tags"),
    ([*CONSUME, "--group", "bad group"], "--group 'bad group' contains illegal characters"),
    (["consume-message", "RMQ_SYS_TRANS_HALF_TOPIC"], "TOPIC 'RMQ_SYS_TRANS_HALF_TOPIC' holds the brokers' "
                                                      "transaction records"),
    ([*CONSUME, "--body-file-dir", "/nonexistent/dir"], "--body-file-dir '/nonexistent/dir' is no directory"),
    ([*CONSUME, "--body-file-dir", ""], "--body-file-dir must name a directory, got ''"),
])
def test_a_bad_consume_argument_exits_2_naming_it(args, named, capsys):
    assert named in _refused(capsys, *args)


BY_OFFSET = ["query-msg-offset", "T", "--broker", "broker-a", "--queue", "0"]


@pytest.mark.parametrize("args, named", [
    ([*BY_OFFSET, "--offset", "-1"], "--offset must be within 0..9223372036854775807, got -1"),
    (["query-msg-offset", "T", "--broker", "broker-a", "--queue", "-2", "--offset", "0"],
     "--queue must be within 0..2147483647, got -2"),
    ([*BY_OFFSET, "--offset", "0", "--body-file", "/nonexistent/dir/b"],
     "--body-file '/nonexistent/dir/b': directory '/nonexistent/dir' does not exist"),
])
def test_a_bad_query_msg_offset_argument_exits_2_naming_it(args, named, capsys):
    assert named in _refused(capsys, *args)


@pytest.mark.parametrize("args, named", [
    (["send-message", "T"], "one of the arguments --body --body-file is required"),
    (["send-message", "T", "--body", "a", "--body-file", "f"], "not allowed with argument"),
    ([*CONSUME, "--offset", "1", "--begin-ms", "5"], "not allowed with argument"),
    (["query-msg-offset", "T", "--broker", "broker-a", "--queue", "0"], "the following arguments are required: "
                                                                        "--offset"),
])
def test_usage_errors_exit_2(args, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["admin", "--namesrv", CLOSED, *args])
    assert exit_info.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    [*SEND, "--keys", "k1,k2", "--tags", "TagA", "--broker", "broker-a", "--queue", "3", "--count", "10000",
     "--delay-level", "18"],
    [*CONSUME, "--broker", "broker-a", "--queue", "0", "--offset", "0", "--end-ms", "9223372036854775807",
     "--tags", "A||B", "--group", "G", "--count", "10000"],
    [*CONSUME, "--begin-ms", "0"],
    [*BY_OFFSET, "--offset", "9223372036854775807"],
])
def test_good_arguments_pass_the_checks_and_reach_the_cluster(args, tmp_path, capsys):
    # Past the checks, the closed name server answers: exit 1, naming it; --json says so in one line.
    assert main(["admin", "--namesrv", CLOSED, "--timeout", "2", "--json", *args]) == 1
    out, err = capsys.readouterr()
    assert "127.0.0.1:1" in json.loads(out)["error"] and "127.0.0.1:1" in err


def _result(i: int) -> SendResult:
    return SendResult(SendStatus.SEND_OK, f"U{i}", f"{i:032X}", MessageQueue("T", "broker-a", i % 2), i // 2)


class _Producer:
    """Sends ``ok`` messages, then does what ``then`` does (hang, or raise)."""

    def __init__(self, ok: int, then) -> None:
        self.ok, self.then, self.sent = ok, then, []

    async def send(self, message, *, queue=None):
        if len(self.sent) == self.ok:
            await self.then()
        self.sent.append(message)
        return _result(len(self.sent) - 1)


def _fake_producer(monkeypatch, producer: _Producer) -> None:
    @contextlib.asynccontextmanager
    async def open_producer(namesrv, **options):
        assert options == {"producer_group": admin_messages.TOOLS_PRODUCER_GROUP}
        yield producer

    monkeypatch.setattr(admin_messages, "open_producer", open_producer)


def test_sends_stopped_by_the_timeout_say_how_many_went(monkeypatch, capsys):
    # run()'s deadline alone would have said "no answer within --timeout" and nothing of the 2 stored messages.
    _fake_producer(monkeypatch, _Producer(2, trio.sleep_forever))
    assert main(["admin", "--namesrv", CLOSED, "--timeout", "1", *SEND, "--count", "5"]) == 1
    assert capsys.readouterr().err.strip() == (f"raftmq admin send-message: 2 of 5 message(s) sent within --timeout 1 "
                                               f"s; the last: offset msg id {1:032X}")


def test_a_send_that_fails_stops_the_rest_and_says_how_many_went(monkeypatch, capsys):
    async def refuse():
        raise ClientError("the broker refused it")

    producer = _Producer(3, refuse)
    _fake_producer(monkeypatch, producer)
    assert main(["admin", "--namesrv", CLOSED, "--json", *SEND, "--count", "10", "--keys", "a,b", "--tags", "T1"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["errors"] == [
        "the broker refused it", f"3 of 10 message(s) were sent before it; the last: offset msg id {2:032X}, broker-a "
                                 f"queue 0 offset 1"]
    assert len(producer.sent) == 3 and producer.sent[0].keys == ["a", "b"] and producer.sent[0].tags == "T1"


def test_sent_messages_are_printed_one_json_line(monkeypatch, capsys):
    _fake_producer(monkeypatch, _Producer(10, trio.sleep_forever))
    assert main(["admin", "--namesrv", CLOSED, "--json", *SEND, "--count", "2"]) == 0
    [line] = capsys.readouterr().out.strip().splitlines()
    assert json.loads(line) == {"topic": "T", "delay_level": 0, "sent": [
        {"send_status": "SEND_OK", "msg_id": "U0", "offset_msg_id": f"{0:032X}", "broker_name": "broker-a",
         "queue_id": 0, "queue_offset": 0},
        {"send_status": "SEND_OK", "msg_id": "U1", "offset_msg_id": f"{1:032X}", "broker_name": "broker-a",
         "queue_id": 1, "queue_offset": 0}]}


def _message(offset: int, tags: str, store_ms: int) -> MessageExt:
    return MessageExt("T", b"m%d" % offset, 0, offset, "broker-a", {"TAGS": tags}, 1000 + offset, store_ms, store_ms,
                      ("127.0.0.1", 10911))


class _PullConsumer:
    """A queue of 10 messages at offsets 0..9 (tag A at even offsets, B at odd, stored at 100 + offset ms), served
    two at a time as the broker serves them; committing is a failure of the test."""

    def __init__(self) -> None:
        self.messages = [_message(i, "A" if i % 2 == 0 else "B", 100 + i) for i in range(10)]
        self.pulls: list[tuple[int, int, str]] = []

    async def pull(self, mq, offset, max_nums=32, *, expression="*", block_ms=0):
        self.pulls.append((offset, max_nums, expression))
        if offset >= 10:
            return PullResult(PullStatus.NO_NEW_MSG, offset, 0, 10)
        batch = self.messages[offset:offset + min(max_nums, 2)]
        matched = tuple(m for m in batch if expression == "*" or m.tags in expression.split("||"))
        return PullResult(PullStatus.FOUND if matched else PullStatus.NO_MATCHED_MSG, offset + len(batch), 0, 10,
                          matched)

    async def commit(self, mq, offset):
        raise AssertionError("consume-message committed an offset")


def _consume_args(**overrides) -> argparse.Namespace:
    return argparse.Namespace(**{"count": 100, "tags": None, "end_ms": None, **overrides})


@pytest.mark.parametrize("overrides, offsets, next_offset", [
    ({}, list(range(10)), 10),  # to the queue's end
    ({"count": 3}, [0, 1, 2], 3),  # --count: the next offset is the one after the last taken
    ({"tags": "B"}, [1, 3, 5, 7, 9], 10),
    ({"end_ms": 104}, [0, 1, 2, 3, 4], 5),  # stored at 100 + offset ms: offset 5 is past the end
    ({"tags": "A", "count": 2}, [0, 2], 3),
])
async def test_reading_a_queue_stops_at_its_end_the_count_or_the_end_time_and_never_commits(overrides, offsets,
                                                                                         next_offset):
    consumer, found = _PullConsumer(), []
    progress = {"next_offset": 0}
    await admin_messages._read_queue(consumer, MessageQueue("T", "broker-a", 0), _consume_args(**overrides), found,
                                     progress, {"bytes": 1 << 20})
    assert [m.queue_offset for m in found] == offsets
    assert progress == {"next_offset": next_offset, "max_offset": 10}
    assert all(expression == (overrides.get("tags") or "*") for _, _, expression in consumer.pulls)


async def test_reading_stops_once_the_bodies_read_reach_the_byte_budget():
    # --count alone let 10,000 messages of 4 MiB be held at once; each body here is 2 bytes ("m0".."m9").
    consumer, found = _PullConsumer(), []
    progress, budget = {"next_offset": 0}, {"bytes": 7}
    await admin_messages._read_queue(consumer, MessageQueue("T", "broker-a", 0), _consume_args(), found, progress,
                                     budget)
    assert [m.queue_offset for m in found] == [0, 1, 2, 3] and progress["next_offset"] == 4 and budget["bytes"] <= 0
