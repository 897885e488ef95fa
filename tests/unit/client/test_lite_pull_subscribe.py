"""The lite pull consumer in subscribe mode against the in-memory fake cluster, on trio's MockClock: group membership
by heartbeat, the group's queues split among its members, a member leaving or joining (queues move, their offsets
committed first), NOTIFY_CONSUMER_IDS_CHANGED, unsubscribe, and assign and subscribe refusing to mix."""

from __future__ import annotations

import cbor2
import pytest
import trio

import client.lite_pull_consumer
from client import MessageQueue, open_lite_pull_consumer
from client.errors import ConfigError
from client.rebalance import allocate_average_by_circle
from remoting.codec import make_request
from remoting.codes import RequestCode
from remoting.errors import ConnectError
from tests.unit.client.fake_cluster import NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx
from tests.unit.client.test_lite_pull import GROUP, HOUR, Recorder, broker_offset, put, wait_for

T, T2 = "SubTopic", "OtherTopic"
ALL_T = [MessageQueue(T, b, q) for b in ("broker-a", "broker-b") for q in range(4)]
ALL_T2 = [MessageQueue(T2, b, q) for b in ("broker-a", "broker-b") for q in range(4)]
# Offsets move only by polls, commits, rebalances and closes; members see each other within 100 virtual ms.
OPEN = dict(consumer_group=GROUP, consume_from_where="CONSUME_FROM_FIRST_OFFSET", auto_commit_interval_ms=HOUR,
            rebalance_interval_ms=100)


@pytest.fixture
def cluster(monkeypatch):
    groups = [FakeGroup("broker-a", ["a:1", "a:2", "a:3"]), FakeGroup("broker-b", ["b:1", "b:2", "b:3"])]
    fake = FakeRemoting(groups)
    fake.handlers = []  # each consumer's ServerRequests, for pushing NOTIFY_CONSUMER_IDS_CHANGED to it

    def open_fake(config, handler=None):
        fake.handlers.append(handler)
        return fake_remoting_ctx(fake)

    monkeypatch.setattr(client.lite_pull_consumer, "open_remoting", open_fake)
    fake.recorder = Recorder(fake)
    fake.heartbeats = []  # decoded HEART_BEAT bodies
    invoke = fake.invoke

    async def recording(addr, request, timeout_s=3.0):
        if request.code == RequestCode.HEART_BEAT:
            fake.heartbeats.append(cbor2.loads(request.body))
        return await invoke(addr, request, timeout_s)

    fake.invoke = recording
    return fake


def members(fake: FakeRemoting) -> set[str]:
    return set.union(*(g.members[GROUP] for g in fake.groups))


async def poll_until(consumer, n: int) -> list:
    got: list = []
    with trio.fail_after(60):
        while len(got) < n:
            got += await consumer.poll(timeout_s=1)
    return got


def keys(msgs) -> list[tuple[MessageQueue, int]]:
    return sorted((m.message_queue, m.queue_offset) for m in msgs)


async def test_a_subscribed_consumer_joins_its_group_as_a_pull_member_without_the_retry_topic(cluster, autojump_clock):
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as consumer:
        assert consumer.mode is None
        await consumer.subscribe(T, "TagA || TagB")
        assert consumer.mode == "subscribe" and consumer.subscriptions() == {T: "TagA || TagB"}
        # Alone in the group: every queue of the topic, started before subscribe returned.
        assert consumer.assignment() == set(ALL_T)
        assert members(cluster) == {consumer.client_id}
        consumers = cluster.heartbeats[-1]["consumers"]
        assert [(c["consumer_group"], c["consume_type"], c["message_model"]) for c in consumers] == [
            (GROUP, "CONSUME_ACTIVELY", "CLUSTERING")]
        # A lite pull consumer sends nothing back, so it does not consume the group's retry topic (as RocketMQ's).
        assert [(s["topic"], s["expression"]) for s in consumers[0]["subscriptions"]] == [(T, "TagA || TagB")]
        client_id = consumer.client_id
    # Leaving unregisters it at once, so the others rebalance without waiting for its heartbeats to lapse.
    assert client_id not in members(cluster)
    assert any(code == RequestCode.UNREGISTER_CLIENT for _, code, _ in cluster.recorder.requests)


async def test_two_members_split_the_queues_and_each_message_goes_to_one_of_them(cluster, autojump_clock):
    for mq in ALL_T:
        put(cluster, mq, 5)
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as one, open_lite_pull_consumer(NAMESRV, **OPEN) as two:
        await one.subscribe(T)
        await two.subscribe(T)
        await wait_for(lambda: len(one.assignment()) == len(two.assignment()) == 4)
        assert one.assignment() | two.assignment() == set(ALL_T) and not one.assignment() & two.assignment()
        first, second = sorted((one, two), key=lambda c: c.client_id)
        # AllocateMessageQueueAveragely: the first member (by client id) takes the first half of the sorted queues.
        assert first.assignment() == set(ALL_T[:4]) and second.assignment() == set(ALL_T[4:])
        got_one, got_two = await poll_until(one, 20), await poll_until(two, 20)
        assert {m.message_queue for m in got_one} == one.assignment()
        assert {m.message_queue for m in got_two} == two.assignment()
        assert keys(got_one + got_two) == sorted((mq, i) for mq in ALL_T for i in range(5))


