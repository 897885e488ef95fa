"""A consumer's one instrumentation hook (``ConsumeHook``, ``client/consume_hook.py``): what it tells its subscribers
and in which order; a tracer's SubAfter of a batch whose head holds a message of the trace topic; and, on the
in-memory fake cluster, a push consumer with running info and message trace both on: nothing of it is replaced, and
both hear the same handler calls with the same outcome (one message or a batch)."""

from __future__ import annotations

import math

import pytest

from client import MessageQueue, ReconsumeLater, open_push_consumer
from client.consume_hook import ConsumeCall, ConsumeHook
from client.trace import TRACE_TOPIC, ConsumeReturnType, ConsumeTracer, TraceDispatcher, TraceType, decode_trace_data
from tests.unit.client.fake_cluster import NAMESRV, send_numbered, wait_until
from tests.unit.client.test_concurrent_handlers import FIRST
from tests.unit.client.test_running_info import _ask, push_cluster  # noqa: F401 - push_cluster is a fixture
from tests.unit.client.test_trace import _ext, _Sink, _traces

MQ = MessageQueue("T", "broker-a", 0)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_hook_tells_each_subscriber_its_events_in_the_order_they_subscribed():
    clock = _Clock()
    hook = ConsumeHook(clock)
    heard: list[tuple] = []
    # Nobody listens yet: the events go nowhere, and a call is still made and handed back.
    hook.pulled(MQ, 1.0, 3)
    quiet = hook.call_started(MQ, (_ext("A"),))
    assert (quiet.mq, quiet.started, quiet.timeout_s, quiet.trace) == (MQ, 100.0, math.inf, None)
    hook.subscribe(pulled=lambda mq, started, n: heard.append(("pulled", "first", mq, started, n)),
                   call_ended=lambda call, failure, ok: heard.append(("ended", "first", call.msgs, failure, ok)))

    def started(call: ConsumeCall) -> None:
        call.trace = "mine"
        heard.append(("started", "second", call.mq, call.started, call.timeout_s))

    hook.subscribe(pulled=lambda mq, started, n: heard.append(("pulled", "second", n)), call_started=started,
                   handed_out=lambda mq, n: heard.append(("handed_out", "second", mq, n)))
    hook.pulled(MQ, 99.5, 4)
    clock.now = 101.0
    batch = (_ext("B"), _ext("C"))
    call = hook.call_started(MQ, batch, 60.0)
    failure = ReconsumeLater(ack_index=0)
    hook.call_ended(call, failure, 1)
    hook.handed_out(MQ, 2)
    assert heard == [("pulled", "first", MQ, 99.5, 4), ("pulled", "second", 4),
                     ("started", "second", MQ, 101.0, 60.0), ("ended", "first", batch, failure, 1),
                     ("handed_out", "second", MQ, 2)]
    assert call.trace == "mine"


def test_subscribing_nothing_or_something_not_callable_is_refused():
    hook = ConsumeHook()
    with pytest.raises(TypeError, match="needs a callback for at least one of pulled"):
        hook.subscribe()
    with pytest.raises(TypeError, match="call_ended must be callable, got 3"):
        hook.subscribe(pulled=lambda mq, started, n: None, call_ended=3)  # type: ignore[arg-type]
    hook.pulled(MQ, 0.0, 1)  # the refused subscription left nothing behind: its pulled was not added


async def test_a_batch_led_by_a_trace_topic_message_is_split_where_its_ack_index_says():
    """The trace topic's own messages are not traced, but a batch's ack_index counts them: here the call's messages
    0 (the trace topic's) and 1 were consumed and 2 failed. Counted over the traced ones, 2 was a success too."""
    sink = _Sink()
    dispatcher = TraceDispatcher(TRACE_TOPIC, sink)
    tracer = ConsumeTracer(dispatcher, "CG", "10.0.0.8")
    call = tracer.before([_ext("TRACE", topic=TRACE_TOPIC), _ext("A"), _ext("B")])
    tracer.after(call, ReconsumeLater(ack_index=1))
    tracer.after(tracer.before([_ext("TRACE", topic=TRACE_TOPIC), _ext("C")]), None)  # all of it succeeded
    await dispatcher.flush()
    after = [(c.msg_id, c.success, c.context_code) for c in decode_trace_data(sink.sent[0].body.decode())
             if c.trace_type is TraceType.SUB_AFTER]
    assert after == [("A", True, ConsumeReturnType.SUCCESS), ("B", False, ConsumeReturnType.FAILED),
                     ("C", True, ConsumeReturnType.SUCCESS)]


