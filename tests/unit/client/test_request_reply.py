"""The pure parts of request-reply: ``create_reply_message`` (RocketMQ's MessageUtil.createReplyMessage), the
producer's table of requests waiting for replies, reading a pushed reply, and the client's and the broker's
lookups that route a reply to its requester."""

from __future__ import annotations

import zlib

import itertools

import pytest
import trio
import trio.testing

from broker.consumer_manager import ClientManager, parse_heartbeat
from client.errors import TooManyRequestsError
from client.instance import ServerRequests
from client.message import Message, MessageExt, create_reply_message, is_reply_message
from client.producer import PendingRequests, read_reply
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.message import COMPRESSED_FLAG, MessageInput, encode_record, record_size

REQUEST_PROPS = {"CLUSTER": "DefaultCluster", "REPLY_TO_CLIENT": "10.0.0.1@7#x#DEFAULT#1",
                 "CORRELATION_ID": "3f1c-uuid", "TTL": "3000", "UNIQ_KEY": "ABC", "TAGS": "T"}


def _request(properties=REQUEST_PROPS) -> MessageExt:
    return MessageExt("Rpc", b"question", 0, 5, "broker-a", dict(properties), 100, 1, 2, ("10.0.0.2", 10911))


def test_a_reply_goes_to_the_requests_cluster_reply_topic_with_its_correlation():
    reply = create_reply_message(_request(), b"answer")
    assert reply.topic == "DefaultCluster_REPLY_TOPIC" and reply.body == b"answer"
    # Copied: what routes and matches the reply; not copied: the request's own id, tags and cluster.
    assert reply.properties == {"REPLY_TO_CLIENT": "10.0.0.1@7#x#DEFAULT#1", "CORRELATION_ID": "3f1c-uuid",
                                "TTL": "3000", "MSG_TYPE": "reply"}
    assert is_reply_message(reply) and not is_reply_message(Message("Rpc", b"q"))
    # A Message (not consumed, e.g. built by hand from a request's properties) does as well; TTL is optional.
    props = {k: v for k, v in REQUEST_PROPS.items() if k not in ("TTL", "TAGS", "UNIQ_KEY")}
    assert "TTL" not in create_reply_message(Message("Rpc", b"q", properties=props), b"a").properties


@pytest.mark.parametrize("missing", ["CLUSTER", "REPLY_TO_CLIENT", "CORRELATION_ID"])
def test_a_message_that_is_no_request_gets_no_reply(missing):
    props = {k: v for k, v in REQUEST_PROPS.items() if k != missing}
    with pytest.raises(ValueError, match=f"no {missing} property"):
        create_reply_message(_request(props), b"answer")


def test_create_reply_message_refuses_what_cannot_be_a_reply():
    with pytest.raises(TypeError, match="request message"):
        create_reply_message(None, b"answer")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="body must be bytes"):
        create_reply_message(_request(), "answer")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no usable reply topic"):
        create_reply_message(_request({**REQUEST_PROPS, "CLUSTER": "c" * 120}), b"answer")


