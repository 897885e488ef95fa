"""The pull consumer and the query requests against a real group, on its leader and on its followers: the
answers a reader acts on (next offsets, lookups by key and by id) are the same whichever member serves them."""

from __future__ import annotations

import pytest
import trio

from client import Message, MessageQueue, PullStatus, open_producer, open_pull_consumer
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.cluster.test_e2e_produce_consume import start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


async def _pull(client, addr: str, topic: str, offset: int):
    return await client.invoke(addr, make_request(RequestCode.PULL_MESSAGE, ext={
        "consumer_group": "pq", "topic": topic, "queue_id": 0, "queue_offset": offset, "max_msg_nums": 32,
        "sys_flag": 0x4, "subscription": "*"}), timeout_s=5.0)


@pytest.mark.timeout(180)
async def test_a_follower_asked_beyond_its_end_leaves_the_offset_where_it_was(spawn, tmp_path):
    # A follower may only be behind, so it answers "retry, ask the master" rather than PULL_OFFSET_MOVED; but its
    # answer carried the store's correction as next_begin_offset: 0 while min_offset is 0. The pull consumer
    # turns that answer into NO_MATCHED_MSG, after which a reader goes on from next_begin_offset: one that had
    # to fall back to a follower (its leader unreachable) was sent back to the start of the queue.
    cluster = await start_cluster(spawn, tmp_path)
    topic = "PullFollowerTopic"
    await cluster.create_topic(topic, 1)
    mq = MessageQueue(topic, "broker-a", 0)
    async with open_producer(cluster.namesrv) as producer:
        for i in range(10):
            await producer.send(Message(topic, b"m%d" % i), queue=mq)
    leader = await cluster.leader_addr()
    followers = [addr for addr in cluster.addr_of.values() if addr != leader]
    async with open_remoting_client() as client:
        for addr in followers:
            with trio.fail_after(10):  # a follower applies a moment after the leader answered the send
                while (await _pull(client, addr, topic, 0)).ext.get("max_offset") != 10:
                    await trio.sleep(0.05)
            for offset in (11, 12, 10 ** 6):
                r = await _pull(client, addr, topic, offset)
                assert r.code == ResponseCode.PULL_RETRY_IMMEDIATELY, (addr, offset, r.remark)
                assert r.ext["next_begin_offset"] == offset and r.ext["suggest_which_broker_id"] == 0, r.ext
            r = await _pull(client, addr, topic, 10)
            assert r.code == ResponseCode.PULL_NOT_FOUND and r.ext["next_begin_offset"] == 10
        r = await _pull(client, leader, topic, 11)  # the leader's correction stays RocketMQ's
        assert r.code == ResponseCode.PULL_OFFSET_MOVED and r.ext["next_begin_offset"] == 0
    async with open_pull_consumer(cluster.namesrv, consumer_group="pq") as consumer:
        found = await consumer.pull(mq, 0, 32)
        assert found.status is PullStatus.FOUND and [m.body for m in found.messages] == [b"m%d" % i for i in range(10)]
