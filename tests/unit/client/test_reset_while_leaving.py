"""An admin offset reset (RESET_CONSUMER_CLIENT_OFFSET) told while a member gives a queue up, against the in-memory
fake cluster on trio's MockClock. The broker sets the reset offsets, then tells the members; a commit of the queue's
old position already on its way may reach it after the reset and undo it, so the member that sent it must commit the
reset offset after it: the reset wins. Here the fake broker takes the member's commit just after the reset, and the
notice reaches the member while the commit's answer is on its way back, the worst order. Orderly releases (the
handler still busy when told) are in tests/integration/test_offset_reset_members.py, against a real broker node."""

from __future__ import annotations

import cbor2
import pytest
import trio

import client.lite_pull_consumer
import client.producer
import client.push_consumer
from client import MessageQueue, open_lite_pull_consumer, open_push_consumer
from remoting.codec import make_request
from remoting.codes import RequestCode
from tests.unit.client.fake_cluster import (NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx, send_numbered,
                                            wait_until)

GROUP = "g"
T0 = MessageQueue("T", "broker-a", 0)
HOUR = 3_600_000  # no periodic commit or rebalance within a test: only the ones it makes send anything
OPEN = dict(consumer_group=GROUP, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
            persist_consumer_offset_interval_ms=HOUR, rebalance_interval_ms=HOUR)
LITE = dict(consumer_group=GROUP, consume_from_where="CONSUME_FROM_FIRST_OFFSET", auto_commit_interval_ms=HOUR,
            rebalance_interval_ms=HOUR)


@pytest.fixture
def fake(monkeypatch):
    fake = FakeRemoting([FakeGroup("broker-a", ["a:1", "a:2", "a:3"], queues=1)])
    fake.handlers = []  # each consumer's ServerRequests: the notices a broker sends it go there

    def open_consumer_remoting(config, handler=None):
        fake.handlers.append(handler)
        return fake_remoting_ctx(fake)

    monkeypatch.setattr(client.producer, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    for mod in (client.push_consumer, client.lite_pull_consumer):
        monkeypatch.setattr(mod, "open_remoting", open_consumer_remoting)
    return fake


def committed(fake: FakeRemoting) -> int | None:
    return fake.groups[0].offsets.get((GROUP, "T", 0))


async def tell_reset(fake: FakeRemoting, offset: int) -> None:
    """What the broker's reset does: set the group's offset of T0, then tell every member (the instance's own
    dispatch of RESET_CONSUMER_CLIENT_OFFSET)."""
    fake.groups[0].offsets[(GROUP, "T", 0)] = offset
    notice = make_request(RequestCode.RESET_CONSUMER_CLIENT_OFFSET,
                          {"consumer_group": GROUP, "topic": "T", "broker_name": "broker-a"},
                          body=cbor2.dumps({"offsets": [(0, offset)]}), oneway=True)
    for handler in fake.handlers:
        await handler.handle(notice, None)


def reset_under_next_commit(fake: FakeRemoting, offset: int) -> list[int]:
    """The next commit of T0 reaches the broker just after an admin reset of T0 to ``offset`` and is taken over it;
    the reset's notice reaches the member before the commit's answer. Returns the commits of T0 from then on."""
    answer = fake.invoke
    commits: list[int] = []

    async def invoke(addr, request, timeout_s=3.0):
        if request.code != RequestCode.UPDATE_CONSUMER_OFFSET or request.ext["topic"] != "T":
            return await answer(addr, request, timeout_s)
        commits.append(request.ext["commit_offset"])
        if len(commits) > 1:
            return await answer(addr, request, timeout_s)
        fake.groups[0].offsets[(GROUP, "T", 0)] = offset  # the reset
        response = await answer(addr, request, timeout_s)  # the commit, taken after it
        await tell_reset(fake, offset)
        return response

    fake.invoke = invoke
    return commits


class Share:
    """An allocate strategy giving this member every queue until ``give_up()``."""

    def __init__(self) -> None:
        self.mine = True

    def __call__(self, group, client_id, queues, client_ids):
        return list(queues) if self.mine else []


async def test_a_queue_taken_away_commits_the_reset_told_while_its_commit_was_on_its_way(fake, autojump_clock):
    """Concurrent handler form: the rebalance that takes the queue away commits its position (10); the reset to 0
    is told while that commit is on its way, and the broker took the commit after the reset. The member commits 0
    after it: before, the next holder started at 10, the reset undone."""
    done: list[int] = []

    async def handler(msg) -> None:
        done.append(msg.queue_offset)

    share = Share()
    await send_numbered(10)
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, allocate_strategy=share, **OPEN) as consumer:
        await wait_until(lambda: len(done) == 10)
        commits = reset_under_next_commit(fake, 0)
        share.mine = False
        await consumer.rebalance()
        assert consumer.assigned_queues() == []
        assert commits == [10, 0]
        assert committed(fake) == 0


async def test_closing_commits_the_reset_told_while_its_commits_were_on_their_way(fake, autojump_clock):
    """The iterator form closes after consuming 10: its commit of 10 is on its way when the reset to 0 is told."""
    await send_numbered(10)
    async with open_push_consumer(NAMESRV, topic="T", **OPEN) as consumer:
        got = []
        async for msg in consumer:
            got.append(msg.queue_offset)
            if len(got) == 10:
                break
        commits = reset_under_next_commit(fake, 0)
    assert commits == [10, 0]
    assert committed(fake) == 0


async def test_a_held_queue_of_a_subscribed_lite_pull_consumer_seeks_to_the_reset(fake, autojump_clock):
    """Subscribe mode: a reset of a queue the member holds drops what it cached and hands out from the reset offset,
    and stores and commits that offset, so the next commit of positions carries it. Before, the notice was answered
    and nothing moved: poll went on from 10, and the next commit undid the reset."""
    await send_numbered(10)
    async with open_lite_pull_consumer(NAMESRV, **LITE) as consumer:
        await consumer.subscribe("T", "*")
        got: list[int] = []
        with trio.fail_after(60):
            while len(got) < 10:
                got += [m.queue_offset for m in await consumer.poll(timeout_s=1)]
        await consumer.commit_sync()
        assert committed(fake) == 10
        await tell_reset(fake, 3)
        with trio.fail_after(60):
            while await consumer.position(T0) != 3:  # the notice is oneway: applied in the background
                await trio.sleep(0.01)
        await consumer.commit_sync()  # the positions, as the next auto-commit takes them
        assert committed(fake) == 3
        again: list[int] = []
        with trio.fail_after(60):
            while len(again) < 7:
                again += [m.queue_offset for m in await consumer.poll(timeout_s=1)]
        assert again == list(range(3, 10))


async def test_a_queue_a_lite_pull_member_gives_up_commits_the_reset_told_while_its_commit_was_on_its_way(
        fake, autojump_clock):
    share = Share()
    await send_numbered(10)
    async with open_lite_pull_consumer(NAMESRV, allocate_strategy=share, **LITE) as consumer:
        await consumer.subscribe("T", "*")
        got: list[int] = []
        with trio.fail_after(60):
            while len(got) < 10:
                got += [m.queue_offset for m in await consumer.poll(timeout_s=1)]
        await consumer.poll(timeout_s=0)  # auto-commit stores 10
        commits = reset_under_next_commit(fake, 0)
        share.mine = False
        await consumer.rebalance()
        assert consumer.assignment() == set()
        assert commits == [10, 0]
        assert committed(fake) == 0
