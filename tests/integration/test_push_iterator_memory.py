"""The push consumer's iterator form against a broker node and a name server in-process: what it holds in memory
for the loop while the application is busy with one message and its queues are dropped and added again (an offset
reset, a rebalance taking them away and back). Messages are counted where they live (``gc``), not where the
consumer says they are."""

from __future__ import annotations

import gc

import trio
import trio.testing

from client import Message, MessageQueue, open_admin, open_producer, open_push_consumer
from client.message import MessageExt
from tests.integration.broker.helpers import start_leading_node
from tests.integration.test_offset_reset_members import HOUR, Share

THRESHOLD = 100  # pull_threshold_for_queue
BATCH = 32  # pull_batch_size: one pull may go past the threshold by it


async def _in_memory(topic: str) -> int:
    """Messages of ``topic`` this process holds, however it holds them, once every task has done what it can (a
    dropped queue's pull task has ended, say)."""
    await trio.testing.wait_all_tasks_blocked()
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is MessageExt and o.topic == topic)


async def _wait_cached(consumer, at_least: int) -> None:
    with trio.fail_after(10):
        while consumer.statistics().cached < at_least:
            await trio.sleep(0.01)


async def test_offset_resets_while_the_loop_holds_a_message_keep_one_cache_in_memory(nursery, tmp_path):
    """The loop holds its first message while the group's offset is reset 5 times. Each reset drops the queue and
    its new ProcessQueue pulls a threshold's worth again; the dropped queue's messages are let go of at once. Was:
    they stayed in the consumer's channel of pulled batches, counted by neither flow control nor
    ``statistics().cached``, until the loop reached them: 128, 256, ... 768 messages held while ``cached`` said
    128. Once the loop goes on it gets the queue from the reset offset, in order, its held message counting for
    nothing (its queue was dropped)."""
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    mq = MessageQueue("Grow", "broker-a", 0)
    async with open_producer(namesrv) as producer:
        for i in range(400):
            await producer.send(Message("Grow", b"%03d" % i + b"x" * 1000), queue=mq)
    async with open_push_consumer(namesrv, topic="Grow", consumer_group="g_grow", pull_threshold_for_queue=THRESHOLD,
                                  pull_batch_size=BATCH, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                                  rebalance_interval_ms=HOUR) as consumer, open_admin(namesrv) as admin:
        loop = consumer.__aiter__()
        with trio.fail_after(10):
            held = await loop.__anext__()  # the application is busy with it
        assert held.queue_offset == 0
        await _wait_cached(consumer, THRESHOLD)
        # The message the loop holds is its queue's, cached until acknowledged.
        assert await _in_memory("Grow") == consumer.statistics().cached
        for _ in range(5):
            pq = consumer._pqs[mq]
            await admin.reset_offset("g_grow", "Grow", 0)
            with trio.fail_after(10):
                while consumer._pqs.get(mq) is pq:
                    await trio.sleep(0.01)
            await _wait_cached(consumer, THRESHOLD)
            cached = consumer.statistics().cached
            assert cached <= THRESHOLD + BATCH
            # The new queue's cache, and the message the loop holds (of the dropped queue: in no cache).
            assert await _in_memory("Grow") == cached + 1
        with trio.fail_after(10):
            offsets = [(await loop.__anext__()).queue_offset for _ in range(400)]
        assert offsets == list(range(400))


async def test_queues_taken_away_and_back_while_the_loop_holds_a_message_keep_one_cache_each(nursery, tmp_path):
    """The same for a rebalance that takes every queue away and gives them back, 4 times, while the loop holds a
    message: each time the 4 queues cache a threshold's worth again, and what they had is let go of at once (was:
    left in the channel, 4 more caches each time). The loop then gets every queue's messages in queue order, the
    queues taking turns."""
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    share = Share()
    async with open_admin(namesrv) as admin, open_producer(namesrv) as producer:
        await admin.create_topic("Flap", read_queue_nums=4, write_queue_nums=4)
        queues = [MessageQueue("Flap", "broker-a", q) for q in range(4)]
        for i in range(200):
            await producer.send(Message("Flap", b"%03d" % i), queue=queues[i % 4])
    async with open_push_consumer(namesrv, topic="Flap", consumer_group="g_flap", pull_threshold_for_queue=20,
                                  pull_batch_size=8, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                                  allocate_strategy=share, rebalance_interval_ms=HOUR) as consumer:
        loop = consumer.__aiter__()
        with trio.fail_after(10):
            held = await loop.__anext__()
        await _wait_cached(consumer, 4 * 20)
        for _ in range(4):
            share.mine = False
            await consumer.rebalance()
            assert consumer.assigned_queues() == [] and consumer.statistics().cached == 0
            assert await _in_memory("Flap") == 1  # the message the loop holds, alone
            share.mine = True
            await consumer.rebalance()
            await _wait_cached(consumer, 4 * 20)
            cached = consumer.statistics().cached
            assert cached <= 4 * (20 + 8)
            assert await _in_memory("Flap") == cached + 1
        got: dict[int, list[int]] = {q: [] for q in range(4)}
        with trio.fail_after(10):
            first_turns = [(await loop.__anext__()) for _ in range(200)]
        for msg in first_turns:
            got[msg.queue_id].append(msg.queue_offset)
        # The held message's queue was dropped: acknowledging it moved nothing, and it comes again with its queue.
        assert got == {q: list(range(50)) for q in range(4)}
        assert {m.queue_id for m in first_turns[:4]} == {0, 1, 2, 3}
        del held
