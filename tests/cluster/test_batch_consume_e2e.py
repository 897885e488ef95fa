"""Batch consumption (``batch_handler``, ``consume_message_batch_max_size``) with real processes: a name server and a
3-node group. Every call gets at most the size, of one queue; a batch failing past ``ReconsumeLater.ack_index`` has
its tail sent back, and those messages come back through the group's retry topic (first topic restored,
reconsume_times 1) while its head is not delivered again. The same logic on the fake cluster, with every failure
path: tests/unit/client/test_batch_consume.py."""

from __future__ import annotations

import logging

import pytest
import trio

from client import Message, MessageQueue, ReconsumeLater, open_producer, open_push_consumer
from tests.cluster.test_e2e_produce_consume import Cluster, start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# Level 3, the first retry's backoff, is 300 ms here: the failed tail is back well within the test.
LEVELS = "100ms 200ms 300ms 400ms 500ms"
SIZE = 4


@pytest.mark.timeout(180)
async def test_batches_of_one_queue_and_a_failed_tail_comes_back_through_the_retry_topic(spawn, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="client")
    cluster: Cluster = await start_cluster(spawn, tmp_path, {"message_delay_level": LEVELS})
    await cluster.create_topic("Batched", 2)
    calls: list[list] = []
    done = trio.Event()
    keys = [f"k{q}-{i}" for q in range(2) for i in range(10)]

    async def handler(batch):
        calls.append(list(batch))
        delivered = [m.keys[0] for call in calls for m in call]
        if set(keys) <= set(delivered) and all(delivered.count(k) == 2 for k in ("k0-5", "k0-6", "k0-7")):
            done.set()
        if any(m.keys[0] == "k0-4" for m in batch) and batch[0].reconsume_times == 0:
            # Consumed up to k0-4; whatever follows it in this batch failed and goes back to the broker.
            raise ReconsumeLater(ack_index=[m.keys[0] for m in batch].index("k0-4"))
        return None

    options = dict(consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=300,
                   persist_consumer_offset_interval_ms=200, broker_suspend_max_time_ms=1000)
    async with open_producer(cluster.namesrv) as producer:
        for key in keys:
            queue_id, _ = key[1:].split("-")
            await producer.send(Message("Batched", key.encode(), keys=[key]),
                                queue=MessageQueue("Batched", "broker-a", int(queue_id)))
    # Sent before the consumer opens, so each queue's first pull brings its whole backlog: full batches.
    async with open_push_consumer(cluster.namesrv, topic="Batched", batch_handler=handler, consumer_group="batched",
                                  consume_message_batch_max_size=SIZE, **options) as consumer:
        with trio.move_on_after(60):
            await done.wait()
        await trio.sleep(1)  # more than level 3's 300 ms: anything else sent back has had time to return
        delivered = consumer.statistics().delivered

    first = [call for call in calls if call[0].reconsume_times == 0 and call[0].topic == "Batched"
             and "RETRY_TOPIC" not in call[0].properties]
    assert all(len(call) <= SIZE and len({m.queue_id for m in call}) == 1 for call in calls)
    assert sorted(m.keys[0] for call in first for m in call) == sorted(keys)
    # k0-4 is the batch (k0-4, k0-5, k0-6, k0-7)'s first message: ack_index 0, so 5, 6 and 7 came back.
    again = [m for call in calls for m in call if m.reconsume_times == 1]
    assert sorted(m.keys[0] for m in again) == ["k0-5", "k0-6", "k0-7"]
    assert all(m.topic == "Batched" and m.properties["RETRY_TOPIC"] == "Batched" for m in again)
    assert delivered == len(keys) + 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in warnings if "send back failed" in m], warnings
