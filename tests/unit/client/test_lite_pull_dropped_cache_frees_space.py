"""A lite pull consumer whose cache across all queues is full (``pull_threshold_for_all``) of messages it then drops
pulls its other queues again at once, against the in-memory fake cluster on trio's MockClock: the queues waiting for
space are woken whatever drops the messages (``_drop``), here ``unsubscribe``."""

from __future__ import annotations

import trio

from client import open_lite_pull_consumer
from tests.unit.client.fake_cluster import NAMESRV
from tests.unit.client.test_lite_pull import put, wait_for
from tests.unit.client.test_lite_pull_subscribe import ALL_T, ALL_T2, OPEN, T, T2, keys, poll_until
from tests.unit.client.test_lite_pull_subscribe import cluster  # noqa: F401 - a fixture

FULL = OPEN | dict(pull_threshold_for_all=10)


async def test_unsubscribing_a_topic_that_fills_the_cache_lets_the_other_topics_queues_pull_again(
        cluster, autojump_clock):
    """Found by review: unsubscribe dropped the topic's cached messages without waking the prefetch tasks waiting
    for the consumer-wide bound, so the other topic's queues never pulled again (B received nothing in 8 s)."""
    async with open_lite_pull_consumer(NAMESRV, **FULL) as c:
        await c.subscribe(T)
        await c.subscribe(T2)
        for mq in ALL_T:
            put(cluster, mq, 50)
        await wait_for(lambda: c.statistics().cached >= 10)
        await trio.sleep(1)  # T2's queues, their long polls answered empty, wait for space
        await c.unsubscribe(T)
        assert c.statistics().cached == 0
        for mq in ALL_T2:
            put(cluster, mq, 1)
        got = await poll_until(c, 8)
        assert keys(got) == sorted((mq, 0) for mq in ALL_T2)

