"""The push consumer's pull-side controls, against the in-memory fake cluster on trio's MockClock:
``consume_concurrently_max_span`` (RocketMQ's consumeConcurrentlyMaxSpan: a message stuck in its handler holds its
queue's pulls, which bounds what is handled again after a restart), ``pull_interval_ms`` (RocketMQ's pullInterval)
and ``suspend()`` / ``resume()``. Nothing here measures wall-clock time: handlers wait on events, and tests wait for
counts; times compared are the mock clock's."""

from __future__ import annotations

import logging

import pytest
import trio

from client import MessageQueue, open_push_consumer
from client.errors import ClientClosedError, ConfigError
from client.push_consumer import PushConsumerConfig
from remoting.codes import RequestCode
from tests.unit.client.fake_cluster import NAMESRV, FakeRemoting, recording_fake, send_numbered, wait_until
from tests.unit.client.test_concurrent_handlers import (  # noqa: F401 (one_queue, two_queues: fixtures)
    FIRST, GROUP, INTRUDER, Calls, one_queue, two_queues)

T0 = MessageQueue("T", "broker-a", 0)


@pytest.fixture
def held_pulls(monkeypatch):
    return recording_fake(monkeypatch, 1, hold_pulls=True)


def _committed(fake: FakeRemoting, queue_id: int = 0) -> int | None:
    return fake.groups[0].offsets.get((GROUP, "T", queue_id))


def test_the_keys_default_to_rocketmqs_and_take_its_ranges():
    config = PushConsumerConfig()
    assert (config.consume_concurrently_max_span, config.pull_interval_ms) == (2000, 0)
    for key, value, problem in (("consume_concurrently_max_span", 0, ">= 1"),
                                ("consume_concurrently_max_span", 65_536, "<= 65535"),
                                ("pull_interval_ms", -1, ">= 0"), ("pull_interval_ms", 65_536, "<= 65535")):
        with pytest.raises(ConfigError, match=f"^{key} must be {problem}, got {value}$"):
            PushConsumerConfig(**{key: value})
    assert PushConsumerConfig(consume_concurrently_max_span=1, pull_interval_ms=65_535).pull_interval_ms == 65_535


# -- consume_concurrently_max_span -------------------------------------------------------------------------------

async def test_a_stuck_message_holds_its_queue_at_the_span_and_bounds_what_a_restart_handles_again(
        one_queue, autojump_clock, caplog):
    """Message 0 is stuck in its handler while the rest go on. Pulls of 10 stop once the offsets from 0 to the last
    one pulled span more than 50 (at 59), and stay stopped after 1..59 were all handled: the span is counted to the
    last offset pulled (RocketMQ's, to the largest still cached, fell back to 0 there and pulled on, a batch at a
    time, without end). Before, all 300 were handled while the committed offset stayed at 0, and a restart handled
    all 299 again; now the next member handles again only what the span let through."""
    caplog.set_level(logging.WARNING, logger="client.push_consumer")
    calls = Calls(gated={b"0"})
    await send_numbered(300)
    async with open_push_consumer(NAMESRV, topic="T", handler=calls, consume_concurrently_max_span=50,
                                  pull_batch_size=10, **FIRST) as consumer:
        await wait_until(lambda: len(calls.finished) == 59)
        await trio.sleep(60)  # rebalances, commits and (were it not stopped) pulls meanwhile
        assert sorted(calls.started) == sorted(b"%d" % i for i in range(60))
        assert calls.running == 1 and consumer.statistics().cached == 1
        assert _committed(one_queue) == 0
    warnings = [r for r in caplog.records if "consume_concurrently_max_span" in r.getMessage()]
    assert len(warnings) == 1 and "least_offset=0 last_pulled=59 span=59 max_span=50" in warnings[0].getMessage()
    assert calls.cancelled == [b"0"] and _committed(one_queue) == 0

    again = Calls(gated=set())
    async with open_push_consumer(NAMESRV, topic="T", handler=again, **FIRST):
        await wait_until(lambda: _committed(one_queue) == 300)
    assert len(again.finished) == 300
    assert len(set(again.finished) & set(calls.finished)) == 59  # handled twice: 1..59, not 1..299


async def test_the_queue_pulls_on_once_the_stuck_message_is_done(one_queue, autojump_clock):
    """The span bound waits for the message, not for a timer: once 0's call finishes, the queue's pulls go on at
    once and the committed offset follows to the end."""
    calls = Calls(gated={b"0"})
    await send_numbered(200)
    async with open_push_consumer(NAMESRV, topic="T", handler=calls, consume_concurrently_max_span=50,
                                  pull_batch_size=10, **FIRST):
        await wait_until(lambda: len(calls.finished) == 59)
        await trio.sleep(10)
        assert len(calls.started) == 60
        calls.open_all()
        await wait_until(lambda: _committed(one_queue) == 200)
    assert sorted(calls.finished) == sorted(b"%d" % i for i in range(200))


