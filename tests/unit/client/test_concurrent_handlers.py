"""The concurrent handler form's pool of handler calls (``max_concurrent_handlers``, RocketMQ's consumeThreadMax),
against the in-memory fake cluster on trio's MockClock: calls of one queue overlap up to the bound and never beyond
it, queues share the bound fairly (also when a task that finished a call goes on with its queue's next message), a
local retry holds its queue, and a queue's committed offset never passes a message whose call has not finished,
whether later ones finish first, the queue is taken away or the consumer closes with calls in flight (their messages
are delivered again: at least once). Nothing here measures wall-clock time: handlers wait on events, and
tests wait for counts. The same with real processes: tests/cluster/test_concurrent_handlers_e2e.py."""

from __future__ import annotations

import pytest
import trio

from client import ConsumeStatus, Message, open_push_consumer
from client.errors import ConfigError
from client.push_consumer import PushConsumerConfig
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from tests.unit.client.fake_cluster import NAMESRV, recording_fake, send_numbered, wait_until

GROUP = "g"
FIRST = dict(consumer_group=GROUP, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
             persist_consumer_offset_interval_ms=100, rebalance_interval_ms=1_000)
# A client id that sorts before every real one ("<client_ip>@..."), so a member by that name takes the only queue.
INTRUDER = "0.0.0.0@intruder"


@pytest.fixture
def one_queue(monkeypatch):
    return recording_fake(monkeypatch, 1)


@pytest.fixture
def two_queues(monkeypatch):
    return recording_fake(monkeypatch, 2)


class Calls:
    """A handler that counts its calls running at once and holds each until its message's gate opens."""

    def __init__(self, gated: set[bytes] | None = None) -> None:
        self.gated = gated  # None: every message waits for its gate
        self.gates: dict[bytes, trio.Event] = {}
        self.running = 0
        self.most_running = 0
        self.started: list[bytes] = []
        self.finished: list[bytes] = []
        self.cancelled: list[bytes] = []

    def gate(self, body: bytes) -> trio.Event:
        return self.gates.setdefault(body, trio.Event())

    def open_all(self) -> None:
        self.gated = set()
        for gate in self.gates.values():
            gate.set()

    async def __call__(self, msg) -> None:
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        self.started.append(msg.body)
        try:
            if self.gated is None or msg.body in self.gated:
                await self.gate(msg.body).wait()
            else:
                await trio.sleep(0)  # a real checkpoint, as any I/O would be
        except trio.Cancelled:
            self.cancelled.append(msg.body)
            raise
        finally:
            self.running -= 1
        self.finished.append(msg.body)


def test_max_concurrent_handlers_defaults_to_rocketmqs_20_and_is_bounded():
    assert PushConsumerConfig().max_concurrent_handlers == 20  # consumeThreadMax
    for value, problem in ((0, ">= 1"), (1001, "<= 1000")):
        with pytest.raises(ConfigError, match=f"^max_concurrent_handlers must be {problem}, got {value}$"):
            PushConsumerConfig(max_concurrent_handlers=value)
    assert PushConsumerConfig(max_concurrent_handlers=1000).max_concurrent_handlers == 1000


async def test_calls_of_one_queue_overlap_up_to_the_bound_and_never_beyond(one_queue, autojump_clock):
    """One queue of 30 messages, every call held open: exactly max_concurrent_handlers run at once, however long
    they are held (before: one at a time per queue), started in offset order; the rest start as calls finish."""
    calls = Calls()
    await send_numbered(30)
    async with open_push_consumer(NAMESRV, topic="T", handler=calls, max_concurrent_handlers=7, **FIRST) as consumer:
        await wait_until(lambda: calls.running == 7)
        await trio.sleep(30)  # pulls and rebalances go on meanwhile; no eighth call starts
        assert (calls.running, calls.most_running, consumer.statistics().handling) == (7, 7, 7)
        assert calls.started == [b"%d" % i for i in range(7)]
        assert consumer.statistics().cached == 30  # flow control counts the messages in calls
        calls.gate(b"4").set()
        await wait_until(lambda: len(calls.started) == 8)
        await trio.sleep(5)
        assert calls.running == 7 and calls.started[-1] == b"7"
        calls.open_all()
        await wait_until(lambda: len(calls.finished) == 30)
        assert calls.most_running == 7 and consumer.statistics().handling == 0
    assert sorted(calls.finished) == sorted(b"%d" % i for i in range(30))
    assert calls.started == [b"%d" % i for i in range(30)]