async def test_the_allocate_strategy_decides_each_members_share(cluster, autojump_clock):
    options = OPEN | dict(allocate_strategy="AllocateMessageQueueAveragelyByCircle")
    async with open_lite_pull_consumer(NAMESRV, **options) as one, open_lite_pull_consumer(NAMESRV, **options) as two:
        await one.subscribe(T)
        await two.subscribe(T)
        await wait_for(lambda: len(one.assignment()) == len(two.assignment()) == 4)
        cids = [one.client_id, two.client_id]
        for c in (one, two):
            assert c.assignment() == set(allocate_average_by_circle(GROUP, c.client_id, ALL_T, cids))
    with pytest.raises(ConfigError, match="allocate_strategy must be one of"):
        async with open_lite_pull_consumer(NAMESRV, **OPEN, allocate_strategy="Nope"):
            pass


async def test_queues_taken_away_by_a_joining_member_have_their_offsets_committed_first(cluster, autojump_clock):
    """The member that had every queue stored its positions (5 of each, auto-commit) without sending them; the
    rebalance that takes half of them away sends theirs before it lets them go. (The joining member may already
    have started them from the older offset: members that briefly disagree both pull a queue, at least once.)"""
    for mq in ALL_T:
        put(cluster, mq, 5)
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as one:
        await one.subscribe(T)
        await trio.sleep(1)  # the starts found are committed (auto-commit): nothing is sent after them but by request
        assert len(await poll_until(one, 40)) == 40
        assert await one.poll(timeout_s=0.5) == []  # auto-commit: the positions of all 40 are stored now
        assert all(broker_offset(cluster, mq) == 0 for mq in ALL_T)  # only the starts were sent
        async with open_lite_pull_consumer(NAMESRV, **OPEN) as two:
            await two.subscribe(T)
            await wait_for(lambda: len(one.assignment()) == len(two.assignment()) == 4)
            moved = set(ALL_T) - one.assignment()
            assert moved == two.assignment()
            assert all(broker_offset(cluster, mq) == 5 for mq in moved)
            assert all(broker_offset(cluster, mq) == 0 for mq in one.assignment())  # kept: not sent yet
            for mq in ALL_T:
                put(cluster, mq, 2)
            # The queues kept go on where they were; those taken away hand nothing more out here.
            assert keys(await poll_until(one, 8)) == sorted((mq, i) for mq in one.assignment() for i in (5, 6))
            got_two: list = []
            with trio.fail_after(60):
                while not {(mq, i) for mq in moved for i in (5, 6)} <= set(keys(got_two)):
                    got_two += await two.poll(timeout_s=1)
            assert {m.message_queue for m in got_two} == moved


async def test_a_member_leaving_hands_its_queues_on_at_the_offsets_it_committed(cluster, autojump_clock):
    for mq in ALL_T:
        put(cluster, mq, 3)
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as one:
        await one.subscribe(T)
        async with open_lite_pull_consumer(NAMESRV, **OPEN) as two:
            await two.subscribe(T)
            await wait_for(lambda: len(one.assignment()) == len(two.assignment()) == 4)
            theirs = two.assignment()
            got_two = await poll_until(two, 12)
            leaving = two.client_id
        # Its close committed what it polled, and it left the group.
        assert all(broker_offset(cluster, mq) == 3 for mq in theirs)
        assert leaving not in members(cluster)
        await wait_for(lambda: one.assignment() == set(ALL_T))
        for mq in ALL_T:
            put(cluster, mq, 1)
        got_one = await poll_until(one, 12 + 8)
        # Nothing of the leaver's queues comes twice: they go on at offset 3.
        assert keys(got_one + got_two) == sorted((mq, i) for mq in ALL_T for i in range(4))


async def test_a_consumer_ids_changed_notice_rebalances_at_once(cluster, autojump_clock):
    options = OPEN | dict(rebalance_interval_ms=HOUR)
    async with open_lite_pull_consumer(NAMESRV, **options) as one, \
            open_lite_pull_consumer(NAMESRV, **options) as two:
        await one.subscribe(T)
        await two.subscribe(T)
        assert len(two.assignment()) == 4
        await trio.sleep(60)
        assert one.assignment() == set(ALL_T)  # no periodic rebalance within the hour: it has not noticed
        notice = make_request(RequestCode.NOTIFY_CONSUMER_IDS_CHANGED, {"consumer_group": GROUP}, oneway=True)
        handler = cluster.handlers[0]
        await handler.handle(notice, None)
        await wait_for(lambda: len(one.assignment()) == 4)
        assert one.assignment() | two.assignment() == set(ALL_T)


