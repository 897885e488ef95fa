"""The rest of the client surface against real processes, on one cluster: admin (topics, routes, cluster info),
send_batch and send_oneway, the pull consumer with a tag filter, the push consumer's start positions, a topic
deleted and created again, and a topic change served by every node once it has applied it."""

from __future__ import annotations

import time

import cbor2
import pytest
import trio

from client import (ClientError, Message, MessageQueue, PullStatus, open_admin, open_producer, open_pull_consumer,
                    open_push_consumer)
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.cluster.test_e2e_produce_consume import start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


async def _drain(consumer, want: int, timeout_s: float = 15.0) -> list:
    got = []
    with trio.move_on_after(timeout_s):
        async for msg in consumer:
            got.append(msg)
            if len(got) >= want:
                break
    return got


@pytest.mark.timeout(180)
async def test_admin_batch_oneway_pull_tags_and_start_positions(spawn, tmp_path):
    cluster = await start_cluster(spawn, tmp_path)
    topic = "ApiTopic"
    await cluster.create_topic(topic, 4)

    async with open_admin(cluster.namesrv) as admin:
        info = await admin.cluster_info()
        assert info.clusters == {"DefaultCluster": ("broker-a",)}
        assert info.master_addr("broker-a") == await cluster.leader_addr()
        route = await admin.get_route(topic)
        assert [(q.broker_name, q.write_queue_nums) for q in route.queue_datas] == [("broker-a", 4)]
        assert topic in await admin.list_topics()
        with pytest.raises(ClientError, match="cluster 'NoSuchCluster' is not known"):
            await admin.create_topic("Other", cluster="NoSuchCluster")

    mq = MessageQueue(topic, "broker-a", 1)
    async with open_producer(cluster.namesrv) as producer:
        batch = [Message(topic, b"b%d" % i, tags="TagA" if i % 2 else "TagB", keys=f"key{i}") for i in range(10)]
        r = await producer.send_batch(batch, queue=mq)
        assert r.message_queue == mq and r.queue_offset == 0 and len(r.msg_ids) == 10
        await producer.send_oneway(Message(topic, b"oneway", tags="TagC"), queue=mq)
        await producer.send(Message(topic, b"after", tags="TagA"), queue=mq)

    async with open_pull_consumer(cluster.namesrv, consumer_group="api_pull") as puller:
        with trio.fail_after(10):  # a oneway send has no answer: wait until it is stored
            while await puller.max_offset(mq) < 12:
                await trio.sleep(0.05)

    async with open_pull_consumer(cluster.namesrv, consumer_group="api_pull") as puller:
        assert mq in await puller.fetch_queues(topic)
        assert await puller.min_offset(mq) == 0 and await puller.max_offset(mq) == 12
        res = await puller.pull(mq, 0, 32, expression="TagA || TagC")
        assert res.status is PullStatus.FOUND
        assert [m.body for m in res.messages][:5] == [b"b1", b"b3", b"b5", b"b7", b"b9"]
        assert sorted(m.body for m in res.messages[5:]) == [b"after", b"oneway"]
        assert res.messages[0].keys == ["key1"] and res.messages[0].msg_id == r.msg_ids[1]
        end = await puller.pull(mq, 12, 32)
        assert end.status is PullStatus.NO_NEW_MSG and end.next_begin_offset == 12
        assert await puller.committed_offset(mq) is None
        await puller.commit(mq, 7)
        assert await puller.committed_offset(mq) == 7

    # Start positions of a new group: LAST skips the backlog, FIRST replays it, TIMESTAMP starts at a time.
    opts = dict(rebalance_interval_ms=300, broker_suspend_max_time_ms=500)
    async with open_push_consumer(cluster.namesrv, topic=topic, consumer_group="from_last",
                                  consume_from_where="CONSUME_FROM_LAST_OFFSET", **opts) as last, \
            open_push_consumer(cluster.namesrv, topic=topic, consumer_group="from_first", expression="TagB",
                               consume_from_where="CONSUME_FROM_FIRST_OFFSET", **opts) as first:
        await trio.sleep(1)  # both have their queues and start offsets before the new message exists
        mark_ms = int(time.time() * 1000)
        await trio.sleep(0.05)
        async with open_producer(cluster.namesrv) as producer:
            await producer.send(Message(topic, b"new", tags="TagB"), queue=mq)
        assert [m.body for m in await _drain(last, 1)] == [b"new"]
        assert [m.body for m in await _drain(first, 6)] == [b"b0", b"b2", b"b4", b"b6", b"b8", b"new"]
    async with open_push_consumer(cluster.namesrv, topic=topic, consumer_group="from_time",
                                  consume_from_where="CONSUME_FROM_TIMESTAMP", consume_timestamp_ms=mark_ms,
                                  **opts) as timed:
        assert [m.body for m in await _drain(timed, 1)] == [b"new"]

    async with open_admin(cluster.namesrv) as admin:
        await admin.delete_topic(topic)
        with trio.fail_after(10):
            while topic in await admin.list_topics():
                await trio.sleep(0.1)


