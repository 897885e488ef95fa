"""Message trace's pure parts (client/trace.py): RocketMQ's TraceDataEncoder text, golden and round trip, the
trace message keys, the dispatcher's bounds (drop when full, batches by count and size, flush at close), the
consumer's SubBefore/SubAfter; and, on the in-memory fake cluster, a traced producer and push consumer end to end, a
traced request's send and a traced answer to a transaction check."""

from __future__ import annotations

import math
import time
import types

import pytest
import trio
import trio.testing

import client.trace as trace_module
import client.trace_producer
from client import Message, Producer, ReconsumeLater, TransactionState, open_producer, open_push_consumer
from client.errors import ConfigError
from client.lite_pull_consumer import LitePullConsumerConfig
from client.listener import ReconsumeLater as _ReconsumeLater
from client.message import MessageExt
from client.producer import ProducerConfig
from client.push_consumer_config import PushConsumerConfig
from client.trace import (TRACE_TOPIC, ConsumeReturnType, ConsumeTracer, TraceContext, TraceDispatcher,
                          TraceMessageType, TraceType, decode_trace_data, encode_trace_context, trace_keys,
                          trace_producer_group)
from remoting.codec import make_request, make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import ConnectError, RaftMQError
from remoting.message import MessageInput, decode_record, encode_record, record_size
from tests.unit.client.fake_cluster import NAMESRV, recording_fake, wait_until

PUB = TraceContext(TraceType.PUB, 1700000000123, "PG", "AC1100010000", topic="T", tags="TagA", keys="k1 k2",
                   store_host="127.0.0.1:10911", client_host="10.0.0.7", body_length=5, cost_ms=3,
                   offset_msg_id="7F00000100002A9F0000000000000000", success=True)
SUB_BEFORE = TraceContext(TraceType.SUB_BEFORE, 1700000000200, "CG", "AC1100010000", request_id="REQ1",
                          retry_times=1, keys="k1 k2", client_host="10.0.0.8")
SUB_AFTER = TraceContext(TraceType.SUB_AFTER, 1700000000250, "CG", "AC1100010000", request_id="REQ1", cost_ms=50,
                         success=False, keys="k1 k2", context_code=4, client_host="10.0.0.8")
END = TraceContext(TraceType.END_TRANSACTION, 1700000000300, "PG", "AC1100010000", topic="T", tags="",
                   keys="", store_host="127.0.0.1:10911", msg_type=TraceMessageType.TRANS_COMMIT,
                   transaction_id="AC1100010000", transaction_state="COMMIT_MESSAGE")


def test_contexts_encode_in_rocketmqs_field_order():
    # Golden: fields joined by char 1, each context ended by char 2, a missing tag or key written "null" as Java.
    assert encode_trace_context(PUB) == "\x01".join([
        "Pub", "1700000000123", "DefaultRegion", "PG", "T", "AC1100010000", "TagA", "k1 k2", "127.0.0.1:10911", "5",
        "3", "0", "7F00000100002A9F0000000000000000", "true", "10.0.0.7"]) + "\x02"
    assert encode_trace_context(SUB_BEFORE) == "\x01".join([
        "SubBefore", "1700000000200", "DefaultRegion", "CG", "REQ1", "AC1100010000", "1", "k1 k2",
        "10.0.0.8"]) + "\x02"
    assert encode_trace_context(SUB_AFTER) == "\x01".join([
        "SubAfter", "REQ1", "AC1100010000", "50", "false", "k1 k2", "4", "1700000000250", "CG", "10.0.0.8"]) + "\x02"
    assert encode_trace_context(END) == "\x01".join([
        "EndTransaction", "1700000000300", "DefaultRegion", "PG", "T", "AC1100010000", "null", "null",
        "127.0.0.1:10911", "2", "AC1100010000", "COMMIT_MESSAGE", "false"]) + "\x02"


def test_contexts_round_trip_through_one_body():
    data = "".join(encode_trace_context(c) for c in (PUB, SUB_BEFORE, SUB_AFTER, END))
    assert decode_trace_data(data) == [PUB, SUB_BEFORE, SUB_AFTER, END]
    assert decode_trace_data("") == []