async def test_the_span_bound_holds_only_the_queue_whose_message_is_stuck(two_queues, autojump_clock):
    """Queue 0's message 0 is stuck; queue 1 shares no flow control with it and is consumed to its end."""
    calls = Calls(gated={b"a0"})
    await send_numbered(100, queue_id=0, prefix=b"a")
    await send_numbered(100, queue_id=1, prefix=b"b")
    async with open_push_consumer(NAMESRV, topic="T", handler=calls, consume_concurrently_max_span=20,
                                  pull_batch_size=10, **FIRST):
        await wait_until(lambda: _committed(two_queues, 1) == 100)
        await trio.sleep(10)
        assert sum(body.startswith(b"a") for body in calls.started) == 30  # pulls of 10 until 29 - 0 > 20
        calls.open_all()
        await wait_until(lambda: _committed(two_queues, 0) == 100)


async def test_the_iterator_form_is_not_span_bound_it_consumes_in_order(one_queue, autojump_clock):
    """The iterator takes a queue's messages in order, so what it caches is the next ones in line: the count bound
    holds the span already, and a span bound would only stop pulls a loop is about to need. With a span of 1 and
    the loop held at its first message, the queue still caches up to pull_threshold_for_queue."""
    await send_numbered(200)
    async with open_push_consumer(NAMESRV, topic="T", consume_concurrently_max_span=1, pull_batch_size=10,
                                  pull_threshold_for_queue=100, **FIRST) as consumer:
        assert (await consumer.__anext__()).body == b"0"
        await trio.sleep(10)
        assert consumer.statistics().cached == 100


async def test_orderly_consumption_is_not_span_bound(one_queue, autojump_clock, tmp_path):
    """Orderly handles a queue one message at a time, in order (RocketMQ applies the span to concurrent consumption
    only): held at its first message, its queue still caches up to pull_threshold_for_queue."""
    gate = trio.Event()

    async def handler(msg) -> None:
        await gate.wait()

    await send_numbered(200)
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, orderly=True, message_model="BROADCASTING",
                                  offset_store_dir=str(tmp_path), consume_concurrently_max_span=1, pull_batch_size=10,
                                  pull_threshold_for_queue=100, **FIRST) as consumer:
        await trio.sleep(10)
        assert consumer.statistics().cached == 100
        gate.set()


# -- pull_interval_ms --------------------------------------------------------------------------------------------

async def test_pull_interval_spaces_each_queues_pulls_that_found_messages_only(two_queues, autojump_clock):
    """A second (mock clock) at least from a pull of a queue that found messages to its next pull; an empty answer
    (held by the broker: the fake holds it 50 ms) is asked again at once, as RocketMQ's pullInterval, which paces only
    FOUND (an idle queue paused after each empty answer learnt of a new message up to a whole interval late). The
    interval is each queue's own: the two queues' pulls are not spaced from one another."""
    seen: list[bytes] = []

    async def handler(msg) -> None:
        seen.append(msg.body)

    await send_numbered(20, queue_id=0, prefix=b"a")
    await send_numbered(20, queue_id=1, prefix=b"b")
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, pull_interval_ms=1_000, pull_batch_size=5,
                                  **FIRST):
        await wait_until(lambda: len(seen) == 40)
        await trio.sleep(10)  # empty pulls
    for queue_id in (0, 1):
        times = [t for q, t in two_queues.pulls if q == queue_id]
        # Four that found (each followed by the interval), then empty ones, each held and asked again at once.
        found_gaps = [b - a for a, b in zip(times[:5], times[1:5])]
        empty_gaps = [b - a for a, b in zip(times[4:], times[5:])]
        assert len(found_gaps) == 4 and min(found_gaps) >= 1.0
        assert len(empty_gaps) >= 50 and max(empty_gaps) < 1.0
    assert two_queues.pulls[0][1] == two_queues.pulls[1][1]  # both queues' first pulls at once


# -- suspend() / resume() ----------------------------------------------------------------------------------------