async def _queue_bounds(client, addr: str, topic: str, queues: int) -> list[tuple[int, int]] | None:
    """(min, max) offset of each queue as the node at ``addr`` serves them; None while it does not know the topic."""
    out = []
    for q in range(queues):
        pair = []
        for code in (RequestCode.GET_MIN_OFFSET, RequestCode.GET_MAX_OFFSET):
            r = await client.invoke(addr, make_request(code, ext={"topic": topic, "queue_id": q}), timeout_s=5)
            if r.code != ResponseCode.SUCCESS:
                return None
            pair.append(r.ext["offset"])
        out.append(tuple(pair))
    return out


@pytest.mark.timeout(180)
async def test_a_deleted_topic_created_again_is_empty_on_every_node(spawn, tmp_path):
    """RocketMQ's deleteTopic removes the messages, not only the config: a topic created again under the same
    name serves none of the old ones, on the leader and on the followers (one restarted by kill -9 after the
    delete), while queue offsets go on from where they were."""
    cluster = await start_cluster(spawn, tmp_path)
    topic = "DoomedTopic"
    await cluster.create_topic(topic, 2)
    async with open_producer(cluster.namesrv) as producer:
        for i in range(20):
            await producer.send(Message(topic, b"old%d" % i), queue=MessageQueue(topic, "broker-a", i % 2))
    async with open_admin(cluster.namesrv) as admin:
        await admin.delete_topic(topic)
    await cluster.create_topic(topic, 2)

    leader = await cluster.leader_addr()
    follower = next(nid for nid, addr in cluster.addr_of.items() if addr != leader)
    await trio.to_thread.run_sync(cluster.nodes[follower].kill)
    await trio.to_thread.run_sync(cluster.start, follower)
    async with open_remoting_client() as client:
        for addr in cluster.addr_of.values():
            bounds = None
            with trio.move_on_after(30):  # a restarted follower serves once it has caught up
                while (bounds := await _queue_bounds(client, addr, topic, 2)) != [(10, 10), (10, 10)]:
                    await trio.sleep(0.1)
            assert bounds == [(10, 10), (10, 10)], f"{addr} serves (min, max) {bounds} for the queues"

    async with open_producer(cluster.namesrv) as producer:
        for i in range(4):
            r = await producer.send(Message(topic, b"new%d" % i), queue=MessageQueue(topic, "broker-a", i % 2))
            assert r.queue_offset == 10 + i // 2
    async with open_push_consumer(cluster.namesrv, topic=topic, consumer_group="after_delete",
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=300,
                                  broker_suspend_max_time_ms=500) as consumer:
        got = await _drain(consumer, 5, timeout_s=5)  # one more than exists: nothing old may follow
    assert sorted(m.body for m in got) == [b"new0", b"new1", b"new2", b"new3"]
    async with open_pull_consumer(cluster.namesrv, consumer_group="after_delete_pull") as puller:
        mq = MessageQueue(topic, "broker-a", 0)
        assert await puller.min_offset(mq) == 10
        res = await puller.pull(mq, 0, 32)
        assert res.status is not PullStatus.FOUND and res.next_begin_offset == 10


@pytest.mark.timeout(180)
async def test_a_node_serves_a_topic_change_from_the_moment_it_applies_it(spawn, tmp_path):
    """A topic gains queues, three times; each follower serves a pull of its last new queue as soon as it has
    applied the change (was: INVALID_REQUEST "must be below topic 'GrowingTopic's read_queue_nums" for up to
    0.2 s more, until a periodic refresh of the node's copy of the topic table; a leader elected meanwhile
    refused sends to those queues the same way)."""
    cluster = await start_cluster(spawn, tmp_path)
    topic = "GrowingTopic"
    await cluster.create_topic(topic, 2)
    leader = await cluster.leader_addr()
    followers = [addr for addr in cluster.addr_of.values() if addr != leader]
    async with open_remoting_client() as client, open_admin(cluster.namesrv) as admin:

        async def applied_index(addr: str) -> int:
            r = await client.invoke(addr, make_request(RequestCode.GET_BROKER_RUNTIME_INFO))
            return cbor2.loads(r.body)["last_applied_index"]

        for queues in (4, 6, 8):
            await admin.create_topic(topic, read_queue_nums=queues, write_queue_nums=queues)
            change = await applied_index(leader)
            for addr in followers:
                with trio.fail_after(10):
                    while await applied_index(addr) < change:
                        await trio.sleep(0)
                r = await client.invoke(addr, make_request(RequestCode.PULL_MESSAGE, ext={
                    "consumer_group": "growing", "topic": topic, "queue_id": queues - 1, "queue_offset": 0,
                    "max_msg_nums": 1}))
                assert r.code == ResponseCode.PULL_NOT_FOUND, (addr, queues, r.code, r.remark)
