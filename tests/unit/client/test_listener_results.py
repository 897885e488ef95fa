"""What a push consumer's handler says, against the in-memory fake cluster on trio's MockClock: its return value
(``ConsumeStatus``, anything else), ``ReconsumeLater``'s delay level and suspend time, RocketMQ's default
max_reconsume_times (-1: 16 concurrent, unlimited orderly) and the concurrent form's consume timeout. The same with
real processes: tests/cluster/test_listener_e2e.py."""

from __future__ import annotations

import logging

import pytest
import trio

import client.producer
import client.push_consumer
from client import ConsumeStatus, Message, ReconsumeLater, open_producer, open_push_consumer
from client.errors import ConfigError
from client.push_consumer import PushConsumerConfig
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from tests.unit.client.fake_cluster import NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx


@pytest.fixture
def cluster(monkeypatch):
    """One group of one queue, so messages reach the handler in the order sent; send-backs are recorded and taken."""
    fake = FakeRemoting([FakeGroup("broker-a", ["a:1", "a:2", "a:3"], queues=1)])
    fake.send_backs = []
    fake.refuse_send_backs = 0  # how many send-backs to come are refused (recorded all the same)
    answer = fake.invoke

    async def invoke(addr, request, timeout_s=3.0):
        if request.code == RequestCode.CONSUMER_SEND_MSG_BACK:
            fake.send_backs.append(dict(request.ext))
            if fake.refuse_send_backs:
                fake.refuse_send_backs -= 1
                return make_response(request, ResponseCode.SYSTEM_ERROR, "store unavailable")
            return make_response(request, ResponseCode.SUCCESS)
        return await answer(addr, request, timeout_s)

    fake.invoke = invoke
    for mod in (client.producer, client.push_consumer):
        monkeypatch.setattr(mod, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    return fake


async def _send(*bodies: bytes) -> None:
    async with open_producer(NAMESRV) as producer:
        for body in bodies:
            await producer.send(Message("T", body))


def test_reconsume_later_checks_its_level_and_clamps_its_suspend_as_rocketmq():
    assert (ReconsumeLater().delay_level, ReconsumeLater().suspend_ms) == (None, None)
    assert ReconsumeLater(delay_level=-1).delay_level == -1 and ReconsumeLater(delay_level=18).delay_level == 18
    for bad in (-2, 2 ** 31, True, "3", 1.0):
        with pytest.raises(ValueError, match="ReconsumeLater.delay_level must be None or an int from -1"):
            ReconsumeLater(delay_level=bad)
    # RocketMQ's submitConsumeRequestLater clamps suspendCurrentQueueTimeMillis to 10..30000.
    assert [ReconsumeLater(suspend_ms=ms).suspend_ms for ms in (-5, 0, 10, 500, 30_000, 90_000)] == [
        10, 10, 10, 500, 30_000, 30_000]
    with pytest.raises(ValueError, match="suspend_ms"):
        ReconsumeLater(suspend_ms=0.5)
    # RocketMQ's defaults: maxReconsumeTimes -1, consumeTimeout 15 minutes.
    config = PushConsumerConfig()
    assert (config.max_reconsume_times, config.consume_timeout_min) == (-1, 15)
    for key, value, problem in (("max_reconsume_times", -2, ">= -1"), ("consume_timeout_min", 0, ">= 1"),
                                ("consume_timeout_min", 1441, "<= 1440")):
        with pytest.raises(ConfigError, match=f"^{key} must be {problem}, got {value}$"):
            PushConsumerConfig(**{key: value})


async def test_return_values_other_than_none_and_success_are_failures_logged_once_per_type(cluster, autojump_clock,
                                                                                         tmp_path, caplog):
    """A ported listener returning "RECONSUME_LATER" (or True, or anything the consumer does not know) had its
    message taken as consumed: lost without a word. Now each is a failure, retried (broadcasting: here, with
    reconsume_times counted up), and each type is named at ERROR once. delay_level -1 in broadcasting mode, which
    has no dead letters: skipped at once."""
    caplog.set_level(logging.DEBUG, logger="client.push_consumer")
    answers = {b"true": True, b"text": "RECONSUME_LATER", b"text2": "RECONSUME_LATER",
               b"later": ConsumeStatus.RECONSUME_LATER, b"ok": ConsumeStatus.SUCCESS, b"none": None}
    seen: list[tuple[bytes, int]] = []
    done = trio.Event()

    async def handler(msg):
        seen.append((msg.body, msg.reconsume_times))
        if msg.body == b"dead":
            raise ReconsumeLater(delay_level=-1)
        if msg.body == b"last":
            done.set()
        return answers.get(msg.body) if msg.reconsume_times == 0 else None

    await _send(b"true", b"text", b"text2", b"later", b"ok", b"none", b"dead", b"last")
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, consumer_group="g", reconsume_delay_ms=100,
                                  message_model="BROADCASTING", offset_store_dir=str(tmp_path),
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET"):
        with trio.fail_after(60):
            await done.wait()
    assert seen == [(b"true", 0), (b"true", 1), (b"text", 0), (b"text", 1), (b"text2", 0), (b"text2", 1),
                    (b"later", 0), (b"later", 1), (b"ok", 0), (b"none", 0), (b"dead", 0), (b"last", 0)]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert sum("handler returned a bool, not None or a ConsumeStatus" in m for m in errors) == 1, errors
    assert sum("handler returned a str, not None or a ConsumeStatus" in m for m in errors) == 1, errors
    assert sum("handler asked for the dead letters (delay_level -1)" in m for m in errors) == 1, errors
    assert cluster.send_backs == []  # broadcasting sends nothing back


async def test_a_concurrent_handler_past_consume_timeout_is_cancelled_and_its_message_sent_back(cluster,
                                                                                                autojump_clock,
                                                                                                tmp_path, caplog):
    """RocketMQ's consumeTimeout: a concurrent handler call longer than consume_timeout_min is cancelled, its message
    sent back (default level; max_reconsume_times -1 sent as 16, never -1) and the queue moves on. An orderly handler
    as long is left alone, as RocketMQ's orderly service does."""
    caplog.set_level(logging.WARNING, logger="client.push_consumer")
    handled: list[tuple[bytes, float]] = []
    cancelled: list[bytes] = []
    done = trio.Event()

    async def handler(msg) -> None:
        started = trio.current_time()
        if msg.body == b"slow":
            try:
                await trio.sleep(3 * 60)
            except trio.Cancelled:
                cancelled.append(msg.body)
                raise
        handled.append((msg.body, trio.current_time() - started))
        if msg.body == b"next":
            done.set()

    await _send(b"slow", b"next")
    # One call at a time: "next" waits for "slow" to time out (test_concurrent_handlers.py has it with more).
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, consumer_group="g", consume_timeout_min=1,
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                                  max_concurrent_handlers=1) as consumer:
        started = trio.current_time()
        with trio.fail_after(3600):
            await done.wait()
        assert consumer.max_reconsume_times == 16
    assert trio.current_time() - started >= 60
    assert cancelled == [b"slow"] and [body for body, _ in handled] == [b"next"]
    (back,) = cluster.send_backs
    assert (back["delay_level"], back["max_reconsume_times"], back["origin_topic"]) == (0, 16, "T")
    (warning,) = [r.getMessage() for r in caplog.records if "consume_timeout_min" in r.getMessage()]
    assert warning.startswith("handler cancelled after consume_timeout_min=1, the message counts as failed")
    assert "topic=T broker_name=broker-a queue_id=0 offset=0" in warning

    handled.clear()
    done = trio.Event()
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, consumer_group="o", consume_timeout_min=1,
                                  orderly=True, message_model="BROADCASTING", offset_store_dir=str(tmp_path),
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET") as consumer:
        with trio.fail_after(3600):
            await done.wait()
        assert consumer.max_reconsume_times == 2 ** 31 - 1
    assert handled == [(b"slow", 3 * 60), (b"next", 0)] and cancelled == [b"slow"]
    assert len(cluster.send_backs) == 1


