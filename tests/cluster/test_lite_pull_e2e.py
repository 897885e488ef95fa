"""The lite pull consumer (assign mode) against a real group: assign, poll, commit_sync, a second consumer of the
group resuming at the committed offsets, and polling going on across a SIGKILL of the group's leader."""

from __future__ import annotations

import pytest
import trio

from client import Message, MessageQueue, RaftMQError, SendFailedError, open_lite_pull_consumer, open_producer
from tests.cluster.test_e2e_produce_consume import start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TOPIC = "LitePullE2ETopic"
QUEUES = [MessageQueue(TOPIC, "broker-a", 0), MessageQueue(TOPIC, "broker-a", 1)]
# Held briefly on the broker, so a pull parked on the killed leader is replaced soon.
OPTIONS = dict(consumer_group="lite_e2e", consume_from_where="CONSUME_FROM_FIRST_OFFSET", auto_commit=False,
               broker_suspend_max_time_ms=1000, poll_max_messages=7)


async def send(producer, mq: MessageQueue, bodies: list[bytes]) -> None:
    for body in bodies:
        with trio.fail_after(60):  # across an election: the producer's own retries, then ours
            while True:
                try:
                    await producer.send(Message(TOPIC, body), queue=mq)
                    break
                except (SendFailedError, RaftMQError):
                    await trio.sleep(0.2)


async def poll_until(consumer, want: set[bytes], got: dict[MessageQueue, list]) -> None:
    """Poll until every body of ``want`` was handed out; each queue's messages go into ``got`` in poll order."""
    seen: set[bytes] = set()
    with trio.fail_after(60):
        while not want <= seen:
            for m in await consumer.poll(timeout_s=1):
                got.setdefault(m.message_queue, []).append(m)
                seen.add(m.body)


def check_order(got: dict[MessageQueue, list]) -> None:
    for mq, msgs in got.items():
        offsets = [m.queue_offset for m in msgs]
        assert offsets == sorted(set(offsets)), (mq, offsets)  # in offset order, none twice


@pytest.mark.timeout(240)
async def test_assign_poll_commit_then_a_second_consumer_resumes_and_polls_across_a_leader_kill(spawn, tmp_path):
    cluster = await start_cluster(spawn, tmp_path)
    await cluster.create_topic(TOPIC, 2)
    first = {mq: [b"%d-first-%02d" % (mq.queue_id, i) for i in range(20)] for mq in QUEUES}
    async with open_producer(cluster.namesrv) as producer:
        for mq in QUEUES:
            await send(producer, mq, first[mq])

    # The first consumer takes at least 12 of each queue's 20 (poll hands out 7 at most, pulls fetch 4) and commits
    # what it was handed.
    got1: dict[MessageQueue, list] = {}
    async with open_lite_pull_consumer(cluster.namesrv, **OPTIONS, pull_batch_size=4) as c1:
        assert sorted(await c1.fetch_queues(TOPIC)) == QUEUES
        c1.assign(QUEUES)
        await poll_until(c1, {b for mq in QUEUES for b in first[mq][:12]}, got1)
        check_order(got1)
        await c1.commit_sync()
        committed = {mq: got1[mq][-1].queue_offset + 1 for mq in QUEUES}
        assert all(c >= 12 for c in committed.values())
        for mq in QUEUES:
            assert await c1.committed(mq) == committed[mq]
            assert [m.body for m in got1[mq]] == first[mq][:committed[mq]]

    async with open_lite_pull_consumer(cluster.namesrv, **OPTIONS) as c2, \
            open_producer(cluster.namesrv, retry_backoff_ms=20) as producer:
        c2.assign(QUEUES)
        for mq in QUEUES:
            assert await c2.position(mq) == committed[mq]  # resumes where the group committed
        got2: dict[MessageQueue, list] = {}
        await poll_until(c2, {b for mq in QUEUES for b in first[mq][committed[mq]:]}, got2)
        check_order(got2)
        for mq in QUEUES:  # a queue whose 20 the first consumer all had gives nothing here
            assert [m.body for m in got2.get(mq, [])] == first[mq][committed[mq]:]

        # SIGKILL the leader; the consumer polls on (followers serve pulls, then the new leader) and commits on the
        # new leader.
        leader = await cluster.leader_addr()
        cluster.nodes[cluster.node_at(leader)].kill()
        second = {mq: [b"%d-second-%02d" % (mq.queue_id, i) for i in range(10)] for mq in QUEUES}
        for mq in QUEUES:
            await send(producer, mq, second[mq])
        await poll_until(c2, {b for mq in QUEUES for b in second[mq]}, got2)
        check_order(got2)
        for mq in QUEUES:
            bodies = [m.body for m in got2[mq]]
            assert set(bodies) >= set(second[mq])  # a resend across the election may store one twice
        with trio.fail_after(60):
            while True:
                try:
                    await c2.commit_sync()
                    break
                except RaftMQError:  # the dead leader first, until the route or a hint names the new one
                    await trio.sleep(0.2)
        for mq in QUEUES:
            assert await c2.committed(mq) == got2[mq][-1].queue_offset + 1
