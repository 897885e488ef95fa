"""``reset_offset`` (``raftmq admin reset-offset``) against a broker node and a name server in-process, with the
members it tells: an orderly member giving a queue up while its handler finishes a message, and a subscribe-mode lite
pull consumer. The broker sets the offsets and tells the online members; what a member does then must not undo it.
The races a commit already on its way runs with the notice are in tests/unit/client/test_reset_while_leaving.py."""

from __future__ import annotations

import time

import pytest
import trio

from client import Message, MessageQueue, open_admin, open_lite_pull_consumer, open_producer, open_push_consumer
from tests.integration.broker.helpers import start_leading_node

HOUR = 3_600_000


class Share:
    """An allocate strategy: every queue while ``mine``, else none."""

    def __init__(self, mine: bool = True) -> None:
        self.mine = mine

    def __call__(self, group, client_id, queues, client_ids):
        return list(queues) if self.mine else []


@pytest.mark.parametrize(("to", "stuck_at", "expected"), [("latest", 0, 10), ("earliest", 3, 0)])
async def test_an_orderly_queue_given_up_while_its_handler_is_busy_commits_the_reset_not_its_position(
        nursery, tmp_path, to, stuck_at, expected):
    """Member a's handler is busy on offset ``stuck_at`` when a rebalance takes the queue away; the queue waits for
    it (releasing: not a's any more, not yet unlocked) while the group is reset. Once the handler is done, a
    releases the queue committing the reset offset, and the next holder, b, starts there. Before, a's release
    committed its position (``stuck_at`` + 1) over the reset, and b started there."""
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    options = dict(consumer_group="g", orderly=True, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                   rebalance_interval_ms=HOUR, persist_consumer_offset_interval_ms=100)
    busy, go = trio.Event(), trio.Event()
    by_b: list[int] = []

    async def handle_a(msg) -> None:
        if msg.queue_offset == stuck_at:
            busy.set()
            await go.wait()

    async def handle_b(msg) -> None:
        by_b.append(msg.queue_offset)

    share = Share()
    async with open_admin(namesrv) as admin, open_producer(namesrv) as producer:
        await admin.create_topic("R", read_queue_nums=1, write_queue_nums=1)
        for i in range(10):
            await producer.send(Message("R", b"m%d" % i))
        async with open_push_consumer(namesrv, topic="R", handler=handle_a, allocate_strategy=share, **options) as a:
            with trio.fail_after(20):
                await busy.wait()
            share.mine = False
            await a.rebalance()
            assert a.assigned_queues() == []
            ts = 0 if to == "earliest" else int(time.time() * 1000) + HOUR
            reset = await admin.reset_offset("g", "R", ts)
            assert reset.offsets == {MessageQueue("R", "broker-a", 0): expected}
            assert a.client_id in reset.consumer_ids["broker-a"]
            async with open_push_consumer(namesrv, topic="R", handler=handle_b, allocate_strategy=Share(),
                                          **options):
                go.set()  # a's handler ends; a commits and unlocks, and b gets the lock
                await producer.send(Message("R", b"m10"))
                with trio.fail_after(20):
                    while not by_b:
                        await trio.sleep(0.02)
    assert by_b[0] == expected, f"b started at {by_b[0]}: a's release committed its position over the reset"


async def test_a_subscribed_lite_pull_consumer_follows_a_reset_and_its_commits_keep_it(nursery, tmp_path):
    """The broker tells the subscribe-mode member, which hands its queue out from the reset offset again, and its
    commits carry it. Before, the notice was ignored: poll went on from 10, and the next commit undid the reset."""
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    mq = MessageQueue("L", "broker-a", 0)
    async with open_admin(namesrv) as admin, open_producer(namesrv) as producer:
        await admin.create_topic("L", read_queue_nums=1, write_queue_nums=1)
        for i in range(10):
            await producer.send(Message("L", b"m%d" % i))
        async with open_lite_pull_consumer(namesrv, consumer_group="lg", auto_commit_interval_ms=HOUR,
                                           consume_from_where="CONSUME_FROM_FIRST_OFFSET") as consumer:
            await consumer.subscribe("L", "*")
            got: list[int] = []
            with trio.fail_after(20):
                while len(got) < 10:
                    got += [m.queue_offset for m in await consumer.poll(timeout_s=1)]
            await consumer.commit_sync()
            assert await consumer.committed(mq) == 10
            reset = await admin.reset_offset("lg", "L", 0)
            assert reset.offsets == {mq: 0} and reset.consumer_ids == {"broker-a": (consumer.client_id,)}
            with trio.fail_after(20):
                while await consumer.position(mq) != 0:  # the notice is oneway: applied in the background
                    await trio.sleep(0.02)
            await consumer.commit_sync()  # the positions, as the next auto-commit takes them
            assert await consumer.committed(mq) == 0
            again: list[int] = []
            with trio.fail_after(20):
                while len(again) < 10:
                    again += [m.queue_offset for m in await consumer.poll(timeout_s=1)]
            assert again == list(range(10))