async def test_a_clustering_message_whose_send_backs_fail_is_retried_here_past_max_reconsume_times_never_skipped(
        cluster, autojump_clock):
    """RocketMQ's clustering consumer consumes a message again locally while its send-back fails, without end: ours
    skipped it after max_reconsume_times + 1 calls, and the group lost a message its broker still held for it. Here
    the broker refuses five send-backs (max_reconsume_times 2): the handler gets it six times, reconsume_times
    counted up, until the sixth send-back gets through (the broker counts the stored message's reconsume times, as
    RocketMQ's: the retry topic, or the dead letters past the maximum); only then does the queue move on."""
    cluster.refuse_send_backs = 5
    calls: list[tuple[bytes, int]] = []
    done = trio.Event()

    async def handler(msg):
        calls.append((msg.body, msg.reconsume_times))
        if msg.body == b"next":
            done.set()
            return None
        return ConsumeStatus.RECONSUME_LATER

    await _send(b"failing", b"next")
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, consumer_group="g", max_reconsume_times=2,
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", max_concurrent_handlers=1):
        with trio.fail_after(3600):
            await done.wait()
    assert calls == [(b"failing", n) for n in range(6)] + [(b"next", 0)]
    assert [(back["offset"], back["max_reconsume_times"]) for back in cluster.send_backs] == [
        (cluster.send_backs[0]["offset"], 2)] * 6


