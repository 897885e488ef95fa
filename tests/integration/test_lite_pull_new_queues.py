"""A subscribe-mode lite pull consumer from its last offset (the default), a broker node and a name server
in-process: the queues of a topic created after it subscribed, and queues added to its topic later, are consumed
from their first message, as the push consumer's (the broker answers QUERY_NOT_FOUND for a group's first offset
query, so nothing but the consumer's own rule starts them there)."""

from __future__ import annotations

import trio

from client import Message, MessageQueue, open_admin, open_lite_pull_consumer, open_producer
from tests.integration.broker.helpers import start_leading_node

# Rebalances and route refreshes every 200 ms: a new queue is found soon after it appears.
SOON = dict(rebalance_interval_ms=200, poll_name_server_interval_ms=200)


async def _poll(consumer, n: int) -> list[bytes]:
    got: list[bytes] = []
    with trio.fail_after(20):  # a lost message fails the test, it does not hang it
        while len(got) < n:
            got += [m.body for m in await consumer.poll(timeout_s=1)]
    return got


async def test_messages_sent_to_a_topic_created_after_subscribing_are_all_consumed(nursery, tmp_path):
    """Found by review: 0 of 20 were consumed (the push consumer got 20 of 20)."""
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    async with open_lite_pull_consumer(namesrv, consumer_group="lite_new_topic", **SOON) as consumer:
        await consumer.subscribe("LiteNewTopic", "*")
        assert consumer.assignment() == set()  # no name server knows the topic yet
        async with open_producer(namesrv) as producer:  # its first send creates it
            for i in range(20):
                await producer.send(Message("LiteNewTopic", b"m%d" % i))
        got = await _poll(consumer, 20)
        assert sorted(got) == sorted(b"m%d" % i for i in range(20))


async def test_messages_sent_to_queues_added_after_subscribing_are_all_consumed(nursery, tmp_path):
    """Found by review: the topic grew from 2 to 4 queues, and 0 of the 10 messages sent to the new ones were
    consumed. The old queues still start at their last offset: their backlog is skipped."""
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    async with open_admin(namesrv) as admin, open_producer(namesrv) as producer:
        await admin.create_topic("LiteGrows", read_queue_nums=2, write_queue_nums=2)
        for q in (0, 1):
            await producer.send(Message("LiteGrows", b"backlog-%d" % q), queue=MessageQueue("LiteGrows", "broker-a", q))
        async with open_lite_pull_consumer(namesrv, consumer_group="lite_grows", **SOON) as consumer:
            await consumer.subscribe("LiteGrows", "*")
            assert len(consumer.assignment()) == 2
            await admin.create_topic("LiteGrows", read_queue_nums=4, write_queue_nums=4)
            sent = []
            for q in (2, 3):
                for i in range(5):
                    sent.append(b"q%d-%d" % (q, i))
                    await producer.send(Message("LiteGrows", sent[-1]), queue=MessageQueue("LiteGrows", "broker-a", q))
            got = await _poll(consumer, 10)
            assert sorted(got) == sorted(sent)
            assert len(consumer.assignment()) == 4
