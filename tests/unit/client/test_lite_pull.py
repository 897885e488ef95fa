"""The lite pull consumer (assign mode) against the in-memory fake cluster, on trio's MockClock: poll order, seeks,
pause/resume, commits as the broker receives them, reassignment, prefetch bounds, failures and bad arguments."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import trio
import trio.testing

import client.lite_pull_consumer
from client import ClientClosedError, LitePullConsumerConfig, MessageQueue, open_lite_pull_consumer
from client.errors import ConfigError
from remoting.codes import RequestCode, ResponseCode
from remoting.message import MessageInput
from tests.unit.client.fake_cluster import NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx

T = "LiteTopic"
GROUP = "lite_group"
A0, A1 = MessageQueue(T, "broker-a", 0), MessageQueue(T, "broker-a", 1)
B0 = MessageQueue(T, "broker-b", 0)


class Recorder:
    """What the brokers received: every request as (addr, code, ext), and the offset commits they took."""

    def __init__(self, fake: FakeRemoting) -> None:
        self.requests: list[tuple[str, int, dict]] = []
        self.commits: list[tuple[MessageQueue, int]] = []
        invoke = fake.invoke

        async def recording_invoke(addr, request, timeout_s=3.0):
            self.requests.append((addr, request.code, dict(request.ext)))
            frame = await invoke(addr, request, timeout_s)
            if request.code == RequestCode.UPDATE_CONSUMER_OFFSET and frame.code == ResponseCode.SUCCESS:
                ext = request.ext
                group = fake.by_addr[addr].name
                self.commits.append((MessageQueue(ext["topic"], group, ext["queue_id"]), ext["commit_offset"]))
            return frame

        fake.invoke = recording_invoke

    def pulls_of(self, mq: MessageQueue) -> int:
        return sum(1 for addr, code, ext in self.requests
                   if code == RequestCode.PULL_MESSAGE and addr.startswith(mq.broker_name[-1])
                   and (ext["topic"], ext["queue_id"]) == (mq.topic, mq.queue_id))


@pytest.fixture
def cluster(monkeypatch):
    groups = [FakeGroup("broker-a", ["a:1", "a:2", "a:3"]), FakeGroup("broker-b", ["b:1", "b:2", "b:3"])]
    fake = FakeRemoting(groups)
    monkeypatch.setattr(client.lite_pull_consumer, "open_remoting",
                        lambda config, handler=None: fake_remoting_ctx(fake))
    fake.recorder = Recorder(fake)
    return fake


def group_of(fake: FakeRemoting, mq: MessageQueue) -> FakeGroup:
    return next(g for g in fake.groups if g.name == mq.broker_name)


def put(fake: FakeRemoting, mq: MessageQueue, n: int, *, size: int = 0) -> None:
    g = group_of(fake, mq)
    for _ in range(n):
        i = len(g.logs[(mq.topic, mq.queue_id)])
        g.append(mq.topic, mq.queue_id, MessageInput(mq.topic, mq.queue_id, (b"%s-%d" % (str(mq).encode(), i))
                                                     .ljust(size, b".")))
    fake.wake.set()  # long polls waiting for these answer now
    fake.wake = trio.Event()


def broker_offset(fake: FakeRemoting, mq: MessageQueue) -> int | None:
    return group_of(fake, mq).offsets.get((GROUP, mq.topic, mq.queue_id))


async def wait_for(condition, timeout_s: float = 60.0) -> None:
    with trio.fail_after(timeout_s):  # virtual seconds: a condition never met fails, it does not hang
        while not condition():
            await trio.sleep(0.01)


async def poll_n(consumer, n: int, **kwargs) -> list:
    got: list = []
    with trio.fail_after(60):
        while len(got) < n:
            got += await consumer.poll(**kwargs)
    return got


def offsets(msgs, mq: MessageQueue) -> list[int]:
    return [m.queue_offset for m in msgs if m.message_queue == mq]


OPEN = dict(consumer_group=GROUP, consume_from_where="CONSUME_FROM_FIRST_OFFSET")
HOUR = 3_600_000  # an auto-commit interval no test reaches: only polls, commits and closes send offsets


# -- polling ---------------------------------------------------------------------------------------------------------
async def test_poll_hands_each_queue_out_in_offset_order_taking_the_queues_in_turn(cluster, autojump_clock):
    put(cluster, A0, 25)
    put(cluster, B0, 25)
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as consumer:
        consumer.assign([A0, B0])
        assert consumer.assignment() == {A0, B0}
        await wait_for(lambda: consumer.statistics().cached == 50)
        polls = [await consumer.poll(max_messages=10) for _ in range(5)]
        assert all(len(p) == 10 for p in polls)
        queues = [{m.message_queue for m in p} for p in polls]
        # A queue that still has messages after a poll goes to the back: they alternate, the last poll takes both.
        first, second = queues[0], queues[1]
        assert len(first) == len(second) == 1 and first != second
        assert queues[2] == first and queues[3] == second and queues[4] == {A0, B0}
        got = [m for p in polls for m in p]
        assert offsets(got, A0) == list(range(25)) and offsets(got, B0) == list(range(25))
        assert await consumer.poll(timeout_s=1) == []  # nothing left: empty after the timeout
        put(cluster, A0, 40)
        more = await poll_n(consumer, 40)  # the default bound: poll_max_messages, 32
        assert offsets(more, A0) == list(range(25, 65))
        assert consumer.statistics().polled == 90


async def test_a_poll_waits_for_messages_sent_while_it_waits(cluster, autojump_clock):
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as consumer, trio.open_nursery() as nursery:
        consumer.assign([A1])
        assert await consumer.position(A1) == 0

        async def send_later() -> None:
            await trio.sleep(1)
            put(cluster, A1, 3)

        nursery.start_soon(send_later)
        msgs = await consumer.poll(timeout_s=30)
        assert [m.body for m in msgs] == [b"%s-%d" % (str(A1).encode(), i) for i in range(3)]


async def test_a_second_task_polling_at_once_is_refused(cluster, autojump_clock):
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as consumer, trio.open_nursery() as nursery:
        consumer.assign([A0])
        nursery.start_soon(consumer.poll, 5.0)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError, match="another task is already polling"):
            await consumer.poll()


# -- start positions -------------------------------------------------------------------------------------------------
async def test_a_new_queue_starts_at_the_committed_offset_else_where_consume_from_where_says(cluster, autojump_clock):
    for mq in (A0, A1, B0):
        put(cluster, mq, 10)
    group_of(cluster, A0).offsets[(GROUP, T, 0)] = 7
    async with open_lite_pull_consumer(NAMESRV, consumer_group=GROUP) as consumer:  # CONSUME_FROM_LAST_OFFSET
        consumer.assign([A0, A1])
        assert await consumer.position(A0) == 7 and await consumer.position(A1) == 10
        assert offsets(await poll_n(consumer, 3), A0) == [7, 8, 9]
        # With auto-commit, a start found from consume_from_where is committed at once: a restart before the first
        # auto-commit would find the queue's end again, past the messages sent meanwhile.
        await wait_for(lambda: broker_offset(cluster, A1) == 10, timeout_s=1)
        assert await consumer.committed(A0) == 7 and await consumer.committed(A1) == 10
    async with open_lite_pull_consumer(NAMESRV, **OPEN, auto_commit=False) as consumer:
        consumer.assign([B0])
        assert await consumer.position(B0) == 0
        assert await consumer.committed(B0) is None  # without auto-commit, nothing is committed unasked


# -- seeks -----------------------------------------------------------------------------------------------------------
async def test_seek_drops_what_is_cached_and_hands_out_from_the_new_offset(cluster, autojump_clock):
    put(cluster, A0, 40)
    async with open_lite_pull_consumer(NAMESRV, **OPEN, auto_commit=False) as consumer:
        consumer.assign([A0])
        await wait_for(lambda: consumer.statistics().cached == 40)
        await consumer.seek(A0, 30)
        assert consumer.statistics().cached == 0 and await consumer.position(A0) == 30
        assert offsets(await poll_n(consumer, 10), A0) == list(range(30, 40))
        await consumer.seek_to_begin(A0)
        assert offsets(await consumer.poll(max_messages=5), A0) == [0, 1, 2, 3, 4]
        await consumer.seek_to_end(A0)
        assert await consumer.position(A0) == 40 and await consumer.poll(timeout_s=1) == []
        await consumer.seek(A0, 40)  # max_offset itself is allowed: the next message sent
        with pytest.raises(ValueError, match=r"seek offset 41 of LiteTopic@broker-a:0 is outside the queue: "
                                             r"min_offset 0, max_offset 40"):
            await consumer.seek(A0, 41)
        with pytest.raises(ValueError, match=r"offset must be an integer within 0\.\.\d+, got -1"):
            await consumer.seek(A0, -1)
        with pytest.raises(ValueError, match="seek: LiteTopic@broker-a:1 is not assigned to this consumer"):
            await consumer.seek(A1, 0)
        with pytest.raises(TypeError, match="mq must be a MessageQueue, got 'LiteTopic'"):
            await consumer.seek(T, 0)
        put(cluster, A0, 2)
        assert offsets(await poll_n(consumer, 2), A0) == [40, 41]


async def test_a_seek_while_a_pull_is_in_flight_discards_its_answer(cluster, autojump_clock):
    async with open_lite_pull_consumer(NAMESRV, **OPEN, auto_commit=False, request_timeout_ms=60_000,
                                       leader_silence_timeout_ms=0) as consumer:
        consumer.assign([A0])
        assert await consumer.position(A0) == 0
        cluster.hung.add("a:1")  # the leader holds the next pull until it is let go
        await wait_for(lambda: any(code == RequestCode.PULL_MESSAGE for conn in [cluster.conns.get("a:1")] if conn
                                   for _, code, _ in conn.waiting.values()))
        put(cluster, A0, 10)
        cluster.hung.discard("a:1")
        await consumer.seek(A0, 8)
        cluster.resume("a:1")  # the pull held answers (offset 0): nobody is waiting for it any more
        assert offsets(await poll_n(consumer, 2), A0) == [8, 9]
        assert await consumer.poll(timeout_s=1) == []


# -- pause and resume ------------------------------------------------------------------------------------------------
async def test_a_paused_queue_is_neither_handed_out_nor_pulled_until_resumed(cluster, autojump_clock):
    put(cluster, A0, 5)
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as consumer:
        consumer.assign([A0, B0])
        await wait_for(lambda: consumer.statistics().cached == 5)
        consumer.pause([A0])
        assert consumer.paused() == {A0}
        put(cluster, B0, 3)
        put(cluster, A0, 5)
        assert offsets(await poll_n(consumer, 3), B0) == [0, 1, 2]
        assert await consumer.poll(timeout_s=2) == []
        pulls = cluster.recorder.pulls_of(A0)
        await trio.sleep(5)
        assert cluster.recorder.pulls_of(A0) == pulls  # at most the one in flight when paused
        assert consumer.statistics().cached <= 10
        consumer.resume([A0])
        assert offsets(await poll_n(consumer, 10), A0) == list(range(10))
        with pytest.raises(ValueError, match="pause: LiteTopic@broker-a:1 is not assigned"):
            consumer.pause([A1])


# -- commits ---------------------------------------------------------------------------------------------------------
async def test_commit_sync_and_commit_send_what_poll_handed_out(cluster, autojump_clock):
    put(cluster, A0, 30)
    async with open_lite_pull_consumer(NAMESRV, **OPEN, auto_commit=False) as consumer:
        consumer.assign([A0, A1])
        await poll_n(consumer, 10, max_messages=10)
        await consumer.commit_sync()
        assert broker_offset(cluster, A0) == 10 and broker_offset(cluster, A1) == 0
        assert await consumer.committed(A0) == 10
        await poll_n(consumer, 10, max_messages=10)
        consumer.commit()  # sent in the background, at once
        await wait_for(lambda: broker_offset(cluster, A0) == 20, timeout_s=1)
        await consumer.commit_sync({A0: 15})  # an explicit offset, as RocketMQ 5's commit(offsets)
        assert broker_offset(cluster, A0) == 15
        await poll_n(consumer, 10, max_messages=10)
        await trio.sleep(30)
    # Without auto-commit nothing more is sent: not periodically, not on close.
    assert broker_offset(cluster, A0) == 15
    assert [c for c in cluster.recorder.commits if c[0] == A0] == [(A0, 10), (A0, 20), (A0, 15)]


async def test_auto_commit_sends_what_earlier_polls_handed_out_and_everything_on_a_normal_close(cluster,
                                                                                               autojump_clock):
    put(cluster, A0, 40)
    async with open_lite_pull_consumer(NAMESRV, **OPEN, auto_commit_interval_ms=1000) as consumer:
        consumer.assign([A0])
        assert await consumer.position(A0) == 0
        assert offsets(await consumer.poll(max_messages=10), A0) == list(range(10))
        await trio.sleep(1.5)
        # The batch just returned may still be in the application's hands: only the start is committed.
        assert broker_offset(cluster, A0) == 0
        await consumer.poll(max_messages=10)  # asking for more: the first 10 count as consumed
        await trio.sleep(1.5)
        assert broker_offset(cluster, A0) == 10
        await consumer.poll(max_messages=10)
    assert broker_offset(cluster, A0) == 30  # a normal close: everything poll handed out
    assert [o for mq, o in cluster.recorder.commits] == [0, 10, 30]


async def test_leaving_by_an_exception_commits_only_up_to_the_last_poll(cluster, autojump_clock):
    put(cluster, A0, 40)
    with pytest.raises(RuntimeError, match="processing failed"):
        async with open_lite_pull_consumer(NAMESRV, **OPEN, auto_commit_interval_ms=HOUR) as consumer:
            consumer.assign([A0])
            await consumer.poll(max_messages=10)
            await consumer.poll(max_messages=10)
            raise RuntimeError("processing failed")
    assert broker_offset(cluster, A0) == 10  # the last poll's 10 messages come again
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as consumer:
        consumer.assign([A0])
        assert offsets(await consumer.poll(max_messages=5), A0) == [10, 11, 12, 13, 14]


async def test_a_commit_the_leader_missed_is_sent_again(cluster, autojump_clock):
    put(cluster, A0, 10)
    a = group_of(cluster, A0)
    async with open_lite_pull_consumer(NAMESRV, **OPEN, auto_commit=False, auto_commit_interval_ms=500) as consumer:
        consumer.assign([A0])
        await poll_n(consumer, 10)
        a.dead.add("a:1")  # the leader dies; the group elects a:2
        a.leader = "a:2"
        with pytest.raises(client.errors.ConnectError):
            await consumer.commit_sync()
        await wait_for(lambda: broker_offset(cluster, A0) == 10)  # retried in the background, on the new leader
        assert consumer.statistics().cached == 0


# -- reassignment ----------------------------------------------------------------------------------------------------
async def test_assign_replaces_the_assignment_dropping_the_caches_of_queues_gone(cluster, autojump_clock):
    for mq in (A0, A1, B0):
        put(cluster, mq, 10)
    async with open_lite_pull_consumer(NAMESRV, **OPEN, auto_commit_interval_ms=HOUR) as consumer:
        consumer.assign([A0, A1])
        await wait_for(lambda: consumer.statistics().cached == 20)
        got = await consumer.poll(max_messages=4)
        kept = {m.message_queue for m in got}.pop()
        gone = ({A0, A1} - {kept}).pop()
        consumer.pause([A0, A1])
        assert await consumer.poll(timeout_s=0) == []  # stores the positions (auto-commit): 4 and 0
        consumer.resume([kept])
        consumer.assign([kept, B0])
        assert consumer.assignment() == {kept, B0} and consumer.paused() == frozenset()
        # Unassigning sent the stored positions at once (the next one to consume the queue gone starts there).
        await wait_for(lambda: broker_offset(cluster, gone) == 0 and broker_offset(cluster, kept) == 4, timeout_s=1)
        pulls = cluster.recorder.pulls_of(gone)
        got = await poll_n(consumer, 16)
        assert offsets(got, kept) == list(range(4, 10)) and offsets(got, B0) == list(range(10))
        assert offsets(got, gone) == [] and cluster.recorder.pulls_of(gone) == pulls
        assert consumer.statistics().cached == 0
        consumer.assign([])
        assert consumer.assignment() == frozenset() and await consumer.poll(timeout_s=1) == []


# -- bounds ----------------------------------------------------------------------------------------------------------
async def test_prefetch_stops_at_the_per_queue_bounds(cluster, autojump_clock):
    put(cluster, A0, 100)
    async with open_lite_pull_consumer(NAMESRV, **OPEN, pull_batch_size=8, pull_threshold_for_queue=20) as consumer:
        consumer.assign([A0])
        await wait_for(lambda: consumer.statistics().cached >= 20)
        await trio.sleep(5)
        assert consumer.statistics().cached == 24  # pulls of 8 until 20 are cached: one may go past by its size
        await consumer.poll(max_messages=10)
        await wait_for(lambda: consumer.statistics().cached >= 20)
        await trio.sleep(5)
        assert consumer.statistics().cached == 22
    put(cluster, A1, 20, size=300 * 1024)
    async with open_lite_pull_consumer(NAMESRV, **OPEN, pull_batch_size=2,
                                       pull_threshold_size_for_queue_mib=1) as consumer:
        consumer.assign([A1])
        await wait_for(lambda: consumer.statistics().cached_bytes >= 1 << 20)
        await trio.sleep(5)
        assert consumer.statistics().cached == 4  # 4 x 300 KiB: past 1 MiB with the second pull of 2


async def test_prefetch_stops_at_the_bound_across_all_queues(cluster, autojump_clock):
    for mq in (A0, A1, B0):
        put(cluster, mq, 100)
    async with open_lite_pull_consumer(NAMESRV, **OPEN, pull_batch_size=8, pull_threshold_for_all=30) as consumer:
        consumer.assign([A0, A1, B0])
        await wait_for(lambda: consumer.statistics().cached >= 30)
        await trio.sleep(5)
        assert 30 <= consumer.statistics().cached < 30 + 3 * 8
        got = await poll_n(consumer, 300, max_messages=50)
        for mq in (A0, A1, B0):
            assert offsets(got, mq) == list(range(100))


# -- failures --------------------------------------------------------------------------------------------------------
async def test_pulls_back_off_after_errors_and_follow_the_group_to_its_followers(cluster, autojump_clock):
    a = group_of(cluster, A0)
    async with open_lite_pull_consumer(NAMESRV, **OPEN, pull_time_delay_ms_when_exception=200) as consumer:
        consumer.assign([A0])
        assert await consumer.position(A0) == 0
        a.dead.update(a.addrs)  # the whole group is down
        await wait_for(lambda: consumer.statistics().pull_errors >= 1)  # the long poll in flight has answered
        put(cluster, A0, 5)
        errors = consumer.statistics().pull_errors
        assert await consumer.poll(timeout_s=2) == []
        assert 1 <= consumer.statistics().pull_errors - errors <= 2 / 0.2 + 1  # one a pause, no spin (virtual time)
        a.dead = {"a:1"}  # the leader stays down: its followers serve the pulls
        assert offsets(await poll_n(consumer, 5), A0) == list(range(5))
        put(cluster, A0, 3)
        assert offsets(await poll_n(consumer, 3), A0) == [5, 6, 7]


async def test_an_assign_mode_consumer_joins_no_group(cluster, autojump_clock):
    put(cluster, A0, 3)
    async with open_lite_pull_consumer(NAMESRV, **OPEN, heartbeat_broker_interval_ms=100) as consumer:
        consumer.assign([A0])
        await poll_n(consumer, 3)
        await trio.sleep(2)
    codes = {code for _, code, _ in cluster.recorder.requests}
    assert not codes & {RequestCode.HEART_BEAT, RequestCode.GET_CONSUMER_LIST_BY_GROUP, RequestCode.UNREGISTER_CLIENT}
    assert all(not g.members[GROUP] for g in cluster.groups)


# -- bad arguments and a closed consumer -----------------------------------------------------------------------------
async def test_bad_arguments_are_refused_naming_them(cluster, autojump_clock):
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as consumer:
        for call, error, text in [
            (lambda: consumer.assign(A0), TypeError, "queues must be a collection of MessageQueue, got MessageQueue"),
            (lambda: consumer.assign("LiteTopic"), TypeError, "queues must be a collection"),
            (lambda: consumer.assign([A0, 3]), TypeError, r"queues\[1\] must be a MessageQueue, got 3"),
            (lambda: consumer.assign([MessageQueue(T, "broker-a", -1)]), ValueError,
             r"queues\[0\] .*queue_id must be an integer within 0\.\."),
            (lambda: consumer.resume([A0]), ValueError, "resume: LiteTopic@broker-a:0 is not assigned"),
            (lambda: consumer.commit({A0: 1}), ValueError, "commit: LiteTopic@broker-a:0 is not assigned"),
        ]:
            with pytest.raises(error, match=text):
                call()
        consumer.assign([A0])
        for coro, error, text in [
            (consumer.poll(timeout_s=-1), ValueError, "timeout_s must be a non-negative number of seconds, got -1"),
            (consumer.poll(max_messages=0), ValueError, r"max_messages must be an integer within 1\.\.65535, got 0"),
            (consumer.commit_sync({A0: -5}), ValueError, r"commit_sync: offset of LiteTopic@broker-a:0 must be an "
                                                        r"integer within 0\.\.\d+, got -5"),
            (consumer.commit_sync([A0]), TypeError, "commit_sync: offsets must map MessageQueue to offset"),
            (consumer.fetch_queues(""), ValueError, "topic must be a non-empty string"),
            (consumer.committed(None), TypeError, "mq must be a MessageQueue, got None"),
            (consumer.position(A1), ValueError, "position: LiteTopic@broker-a:1 is not assigned"),
        ]:
            with pytest.raises(error, match=text):
                await coro
        assert sorted(await consumer.fetch_queues(T)) == sorted(
            MessageQueue(T, b, q) for b in ("broker-a", "broker-b") for q in range(4))
    for key, value, text in [("pull_threshold_for_queue", 0, "pull_threshold_for_queue must be"),
                             ("auto_commit_interval_ms", 0, "auto_commit_interval_ms must be"),
                             ("consume_from_where", "CONSUME_FROM_MAX_OFFSET", "consume_from_where must be"),
                             ("poll_max_messages", 70_000, "poll_max_messages must be")]:
        with pytest.raises(ConfigError, match=text):
            async with open_lite_pull_consumer(NAMESRV, **{**OPEN, key: value}):
                pass
    assert LitePullConsumerConfig().auto_commit and LitePullConsumerConfig().auto_commit_interval_ms == 5000


def test_every_numeric_option_has_an_upper_bound():
    # What tests/unit/test_config_bounds.py checks of the other client configs.
    hints = typing.get_type_hints(LitePullConsumerConfig)
    assert [f.name for f in dataclasses.fields(LitePullConsumerConfig)
            if hints[f.name] in (int, float) and f.metadata.get("max") is None] == []


async def test_a_closed_consumer_says_so(cluster, autojump_clock):
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as consumer:
        consumer.assign([A0])
    for call in (consumer.poll(), consumer.seek(A0, 0), consumer.commit_sync(), consumer.committed(A0),
                 consumer.fetch_queues(T), consumer.position(A0)):
        with pytest.raises(ClientClosedError, match=r"the lite pull consumer of group 'lite_group' is closed"):
            await call
    for sync_call in (lambda: consumer.assign([A0]), consumer.assignment, consumer.commit,
                      lambda: consumer.pause([A0])):
        with pytest.raises(ClientClosedError, match="is closed"):
            sync_call()


async def test_a_poll_waiting_in_another_task_ends_when_the_consumer_closes(cluster, autojump_clock):
    errors: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        async with open_lite_pull_consumer(NAMESRV, **OPEN) as consumer:
            consumer.assign([A0])

            async def poller() -> None:
                try:
                    await consumer.poll(timeout_s=600)
                except ClientClosedError as e:
                    errors.append(e)

            nursery.start_soon(poller)
            await trio.testing.wait_all_tasks_blocked()
    assert len(errors) == 1 and "poll: the lite pull consumer" in str(errors[0])


async def test_an_offset_beyond_the_queue_end_follows_the_brokers_correction(cluster, autojump_clock):
    # A committed offset past the end (a wiped store): the leader answers PULL_OFFSET_MOVED naming where to go on.
    put(cluster, A0, 10)
    group_of(cluster, A0).offsets[(GROUP, T, 0)] = 50
    async with open_lite_pull_consumer(NAMESRV, **OPEN) as consumer:
        consumer.assign([A0])
        assert offsets(await poll_n(consumer, 10), A0) == list(range(10))
        assert await consumer.position(A0) == 10


async def test_a_poll_after_a_seek_or_a_pause_waits_for_messages_instead_of_returning_none(cluster, autojump_clock):
    # Found by review: the sought (or paused) queue's stale turn in the ready round ended the wait at once, with [].
    put(cluster, A0, 40)
    async with open_lite_pull_consumer(NAMESRV, **OPEN, auto_commit=False) as consumer, trio.open_nursery() as n:
        consumer.assign([A0, B0])
        await wait_for(lambda: consumer.statistics().cached == 40)
        await consumer.seek(A0, 30)
        assert offsets(await consumer.poll(timeout_s=30), A0) == list(range(30, 40))
        await wait_for(lambda: consumer.statistics().cached == 0)
        put(cluster, A0, 5)
        await wait_for(lambda: consumer.statistics().cached == 5)
        consumer.pause([A0])

        async def later() -> None:
            await trio.sleep(1)
            put(cluster, B0, 3)

        n.start_soon(later)
        assert offsets(await consumer.poll(timeout_s=30), B0) == [0, 1, 2]


async def test_an_idle_queue_without_long_polling_is_not_pulled_in_a_spin(cluster):
    # broker_suspend_max_time_ms=0 (allowed): each NO_NEW_MSG was followed by the next pull at once (7,440 pulls in
    # 0.2 s of one idle queue); now pull_time_delay_ms_when_exception (200 ms) apart. A count, not a speed.
    async with open_lite_pull_consumer(NAMESRV, **OPEN, broker_suspend_max_time_ms=0) as consumer:
        consumer.assign([A0])
        await consumer.position(A0)
        await trio.sleep(0.5)
        assert consumer.statistics().pulls < 50
