"""Request-reply (RocketMQ 4.6's DefaultMQProducer.request) against a broker node (a single-member group) and a name
server in-process: a push consumer answers each request with ``create_reply_message``, the broker stores the reply
in the cluster's reply topic and pushes it to the requester, whose waiting request it completes."""

from __future__ import annotations

import logging

import cbor2
import pytest
import trio

from client import Message, MessageExt, open_admin, open_producer, open_push_consumer
from client.errors import ReplyTimeoutError
from client.message import create_reply_message
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import call, start_leading_node

REPLY_TOPIC = "DefaultCluster_REPLY_TOPIC"


async def _create(namesrv: str, *topics: str) -> None:
    async with open_admin(namesrv) as admin:
        for topic in topics:
            await admin.create_topic(topic, read_queue_nums=4, write_queue_nums=4)


async def test_concurrent_requests_each_get_their_own_reply(nursery, tmp_path):
    namesrv, addr = await start_leading_node(nursery, tmp_path)
    await _create(namesrv, "Rpc")
    served: list[MessageExt] = []
    async with open_producer(namesrv, producer_group="rpc_replier") as replier:

        async def on_request(msg: MessageExt) -> None:
            served.append(msg)
            await replier.send(create_reply_message(msg, b"re:" + msg.body))

        async with open_push_consumer(namesrv, topic="Rpc", handler=on_request, consumer_group="rpc_server",
                                      broker_suspend_max_time_ms=300), \
                open_producer(namesrv, producer_group="rpc_requester") as requester:
            replies: dict[int, MessageExt] = {}

            async def ask(i: int) -> None:
                replies[i] = await requester.request(Message("Rpc", b"q%d" % i), timeout_s=20)

            async with trio.open_nursery() as asking:
                for i in range(10):
                    asking.start_soon(ask, i)
            assert len(requester._pending) == 0
    assert {i: reply.body for i, reply in replies.items()} == {i: b"re:q%d" % i for i in range(10)}
    requests = {msg.properties["CORRELATION_ID"]: msg for msg in served}
    assert len(requests) == 10  # every request had its own correlation id
    for i, reply in replies.items():
        request = requests[reply.properties["CORRELATION_ID"]]
        assert request.body == b"q%d" % i
        assert request.properties["REPLY_TO_CLIENT"] == reply.properties["REPLY_TO_CLIENT"] == requester.client_id
        assert request.properties["CLUSTER"] == "DefaultCluster"
        assert request.properties["TTL"] == reply.properties["TTL"] == "20000"
        assert reply.properties["MSG_TYPE"] == "reply" and "ARRIVE_TIME" in reply.properties
        assert reply.topic == REPLY_TOPIC and reply.broker_name == "broker-a"
    # The replies were stored in the reply topic too (storeReplyMessageEnable), as any message.
    async with open_remoting_client() as client:
        frame = await call(client, addr, RequestCode.GET_MAX_OFFSET, {"topic": REPLY_TOPIC, "queue_id": 0})
    assert frame.code == ResponseCode.SUCCESS and frame.ext["offset"] == 10


async def test_a_request_to_a_topic_not_created_yet_learns_its_cluster_and_is_answered(nursery, tmp_path):
    """A topic no name server knows is routed to every group by a stand-in route that names no cluster (as a send
    auto-creates it): the cluster comes from the name servers' cluster table."""
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    async with open_producer(namesrv, producer_group="fresh_replier") as replier:

        async def on_request(msg: MessageExt) -> None:
            await replier.send(create_reply_message(msg, msg.properties["CLUSTER"].encode()))

        async with open_push_consumer(namesrv, topic="Fresh", handler=on_request, consumer_group="fresh_server",
                                      consume_from_where="CONSUME_FROM_FIRST_OFFSET", broker_suspend_max_time_ms=300,
                                      poll_name_server_interval_ms=100), \
                open_producer(namesrv, producer_group="fresh_requester") as requester:
            assert requester.routes.cached("Fresh") is None
            reply = await requester.request(Message("Fresh", b"first"), timeout_s=30)
    assert reply.body == b"DefaultCluster" and reply.topic == REPLY_TOPIC


