"""The SendResult of a delayed or timer send, against a broker node and a name server in-process: it names the
topic's queue the message was sent to (the broker answers the schedule queue it waits in, as RocketMQ's answers the
request's queue id), with the offset in that schedule queue."""

from __future__ import annotations

from client import Message, MessageQueue, open_producer
from remoting.codes import RequestCode
from remoting.message import decode_record
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import call, start_leading_node

TOPIC = "QT"


async def test_a_delayed_or_timer_send_names_the_topics_queue_it_was_sent_to(nursery, tmp_path):
    namesrv, addr = await start_leading_node(nursery, tmp_path, message_delay_level="1s 2s 5s 10s 30s 1m")
    async with open_producer(namesrv, producer_group="pq") as producer:
        plain = await producer.send(Message(TOPIC, b"warm"))  # creates the topic, 4 queues
        queues = await producer.fetch_publish_queues(TOPIC)
        assert sorted(q.queue_id for q in queues) == [0, 1, 2, 3] and plain.message_queue in queues
        pinned = MessageQueue(TOPIC, plain.message_queue.broker_name, 1)
        results = {}
        for level in (5, 6):  # schedule queues 4 and 5: no queue of the topic
            results[f"level {level}"] = await producer.send(Message(TOPIC, b"x", delay_level=level))
            results[f"pinned level {level}"] = await producer.send(Message(TOPIC, b"x", delay_level=level),
                                                                   queue=pinned)
        results["timer"] = await producer.send(Message(TOPIC, b"x", delay_ms=40_000))  # waits in the 30 s level
        for name, result in results.items():
            assert result.message_queue in queues, (name, result.message_queue)
        for level in (5, 6):
            assert results[f"pinned level {level}"].message_queue == pinned
            # The offset is the one in the schedule queue: the level's second message.
            assert results[f"pinned level {level}"].queue_offset == 1, results[f"pinned level {level}"]
        async with open_remoting_client() as client:
            for name, result in results.items():
                stored = decode_record((await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID,
                                                   {"msg_id": result.offset_msg_id})).body)
                assert stored.topic == "SCHEDULE_TOPIC_XXXX", name
                assert stored.properties["REAL_QID"] == str(result.message_queue.queue_id), name
                assert stored.queue_offset == result.queue_offset, name
