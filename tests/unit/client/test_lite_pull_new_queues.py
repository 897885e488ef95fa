"""A subscribe-mode lite pull consumer from its last offset (the default) and the queues that appear after it
subscribed, against the in-memory fake cluster on trio's MockClock: a topic no name server knew when it subscribed,
and queues added to its topic later, are consumed from their first message (all they hold was sent after the
subscription); and each start found from ``consume_from_where`` is committed before ``subscribe`` returns, so a
member that never committed, or a queue moved to another member, skips nothing stored in between (as the push
consumer's ``_compute_pull_from``)."""

from __future__ import annotations

import pytest

from client import MessageQueue, open_lite_pull_consumer
from tests.unit.client.fake_cluster import NAMESRV
from tests.unit.client.test_lite_pull import HOUR, broker_offset, put, wait_for
from tests.unit.client.test_lite_pull_subscribe import ALL_T, OPEN, T, keys, poll_until
from tests.unit.client.test_lite_pull_subscribe import cluster  # noqa: F401 - a fixture

LAST = OPEN | dict(consume_from_where="CONSUME_FROM_LAST_OFFSET")
LATER = "LaterTopic"
ALL_LATER = [MessageQueue(LATER, b, q) for b in ("broker-a", "broker-b") for q in range(4)]


async def test_a_topic_created_after_subscribing_is_consumed_from_its_first_message(cluster, autojump_clock):
    """Found by review: the queues of a topic unknown when the consumer subscribed started at their max offset when
    a rebalance found them, so every message sent before that was never consumed (0 of 20 on a broker node)."""
    cluster.unknown_topics.add(LATER)
    async with open_lite_pull_consumer(NAMESRV, **LAST | dict(rebalance_interval_ms=HOUR)) as c:
        await c.subscribe(LATER)
        assert c.assignment() == set()
        cluster.unknown_topics.discard(LATER)
        for mq in ALL_LATER:
            put(cluster, mq, 3)
        c.trigger_rebalance()
        got = await poll_until(c, 24)
        assert keys(got) == sorted((mq, i) for mq in ALL_LATER for i in range(3))


async def test_queues_added_to_the_topic_are_consumed_from_their_first_message_and_the_old_ones_from_the_last(
        cluster, autojump_clock):
    for mq in ALL_T:
        put(cluster, mq, 3)  # the backlog, before the subscription: skipped
    async with open_lite_pull_consumer(NAMESRV, **LAST | dict(poll_name_server_interval_ms=100)) as c:
        await c.subscribe(T)
        assert c.assignment() == set(ALL_T)
        for g in cluster.groups:
            g.queues = 6
        added = [MessageQueue(T, b, q) for b in ("broker-a", "broker-b") for q in (4, 5)]
        for mq in added:
            put(cluster, mq, 2)
        put(cluster, ALL_T[0], 1)
        got = await poll_until(c, 9)
        assert c.assignment() == set(ALL_T + added)
        assert keys(got) == sorted([(mq, i) for mq in added for i in range(2)] + [(ALL_T[0], 3)])


@pytest.mark.parametrize("auto_commit", [True, False])
async def test_the_starts_found_are_committed_before_subscribe_returns(cluster, autojump_clock, auto_commit):
    """Until the group has an offset for a queue, each start is found from ``consume_from_where`` again, and from the
    last offset that is the queue's end at that moment: a member gone before it committed (auto-commit sent the start
    only later, in the background; without auto-commit, never) left the next one to skip what was stored between."""
    for mq in ALL_T:
        put(cluster, mq, 3)
    async with open_lite_pull_consumer(NAMESRV, **LAST | dict(auto_commit=auto_commit)) as c:
        await c.subscribe(T)
        assert {mq: broker_offset(cluster, mq) for mq in ALL_T} == {mq: 3 for mq in ALL_T}
        assert {mq: await c.position(mq) for mq in ALL_T} == {mq: 3 for mq in ALL_T}


async def test_a_queue_moved_before_its_member_committed_goes_on_from_the_start_it_found(cluster, autojump_clock):
    """The first member (committing by hand) polled nothing and committed nothing when a second one joined and took
    half of its queues: the second went on from the first one's start, not from the queues' end by then."""
    for mq in ALL_T:
        put(cluster, mq, 3)
    options = LAST | dict(auto_commit=False)
    async with open_lite_pull_consumer(NAMESRV, **options) as one:
        await one.subscribe(T)
        for mq in ALL_T:
            put(cluster, mq, 2)  # offsets 3 and 4, sent after the subscription
        async with open_lite_pull_consumer(NAMESRV, **options) as two:
            await two.subscribe(T)
            await wait_for(lambda: len(one.assignment()) == len(two.assignment()) == 4)
            moved = two.assignment()
            got = await poll_until(two, 8)
            assert keys(got) == sorted((mq, i) for mq in moved for i in (3, 4))

