"""Producer auto-batching against real processes (a name server and the 3-node group broker-a): concurrent
single sends share batch requests, and every caller's own result names where its message was stored."""

from __future__ import annotations

import pytest
import trio

from client import Message, open_producer, open_pull_consumer
from tests.cluster.test_e2e_produce_consume import start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.timeout(120)
async def test_auto_batched_sends_are_each_acknowledged_where_they_are_stored(spawn, tmp_path):
    cluster = await start_cluster(spawn, tmp_path)
    topic, total = "AutoBatchTopic", 3000
    await cluster.create_topic(topic, 4)
    results = {}
    async with open_producer(cluster.namesrv, auto_batch=True) as producer:
        async def worker(k: int) -> None:
            for i in range(k, total, 64):
                results[i] = await producer.send(Message(topic, b"ab-%05d" % i, keys=f"key-{i}"))

        async with trio.open_nursery() as nursery:
            for k in range(64):
                nursery.start_soon(worker, k)
        requests = producer.statistics().auto_batches
    assert len(results) == total and requests < total / 4, f"{requests} requests for {total} sends"

    stored = {}
    async with open_pull_consumer(cluster.namesrv, consumer_group="ab_check") as consumer:
        for mq in await consumer.fetch_queues(topic):
            offset = 0
            while True:
                pulled = await consumer.pull(mq, offset, 32)
                if not pulled.messages:
                    break
                for m in pulled.messages:
                    stored[(mq, m.queue_offset)] = m
                offset = pulled.next_begin_offset
    assert len(stored) == total
    for i, r in results.items():
        m = stored[(r.message_queue, r.queue_offset)]
        assert m.body == b"ab-%05d" % i and m.keys == [f"key-{i}"]
        assert m.msg_id == r.msg_id and m.offset_msg_id == r.offset_msg_id