def _outcomes(fake, group: str) -> dict[tuple[str, int], bool]:
    """Each traced handler call of ``group``'s messages: (msg id, reconsume times) -> its SubAfter's success."""
    contexts = [c for c in _traces(fake) if c.group == group]
    tries = {(c.request_id, c.msg_id): c.retry_times for c in contexts if c.trace_type is TraceType.SUB_BEFORE}
    return {(c.msg_id, tries[c.request_id, c.msg_id]): c.success for c in contexts
            if c.trace_type is TraceType.SUB_AFTER}


async def test_running_info_and_trace_hear_the_same_calls_and_outcomes_through_the_one_hook(push_cluster, tmp_path,
                                                                                          autojump_clock):
    """Both on, on one message a call, then on batches. No method of the consumer, its service or its pull API is
    replaced on the instance. A one-message handler that raises ``ReconsumeLater(ack_index=0)`` failed its message
    (retried: ack_index is a batch's) for both: the trace called it a success while the statistics counted a failure."""
    await send_numbered(5)
    ids: dict[bytes, str] = {}
    failed: list[bytes] = []

    async def handler(msg):
        ids[msg.body] = msg.msg_id
        if msg.body == b"3" and not failed:
            failed.append(msg.body)
            raise ReconsumeLater("once", ack_index=0)

    options = dict(FIRST, topic="T", message_model="BROADCASTING", offset_store_dir=str(tmp_path),
                   reconsume_delay_ms=10, enable_msg_trace=True)
    async with open_push_consumer(NAMESRV, handler=handler, **options) as consumer:
        await wait_until(lambda: consumer.statistics().delivered == 5)
        assert not {"_call_handler", "_consumed"} & vars(consumer).keys()
        assert "_call_batch" not in vars(consumer._concurrent) and "pull" not in vars(consumer._api)
        info = await _ask(push_cluster.server_requests[0], consumer.client_id)
    assert (info.status["T"].consume_failed_msgs, info.status["T"].consume_ok_tps > 0) == (1, True)
    assert _outcomes(push_cluster, "g") == {**{(ids[b], 0): True for b in (b"0", b"1", b"2", b"4")},
                                            (ids[b"3"], 0): False, (ids[b"3"], 1): True}

    # A batch of four fails its last two once (ack_index=1): counted and traced alike, then retried together.
    calls: list[tuple[bytes, ...]] = []

    async def batch_handler(msgs):
        calls.append(tuple(m.body for m in msgs))
        if len(calls) == 1:
            raise ReconsumeLater("tail", ack_index=1)

    async with open_push_consumer(NAMESRV, batch_handler=batch_handler, consume_message_batch_max_size=4,
                                  **dict(options, consumer_group="g2", offset_store_dir=str(tmp_path / "2"))
                                  ) as consumer:
        await wait_until(lambda: consumer.statistics().delivered == 5)
        info = await _ask(push_cluster.server_requests[1], consumer.client_id)
    assert calls[0] == (b"0", b"1", b"2", b"3") and (b"2", b"3") in calls[1:]
    assert info.status["T"].consume_failed_msgs == 2
    assert _outcomes(push_cluster, "g2") == {
        **{(ids[b], 0): True for b in (b"0", b"1", b"4")}, (ids[b"2"], 0): False, (ids[b"3"], 0): False,
        (ids[b"2"], 1): True, (ids[b"3"], 1): True}