async def test_a_request_nobody_answers_times_out_and_leaves_nothing_waiting(nursery, tmp_path):
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    await _create(namesrv, "Unanswered")
    async with open_producer(namesrv, producer_group="lonely_requester") as requester:
        with pytest.raises(ReplyTimeoutError) as caught:
            await requester.request(Message("Unanswered", b"anyone?"), timeout_s=0.5)
        assert len(requester._pending) == 0
        error = caught.value
        assert error.topic == "Unanswered" and error.timeout_s == 0.5 and not error.retriable
        assert "no reply came within 0.5 s" in str(error) and error.correlation_id in str(error)
        # A request given up by its caller (cancelled) leaves nothing either.
        with trio.move_on_after(0.3):
            await requester.request(Message("Unanswered", b"never mind"), timeout_s=10)
        assert len(requester._pending) == 0


async def test_a_reply_after_the_timeout_is_dropped_without_error(nursery, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="client.producer")
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    await _create(namesrv, "Slow")
    sent_late: list[object] = []
    async with open_producer(namesrv, producer_group="slow_replier") as replier:

        async def on_request(msg: MessageExt) -> None:
            if msg.body == b"slow":
                await trio.sleep(1.5)  # past the requester's 1 s
            sent_late.append(await replier.send(create_reply_message(msg, b"late:" + msg.body)))

        async with open_push_consumer(namesrv, topic="Slow", handler=on_request, consumer_group="slow_server",
                                      broker_suspend_max_time_ms=300), \
                open_producer(namesrv, producer_group="impatient_requester") as requester:
            with pytest.raises(ReplyTimeoutError):
                await requester.request(Message("Slow", b"slow"), timeout_s=1)
            with trio.fail_after(15):
                while not sent_late:
                    await trio.sleep(0.05)
            # The late reply was pushed and taken (the replier's send succeeded), then dropped.
            assert sent_late[0].queue_offset == 0
            assert any("reply dropped" in r.getMessage() for r in caplog.records)
            assert len(requester._pending) == 0
            # The producer goes on answering requests.
            reply = await requester.request(Message("Slow", b"quick"), timeout_s=15)
            assert reply.body == b"late:quick"


async def test_the_broker_refuses_what_is_no_reply_and_reports_a_requester_it_cannot_reach(nursery, tmp_path):
    namesrv, addr = await start_leading_node(nursery, tmp_path)

    def reply_ext(topic: str = REPLY_TOPIC, **properties: str) -> dict:
        props = {"REPLY_TO_CLIENT": "10.0.0.9@1#gone#DEFAULT#1", "CORRELATION_ID": "c-1", "MSG_TYPE": "reply"}
        props.update(properties)
        return {"producer_group": "replier", "topic": topic, "queue_id": -1, "born_timestamp": 1, "flag": 0,
                "properties": {k: v for k, v in props.items() if v}}

    async with open_remoting_client() as client:
        # The leader created the cluster's reply topic as it started (RocketMQ's brokers do too).
        with trio.fail_after(10):
            while True:
                frame = await call(client, addr, RequestCode.GET_ALL_TOPIC_CONFIG)
                configs = cbor2.loads(frame.body)["topic_configs"]
                if REPLY_TOPIC in configs:
                    break
                await trio.sleep(0.05)
        assert configs[REPLY_TOPIC]["read_queue_nums"] == configs[REPLY_TOPIC]["write_queue_nums"] == 1

        gone = await call(client, addr, RequestCode.SEND_REPLY_MESSAGE, reply_ext(), b"answer")
        assert gone.code == ResponseCode.SYSTEM_ERROR
        assert gone.remark == "push reply message fail, channel of <10.0.0.9@1#gone#DEFAULT#1> not found."
        assert gone.ext["queue_offset"] == 0  # stored all the same, as RocketMQ stores it

        other = await call(client, addr, RequestCode.SEND_REPLY_MESSAGE_V2, reply_ext("Elsewhere_REPLY_TOPIC"), b"x")
        assert other.code == ResponseCode.TOPIC_NOT_EXIST and "DefaultCluster_REPLY_TOPIC" in other.remark
        for missing in ("REPLY_TO_CLIENT", "CORRELATION_ID"):
            frame = await call(client, addr, RequestCode.SEND_REPLY_MESSAGE, reply_ext(**{missing: ""}), b"x")
            assert frame.code == ResponseCode.INVALID_REQUEST and frame.ext["field"] == "properties"
            assert missing in frame.remark
        delayed = await call(client, addr, RequestCode.SEND_REPLY_MESSAGE, reply_ext(DELAY="2"), b"x")
        assert delayed.code == ResponseCode.INVALID_REQUEST and "DELAY" in delayed.remark
        frame = await call(client, addr, RequestCode.GET_MAX_OFFSET, {"topic": REPLY_TOPIC, "queue_id": 0})
        assert frame.ext["offset"] == 1  # nothing refused was stored
