"""The producer's timer messages (``Message(deliver_time_ms=...)`` / ``delay_ms``) against a broker node and a name
server in-process: sent as RocketMQ's property on every single-send path (auto-batching sends them alone), refused
in a batch and in a transaction, and the broker's refusal of a time too far ahead reaches the caller."""

from __future__ import annotations

import time

import cbor2
import pytest
import trio

from client import Message, open_producer
from remoting.codes import RequestCode
from remoting.errors import RaftMQError
from remoting.message import decode_record
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import call, start_leading_node
from tests.integration.test_transaction_producer import Listener

TOPIC = "TimerOrders"


async def _stored(addr: str, offset_msg_id: str):
    async with open_remoting_client() as client:
        return decode_record((await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID,
                                         {"msg_id": offset_msg_id})).body)


async def test_timer_messages_are_sent_as_the_property_alone_and_refused_in_batches_and_transactions(nursery,
                                                                                                   tmp_path):
    namesrv, addr = await start_leading_node(nursery, tmp_path, message_delay_level="300ms 600ms 1s")
    async with open_producer(namesrv, auto_batch=True) as producer:
        deliver_ms = int(time.time() * 1000) + 60_000
        results = {}

        async def send(name: str, message: Message) -> None:
            results[name] = await producer.send(message)

        async with trio.open_nursery() as senders:  # concurrent sends: auto-batching takes the plain ones
            for i in range(8):
                senders.start_soon(send, f"plain-{i}", Message(TOPIC, b"plain"))
            senders.start_soon(send, "at", Message(TOPIC, b"at", keys="k-at", deliver_time_ms=deliver_ms))
            senders.start_soon(send, "in", Message(TOPIC, b"in", properties={"c": "1"}, delay_ms=2500))
        at = await _stored(addr, results["at"].offset_msg_id)
        assert (at.topic, at.queue_id, at.body) == ("SCHEDULE_TOPIC_XXXX", 2, b"at")  # waits in the 1 s level
        assert at.properties["TIMER_DELIVER_MS"] == str(deliver_ms) and at.properties["KEYS"] == "k-at"
        assert at.properties["UNIQ_KEY"] == results["at"].msg_id
        relative = await _stored(addr, results["in"].offset_msg_id)
        assert relative.topic == "SCHEDULE_TOPIC_XXXX" and relative.properties["c"] == "1"
        assert int(relative.properties["TIMER_DELIVER_MS"]) >= int(time.time() * 1000) + 2500 - 1000
        assert (await _stored(addr, results["plain-0"].offset_msg_id)).topic == TOPIC
        # Oneway too: the property travels in the request's properties, as any.
        await producer.send_oneway(Message(TOPIC, b"ow", delay_ms=700))
        async with open_remoting_client() as client:
            with trio.fail_after(5):  # in the 600 ms level, where no other message goes
                while cbor2.loads((await call(client, addr, RequestCode.GET_ALL_DELAY_OFFSET, {})).body)[
                        "levels"][1]["max_offset"] < 1:
                    await trio.sleep(0.05)

        with pytest.raises(ValueError, match=r"send_batch: messages\[1\]: .*TIMER_DELAY_MS.*not in a batch"):
            await producer.send_batch([Message(TOPIC, b"a"), Message(TOPIC, b"b", delay_ms=1000)])
        with pytest.raises(RaftMQError, match="259200000 ms"):
            await producer.send(Message(TOPIC, b"far", deliver_time_ms=int(time.time() * 1000) + 4 * 86_400_000))
    listener = Listener()
    async with open_producer(namesrv, transaction_listener=listener) as producer:
        for message in (Message(TOPIC, b"x", keys="commit-1", delay_ms=1000),
                        Message(TOPIC, b"x", keys="commit-1", properties={"TIMER_DELAY_SEC": "5"})):
            with pytest.raises(ValueError, match="send_in_transaction: the message has a delivery time .*may not be "
                                                 "delayed"):
                await producer.send_in_transaction(message)
        assert listener.executed == []