async def test_the_bound_is_shared_by_all_queues_and_freed_slots_go_round_them(two_queues, autojump_clock):
    """Queue 0 has a backlog of 40 slow messages, queue 1 a few; with 4 slots, queue 1 is not kept waiting until
    queue 0's backlog is done: freed slots alternate between the queues that wait for one."""
    order: list[bytes] = []
    running = 0
    most = 0

    async def handler(msg) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            await trio.sleep(1)  # virtual time: I/O-bound work
        finally:
            running -= 1
        order.append(msg.body)

    await send_numbered(40, queue_id=0, prefix=b"a")
    await send_numbered(5, queue_id=1, prefix=b"b")
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, max_concurrent_handlers=4, **FIRST):
        await wait_until(lambda: len(order) == 45, timeout_s=600)
    assert most == 4
    last_b = max(i for i, body in enumerate(order) if body.startswith(b"b"))
    assert last_b < 20, order  # all of queue 1 done while most of queue 0's backlog still waited


async def test_a_call_that_finishes_goes_on_with_its_queue_only_when_no_other_queue_waits_for_a_slot(
        two_queues, autojump_clock):
    """One slot, both queues with a backlog of quick messages, both waiting while the first call (a0 or b0, whichever
    queue came first) holds the slot: from then on the queues take turns, call by call. A task that has finished a
    call takes its queue's next message only with a slot nobody waits for; taking it while the other queue waited
    made one queue's backlog run through first."""
    calls = Calls(gated={b"a0", b"b0"})
    await send_numbered(10, queue_id=0, prefix=b"a")
    await send_numbered(10, queue_id=1, prefix=b"b")
    async with open_push_consumer(NAMESRV, topic="T", handler=calls, max_concurrent_handlers=1, **FIRST) as consumer:
        await wait_until(lambda: calls.running == 1)
        await trio.sleep(5)  # both queues pulled: their dispatchers wait for the slot
        assert len(calls.started) == 1 and consumer.statistics().cached == 20
        calls.open_all()
        await wait_until(lambda: len(calls.finished) == 20)
    after = calls.started[1:]
    for i in range(1, 19):
        # At most one call ahead, whichever queue got the slot the first call gave back (their order in the FIFO).
        assert abs(sum(b.startswith(b"a") for b in after[:i]) - sum(b.startswith(b"b") for b in after[:i])) <= 1, after
    assert [b for b in calls.started if b.startswith(b"a")] == [b"a%d" % i for i in range(10)]
    assert [b for b in calls.started if b.startswith(b"b")] == [b"b%d" % i for i in range(10)]


async def test_a_local_retry_holds_its_queue_from_calls_that_finish_meanwhile_too(one_queue, autojump_clock,
                                                                                  tmp_path):
    """Broadcasting (no broker to hand a failure to): message 1 fails and waits reconsume_delay_ms to be retried here,
    holding its queue. Message 0's call, running meanwhile, goes on and finishes, and its task starts nothing more:
    2 starts only after 1 has been retried."""
    started: list[tuple[bytes, int]] = []
    finished: list[bytes] = []
    gate = trio.Event()

    async def handler(msg):
        started.append((msg.body, msg.reconsume_times))
        if msg.body == b"1" and msg.reconsume_times == 0:
            return ConsumeStatus.RECONSUME_LATER  # at once: the local retry begins before another call can start
        if msg.body == b"0":
            await gate.wait()
        else:
            await trio.sleep(0)
        finished.append(msg.body)

    await send_numbered(10)
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, consumer_group=GROUP,
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", message_model="BROADCASTING",
                                  offset_store_dir=str(tmp_path), reconsume_delay_ms=10_000) as consumer:
        await wait_until(lambda: len(started) == 2)
        retry_began = trio.current_time()
        gate.set()
        await wait_until(lambda: finished == [b"0"])
        await trio.sleep(5)
        assert trio.current_time() - retry_began < 10  # still in the retry's delay
        assert started == [(b"0", 0), (b"1", 0)] and consumer.statistics().handling == 0
        await wait_until(lambda: len(finished) == 10)
    assert started == [(b"0", 0), (b"1", 0), (b"1", 1)] + [(b"%d" % i, 0) for i in range(2, 10)]


async def test_the_committed_offset_never_passes_a_message_whose_call_has_not_finished(one_queue, autojump_clock):
    """Message 2 is held while 0, 1 and 3..9 finish: every commit stops at 2 (RocketMQ's ProcessQueue TreeMap's first
    key), however many later ones finished and however often offsets are persisted; once 2 finishes, the offset
    moves to the end at once."""
    calls = Calls(gated={b"2"})
    await send_numbered(10)
    async with open_push_consumer(NAMESRV, topic="T", handler=calls, **FIRST) as consumer:
        await wait_until(lambda: len(calls.finished) == 9)
        assert calls.running == 1 and b"2" not in calls.finished
        await trio.sleep(5)  # fifty persist intervals
        assert one_queue.commits and max(offset for _, offset in one_queue.commits) == 2
        assert one_queue.groups[0].offsets[(GROUP, "T", 0)] == 2
        assert consumer.statistics().cached == 1
        held = len(one_queue.commits)
        calls.open_all()
        await wait_until(lambda: one_queue.groups[0].offsets[(GROUP, "T", 0)] == 10)
    assert all(offset <= 2 for _, offset in one_queue.commits[:held])


