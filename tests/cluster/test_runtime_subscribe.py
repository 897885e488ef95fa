"""A running push consumer's ``subscribe`` / ``unsubscribe`` and its ``allocate_strategy`` with real processes (a name
server and a 3-node group): a consumer of one topic subscribes to a second and receives what is sent to it, the
group's leader lists the new subscription at once, and after ``unsubscribe`` nothing more of the second topic
arrives while the first keeps flowing; two members with the circle strategy split a topic's queues as RocketMQ's
AllocateMessageQueueAveragelyByCircle does. Every case on the fake cluster: tests/unit/client/test_runtime_subscribe.py
and test_allocate_strategies.py."""

from __future__ import annotations

import pytest
import trio

from client import Message, MessageQueue, open_admin, open_producer, open_push_consumer
from tests.cluster.test_e2e_produce_consume import start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

FIRST, SECOND = "RuntimeSubFirst", "RuntimeSubSecond"


async def _wait_for(condition, timeout_s: float = 60.0) -> None:
    with trio.fail_after(timeout_s):  # a guard against a hang, not a measure
        while not condition():
            await trio.sleep(0.05)


async def _send(producer, topic: str, bodies: list[str]) -> None:
    for body in bodies:
        await producer.send(Message(topic, body.encode()))


@pytest.mark.timeout(240)
async def test_a_running_consumer_subscribes_to_a_second_topic_then_unsubscribes(spawn, tmp_path):
    cluster = await start_cluster(spawn, tmp_path)
    await cluster.create_topic(FIRST, 4)
    await cluster.create_topic(SECOND, 4)
    group = "runtime_sub"
    got: dict[str, list[str]] = {FIRST: [], SECOND: []}

    async def handler(msg) -> None:
        got[msg.topic].append(msg.body.decode())

    async with open_producer(cluster.namesrv) as producer, open_admin(cluster.namesrv) as admin, \
            open_push_consumer(cluster.namesrv, topic=FIRST, handler=handler, consumer_group=group,
                               persist_consumer_offset_interval_ms=200, rebalance_interval_ms=1_000) as consumer:
        await _send(producer, SECOND, ["early-1", "early-2"])  # before the subscription: skipped (from last offset)
        await _send(producer, FIRST, [f"f{i}" for i in range(5)])
        await _wait_for(lambda: len(got[FIRST]) == 5)

        await consumer.subscribe(SECOND)
        assert {mq for mq in consumer.assigned_queues() if mq.topic == SECOND} == {
            MessageQueue(SECOND, "broker-a", q) for q in range(4)}
        connection = await admin.consumer_connections(group)
        assert connection.member_subscriptions[consumer.client_id] == {
            FIRST: "*", SECOND: "*", f"%RETRY%{group}": "*"}
        await _send(producer, SECOND, [f"s{i}" for i in range(10)])
        await _send(producer, FIRST, [f"f{i}" for i in range(5, 10)])
        await _wait_for(lambda: len(got[SECOND]) == 10 and len(got[FIRST]) == 10)
        assert sorted(got[SECOND]) == sorted(f"s{i}" for i in range(10))

        await consumer.unsubscribe(SECOND)
        assert all(mq.topic == FIRST for mq in consumer.assigned_queues())
        connection = await admin.consumer_connections(group)
        assert connection.member_subscriptions[consumer.client_id] == {FIRST: "*", f"%RETRY%{group}": "*"}
        stats = await admin.consume_stats(group, topic=SECOND)
        assert sum(q.consumer_offset or 0 for q in stats.queues) == 12  # committed as the queues were dropped
        await _send(producer, SECOND, [f"late-{i}" for i in range(10)])
        await _send(producer, FIRST, [f"f{i}" for i in range(10, 20)])
        await _wait_for(lambda: len(got[FIRST]) == 20)
        await trio.sleep(2)  # two rebalances, pulls held on the broker answered meanwhile
    assert sorted(got[FIRST]) == sorted(f"f{i}" for i in range(20))
    assert sorted(got[SECOND]) == sorted(f"s{i}" for i in range(10))


@pytest.mark.timeout(240)
async def test_two_members_with_the_circle_strategy_split_the_queues_alternately(spawn, tmp_path):
    """Sorted queues 0..5 dealt to the two sorted members: the first takes 0, 2, 4, the second 1, 3, 5 (averagely
    would give 0, 1, 2 and 3, 4, 5); each consumes what is sent to its queues."""
    cluster = await start_cluster(spawn, tmp_path)
    topic, group = "CircleSplit", "circle_split"
    await cluster.create_topic(topic, 6)
    got: dict[str, list[tuple[int, str]]] = {"one": [], "two": []}

    def handler(name: str):
        async def on_message(msg) -> None:
            got[name].append((msg.queue_id, msg.body.decode()))
        return on_message

    opts = dict(consumer_group=group, allocate_strategy="AllocateMessageQueueAveragelyByCircle",
                consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=500)
    async with open_producer(cluster.namesrv) as producer, \
            open_push_consumer(cluster.namesrv, topic=topic, handler=handler("one"), **opts) as one, \
            open_push_consumer(cluster.namesrv, topic=topic, handler=handler("two"), **opts) as two:
        names = {one.client_id: "one", two.client_id: "two"}
        first, second = sorted((one, two), key=lambda c: c.client_id)
        queues = [MessageQueue(topic, "broker-a", q) for q in range(6)]
        await _wait_for(lambda: first.assigned_queues() == queues[0::2] and second.assigned_queues() == queues[1::2])
        for q in range(6):
            for i in range(3):
                await producer.send(Message(topic, f"q{q}-{i}".encode()), queue=queues[q])
        await _wait_for(lambda: len(got["one"]) + len(got["two"]) == 18)
        assert first.assigned_queues() == queues[0::2] and second.assigned_queues() == queues[1::2]
    assert {q for q, _ in got[names[first.client_id]]} == {0, 2, 4}
    assert {q for q, _ in got[names[second.client_id]]} == {1, 3, 5}
    assert sorted(body for share in got.values() for _, body in share) == sorted(
        f"q{q}-{i}" for q in range(6) for i in range(3))
