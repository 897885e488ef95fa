"""Body compression against real processes (one name server, one 3-node group): a 64 KiB text body sent alone is
stored zlib-compressed with sys_flag bit 0x1 on every node, and comes back as sent through a pull consumer, a
push consumer and the admin's view by message id; a 1 KiB body and a batch's bodies are stored as they are.

Fails without the change (checked with the original client files copied back): every body was stored as sent,
sys_flag 0, so the 64 KiB record's stored body was 65,536 bytes."""

from __future__ import annotations

import zlib

import pytest
import trio

from client import Message, MessageQueue, open_admin, open_producer, open_pull_consumer, open_push_consumer
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.message import COMPRESSED_FLAG, decode_records
from remoting.transport import open_remoting_client
from tests.cluster.test_e2e_produce_consume import start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TEXT = b"".join(b"order %06d shipped to warehouse %d, status OK\n" % (i, i % 7) for i in range(2000))[:64 * 1024]


async def _stored(client, addr: str, topic: str) -> list[tuple[int, int]]:
    """(sys_flag, stored body length) of each record of queue 0 as the node at ``addr`` stores it: a raw pull."""
    ext = {"consumer_group": "zip_raw", "topic": topic, "queue_id": 0, "queue_offset": 0, "max_msg_nums": 32,
           "sys_flag": 0x4, "commit_offset": -1, "suspend_timeout_millis": 0, "subscription": "*", "sub_version": 0}
    r = await client.invoke(addr, make_request(RequestCode.PULL_MESSAGE, ext=ext), timeout_s=5)
    if r.code != ResponseCode.SUCCESS:
        return []
    return [(rec[10], len(rec[1])) for rec in decode_records(r.body)]


@pytest.mark.timeout(180)
async def test_a_large_text_body_is_stored_compressed_on_every_node_and_read_back_as_sent(spawn, tmp_path):
    cluster = await start_cluster(spawn, tmp_path)
    topic = "ZipTopic"
    await cluster.create_topic(topic, 1)
    mq = MessageQueue(topic, "broker-a", 0)
    small = TEXT[:1024]
    async with open_producer(cluster.namesrv) as producer:
        big = await producer.send(Message(topic, TEXT, tags="Big", keys="k-big"), queue=mq)
        await producer.send(Message(topic, small, tags="Small"), queue=mq)
        await producer.send_batch([Message(topic, TEXT, tags="Batch"), Message(topic, small, tags="Batch")],
                                  queue=mq)

    async with open_remoting_client() as client:
        for addr in cluster.addr_of.values():  # the leader and both followers hold the same bytes
            stored = []
            with trio.move_on_after(30):  # a follower serves the records once it has applied them
                while len(stored := await _stored(client, addr, topic)) < 4:
                    await trio.sleep(0.1)
            assert [flag for flag, _ in stored] == [COMPRESSED_FLAG, 0, 0, 0], addr
            # zlib at level 5 (RocketMQ's default): a few KiB on each of the three nodes instead of 64
            assert stored[0][1] == len(zlib.compress(TEXT, 5)) < len(TEXT) // 4, addr
            assert [n for _, n in stored[1:]] == [1024, 65536, 1024], addr

    bodies = [TEXT, small, TEXT, small]
    async with open_pull_consumer(cluster.namesrv, consumer_group="zip_pull") as puller:
        res = await puller.pull(mq, 0, 32)
        assert [m.body for m in res.messages] == bodies
        assert [m.sys_flag for m in res.messages] == [0, 0, 0, 0]
        assert (res.messages[0].tags, res.messages[0].keys) == ("Big", ["k-big"])

    got = []
    async with open_push_consumer(cluster.namesrv, topic=topic, consumer_group="zip_push",
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=300,
                                  broker_suspend_max_time_ms=500) as consumer:
        with trio.move_on_after(20):
            async for msg in consumer:
                got.append(msg.body)
                if len(got) == 4:
                    break
    assert got == bodies

    async with open_admin(cluster.namesrv) as admin:
        viewed = await admin.view_message(big.offset_msg_id)
        assert (viewed.body, viewed.sys_flag, viewed.tags) == (TEXT, 0, "Big")
        by_key = await admin.query_message(topic, "k-big")
        assert [m.body for m in by_key] == [TEXT]