async def test_a_queue_taken_away_with_calls_in_flight_commits_nothing_past_them_and_loses_nothing(
        one_queue, autojump_clock):
    """Messages 3 and 6 are in their calls when the queue goes to another member: those calls are cancelled, as the
    one call per queue was; the commit stops at 3, and the queue's next holder gets 3 to 9 again (at least once),
    3 and 6 included."""
    calls = Calls(gated={b"3", b"6"})
    group = one_queue.groups[0]
    await send_numbered(10)
    async with open_push_consumer(NAMESRV, topic="T", handler=calls, **FIRST) as consumer:
        await wait_until(lambda: len(calls.finished) == 8)
        assert calls.running == 2
        group.members[GROUP].add(INTRUDER)  # sorts first: the only queue is the intruder's now
        consumer.trigger_rebalance()
        await wait_until(lambda: not consumer.assigned_queues())
        await trio.sleep(1)
        assert sorted(calls.cancelled) == [b"3", b"6"] and calls.running == 0
        assert group.offsets[(GROUP, "T", 0)] == 3
        assert max(offset for _, offset in one_queue.commits) == 3
        # The intruder leaves; the queue comes back, from the committed offset.
        group.members[GROUP].discard(INTRUDER)
        calls.open_all()
        consumer.trigger_rebalance()
        await wait_until(lambda: group.offsets[(GROUP, "T", 0)] == 10)
    assert set(calls.finished) == {b"%d" % i for i in range(10)}
    assert sorted(calls.finished[8:]) == sorted(b"%d" % i for i in range(3, 10))  # redelivered from 3


async def test_close_with_calls_in_flight_commits_nothing_past_them_and_the_next_member_gets_them(
        one_queue, autojump_clock):
    """Close cancels the calls in flight (as it did the one call per queue) and commits the offset of the first
    unfinished message; a member opened afterwards starts there and gets every message from it again."""
    calls = Calls(gated={b"3", b"6"})
    group = one_queue.groups[0]
    await send_numbered(10)
    async with open_push_consumer(NAMESRV, topic="T", handler=calls, **FIRST):
        await wait_until(lambda: len(calls.finished) == 8)
        assert calls.running == 2
    assert sorted(calls.cancelled) == [b"3", b"6"] and calls.running == 0
    assert group.offsets[(GROUP, "T", 0)] == 3
    assert max(offset for _, offset in one_queue.commits) == 3

    again = Calls(gated=set())
    async with open_push_consumer(NAMESRV, topic="T", handler=again, **FIRST):
        await wait_until(lambda: group.offsets[(GROUP, "T", 0)] == 10)
    assert sorted(again.finished) == sorted(b"%d" % i for i in range(3, 10))


async def test_a_call_past_consume_timeout_is_cancelled_while_the_queues_later_messages_go_on(one_queue,
                                                                                               autojump_clock):
    """RocketMQ's consumeTimeout in the concurrent form: the slow call is cancelled after consume_timeout_min and its
    message sent back (a failure); the messages after it were handled meanwhile, and the offset waited for it."""
    sent_back: list[int] = []
    answer = one_queue.invoke

    async def invoke(addr, request, timeout_s=3.0):
        if request.code == RequestCode.CONSUMER_SEND_MSG_BACK:
            sent_back.append(request.ext["offset"])  # the message's commit-log offset
            return make_response(request, ResponseCode.SUCCESS)
        return await answer(addr, request, timeout_s)

    one_queue.invoke = invoke
    calls = Calls(gated={b"0"})
    await send_numbered(5)
    async with open_push_consumer(NAMESRV, topic="T", handler=calls, consume_timeout_min=1, **FIRST):
        await wait_until(lambda: len(calls.finished) == 4)
        started = trio.current_time()
        assert one_queue.groups[0].offsets.get((GROUP, "T", 0), 0) == 0
        await wait_until(lambda: one_queue.groups[0].offsets[(GROUP, "T", 0)] == 5, timeout_s=120)
        assert 55 <= trio.current_time() - started <= 61
    assert calls.cancelled == [b"0"] and len(sent_back) == 1
