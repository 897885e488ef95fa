"""Message trace with real processes (``raftmq dev``): the brokers create the trace topic at start
(``trace_topic_enable``, with auto-create off), a traced producer sends, a traced push consumer consumes (its handler
failing once, so the message comes back from the retry topic), and ``AdminClient.query_msg_trace`` and ``raftmq
admin query-msg-trace`` show its Pub and both handler calls' SubBefore/SubAfter, with the right groups, ids and
success flags. On the same cluster: a traced request (its Pub), answered from a traced iterator-form push consumer
and also polled by a traced lite pull consumer (their SubBefore/SubAfter), and a traced transaction the broker
checks back (its EndTransaction from the check). Everything under its default names (``RMQ_SYS_TRACE_TOPIC``)."""

from __future__ import annotations

import time

import pytest
import trio

from client import (Message, MessageExt, TraceType, TransactionState, create_reply_message, open_admin,
                    open_lite_pull_consumer, open_producer, open_push_consumer)
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


async def _query(namesrv: str, msg_id: str, count: int = 5) -> list:
    async with open_admin(namesrv) as admin:
        with trio.fail_after(30):
            while True:  # closing flushed the traces; the brokers index them a moment after storing
                found = await admin.query_msg_trace(msg_id)
                if len(found) >= count:
                    return found
                await trio.sleep(0.2)


async def _request_answered_from_an_iterator_and_polled(namesrv: str) -> str:
    """A traced request to TOPIC (tag TagR), answered by a traced iterator-form push consumer of TagR and polled by
    a traced lite pull consumer of TagR too; the request message's id."""
    request_ids: list[str] = []
    async with open_lite_pull_consumer(namesrv, consumer_group="TraceLiteCG", enable_msg_trace=True,
                                       consume_from_where="CONSUME_FROM_FIRST_OFFSET") as lite:
        lite.set_sub_expression_for_assign(TOPIC, "TagR")
        lite.assign(await lite.fetch_queues(TOPIC))
        async with open_push_consumer(namesrv, topic=TOPIC, expression="TagR", consumer_group="TraceIterCG",
                                      consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=300,
                                      enable_msg_trace=True) as iterated, open_producer(namesrv) as replier:

            async def answer() -> None:
                async for msg in iterated:
                    if msg.topic == TOPIC:
                        request_ids.append(msg.msg_id)
                        await replier.send(create_reply_message(msg, b"pong"))
                        break
                iterated.ack_pending()  # done with it: its SubAfter

            async with open_producer(namesrv, producer_group="TraceReqPG", enable_msg_trace=True) as requester:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(answer)
                    reply = await requester.request(Message(TOPIC, b"ping", tags="TagR", keys=["req-1"]),
                                                    timeout_s=30)
        assert reply.body == b"pong" and request_ids
        polled: list[MessageExt] = []
        with trio.fail_after(30):
            while not any(m.msg_id == request_ids[0] for m in polled):
                polled += await lite.poll(timeout_s=1)
    return request_ids[0]


class _CheckedListener:
    """Leaves the transaction to the broker's check, which it commits."""

    def __init__(self) -> None:
        self.checked = trio.Event()

    async def execute(self, msg, arg) -> TransactionState:
        return TransactionState.UNKNOWN

    async def check(self, msg) -> TransactionState:
        self.checked.set()
        return TransactionState.COMMIT


async def _transaction_checked_back(namesrv: str) -> str:
    listener = _CheckedListener()
    # Heartbeats soon after the send: the brokers check back only a producer of the group they know a connection of.
    async with open_producer(namesrv, producer_group="TraceTxPG", transaction_listener=listener,
                             enable_msg_trace=True, heartbeat_broker_interval_ms=300) as producer:
        result = await producer.send_in_transaction(Message(TOPIC, b"tx", tags="TagX", keys=["tx-1"]))
        with trio.fail_after(60):
            await listener.checked.wait()
        await trio.sleep(0.5)  # the check's answer (END_TRANSACTION) goes out from a task of its own
    return result.msg_id


def test_a_traced_message_shows_who_sent_it_and_each_consume_attempt(spawn, tmp_path):
    dev = spawn(raftmq_argv("--log-level", "WARNING", "dev", "--data-dir", str(tmp_path / "dev"), "--base-port", "0",
                            "--set", "trace_topic_enable=true",
                            "--set", "auto_create_topic_enable=false",
                            "--set", "transaction_timeout_ms=1000", "--set", "transaction_check_interval_ms=300",
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

    # A request's send (its Pub), the iterator that answered it and the lite pull poll that took it too.
    request_id = trio.run(_request_answered_from_an_iterator_and_polled, namesrv)
    traces = trio.run(_query, namesrv, request_id, 5)
    assert sorted((c.trace_type.value, c.group, c.success) for c in traces) == [
        ("Pub", "TraceReqPG", True), ("SubAfter", "TraceIterCG", True), ("SubAfter", "TraceLiteCG", True),
        ("SubBefore", "TraceIterCG", None), ("SubBefore", "TraceLiteCG", None)]
    pub = next(c for c in traces if c.trace_type is TraceType.PUB)
    assert (pub.topic, pub.tags, pub.keys) == (TOPIC, "TagR", "req-1") and pub.offset_msg_id and pub.store_host
    for group in ("TraceIterCG", "TraceLiteCG"):  # each consumer's pair shares a request id
        assert len({c.request_id for c in traces if c.group == group}) == 1

    # A transaction left UNKNOWN by execute and committed by the broker's check-back: both ends are traced.
    tx_id = trio.run(_transaction_checked_back, namesrv)
    traces = trio.run(_query, namesrv, tx_id, 3)
    ends = [(c.transaction_state, c.from_transaction_check) for c in traces
            if c.trace_type is TraceType.END_TRANSACTION]
    assert ("UNKNOW", False) in ends and ("COMMIT_MESSAGE", True) in ends
    checked = next(c for c in traces if c.from_transaction_check)
    assert (checked.group, checked.msg_id, checked.transaction_id, checked.topic, checked.keys) == (
        "TraceTxPG", tx_id, tx_id, TOPIC, "tx-1") and checked.store_host
