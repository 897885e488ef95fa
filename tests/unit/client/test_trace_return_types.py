"""A SubAfter context's code (RocketMQ's ConsumeReturnType, ``client/trace.py``) says how a failed handler call
failed, as RocketMQ's consume services set it: EXCEPTION when the handler raised, FAILED when it asked to be called
again (``ReconsumeLater``, ``RECONSUME_LATER``), RETURN_NULL when it returned no ``ConsumeStatus``, TIME_OUT first
when the call ran past its consume timeout. Pure (the tracer, the failures the consumer makes), and handler, batch
handler and orderly push consumers on the in-memory fake cluster, traced to the trace topic."""

from __future__ import annotations

import pytest
import trio

from client import ConsumeStatus, ReconsumeLater, open_push_consumer
from client.listener import FailureCause, failure_of, grouped_failure
from client.trace import TRACE_TOPIC, ConsumeReturnType, ConsumeTracer, TraceDispatcher, TraceType, decode_trace_data
from tests.unit.client.fake_cluster import NAMESRV, recording_fake, send_numbered, wait_until
from tests.unit.client.test_concurrent_handlers import FIRST
from tests.unit.client.test_trace import _ext, _Sink, _traces


async def test_the_tracer_codes_a_failure_by_its_cause_and_a_timed_out_call_as_time_out_first():
    sink = _Sink()
    dispatcher = TraceDispatcher(TRACE_TOPIC, sink)
    tracer = ConsumeTracer(dispatcher, "CG", "10.0.0.8")
    for msg_id, failure, timeout_s in (("RAISED", failure_of(FailureCause.RAISED), 60.0),
                                       ("ASKED", ReconsumeLater(), 60.0),
                                       ("NO_STATUS", failure_of(FailureCause.NO_STATUS), 60.0),
                                       ("LATE", failure_of(FailureCause.RAISED), 0.0),
                                       ("OK", None, 60.0)):
        tracer.after(tracer.before([_ext(msg_id)]), failure, timeout_s)
    await dispatcher.flush()
    codes = {c.msg_id: (c.success, c.context_code) for c in decode_trace_data(sink.sent[0].body.decode())
             if c.trace_type is TraceType.SUB_AFTER}
    assert codes == {"RAISED": (False, ConsumeReturnType.EXCEPTION), "ASKED": (False, ConsumeReturnType.FAILED),
                     "NO_STATUS": (False, ConsumeReturnType.RETURN_NULL), "LATE": (False, ConsumeReturnType.TIME_OUT),
                     "OK": (True, ConsumeReturnType.SUCCESS)}


def test_the_consumers_own_failures_carry_their_cause_and_a_handlers_its_ask():
    assert ReconsumeLater(delay_level=3).cause is FailureCause.ASKED
    raised = failure_of(FailureCause.RAISED)
    assert (raised.cause, raised.delay_level, raised.ack_index, str(raised)) == (
        FailureCause.RAISED, None, None, "the handler raised")
    assert str(failure_of(FailureCause.NO_STATUS)) == "the handler returned no ConsumeStatus"
    logged = []
    mixed = grouped_failure(ExceptionGroup("h", [ValueError("bad"), ReconsumeLater()]), logged.append)
    assert mixed.cause is FailureCause.RAISED and len(logged) == 1
    asked = ReconsumeLater(delay_level=-1)
    assert grouped_failure(ExceptionGroup("h", [asked]), logged.append) is asked and asked.cause is FailureCause.ASKED


def _codes(fake, group: str) -> dict[tuple[bytes, int], int]:
    """``group``'s SubAfter codes: (msg id, reconsume times of its call) -> context code."""
    contexts = [c for c in _traces(fake) if c.group == group]
    tries = {(c.request_id, c.msg_id): c.retry_times for c in contexts if c.trace_type is TraceType.SUB_BEFORE}
    return {(c.msg_id, tries[c.request_id, c.msg_id]): c.context_code for c in contexts
            if c.trace_type is TraceType.SUB_AFTER}


async def _raise_grouped() -> None:
    async def child() -> None:
        raise ValueError("a child failed")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(child)


@pytest.mark.parametrize("orderly", [False, True])
async def test_each_way_a_handler_fails_is_traced_with_rocketmqs_code(monkeypatch, tmp_path, autojump_clock,
                                                                      orderly):
    """Each message fails its first call its own way and succeeds the next. A raise was traced FAILED (4), as a
    RECONSUME_LATER asked for, where RocketMQ writes EXCEPTION (2)."""
    fake = recording_fake(monkeypatch, 1)
    await send_numbered(6)
    ids: dict[bytes, str] = {}

    async def handler(msg):
        first = msg.body not in ids
        ids[msg.body] = msg.msg_id
        if not first:
            return None
        if msg.body == b"0":
            raise RuntimeError("boom")
        if msg.body == b"1":
            return ConsumeStatus.RECONSUME_LATER
        if msg.body == b"2":
            raise ReconsumeLater("later")
        if msg.body == b"3":
            return "RECONSUME_LATER"  # no ConsumeStatus: a ported listener's
        if msg.body == b"4":
            await _raise_grouped()
        return ConsumeStatus.SUCCESS

    async with open_push_consumer(NAMESRV, topic="T", handler=handler, orderly=orderly, message_model="BROADCASTING",
                                  offset_store_dir=str(tmp_path), reconsume_delay_ms=10,
                                  suspend_current_queue_time_ms=10, enable_msg_trace=True, **FIRST) as consumer:
        await wait_until(lambda: consumer.statistics().delivered == 6)
    codes = _codes(fake, FIRST["consumer_group"])
    assert {body: codes[ids[body], 0] for body in sorted(ids)} == {
        b"0": ConsumeReturnType.EXCEPTION, b"1": ConsumeReturnType.FAILED, b"2": ConsumeReturnType.FAILED,
        b"3": ConsumeReturnType.RETURN_NULL, b"4": ConsumeReturnType.EXCEPTION, b"5": ConsumeReturnType.SUCCESS}
    assert {codes[ids[body], 1] for body in (b"0", b"1", b"2", b"3", b"4")} == {ConsumeReturnType.SUCCESS}


async def test_a_batch_handler_that_raised_is_traced_exception_for_each_message(monkeypatch, tmp_path,
                                                                                 autojump_clock):
    fake = recording_fake(monkeypatch, 1)
    await send_numbered(3)
    calls: list[tuple[str, ...]] = []

    async def batch_handler(msgs):
        calls.append(tuple(m.msg_id for m in msgs))
        if len(calls) == 1:
            raise RuntimeError("boom")
        if len(calls) == 2:
            return "no status"

    async with open_push_consumer(NAMESRV, topic="T", batch_handler=batch_handler, consume_message_batch_max_size=3,
                                  message_model="BROADCASTING", offset_store_dir=str(tmp_path),
                                  reconsume_delay_ms=10, enable_msg_trace=True, **FIRST) as consumer:
        await wait_until(lambda: consumer.statistics().delivered == 3)
    assert len(calls[0]) == 3 and calls[1] == calls[0]
    codes = _codes(fake, FIRST["consumer_group"])
    assert [codes[msg_id, 0] for msg_id in calls[0]] == [ConsumeReturnType.EXCEPTION] * 3
    assert [codes[msg_id, 1] for msg_id in calls[0]] == [ConsumeReturnType.RETURN_NULL] * 3
