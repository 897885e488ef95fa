"""``raftmq admin send-message``, ``consume-message`` and ``query-msg-offset`` against a real ``raftmq dev``
(mqadmin's sendMessage, consumeMessage, queryMsgByOffset): what is sent is stored where the command says, read back
by queue and offset, by time and by tag; reading moves no consumer group; refusals exit 1 naming the cause."""

from __future__ import annotations

import base64
import json
import time

import pytest
import trio

from client import MessageQueue, open_pull_consumer
from tests.cluster.test_admin_cli import _admin, _admin_json, _wait_for_leader
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

TOPIC = "MsgTopic"


async def _commit(namesrv: str, group: str, queue_id: int, offset: int) -> None:
    async with open_pull_consumer(namesrv, consumer_group=group) as consumer:
        await consumer.commit(MessageQueue(TOPIC, "broker-a", queue_id), offset)


def test_send_consume_and_query_by_offset_through_the_admin_commands(spawn, tmp_path):
    dev = spawn(raftmq_argv("--log-level", "WARNING", "dev", "--data-dir", str(tmp_path / "dev"), "--base-port", "0"),
                ready_timeout_s=90)
    namesrv = dev.fields["namesrv"]
    _wait_for_leader(namesrv)
    _admin(namesrv, "create-topic", TOPIC, "--read-queues", "2", "--write-queues", "2")

    # Pinned to queue 1: stored there one after another, in the order sent.
    pinned = _admin_json(namesrv, "send-message", TOPIC, "--body", "hello", "--keys", "k1,k2", "--tags", "TagA",
                         "--broker", "broker-a", "--queue", "1", "--count", "3")
    assert pinned["topic"] == TOPIC and len(pinned["sent"]) == 3
    assert [(r["send_status"], r["broker_name"], r["queue_id"], r["queue_offset"]) for r in pinned["sent"]] == [
        ("SEND_OK", "broker-a", 1, offset) for offset in range(3)]
    assert len({r["offset_msg_id"] for r in pinned["sent"]}) == len({r["msg_id"] for r in pinned["sent"]}) == 3
    # A binary body from a file, with the table: every row says where it went.
    body_file = tmp_path / "body.bin"
    body_file.write_bytes(b"\x00\x01bin" + b"x" * 200)
    table = _admin(namesrv, "send-message", TOPIC, "--body-file", str(body_file), "--tags", "TagB", "--broker",
                   "broker-a", "--queue", "0").stdout
    assert "1 message(s) sent to MsgTopic" in table and "SEND_OK" in table and "broker-a" in table
    spread = _admin_json(namesrv, "send-message", TOPIC, "--body", "spread", "--tags", "TagC", "--count", "4")
    assert sorted(r["queue_id"] for r in spread["sent"]) == [0, 0, 1, 1]  # round-robin over both write queues

    # One message by queue and offset, as query-msg-id shows it.
    [by_offset] = _admin_json(namesrv, "query-msg-offset", TOPIC, "--broker", "broker-a", "--queue", "1",
                              "--offset", "2")["messages"]
    assert (by_offset["offset_msg_id"], by_offset["msg_id"]) == (pinned["sent"][2]["offset_msg_id"],
                                                                 pinned["sent"][2]["msg_id"])
    assert (by_offset["keys"], by_offset["tags"], base64.b64decode(by_offset["body_base64"])) == (
        ["k1", "k2"], "TagA", b"hello")
    assert _admin_json(namesrv, "query-msg-id", by_offset["offset_msg_id"])["messages"] == [by_offset]
    saved = tmp_path / "saved.bin"
    shown = _admin(namesrv, "query-msg-offset", TOPIC, "--broker", "broker-a", "--queue", "0", "--offset", "0",
                   "--body-file", str(saved)).stdout
    assert "TagB" in shown and "\\x00\\x01bin" in shown and saved.read_bytes() == body_file.read_bytes()
    beyond = _admin(namesrv, "query-msg-offset", TOPIC, "--broker", "broker-a", "--queue", "1", "--offset", "99",
                    expect_rc=1)
    assert "no message at offset 99 of broker-a queue 1 of 'MsgTopic', which holds offsets 0..4" in beyond.stderr

    # A group that committed offset 1 of queue 1, and one that never committed: reading must move neither.
    trio.run(_commit, namesrv, "MsgCommitted", 1, 1)
    before = _admin_json(namesrv, "consumer-progress", "MsgCommitted", "--topic", TOPIC)

    # Every queue, queue after queue, from the oldest message kept: all 8, bodies whole in --json.
    everything = _admin_json(namesrv, "consume-message", TOPIC, "--group", "MsgCommitted")
    rows = [(m["queue_id"], m["queue_offset"], m["tags"]) for m in everything["messages"]]
    assert rows == [(0, 0, "TagB"), (0, 1, "TagC"), (0, 2, "TagC"), (1, 0, "TagA"), (1, 1, "TagA"),
                    (1, 2, "TagA"), (1, 3, "TagC"), (1, 4, "TagC")]
    assert base64.b64decode(everything["messages"][0]["body_base64"]) == body_file.read_bytes()
    assert [(q["queue_id"], q["from_offset"], q["next_offset"], q["max_offset"]) for q in everything["queues"]] == [
        (0, 0, 3, 3), (1, 0, 5, 5)]
    fresh = _admin(namesrv, "consume-message", TOPIC, "--group", "MsgFresh").stdout
    assert "8 message(s) of MsgTopic" in fresh and "broker-a:1" in fresh and "hello" in fresh
    assert "\\x00\\x01binxxx" in fresh and "…" in fresh  # a binary body escaped, a long one cut
    assert "queues read (no offset committed)" in fresh
    after = _admin_json(namesrv, "consumer-progress", "MsgCommitted", "--topic", TOPIC)
    # Its offsets and lag are where they were; only the pull statistics saw the pulls that named it (--group).
    assert after["consume_tps"] > before["consume_tps"] == 0
    assert {**after, "consume_tps": 0} == {**before, "consume_tps": 0}
    assert [(q["queue_id"], q["consumer_offset"]) for q in before["queues"]] == [(0, None), (1, 1)]
    untouched = _admin(namesrv, "consumer-progress", "MsgFresh", expect_rc=1)
    assert "consumer group 'MsgFresh' has no progress on any topic" in untouched.stderr

    # From an offset of one queue, bounded by --count; by tag; by time.
    two = _admin_json(namesrv, "consume-message", TOPIC, "--broker", "broker-a", "--queue", "1", "--offset", "1",
                      "--count", "2")
    assert [m["queue_offset"] for m in two["messages"]] == [1, 2] and two["queues"][0]["next_offset"] == 3
    tagged = _admin_json(namesrv, "consume-message", TOPIC, "--tags", "TagB||TagA")["messages"]
    assert [(m["queue_id"], m["queue_offset"]) for m in tagged] == [(0, 0), (1, 0), (1, 1), (1, 2)]
    spread_times = sorted(m["store_timestamp"] for m in everything["messages"] if m["tags"] == "TagC")
    pinned_times = [m["store_timestamp"] for m in everything["messages"] if m["tags"] == "TagA"]
    since = _admin_json(namesrv, "consume-message", TOPIC, "--begin-ms", str(spread_times[0]))["messages"]
    assert sorted(m["body_base64"] for m in since) == [base64.b64encode(b"spread").decode()] * 4
    until = _admin_json(namesrv, "consume-message", TOPIC, "--broker", "broker-a", "--end-ms",
                        str(pinned_times[-1]))
    # Sent first: queue 0's messages (TagB, then TagC) were all stored later, and so were queue 1's TagC.
    assert [m["tags"] for m in until["messages"]] == ["TagA", "TagA", "TagA"]
    assert [(q["queue_id"], q["from_offset"], q["next_offset"]) for q in until["queues"]] == [(0, 0, 0), (1, 0, 3)]
    bodies = tmp_path / "bodies"
    bodies.mkdir()
    written = _admin_json(namesrv, "consume-message", TOPIC, "--broker", "broker-a", "--queue", "0",
                          "--body-file-dir", str(bodies))["messages"]
    assert sorted(p.name for p in bodies.iterdir()) == sorted(m["offset_msg_id"] for m in written)
    assert (bodies / written[0]["offset_msg_id"]).read_bytes() == body_file.read_bytes()

    # A delayed message: where the send says it waits, then in its topic a second later (level 1: 1 s).
    delayed = _admin_json(namesrv, "send-message", TOPIC, "--body", "later", "--tags", "TagD", "--delay-level", "1",
                          "--broker", "broker-a", "--queue", "1")
    assert delayed["delay_level"] == 1 and delayed["sent"][0]["send_status"] == "SEND_OK"
    deadline = time.monotonic() + 30
    while not (arrived := _admin_json(namesrv, "consume-message", TOPIC, "--tags", "TagD")["messages"]):
        assert time.monotonic() < deadline, "the delayed message never reached its topic"
        time.sleep(0.3)
    assert [(m["queue_id"], m["queue_offset"]) for m in arrived] == [(1, 5)]  # the queue it was sent to, when due

    # Refusals: the cluster's, exit 1 naming what is missing.
    unknown_group = _admin(namesrv, "send-message", TOPIC, "--body", "x", "--broker", "broker-zz", "--queue", "0",
                           expect_rc=1)
    assert "topic 'MsgTopic' has no write queue on broker group 'broker-zz' (it has write queues on: broker-a)" in \
        unknown_group.stderr
    no_queue = _admin(namesrv, "consume-message", TOPIC, "--broker", "broker-a", "--queue", "5", expect_rc=1)
    assert "queue 5 is no read queue of topic 'MsgTopic' on broker group 'broker-a' (its read queues: 0..1)" in \
        no_queue.stderr
    outside = _admin(namesrv, "consume-message", TOPIC, "--broker", "broker-a", "--queue", "0", "--offset", "9",
                     expect_rc=1)
    assert "--offset 9 is outside broker-a queue 0 of 'MsgTopic', which holds offsets 0..2" in outside.stderr
    missing = _admin(namesrv, "consume-message", "NoSuchTopic", expect_rc=1)
    assert "NoSuchTopic" in missing.stderr
    error = json.loads(_admin(namesrv, "--json", "query-msg-offset", "NoSuchTopic", "--broker", "broker-a",
                              "--queue", "0", "--offset", "0", expect_rc=1).stdout)
    assert error["exit_status"] == 1 and "NoSuchTopic" in error["error"]