async def test_suspend_stops_every_pull_while_cached_messages_are_handled_and_committed(one_queue, autojump_clock):
    """Suspended: no pull is sent, whatever is sent to the queue, while message 3 (pulled before) is still handled
    and its offset committed; rebalances and heartbeats go on. Resumed: the new messages come."""
    calls = Calls(gated={b"3"})
    await send_numbered(5)
    async with open_push_consumer(NAMESRV, topic="T", handler=calls, **FIRST) as consumer:
        await wait_until(lambda: len(calls.finished) == 4)
        assert not consumer.statistics().suspended
        consumer.suspend()
        consumer.suspend()  # a second time does nothing
        assert consumer.statistics().suspended
        pulls, calls_made = len(one_queue.pulls), len(one_queue.codes)
        await send_numbered(5, prefix=b"new")
        await trio.sleep(30)
        calls.gate(b"3").set()
        await wait_until(lambda: _committed(one_queue) == 5)  # committed while suspended
        await trio.sleep(30)
        assert len(one_queue.pulls) == pulls and len(calls.started) == 5
        later = one_queue.codes[calls_made:]
        assert RequestCode.HEART_BEAT in later and RequestCode.GET_CONSUMER_LIST_BY_GROUP in later
        consumer.resume()
        consumer.resume()
        assert not consumer.statistics().suspended
        await wait_until(lambda: _committed(one_queue) == 10)
    assert sorted(calls.finished[5:]) == sorted(b"new%d" % i for i in range(5))


async def test_suspend_cancels_a_pull_held_on_the_broker(held_pulls, autojump_clock):
    """A long poll waiting on the broker when suspend() is called would bring a message sent meanwhile: it is
    cancelled (it took nothing), so nothing arrives until resume(), which pulls the same offset again."""
    seen: list[bytes] = []

    async def handler(msg) -> None:
        seen.append(msg.body)

    async with open_push_consumer(NAMESRV, topic="T", handler=handler, **FIRST) as consumer:
        await wait_until(lambda: held_pulls.holding == 1)
        consumer.suspend()
        await send_numbered(1)
        await trio.sleep(60)
        assert seen == [] and held_pulls.holding == 0
        consumer.resume()
        await wait_until(lambda: seen == [b"0"])


async def test_the_iterator_delivers_what_it_cached_while_suspended(one_queue, autojump_clock):
    await send_numbered(10)
    async with open_push_consumer(NAMESRV, topic="T", **FIRST) as consumer:
        assert (await consumer.__anext__()).body == b"0"  # the one pull brought all ten
        consumer.suspend()
        await send_numbered(3, prefix=b"new")
        assert [(await consumer.__anext__()).body for _ in range(9)] == [b"%d" % i for i in range(1, 10)]
        with trio.move_on_after(60):
            await consumer.__anext__()
            pytest.fail("a message pulled while suspended")
        consumer.resume()
        assert [(await consumer.__anext__()).body for _ in range(3)] == [b"new0", b"new1", b"new2"]


async def test_a_queue_assigned_while_suspended_gets_its_start_but_no_pull(one_queue, autojump_clock):
    """Rebalancing goes on while suspended: the queue the intruder held comes to this member when it leaves, its
    start offset is found and committed, and it is pulled only after resume()."""
    seen: list[bytes] = []

    async def handler(msg) -> None:
        seen.append(msg.body)

    group = one_queue.groups[0]
    group.members[GROUP].add(INTRUDER)  # sorts first: the only queue is the intruder's
    await send_numbered(3)
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, **FIRST) as consumer:
        assert consumer.assigned_queues() == []
        consumer.suspend()
        group.members[GROUP].discard(INTRUDER)
        consumer.trigger_rebalance()
        await wait_until(lambda: consumer.assigned_queues() == [T0])
        await trio.sleep(30)
        assert _committed(one_queue) == 0 and one_queue.pulls == [] and seen == []
        consumer.resume()
        await wait_until(lambda: _committed(one_queue) == 3)
    assert seen == [b"0", b"1", b"2"]


async def test_a_suspended_consumer_closes_and_then_suspend_and_resume_say_it_is_closed(one_queue, autojump_clock):
    await send_numbered(3)
    async with open_push_consumer(NAMESRV, topic="T", **FIRST) as consumer:
        assert (await consumer.__anext__()).body == b"0"
        consumer.suspend()
        assert (await consumer.__anext__()).body == b"1"
    assert _committed(one_queue) == 2  # leaving by the block's end consumed 1, as always
    for method in ("suspend", "resume"):
        with pytest.raises(ClientClosedError, match=rf"^the push consumer is closed: {method}\(\) cannot be called"):
            getattr(consumer, method)()


async def test_an_idle_queue_without_long_polling_is_not_pulled_in_a_spin(held_pulls):
    # broker_suspend_max_time_ms=0 (allowed): each NO_NEW_MSG answered at once was followed by the next pull at once;
    # now pull_time_delay_ms_when_exception (200 ms) apart. Real time, a count, not a speed.
    async with open_push_consumer(NAMESRV, topic="T", consumer_group=GROUP, broker_suspend_max_time_ms=0):
        await trio.sleep(0.5)
    assert 1 <= len(held_pulls.pulls) < 50
