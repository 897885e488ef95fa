"""A simple consumer one of whose subscribed topics an admin deletes receives its other topics (an in-process name
server and broker): the broker refuses the deleted topic's POPs (TOPIC_NOT_EXIST, not retriable), and every receive
raised that, for good, never reaching the other topic (client/simple_consumer.py)."""

from __future__ import annotations

from client import Message, open_admin, open_producer, open_simple_consumer
from remoting.errors import RaftMQError
from tests.integration.broker.helpers import start_leading_node


async def test_receives_go_on_with_the_other_topic_after_a_subscribed_topic_is_deleted(nursery, tmp_path):
    namesrv, _addr = await start_leading_node(nursery, tmp_path)
    async with open_admin(namesrv) as admin:
        for topic in ("DelA", "DelB"):
            assert await admin.create_topic(topic, read_queue_nums=1, write_queue_nums=1) is not None
        await admin.update_subscription_group("del_g")
    async with open_simple_consumer(namesrv, consumer_group="del_g", subscriptions={"DelA": "*", "DelB": "*"},
                                    await_duration_ms=300, consume_from_where="CONSUME_FROM_FIRST_OFFSET") as consumer:
        assert await consumer.receive(8) == []
        async with open_admin(namesrv) as admin:
            assert await admin.delete_topic("DelA") == ["broker-a"]
        async with open_producer(namesrv) as producer:
            for i in range(5):
                await producer.send(Message("DelB", f"b{i}".encode()))
        got: list[bytes] = []
        errors: list[RaftMQError] = []
        for _ in range(8):  # on after B's messages came too: in turn, each topic is asked first in every other
            try:
                msgs = await consumer.receive(8)
            except RaftMQError as e:
                errors.append(e)
                continue
            for msg in msgs:
                await consumer.ack(msg)
            got += [msg.body for msg in msgs]
        assert errors == []
        assert sorted(got) == [f"b{i}".encode() for i in range(5)]
