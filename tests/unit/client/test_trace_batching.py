"""The trace dispatcher's batching (``client/trace.py``, "Batching") on trio's MockClock: while serving it sends full
batches only, a short one once its oldest context has waited ``flush_interval_ms`` (counted from when that context
arrived), so contexts that arrive during a send wait their turn rather than go out a few at a time; a trace message
that cannot be sent (a trace topic missing fails every one) is logged the first and every 100th time."""

from __future__ import annotations

import logging

import trio
import trio.testing

from client.trace import TraceDispatcher, decode_trace_data
from tests.unit.client.test_trace import _pub, _Sink


class _SlowSink:
    """The inner producer's send, taking ``send_s`` (trio's clock) each; records each message and when it went."""

    def __init__(self, send_s: float) -> None:
        self.send_s = send_s
        self.sizes: list[int] = []
        self.started: list[float] = []

    async def __call__(self, message) -> None:
        self.started.append(trio.current_time())
        await trio.sleep(self.send_s)
        self.sizes.append(len(decode_trace_data(message.body.decode())))


async def test_a_busy_clients_contexts_go_a_full_batch_to_a_message(autojump_clock):
    """A context a millisecond, a send taking 50 ms: 50 contexts arrive during each send. They were sent as soon as
    it ended, 50 to a message where 100 fit; now each message waits for its 100."""
    sink = _SlowSink(0.05)
    dispatcher = TraceDispatcher("TR", sink, max_queued=10_000, batch_size=100, flush_interval_ms=500)
    async with trio.open_nursery() as nursery:
        await nursery.start(dispatcher.serve)
        for i in range(2000):
            dispatcher.append(_pub(i))
            await trio.sleep(0.001)
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert sink.sizes == [100] * 20
    stats = dispatcher.statistics()
    assert (stats.sent_messages, stats.sent_contexts, stats.queued) == (20, 2000, 0)


async def test_a_short_batch_goes_once_its_oldest_context_has_waited_the_interval_from_its_arrival(autojump_clock):
    sink = _SlowSink(0.4)
    dispatcher = TraceDispatcher("TR", sink, batch_size=100, flush_interval_ms=500)
    async with trio.open_nursery() as nursery:
        await nursery.start(dispatcher.serve)
        start = trio.current_time()
        for i in range(100):  # a full batch: sent at once, for 0.4 s
            dispatcher.append(_pub(i))
        await trio.sleep(0.1)
        dispatcher.append(_pub(100))  # arrives during that send
        await trio.sleep(0.3)
        dispatcher.append(_pub(101))
        await trio.sleep(2)
        nursery.cancel_scope.cancel()
    # The short batch waited 0.5 s from its oldest's arrival (0.1), not from the end of the send before it (0.4).
    assert sink.sizes == [100, 2]
    assert [round(t - start, 3) for t in sink.started] == [0.0, 0.6]


async def test_close_flushes_what_waits_fewer_than_a_batch():
    sink = _Sink()
    dispatcher = TraceDispatcher("TR", sink, batch_size=100, flush_interval_ms=60_000)
    async with trio.open_nursery() as nursery:
        await nursery.start(dispatcher.serve)
        for i in range(130):
            dispatcher.append(_pub(i))
        await trio.testing.wait_all_tasks_blocked()
        assert [len(decode_trace_data(m.body.decode())) for m in sink.sent] == [100]
        nursery.cancel_scope.cancel()
    await dispatcher.flush()  # what open_trace_dispatcher's close does
    assert [len(decode_trace_data(m.body.decode())) for m in sink.sent] == [100, 30]


async def test_trace_messages_not_sent_are_logged_the_first_and_every_100th_time_with_the_counts(caplog):
    caplog.set_level(logging.WARNING, logger="client.trace")
    sink = _Sink()
    sink.failing = True
    dispatcher = TraceDispatcher("TR", sink, batch_size=2, max_queued=1000)
    for i in range(500):
        dispatcher.append(_pub(i))
    await dispatcher.flush()
    warnings = [r.getMessage() for r in caplog.records if "trace message not sent" in r.getMessage()]
    assert len(warnings) == 3
    assert "contexts=2 failed_messages=101 failed_contexts=202 error=" in warnings[1]
    assert "no broker" in warnings[2] and "failed_messages=201" in warnings[2]
    assert dispatcher.statistics().failed_contexts == 500
    # It never fails the caller: the queue takes contexts again, and a working send sends them.
    sink.failing = False
    assert dispatcher.append(_pub(500))
    await dispatcher.flush()
    assert len(sink.sent) == 1 and dispatcher.statistics().sent_contexts == 1
