"""A consumer's pull rates (running info's ``pull_tps`` and ``pull_rt_ms``, ``client/running_info.py``) count the
pulls that found messages only, as RocketMQ's incPullRT and incPullTPS: a long poll that found none, held up to its
suspend time, is neither timed nor counted, though it still tells when its queue was last pulled. Pure (the hook's
``told_pull`` and the recorder), and a push consumer on the in-memory fake cluster whose pulls the fake holds as a
broker does, its pulls timed on trio's clock."""

from __future__ import annotations

import trio

import client.push_consumer
from client import MessageQueue, open_push_consumer
from client.consume_hook import ConsumeHook, told_pull
from client.message import PullResult, PullStatus
from client.running_info import ConsumeStatsRecorder
from tests.unit.client.fake_cluster import NAMESRV, fake_remoting_ctx, recording_fake, send_numbered, wait_until
from tests.unit.client.test_concurrent_handlers import FIRST
from tests.unit.client.test_running_info import _ask
from tests.unit.client.test_trace import _ext

T0 = MessageQueue("T", "broker-a", 0)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_told_pull_tells_what_a_pull_found_and_none_for_a_pull_that_found_nothing():
    clock = _Clock()
    hook = ConsumeHook(clock)
    heard: list[tuple] = []
    hook.subscribe(pulled=lambda mq, started, messages: heard.append((mq, started, messages)))

    async def answer(result: PullResult) -> PullResult:
        clock.now += 5.0  # a long poll held to its suspend time
        return result

    found = PullResult(PullStatus.FOUND, 2, 0, 2, (_ext("A"), _ext("B")))
    filtered = PullResult(PullStatus.FOUND, 3, 0, 3)  # the client's tag check left none: still a FOUND pull
    for result in (found, filtered, PullResult(PullStatus.NO_NEW_MSG, 3, 0, 3),
                   PullResult(PullStatus.NO_MATCHED_MSG, 4, 0, 4), PullResult(PullStatus.OFFSET_ILLEGAL, 0, 0, 4)):
        assert await told_pull(hook, T0, answer(result)) is result
    assert heard == [(T0, 1000.0, 2), (T0, 1005.0, 0), (T0, 1010.0, None), (T0, 1015.0, None), (T0, 1020.0, None)]


def test_a_pull_that_found_nothing_is_not_timed_nor_counted_but_tells_when_its_queue_was_pulled():
    clock = _Clock()
    recorder = ConsumeStatsRecorder(clock=clock, wall=lambda: 1_700_000_000 + clock.now)
    clock.now += 10
    recorder.pulled(T0, clock.now - 0.02, 8)
    recorder.pulled(T0, clock.now - 5.0, None)  # a long poll held 5 s that found nothing
    recorder.pulled(T0, clock.now - 5.0, None)
    status = recorder.status("T")
    assert (status["pull_tps"], status["pull_rt_ms"]) == (0.8, 20.0)
    clock.now += 5
    recorder.pulled(T0, clock.now - 5.0, None)
    assert recorder.status("T")["pull_rt_ms"] == 20.0
    assert recorder.timestamp_ms(recorder.last_pull[T0]) == (1_700_000_000 + 1015) * 1000
    # Nothing but empty pulls: nothing to rate.
    recorder.pulled(MessageQueue("Idle", "broker-a", 0), clock.now - 5.0, None)
    assert recorder.status("Idle")["pull_rt_ms"] == 0.0 and "Idle" not in recorder._topics


async def test_an_idle_push_consumers_long_polls_leave_its_pull_rt_alone(monkeypatch, autojump_clock):
    """Each pull of an empty queue is held 5 s; the pulls that found the messages were answered at once: the pull RT
    is theirs, 0 on trio's clock, however long the consumer idles. Counted, the long polls made it seconds."""
    fake = recording_fake(monkeypatch, 2, hold_pulls=True)
    fake.server_requests = []

    def remoting(config, handler=None):
        fake.server_requests.append(handler)
        return fake_remoting_ctx(fake)

    monkeypatch.setattr(client.push_consumer, "open_remoting", remoting)
    # Its pulls timed on trio's clock, which the held pulls move: the consumer's own reads time.monotonic.
    monkeypatch.setattr(client.push_consumer, "ConsumeHook", lambda: ConsumeHook(trio.current_time))
    await send_numbered(6)
    consumed = []

    async def handler(msg) -> None:
        consumed.append(msg.body)

    async with open_push_consumer(NAMESRV, topic="T", handler=handler, broker_suspend_max_time_ms=5000,
                                  **FIRST) as consumer:
        await wait_until(lambda: len(consumed) == 6)
        held = len(fake.pulls)
        await trio.sleep(12)
        assert len(fake.pulls) >= held + 4  # both queues long-polled, twice each at least, and found nothing
        [requests] = fake.server_requests
        info = await _ask(requests, consumer.client_id)
    status = info.status["T"]
    assert status.pull_rt_ms == 0.0 and status.pull_tps > 0
    # The idle queue's long polls still tell when it was last pulled.
    q0, q1 = (q for q in info.queues if q.queue.topic == "T")
    assert q1.queue.queue_id == 1 and q1.last_pull_timestamp is not None
    assert q1.last_pull_timestamp >= q0.last_consume_timestamp + 5_000