async def test_unsubscribe_drops_the_topics_queues_after_committing_them(cluster, autojump_clock):
    for mq in ALL_T + ALL_T2:
        put(cluster, mq, 2)
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as consumer:
        await consumer.subscribe(T)
        await consumer.subscribe(T2)
        assert consumer.assignment() == set(ALL_T + ALL_T2)
        await poll_until(consumer, 32)
        await consumer.poll(timeout_s=0.5)  # stores the positions
        await consumer.unsubscribe(T)
        assert consumer.assignment() == set(ALL_T2) and consumer.subscriptions() == {T2: "*"}
        assert all(broker_offset(cluster, mq) == 2 for mq in ALL_T)
        assert [s["topic"] for s in cluster.heartbeats[-1]["consumers"][0]["subscriptions"]] == [T2]
        for mq in ALL_T + ALL_T2:
            put(cluster, mq, 1)
        got = await poll_until(consumer, 8)
        assert {m.topic for m in got} == {T2}
        await trio.sleep(1)  # rebalances go on: the topic stays dropped
        assert consumer.assignment() == set(ALL_T2)
        assert consumer.client_id in members(cluster)  # still a member, of T2
        with pytest.raises(ValueError, match=rf"topic '{T}' is not subscribed \(subscribed: '{T2}'\)"):
            await consumer.unsubscribe(T)


async def test_assign_and_subscribe_do_not_mix(cluster, autojump_clock):
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as consumer:
        consumer.assign(ALL_T[:1])
        assert consumer.mode == "assign"
        with pytest.raises(RuntimeError, match=r"^subscribe\('SubTopic'\): this lite pull consumer of group "
                                               r"'lite_group' is in assign mode, and assign and subscribe are "
                                               r"mutually exclusive"):
            await consumer.subscribe(T)
        with pytest.raises(RuntimeError, match="is in assign mode"):
            await consumer.unsubscribe(T)
        assert consumer.assignment() == {ALL_T[0]} and consumer.subscriptions() == {}
        assert not members(cluster)
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as consumer:
        await consumer.subscribe(T)
        with pytest.raises(RuntimeError, match=r"^assign\(\): .* is in subscribe mode"):
            consumer.assign(ALL_T[:1])
        with pytest.raises(RuntimeError, match=r"^set_sub_expression_for_assign\('SubTopic'\): .* subscribe mode"):
            consumer.set_sub_expression_for_assign(T, "TagA")
        assert consumer.assignment() == set(ALL_T) and consumer.subscriptions() == {T: "*"}


async def test_subscribe_from_the_last_offset_skips_the_backlog_only(cluster, autojump_clock):
    for mq in ALL_T:
        put(cluster, mq, 3)
    async with open_lite_pull_consumer(NAMESRV, **OPEN | dict(consume_from_where="CONSUME_FROM_LAST_OFFSET")) as c:
        await c.subscribe(T)
        put(cluster, ALL_T[0], 1)  # sent once subscribe returned: the start was fixed before, so it is consumed
        got = await poll_until(c, 1)
        assert keys(got) == [(ALL_T[0], 3)]


@pytest.mark.parametrize("then", ["the old member commits", "the queues come back"])
async def test_a_queue_taken_away_whose_commit_failed_is_forgotten_not_committed_later(cluster, autojump_clock, then):
    """The commit of a queue taken away fails (its group's leader moving): RocketMQ's member, as the push consumer,
    forgets the queue's offset all the same. Kept to be sent again, it was committed by the old member's next
    commit over the progress of the member that has the queue now, and it was where the queue started again if it
    came back to the old member."""
    for mq in ALL_T:
        put(cluster, mq, 5)
    refusing = False
    invoke = cluster.invoke

    async def commits_refused(addr, request, timeout_s=3.0):
        if refusing and request.code == RequestCode.UPDATE_CONSUMER_OFFSET:
            await trio.lowlevel.checkpoint()
            raise ConnectError(addr, "connection refused")
        return await invoke(addr, request, timeout_s)

    cluster.invoke = commits_refused
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as one:
        await one.subscribe(T)
        await trio.sleep(1)  # the starts found (0) are committed
        assert len(await poll_until(one, 40)) == 40
        assert await one.poll(timeout_s=0.5) == []  # auto-commit: positions 5 stored, not sent
        refusing = True
        async with open_lite_pull_consumer(NAMESRV, **OPEN) as two:
            await two.subscribe(T)
            await wait_for(lambda: len(one.assignment()) == len(two.assignment()) == 4)
            moved = two.assignment()
            assert all(broker_offset(cluster, mq) == 0 for mq in moved)  # one's commit of 5 was refused
            refusing = False
            for mq in moved:
                put(cluster, mq, 2)
            assert len(await poll_until(two, 4 * 7)) == 4 * 7  # from the group's offset, 0: at least once
            await two.commit_sync()
            assert all(broker_offset(cluster, mq) == 7 for mq in moved)
            if then == "the old member commits":
                one.commit()
                await trio.sleep(1)
                assert all(broker_offset(cluster, mq) == 7 for mq in moved)  # not set back to 5
        if then == "the queues come back":  # two left, having committed 7
            await wait_for(lambda: one.assignment() == set(ALL_T))
            assert {mq: await one.position(mq) for mq in moved} == {mq: 7 for mq in moved}