async def test_orderly_retries_without_end_by_default_counting_reconsume_times_and_suspending_as_asked(
        cluster, autojump_clock, tmp_path):
    """RocketMQ's orderly service retries a failing message without end by default (maxReconsumeTimes -1:
    Integer.MAX_VALUE; ours gave up after 16), hands it over again with reconsumeTimes counted up (ours kept 0) and
    suspends the queue for the context's suspendCurrentQueueTimeMillis when the listener set it (clamped)."""
    attempts: list[tuple[bytes, int, float]] = []
    done = trio.Event()

    async def handler(msg):
        attempts.append((msg.body, msg.reconsume_times, trio.current_time()))
        if msg.body == b"last":
            done.set()
        if msg.body != b"stubborn":
            return None
        n = msg.reconsume_times
        if n == 0:
            raise ReconsumeLater(suspend_ms=20_000)
        if n == 1:
            raise ReconsumeLater(suspend_ms=0)  # clamped to 10 ms
        if n == 2:
            return ConsumeStatus.RECONSUME_LATER  # suspend_current_queue_time_ms
        if n < 20:
            raise RuntimeError("not yet")
        return ConsumeStatus.SUCCESS

    await _send(b"stubborn", b"last")
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, consumer_group="o", orderly=True,
                                  message_model="BROADCASTING", offset_store_dir=str(tmp_path),
                                  suspend_current_queue_time_ms=1000,
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET"):
        with trio.fail_after(3600):
            await done.wait()
    assert [(body, n) for body, n, _ in attempts] == [(b"stubborn", n) for n in range(21)] + [(b"last", 0)]
    gaps = [t2 - t1 for (_, _, t1), (_, _, t2) in zip(attempts, attempts[1:])]
    assert gaps[:3] == pytest.approx([20.0, 0.01, 1.0])
    assert gaps[3:20] == pytest.approx([1.0] * 17) and gaps[20] == pytest.approx(0, abs=0.001)
    assert cluster.send_backs == []


async def test_a_reconsume_later_raised_in_the_handlers_own_nursery_keeps_its_settings(cluster, autojump_clock):
    # trio groups what a nursery's children raise: caught as any failure, delay_level -1 became 0 (16 retries).
    done = trio.Event()

    async def child() -> None:
        raise ReconsumeLater(delay_level=-1)

    async def handler(msg) -> None:
        if msg.body == b"bad":
            async with trio.open_nursery() as nursery:
                nursery.start_soon(child)
        done.set()

    await _send(b"bad", b"ok")
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, consumer_group="g",
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", max_concurrent_handlers=1):
        with trio.fail_after(60):
            await done.wait()
    assert [back["delay_level"] for back in cluster.send_backs] == [-1]


async def test_an_error_in_a_handlers_nursery_while_it_is_timed_out_fails_the_message_not_the_consumer(
        cluster, autojump_clock):
    # The handler's nursery raised [Cancelled, RuntimeError]: no Exception, so it went past the handler's except,
    # the timeout's scope took the Cancelled and the RuntimeError ended the whole consumer.
    done = trio.Event()

    async def child() -> None:
        try:
            await trio.sleep_forever()
        finally:
            raise RuntimeError("cleanup failed")

    async def handler(msg) -> None:
        if msg.body == b"slow":
            async with trio.open_nursery() as nursery:
                nursery.start_soon(child)
                await trio.sleep_forever()
        done.set()

    await _send(b"slow", b"next")
    with trio.fail_after(3600):
        async with open_push_consumer(NAMESRV, topic="T", handler=handler, consumer_group="g", consume_timeout_min=1,
                                      consume_from_where="CONSUME_FROM_FIRST_OFFSET", max_concurrent_handlers=1):
            await done.wait()
    assert len(cluster.send_backs) == 1 and cluster.send_backs[0]["delay_level"] == 0