def test_rocketmqs_older_and_shorter_lines_decode():
    # A RocketMQ 4.3 Pub (13 fields: no offset msg id), a SubBefore of 8 and a SubAfter of 6, "null" keys, and a
    # context type this version does not know, which is skipped.
    old_pub = "\x01".join(["Pub", "5", "DefaultRegion", "PG", "T", "ID", "null", "null", "h:1", "9", "2", "3",
                           "true"])
    before = "\x01".join(["SubBefore", "6", "DefaultRegion", "CG", "R", "ID", "0", "null"])
    after = "\x01".join(["SubAfter", "R", "ID", "4", "true", "null"])
    unknown = "\x01".join(["Future", "x"])
    pub, sub_before, sub_after = decode_trace_data("\x02".join([old_pub, before, unknown, after]) + "\x02")
    assert (pub.msg_type, pub.success, pub.offset_msg_id, pub.tags, pub.keys) == (TraceMessageType.DELAY, True, "",
                                                                                  "", "")
    assert (sub_before.group, sub_before.request_id, sub_before.keys, sub_before.client_host) == ("CG", "R", "", "")
    assert (sub_after.request_id, sub_after.cost_ms, sub_after.success, sub_after.group) == ("R", 4, True, "")


def test_malformed_contexts_are_refused_naming_the_field():
    line = encode_trace_context(PUB).split("\x01")
    with pytest.raises(ValueError, match="Pub context field 9 must be an integer"):
        decode_trace_data("\x01".join(line[:9] + ["many"] + line[10:]))
    with pytest.raises(ValueError, match="Pub context field 13 must be true or false"):
        decode_trace_data("\x01".join(line[:13] + ["yes"] + line[14:]))
    with pytest.raises(ValueError, match="SubBefore context has 3 fields, at least 8 expected"):
        decode_trace_data("SubBefore\x011\x012")
    with pytest.raises(ValueError, match="no message type"):
        decode_trace_data("\x01".join(line[:11] + ["9"] + line[12:]))
    with pytest.raises(ValueError, match="holds a separator character"):
        encode_trace_context(TraceContext(TraceType.PUB, 1, "PG", "a\x01b"))


def test_trace_keys_are_the_msg_ids_then_their_keys_once_each():
    assert trace_keys([PUB, SUB_BEFORE, TraceContext(TraceType.PUB, 1, "PG", "OTHER")]) == [
        "AC1100010000", "k1", "k2", "OTHER"]
    assert trace_producer_group(TRACE_TOPIC) == "_INNER_TRACE_PRODUCER-RMQ_SYS_TRACE_TOPIC"


def test_trace_topics_are_checked_as_topic_names():
    with pytest.raises(ConfigError, match="trace_topic"):
        ProducerConfig(trace_topic="bad topic")
    with pytest.raises(ConfigError, match="trace_topic"):
        PushConsumerConfig(trace_topic="")
    with pytest.raises(ConfigError, match="trace_topic"):
        LitePullConsumerConfig(trace_topic="a/b")
    assert ProducerConfig().trace_topic == PushConsumerConfig().trace_topic == TRACE_TOPIC
    assert LitePullConsumerConfig().trace_topic == TRACE_TOPIC
    assert not (ProducerConfig().enable_msg_trace or PushConsumerConfig().enable_msg_trace
                or LitePullConsumerConfig().enable_msg_trace)
    with pytest.raises(ValueError, match="max_queued must be an integer >= 1"):
        TraceDispatcher("T", _Sink(), max_queued=0)