async def test_a_reply_completes_the_request_waiting_for_it_and_only_once():
    table = PendingRequests(8)
    got = []
    reply = create_reply_message(_request(), b"answer")

    async def wait(correlation_id):
        with table.expect(correlation_id) as pending:
            got.append((correlation_id, await pending.wait()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, "a")
        nursery.start_soon(wait, "b")
        await trio.testing.wait_all_tasks_blocked()
        assert len(table) == 2 and "a" in table
        assert table.complete("b", reply)
        assert not table.complete("b", reply)  # a second copy (a replier's retry) finds nothing waiting
        assert table.complete("a", reply)
    assert sorted(cid for cid, _ in got) == ["a", "b"] and len(table) == 0
    assert not table.complete("a", reply)  # late: dropped


async def test_a_timed_out_cancelled_or_failed_request_leaves_nothing_behind():
    table = PendingRequests(8)
    with trio.move_on_after(0.01) as scope:
        with table.expect("timed-out") as pending:
            await pending.wait()
    assert scope.cancelled_caught and len(table) == 0
    with pytest.raises(RuntimeError):
        with table.expect("send-failed"):
            raise RuntimeError("the send failed")
    assert len(table) == 0
    async with trio.open_nursery() as nursery:
        async def wait():
            with table.expect("cancelled") as pending:
                await pending.wait()
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert "cancelled" in table
        nursery.cancel_scope.cancel()
    assert len(table) == 0


def test_the_table_is_bounded_and_correlation_ids_unique():
    table = PendingRequests(2)
    with table.expect("a"), table.expect("b"):
        with pytest.raises(TooManyRequestsError, match="max_pending_requests 2") as caught:
            with table.expect("c"):
                pass
        assert caught.value.retriable and caught.value.max_pending == 2
        assert len(table) == 2 and "c" not in table
    table = PendingRequests(4)
    with table.expect("a"):
        with pytest.raises(ValueError, match="already waiting"):
            with table.expect("a"):
                pass
        assert "a" in table  # the first one still waits
    assert len(table) == 0


def _record(body: bytes, properties: dict[str, str], sys_flag: int = 0) -> bytes:
    message = MessageInput("DefaultCluster_REPLY_TOPIC", 0, body, properties, sys_flag=sys_flag, born_timestamp=7)
    buf = bytearray(record_size(len(body), 26, 200))
    size = encode_record(buf, 0, message, queue_offset=3, phy_offset=4096, store_timestamp=9,
                         store_host=("10.0.0.3", 10911))
    return bytes(buf[:size])


def test_a_pushed_reply_reads_as_the_stored_message():
    props = {"CORRELATION_ID": "c-1", "MSG_TYPE": "reply", "UNIQ_KEY": "U1"}
    reply = read_reply({"broker_name": "broker-a"}, _record(zlib.compress(b"answer" * 100), props, COMPRESSED_FLAG))
    assert reply.body == b"answer" * 100 and reply.sys_flag == 0  # inflated as a consumer's
    assert (reply.topic, reply.queue_id, reply.queue_offset, reply.phy_offset) == ("DefaultCluster_REPLY_TOPIC", 0,
                                                                                     3, 4096)
    assert reply.broker_name == "broker-a" and reply.msg_id == "U1" and reply.store_timestamp == 9
    assert reply.properties["CORRELATION_ID"] == "c-1" and int(reply.properties["ARRIVE_TIME"]) > 0
    with pytest.raises(ValueError, match="broker_name"):
        read_reply({}, _record(b"x", props))
    with pytest.raises(ValueError, match="not a reply record"):
        read_reply({"broker_name": "broker-a"}, b"garbage")
    with pytest.raises(ValueError, match="no CORRELATION_ID"):
        read_reply({"broker_name": "broker-a"}, _record(b"x", {"MSG_TYPE": "reply"}))


async def test_a_reply_push_reaches_the_producer_hook_and_only_a_producer_takes_it():
    requests = ServerRequests()
    push = make_request(RequestCode.PUSH_REPLY_MESSAGE_TO_CLIENT, ext={"broker_name": "broker-a"}, body=b"r")
    answer = await requests.handle(push, None)
    assert answer.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED and "no producer" in answer.remark
    seen = []
    requests.on_reply_message = lambda frame: seen.append(frame) or None
    assert (await requests.handle(push, None)).code == ResponseCode.SUCCESS and seen == [push]
    requests.on_reply_message = lambda frame: "malformed reply: no record"
    answer = await requests.handle(push, None)
    assert answer.code == ResponseCode.INVALID_REQUEST and answer.remark == "malformed reply: no record"


class _Conn:
    closed = False


def test_the_broker_finds_a_requesters_connection_by_its_client_id():
    clients = ClientManager(clock=itertools.count().__next__)  # every heartbeat later than the one before
    old, new, other = _Conn(), _Conn(), _Conn()
    clients.heartbeat(parse_heartbeat({"client_id": "req-1", "producers": [{"producer_group": "pg1"}]}), old)
    clients.heartbeat(parse_heartbeat({"client_id": "req-2", "producers": [{"producer_group": "pg1"}]}), other)
    assert clients.find_producer_connection("req-1") is old
    clients.heartbeat(parse_heartbeat({"client_id": "req-1", "producers": [{"producer_group": "pg2"}]}), new)
    assert clients.find_producer_connection("req-1") is new  # the latest heartbeat's connection
    new.closed = True
    assert clients.find_producer_connection("req-1") is old
    clients.connection_closed(old)
    assert clients.find_producer_connection("req-1") is None  # gone
    assert clients.find_producer_connection("nobody") is None
    # A consumer's heartbeat alone does not make a requester (only producers send requests).
    clients.heartbeat(parse_heartbeat({"client_id": "cons", "consumers": [{"consumer_group": "cg"}]}), _Conn())
    assert clients.find_producer_connection("cons") is None


@pytest.fixture
def fake_producer_cluster(monkeypatch):
    import client.producer
    from tests.unit.client.fake_cluster import FakeGroup, FakeRemoting, fake_remoting_ctx

    fake = FakeRemoting([FakeGroup("broker-a", ["a:1", "a:2", "a:3"])])
    monkeypatch.setattr(client.producer, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    return fake


async def test_a_requests_timeout_bounds_its_route_fetches_and_a_reply_outlives_a_failed_send(
        fake_producer_cluster, autojump_clock):
    """Found by review: the route fetches and heartbeats before the send ran without bound, so a request given 1 s
    took as long as a slow leader made them; and a send that failed after an attempt stored the request (its answer
    lost) raised although the reply had come. Now the first raises ReplyTimeoutError at the deadline, the second
    returns the reply."""
    from client import open_producer
    from client.errors import ReplyTimeoutError, SendFailedError
    from tests.unit.client.fake_cluster import NAMESRV

    async with open_producer(NAMESRV) as producer:
        async def slow_prepare(topic):
            await trio.sleep(3600)

        producer._prepare_request = slow_prepare
        started = trio.current_time()
        with pytest.raises(ReplyTimeoutError, match="not sent: its 1 s went by"):
            await producer.request(Message("Rpc", b"q"), timeout_s=1)
        assert trio.current_time() - started == pytest.approx(1)
        assert not producer._pending._waiting

        async def prepared(topic):
            return "DefaultCluster", None

        reply = _request()

        async def stored_then_failed(topic, code, ext, body_for, uniqs, queue, key, timeout):
            (correlation_id,) = producer._pending._waiting  # the one request waiting
            producer._pending.complete(correlation_id, reply)
            raise SendFailedError("the answer of the attempt that stored it was lost", topic=topic, attempts=3,
                                  last_error=TimeoutError())

        producer._prepare_request = prepared
        producer._send_with_retries = stored_then_failed
        assert await producer.request(Message("Rpc", b"q"), timeout_s=1) is reply
