"""The concurrent handler form's pool of calls with real processes (a name server and a 3-node group): a slow,
I/O-bound handler on a one-queue topic runs ``max_concurrent_handlers`` calls at once (before: one per queue), and
the offset the broker holds for the group waits for a message still in its handler while the ones after it finish.
The same logic on the fake cluster, with every case: tests/unit/client/test_concurrent_handlers.py."""

from __future__ import annotations

from collections import Counter

import pytest
import trio

from client import Message, open_admin, open_producer, open_push_consumer
from tests.cluster.test_e2e_produce_consume import Cluster, start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TOPIC, GROUP, TOTAL, BOUND = "ConcurrentHandlers", "concurrent_handlers", 40, 8
HELD = b"05"  # handled only once every other message is, and the commit checked


async def _committed(admin) -> int | None:
    stats = await admin.consume_stats(GROUP, topic=TOPIC)
    (queue,) = stats.queues
    return queue.consumer_offset


@pytest.mark.timeout(180)
async def test_one_queue_runs_the_bound_of_calls_at_once_and_its_offset_waits_for_the_unfinished(spawn, tmp_path):
    cluster: Cluster = await start_cluster(spawn, tmp_path)
    await cluster.create_topic(TOPIC, 1)
    running = most_running = 0
    finished: list[bytes] = []
    release = trio.Event()

    async def handler(msg) -> None:
        nonlocal running, most_running
        running += 1
        most_running = max(most_running, running)
        try:
            if msg.body == HELD:
                await release.wait()
            else:
                await trio.sleep(0.05)  # I/O-bound work
        finally:
            running -= 1
        finished.append(msg.body)

    async with open_producer(cluster.namesrv) as producer:
        for i in range(TOTAL):
            await producer.send(Message(TOPIC, b"%02d" % i))
    async with open_admin(cluster.namesrv) as admin, \
            open_push_consumer(cluster.namesrv, topic=TOPIC, handler=handler, consumer_group=GROUP,
                               consume_from_where="CONSUME_FROM_FIRST_OFFSET", max_concurrent_handlers=BOUND,
                               persist_consumer_offset_interval_ms=100, rebalance_interval_ms=500):
        with trio.fail_after(60):
            while len(finished) < TOTAL - 1:
                await trio.sleep(0.05)
        await trio.sleep(1)  # ten persist intervals, with nothing left to consume but HELD
        assert await _committed(admin) == int(HELD)
        release.set()
        with trio.fail_after(30):
            while await _committed(admin) != TOTAL:
                await trio.sleep(0.1)
    assert most_running == BOUND
    assert Counter(finished) == Counter(b"%02d" % i for i in range(TOTAL))