class _Sink:
    """The inner producer's send: records each trace message, failing while ``failing``."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.failing = False

    async def __call__(self, message: Message) -> None:
        await trio.lowlevel.checkpoint()
        if self.failing:
            raise ConnectError("b:1", "no broker")
        self.sent.append(message)


def _pub(i: int, keys: str = "") -> TraceContext:
    return TraceContext(TraceType.PUB, i, "PG", f"ID{i}", topic="T", keys=keys, success=True)


async def test_a_full_queue_drops_and_counts_and_never_waits():
    sink = _Sink()
    dispatcher = TraceDispatcher("TR", sink, max_queued=3)
    assert [dispatcher.append(_pub(i)) for i in range(5)] == [True, True, True, False, False]
    stats = dispatcher.statistics()
    assert (stats.recorded, stats.dropped, stats.queued) == (3, 2, 3)
    await dispatcher.flush()
    assert [decode_trace_data(m.body.decode()) for m in sink.sent] == [[_pub(0), _pub(1), _pub(2)]]
    assert sink.sent[0].topic == "TR" and sink.sent[0].keys == ["ID0", "ID1", "ID2"]
    assert dispatcher.append(_pub(5))  # room again once sent


async def test_batches_go_by_count_at_once_and_by_time_otherwise():
    sink = _Sink()
    dispatcher = TraceDispatcher("TR", sink, batch_size=2, flush_interval_ms=60_000)
    async with trio.open_nursery() as nursery:
        await nursery.start(dispatcher.serve)
        dispatcher.append(_pub(0))
        await trio.testing.wait_all_tasks_blocked()
        assert sink.sent == []  # one context waits for the time bound
        dispatcher.append(_pub(1))  # a full batch goes at once
        await trio.testing.wait_all_tasks_blocked()
        assert [len(decode_trace_data(m.body.decode())) for m in sink.sent] == [2]
        nursery.cancel_scope.cancel()


async def test_the_time_bound_sends_a_lone_context(autojump_clock):
    sink = _Sink()
    dispatcher = TraceDispatcher("TR", sink, flush_interval_ms=500)
    async with trio.open_nursery() as nursery:
        await nursery.start(dispatcher.serve)
        dispatcher.append(_pub(0))
        await trio.sleep(0.4)
        assert sink.sent == []
        await trio.sleep(0.2)
        assert len(sink.sent) == 1
        nursery.cancel_scope.cancel()


async def test_messages_are_bounded_by_bytes_and_keys_and_failures_are_counted():
    sink = _Sink()
    dispatcher = TraceDispatcher("TR", sink, max_message_bytes=1024)
    for i in range(30):  # about 60 bytes a line: about 17 a message
        dispatcher.append(_pub(i))
    await dispatcher.flush()
    bodies = [m.body for m in sink.sent]
    assert len(bodies) > 1 and all(len(b) <= 1024 for b in bodies)
    assert [c.msg_id for b in bodies for c in decode_trace_data(b.decode())] == [f"ID{i}" for i in range(30)]
    # A message whose keys alone are too many is traced by its msg id only.
    sink.sent.clear()
    big = " ".join(f"key{i:05d}" for i in range(2000))
    dispatcher = TraceDispatcher("TR", sink)
    dispatcher.append(_pub(1, keys=big))
    dispatcher.append(_pub(2, keys="k"))
    await dispatcher.flush()
    assert [m.keys for m in sink.sent] == [["ID1", "ID2", "k"]]
    assert decode_trace_data(sink.sent[0].body.decode())[0].keys == ""
    sink.failing = True
    dispatcher.append(_pub(3))
    await dispatcher.flush()
    stats = dispatcher.statistics()
    assert (stats.sent_messages, stats.sent_contexts, stats.failed_contexts, stats.queued) == (1, 2, 1, 0)


async def test_a_msg_id_no_trace_message_can_carry_is_left_out_of_its_keys_and_nothing_stops_the_dispatcher(
        monkeypatch):
    # A msg id is a UNIQ_KEY any producer may set: one holding the key separator made the trace message itself a
    # ValueError raised in serve(), which ended the traced producer or consumer.
    sink = _Sink()
    dispatcher = TraceDispatcher("TR", sink)
    dispatcher.append(TraceContext(TraceType.PUB, 1, "PG", "a b", topic="T", keys="k1", success=True))
    dispatcher.append(TraceContext(TraceType.PUB, 2, "PG", "x" * 40_000, topic="T", success=True))
    dispatcher.append(_pub(3, keys="k3 " + "y" * 5_000))
    await dispatcher.flush()
    assert [m.keys for m in sink.sent] == [["k1", "ID3", "k3"]]
    assert [c.msg_id for c in decode_trace_data(sink.sent[0].body.decode())] == ["a b", "x" * 40_000, "ID3"]
    # Whatever else makes a trace message unbuildable costs its contexts only, counted.
    monkeypatch.setattr(trace_module, "trace_keys", lambda contexts: ["bad key"])
    dispatcher.append(_pub(4))
    await dispatcher.flush()
    assert dispatcher.statistics().failed_contexts == 1 and dispatcher.statistics().queued == 0


async def test_a_flush_cancelled_mid_send_keeps_its_contexts_for_the_close():
    sink = _Sink()
    blocked = trio.Event()

    async def stuck(message: Message) -> None:
        blocked.set()
        await trio.sleep_forever()

    dispatcher = TraceDispatcher("TR", stuck)
    dispatcher.append(_pub(0))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(dispatcher.flush)
        await blocked.wait()
        nursery.cancel_scope.cancel()
    dispatcher._send = sink  # what the close's flush sends through
    await dispatcher.flush()
    assert [decode_trace_data(m.body.decode()) for m in sink.sent] == [[_pub(0)]]


def _ext(msg_id: str, topic: str = "T", reconsume_times: int = 0) -> MessageExt:
    return MessageExt(topic, b"x", 0, 0, "broker-a", {"UNIQ_KEY": msg_id, "KEYS": "k"}, 0, 0, 0, ("127.0.0.1", 1),
                      reconsume_times)


async def test_a_handler_calls_contexts_pair_by_request_id_and_ack_index_splits_a_batch():
    sink = _Sink()
    dispatcher = TraceDispatcher("TR", sink)
    tracer = ConsumeTracer(dispatcher, "CG", "10.0.0.8")
    call = tracer.before([_ext("A", reconsume_times=2), _ext("B"), _ext("TRACE", topic="TR")])
    tracer.after(call, _ReconsumeLater(ack_index=0))
    assert tracer.before([_ext("X", topic="TR")]) is None  # the trace topic's messages are not traced
    await dispatcher.flush()
    before_a, before_b, after_a, after_b = decode_trace_data(sink.sent[0].body.decode())
    assert [c.trace_type for c in (before_a, before_b, after_a, after_b)] == [TraceType.SUB_BEFORE] * 2 + [
        TraceType.SUB_AFTER] * 2
    assert len({c.request_id for c in (before_a, before_b, after_a, after_b)}) == 1
    assert (before_a.msg_id, before_a.retry_times, before_a.group, before_a.client_host) == ("A", 2, "CG", "10.0.0.8")
    assert (after_a.success, after_a.context_code) == (True, ConsumeReturnType.SUCCESS)
    assert (after_b.success, after_b.context_code) == (False, ConsumeReturnType.FAILED)
    assert sink.sent[0].keys == ["A", "k", "B"]
    # A failure that took the whole consume timeout was the timeout's.
    sink.sent.clear()
    tracer.after(tracer.before([_ext("C")]), ReconsumeLater(), timeout_s=0.0)
    tracer.after(tracer.before([_ext("D")]), None, timeout_s=math.inf)
    await dispatcher.flush()
    codes = [(c.msg_id, c.context_code) for c in decode_trace_data(sink.sent[0].body.decode())
             if c.trace_type is TraceType.SUB_AFTER]
    assert codes == [("C", ConsumeReturnType.TIME_OUT), ("D", ConsumeReturnType.SUCCESS)]


# -- wired: a traced producer and push consumer on the fake cluster ------------------------------------------------


def _traces(fake, topic: str = TRACE_TOPIC) -> list[TraceContext]:
    group = fake.groups[0]
    return [c for (t, _), records in sorted(group.logs.items()) if t == topic for raw in records
            for c in decode_trace_data(decode_record(raw).body.decode())]


async def test_traced_sends_and_handler_calls_reach_the_trace_topic(monkeypatch, tmp_path):
    fake = recording_fake(monkeypatch, 2)
    async with open_producer(NAMESRV) as plain:
        assert type(plain) is Producer  # tracing off: no hook at all on the send path
        await plain.send(Message("T", b"untraced"))
    async with open_producer(NAMESRV, producer_group="PG", enable_msg_trace=True, client_ip="10.0.0.7") as producer:
        one = await producer.send(Message("T", b"one", tags="TagA", keys=["k1", "k2"]))
        batch = await producer.send_batch([Message("T", b"b1"), Message("T", b"b2")])
        oneway = Message("T", b"fire")
        await producer.send_oneway(oneway)
        assert "UNIQ_KEY" not in oneway.properties  # the id went on a copy
    # Closing flushed them, through the inner producer.
    pubs = _traces(fake)
    assert [(c.trace_type, c.group, c.msg_id) for c in pubs[:3]] == [
        (TraceType.PUB, "PG", one.msg_id), (TraceType.PUB, "PG", batch.msg_ids[0]),
        (TraceType.PUB, "PG", batch.msg_ids[1])]
    first = pubs[0]
    assert (first.topic, first.tags, first.keys, first.body_length, first.offset_msg_id, first.success,
            first.client_host) == ("T", "TagA", "k1 k2", 3, one.offset_msg_id, True, "10.0.0.7")
    assert (pubs[3].offset_msg_id, pubs[3].store_host, pubs[3].success) == ("", "", True)  # the oneway
    assert len(pubs) == 4

    failed: set[str] = set()

    async def handler(msg: MessageExt) -> None:
        if msg.msg_id == one.msg_id and msg.msg_id not in failed:
            failed.add(msg.msg_id)
            raise ReconsumeLater("once")

    async with open_push_consumer(NAMESRV, topic="T", handler=handler, consumer_group="CG",
                                  message_model="BROADCASTING", offset_store_dir=str(tmp_path),
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", reconsume_delay_ms=10,
                                  enable_msg_trace=True, client_ip="10.0.0.8") as consumer:
        with trio.fail_after(10):
            while consumer.statistics().delivered < 5:
                await trio.sleep(0.01)
    subs = [c for c in _traces(fake) if c.trace_type is not TraceType.PUB]
    mine = [(c.trace_type, c.retry_times, c.success) for c in subs if c.msg_id == one.msg_id]
    assert mine == [(TraceType.SUB_BEFORE, 0, None), (TraceType.SUB_AFTER, 0, False),
                    (TraceType.SUB_BEFORE, 1, None), (TraceType.SUB_AFTER, 0, True)]
    assert {(c.group, c.client_host) for c in subs} == {("CG", "10.0.0.8")}
    assert len({c.msg_id for c in subs}) == 5  # the untraced message is consumed, and traced, too


class _Monotonic:
    """``time.monotonic`` as the traced producer reads it, moved on by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_requests_send_is_traced_at_its_own_cost_and_a_failed_one_not_at_all(monkeypatch):
    """RocketMQ's send hook sees a request's send: one Pub with the request's ids and the send's cost, not the
    wait for the reply. A request whose send failed records nothing, as a failed send."""
    fake = recording_fake(monkeypatch, 2)
    clock = _Monotonic()
    monkeypatch.setattr(client.trace_producer, "time", types.SimpleNamespace(time=time.time, monotonic=clock))
    answer = fake.invoke
    requests: list[dict] = []

    async def invoke(addr, request, timeout_s=3.0):
        response = await answer(addr, request, timeout_s)
        if request.code == RequestCode.SEND_MESSAGE and request.ext["topic"] == "T":
            requests.append(request.ext["properties"])
            clock.now += 7  # the send took 7 s
        return response

    fake.invoke = invoke

    async def prepared(topic: str):
        return "DefaultCluster", None

    async with open_producer(NAMESRV, producer_group="PG", enable_msg_trace=True, client_ip="10.0.0.7") as producer:
        producer._prepare_request = prepared  # the fake has no cluster to name; the heartbeats are not the point
        replies = []

        async def ask() -> None:
            replies.append(await producer.request(Message("T", b"question", tags="TagQ", keys=["q1"]),
                                                  timeout_s=30))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await wait_until(lambda: requests, timeout_s=10)
            clock.now += 100  # the reply takes long: none of it is the send's
            assert producer._pending.complete(requests[0]["CORRELATION_ID"], _ext("REPLY"))
        with pytest.raises(RaftMQError):
            await producer.request(Message("T", b"refused", properties={"reject": "yes"}), timeout_s=30)
    [pub] = _traces(fake)
    assert replies and (pub.trace_type, pub.group, pub.msg_id, pub.topic, pub.tags, pub.keys) == (
        TraceType.PUB, "PG", requests[0]["UNIQ_KEY"], "T", "TagQ", "q1")
    assert (pub.cost_ms, pub.success, pub.body_length, pub.client_host, pub.msg_type) == (
        7000, True, 8, "10.0.0.7", TraceMessageType.NORMAL)
    assert pub.offset_msg_id.startswith("broker-a-")  # the fake broker's offset msg id of the stored request


