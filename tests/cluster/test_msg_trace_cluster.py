"""Message trace with real processes (``raftmq dev``): the brokers create the trace topic at start
(``trace_topic_enable``, with auto-create off), a traced producer sends, a traced push consumer consumes (its handler
failing once, so the message comes back from the retry topic), and ``AdminClient.query_msg_trace`` and ``raftmq
admin query-msg-trace`` show its Pub and both handler calls' SubBefore/SubAfter, with the right groups, ids and
success flags. Everything under its default names (``RMQ_SYS_TRACE_TOPIC``)."""

from __future__ import annotations

import time

import pytest
import trio

from client import Message, TraceType, open_admin, open_producer, open_push_consumer
from tests.cluster.test_admin_cli import _admin, _admin_json, _wait_for_leader
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

TOPIC = "TracedTopic"


def _wait_for_route(namesrv: str, topic: str) -> None:
    deadline = time.monotonic() + 30
    while _admin(namesrv, "route", topic, expect_rc=None).returncode != 0:
        assert time.monotonic() < deadline, f"{topic} never routed"
        time.sleep(0.3)


async def _send_and_consume(namesrv: str) -> tuple[str, str]:
    deliveries: list[int] = []
    done = trio.Event()

    async def handler(msg) -> None:
        if msg.topic != TOPIC:
            return
        deliveries.append(msg.reconsume_times)
        if len(deliveries) == 1:
            raise RuntimeError("fails once")
        done.set()

    async with open_producer(namesrv, producer_group="TracePG", enable_msg_trace=True) as producer:
        result = await producer.send(Message(TOPIC, b"traced", tags="TagT", keys=["order-7"]))
    async with open_push_consumer(namesrv, topic=TOPIC, handler=handler, consumer_group="TraceCG",
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=300,
                                  enable_msg_trace=True):
        with trio.fail_after(60):
            await done.wait()
    assert deliveries == [0, 1]
    return result.msg_id, result.offset_msg_id


async def _query(namesrv: str, msg_id: str) -> list:
    async with open_admin(namesrv) as admin:
        with trio.fail_after(30):
            while True:  # closing flushed the traces; the brokers index them a moment after storing
                found = await admin.query_msg_trace(msg_id)
                if len(found) >= 5:
                    return found
                await trio.sleep(0.2)


def test_a_traced_message_shows_who_sent_it_and_each_consume_attempt(spawn, tmp_path):
    dev = spawn(raftmq_argv("--log-level", "WARNING", "dev", "--data-dir", str(tmp_path / "dev"), "--base-port", "0",
                            "--set", "trace_topic_enable=true",
                            "--set", "auto_create_topic_enable=false",
                            "--set", 'message_delay_level="100ms 200ms 300ms 400ms 500ms"'),
                ready_timeout_s=90)
    namesrv = dev.fields["namesrv"]
    _wait_for_leader(namesrv)
    _wait_for_route(namesrv, "RMQ_SYS_TRACE_TOPIC")  # created by the leader at start, with auto-create off
    _admin(namesrv, "create-topic", TOPIC, "--read-queues", "2", "--write-queues", "2")
    refused = _admin(namesrv, "create-topic", "RMQ_SYS_TRACE_TOPIC", expect_rc=2)  # the brokers' own to create
    assert "reserved for the broker" in refused.stderr

    msg_id, offset_msg_id = trio.run(_send_and_consume, namesrv)
    traces = trio.run(_query, namesrv, msg_id)
    assert [c.trace_type for c in traces] == [TraceType.PUB, TraceType.SUB_BEFORE, TraceType.SUB_AFTER,
                                              TraceType.SUB_BEFORE, TraceType.SUB_AFTER]
    pub, before1, after1, before2, after2 = traces
    assert (pub.group, pub.msg_id, pub.topic, pub.tags, pub.keys, pub.offset_msg_id, pub.success) == (
        "TracePG", msg_id, TOPIC, "TagT", "order-7", offset_msg_id, True)
    assert pub.store_host and pub.client_host and pub.body_length == 6
    assert {(c.group, c.msg_id) for c in traces[1:]} == {("TraceCG", msg_id)}
    assert [(before1.retry_times, after1.success), (before2.retry_times, after2.success)] == [(0, False), (1, True)]
    assert before1.request_id == after1.request_id != before2.request_id == after2.request_id

    shown = _admin_json(namesrv, "query-msg-trace", "--msg-id", msg_id)
    assert [(t["trace_type"], t["group"], t["success"]) for t in shown["traces"]] == [
        ("Pub", "TracePG", True), ("SubBefore", "TraceCG", None), ("SubAfter", "TraceCG", False),
        ("SubBefore", "TraceCG", None), ("SubAfter", "TraceCG", True)]
    table = _admin(namesrv, "query-msg-trace", "--msg-id", msg_id).stdout
    assert "TracePG" in table and "TraceCG" in table and "failed" in table and "success" in table
    missing = _admin(namesrv, "query-msg-trace", "--msg-id", "NOSUCHID", expect_rc=1)
    assert "no trace of message 'NOSUCHID'" in missing.stderr
