"""The pull consumer and the query requests against a real group, on its leader and on its followers: the
answers a reader acts on (next offsets, lookups by key and by id) are the same whichever member serves them."""

from __future__ import annotations

import pytest
import trio

from client import ClientError, Message, MessageQueue, PullStatus, open_admin, open_producer, open_pull_consumer
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.message import create_msg_id, parse_msg_id
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
                assert "ask the master" in r.remark and "next_begin_offset" not in r.remark, r.remark
            r = await _pull(client, addr, topic, 10)
            assert r.code == ResponseCode.PULL_NOT_FOUND and r.ext["next_begin_offset"] == 10
        r = await _pull(client, leader, topic, 11)  # the leader's correction stays RocketMQ's
        assert r.code == ResponseCode.PULL_OFFSET_MOVED and r.ext["next_begin_offset"] == 0
        assert r.remark.endswith("(min_offset 0, max_offset 10); next_begin_offset 0"), r.remark
    async with open_pull_consumer(cluster.namesrv, consumer_group="pq") as consumer:
        found = await consumer.pull(mq, 0, 32)
        assert found.status is PullStatus.FOUND and [m.body for m in found.messages] == [b"m%d" % i for i in range(10)]


@pytest.mark.timeout(180)
async def test_messages_stored_by_a_killed_leader_are_viewed_by_their_offset_ids(spawn, tmp_path):
    # An offset message id names the node that stored the message, and the admin client asked that node's group;
    # a killed leader leaves the name servers' lists, so its ids were refused ("which is no node of a group the
    # name servers know") while the two other members held every message and served everything else.
    cluster = await start_cluster(spawn, tmp_path)
    topic = "ViewAfterKillTopic"
    await cluster.create_topic(topic, 2)
    async with open_producer(cluster.namesrv) as producer:
        sent = [await producer.send(Message(topic, b"v%d" % i, keys=f"view-{i}")) for i in range(8)]
    old_leader = await cluster.leader_addr()
    host, port = old_leader.rsplit(":", 1)
    assert {parse_msg_id(r.offset_msg_id)[0] for r in sent} == {(host, int(port))}
    cluster.nodes[cluster.node_at(old_leader)].kill()
    async with open_admin(cluster.namesrv) as admin:
        with trio.fail_after(20):  # until the name server has dropped the killed node
            while old_leader in (await admin.cluster_info()).broker_addrs.get("broker-a", {}).values():
                await trio.sleep(0.1)
        # The last sends were acknowledged once one follower had them; the survivors apply them only when a
        # leader tells them they are committed, so the ids are viewable once the group has a leader that takes
        # writes again (it applied everything before its first entry; the admin client asks every node, leader
        # first: a follower may still be a moment behind it).
        assert await cluster.leader_addr() != old_leader
        async with open_producer(cluster.namesrv) as producer:
            await producer.send(Message(topic, b"after the kill"))
        for i, result in enumerate(sent):
            message = await admin.view_message(result.offset_msg_id)
            assert (message.body, message.msg_id, message.keys) == (b"v%d" % i, result.msg_id, [f"view-{i}"])
            assert message.queue_offset == result.queue_offset and message.message_queue == result.message_queue
        with pytest.raises(ClientError, match="no group holds it"):
            await admin.view_message(create_msg_id((host, int(port)), 10 ** 9))