def _check_request(group: str, offset: int, uniq: str) -> object:
    """A broker's CHECK_TRANSACTION_STATE for the half message ``uniq`` of topic T, stored at ``offset``."""
    props = {"TRAN_MSG": "true", "PGROUP": group, "UNIQ_KEY": uniq, "REAL_TOPIC": "T", "REAL_QID": "0",
             "TAGS": "TagH", "KEYS": "order-1"}
    half = MessageInput("RMQ_SYS_TRANS_HALF_TOPIC", 0, b"half", props, sys_flag=0x4)
    buf = bytearray(record_size(4, len(half.topic), 200))
    size = encode_record(buf, 0, half, queue_offset=offset, phy_offset=4096, store_timestamp=1,
                         store_host=("127.0.0.1", 10911))
    return make_request(RequestCode.CHECK_TRANSACTION_STATE, {
        "producer_group": group, "broker_name": "broker-a", "tran_state_table_offset": offset}, bytes(buf[:size]))


async def test_a_check_back_answer_is_traced_as_an_end_transaction_from_the_check(monkeypatch):
    """RocketMQ's checkTransactionState runs the end-transaction hook: an EndTransaction context with
    fromTransactionCheck true, the state answered, the half's ids, the producer group."""
    fake = recording_fake(monkeypatch, 2)
    answer = fake.invoke
    ends: list[dict] = []

    async def invoke(addr, request, timeout_s=3.0):
        if request.code == RequestCode.END_TRANSACTION:
            ends.append(request.ext)
            return make_response(request, ResponseCode.SUCCESS)
        return await answer(addr, request, timeout_s)

    fake.invoke = invoke

    class Listener:
        async def execute(self, msg, arg):
            return TransactionState.COMMIT

        async def check(self, msg):
            return TransactionState.ROLLBACK

    async with open_producer(NAMESRV, producer_group="PG", transaction_listener=Listener(),
                             enable_msg_trace=True) as producer:
        await producer.fetch_publish_queues("T")  # the route names broker-a's leader, where the answer goes
        producer._on_check(_check_request("PG", 3, "HALF-1"))
        await wait_until(lambda: ends, timeout_s=10)
    [end] = _traces(fake)
    assert ends[0]["transaction_id"] == end.transaction_id == end.msg_id == "HALF-1"
    assert (end.trace_type, end.group, end.topic, end.tags, end.keys, end.store_host) == (
        TraceType.END_TRANSACTION, "PG", "T", "TagH", "order-1", "127.0.0.1:10911")
    assert (end.transaction_state, end.from_transaction_check, end.msg_type) == (
        "ROLLBACK_MESSAGE", True, TraceMessageType.TRANS_COMMIT)
