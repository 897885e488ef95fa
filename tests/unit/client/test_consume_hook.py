"""A consumer's one instrumentation hook (``ConsumeHook``, ``client/consume_hook.py``): what it tells its subscribers
and in which order, holds included; a tracer's SubAfter of a batch whose head holds a message of the trace topic;
and, on the in-memory fake cluster, a push consumer with running info and message trace both on: nothing of it is
replaced, and both hear the same handler calls with the same outcome (one message or a batch); an iterating push
consumer's and a lite pull consumer's messages traced as holds, the running info counting them as before."""

from __future__ import annotations

import math

import pytest
import trio

import client.lite_pull_consumer
from client import MessageQueue, ReconsumeLater, open_lite_pull_consumer, open_push_consumer
from client.consume_hook import ConsumeCall, ConsumeHook
from client.trace import TRACE_TOPIC, ConsumeReturnType, ConsumeTracer, TraceDispatcher, TraceType, decode_trace_data
from tests.unit.client.fake_cluster import NAMESRV, fake_remoting_ctx, send_numbered, wait_until
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


def test_holds_are_told_to_their_own_subscribers_and_holds_heard_says_whether_any_listens():
    clock = _Clock()
    hook = ConsumeHook(clock)
    heard: list[tuple] = []
    hook.subscribe(call_started=lambda call: heard.append(("call_started", call.msgs)),
                   call_ended=lambda call, failure, ok: heard.append(("call_ended", call.msgs)))
    assert not hook.holds_heard  # a call site builds no hold: nobody would hear it
    quiet = hook.hold_started(MQ, (_ext("A"),))
    hook.hold_ended(quiet)
    assert heard == []  # a hold is no handler call: their subscribers hear nothing of it

    def started(call: ConsumeCall) -> None:
        call.trace = "held"
        heard.append(("hold_started", call.mq, call.msgs, call.started, call.timeout_s))

    hook.subscribe(hold_started=started, hold_ended=lambda call: heard.append(("hold_ended", call.trace)))
    assert hook.holds_heard
    clock.now = 102.0
    held = (_ext("B"),)
    call = hook.hold_started(MQ, held)
    hook.hold_ended(call)
    assert heard == [("hold_started", MQ, held, 102.0, math.inf), ("hold_ended", "held")]
    with pytest.raises(TypeError, match="hold_ended must be callable, got 'x'"):
        hook.subscribe(hold_ended="x")  # type: ignore[arg-type]


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


class _Left(Exception):
    pass


def _held(fake, group: str) -> list[tuple]:
    """``group``'s contexts in order: (type, msg id, request id, success)."""
    return [(c.trace_type, c.msg_id, c.request_id, c.success) for c in _traces(fake) if c.group == group]


async def test_an_iterating_consumer_traces_each_message_from_handed_out_to_acknowledged(push_cluster):
    """SubBefore as ``__anext__`` hands a message out; SubAfter (success, cost: the time the loop held it) once the
    next ``__anext__`` or ``ack_pending`` acknowledges it. None for a message whose queue was taken away before its
    acknowledgement, nor for one whose block was left by an exception: delivered again, as a cancelled handler
    call's. The running info still counts what the loop took, untimed."""
    await send_numbered(4)
    async with open_push_consumer(NAMESRV, topic="T", enable_msg_trace=True, client_ip="10.0.0.9",
                                  **FIRST) as consumer:
        first = await consumer.__anext__()
        await trio.sleep(0.05)
        second = await consumer.__anext__()  # acknowledges the first
        consumer.ack_pending()
        info = await _ask(push_cluster.server_requests[0], consumer.client_id)
        third = await consumer.__anext__()
        await consumer.unsubscribe("T")  # its queue taken away: the acknowledgement on close commits nothing
    assert info.status["T"].consume_ok_tps > 0 and info.status["T"].consume_rt_ms == 0.0
    with pytest.raises(_Left):
        async with open_push_consumer(NAMESRV, topic="T", enable_msg_trace=True,
                                      **dict(FIRST, consumer_group="g2")) as consumer:
            left = await consumer.__anext__()
            raise _Left
    assert first.body == left.body == b"0"
    contexts = _held(push_cluster, "g")
    ids = [first.msg_id, second.msg_id, third.msg_id]
    # The next __anext__ acknowledges a message before it hands out the next one.
    assert [(t, msg_id, success) for t, msg_id, _, success in contexts] == [
        (TraceType.SUB_BEFORE, ids[0], None), (TraceType.SUB_AFTER, ids[0], True), (TraceType.SUB_BEFORE, ids[1], None),
        (TraceType.SUB_AFTER, ids[1], True), (TraceType.SUB_BEFORE, ids[2], None)]
    assert contexts[0][2] == contexts[1][2] != contexts[2][2] == contexts[3][2]  # one request id a message
    after_first = next(c for c in _traces(push_cluster) if c.trace_type is TraceType.SUB_AFTER)
    assert after_first.cost_ms >= 50 and after_first.client_host == "10.0.0.9"
    assert after_first.context_code == ConsumeReturnType.SUCCESS
    assert [(t, msg_id) for t, msg_id, _, _ in _held(push_cluster, "g2")] == [(TraceType.SUB_BEFORE, left.msg_id)]


async def test_a_lite_pull_poll_traces_each_message_it_returns(push_cluster, monkeypatch):
    """As RocketMQ's poll runs its consume hook's before and after: a SubBefore, then a SubAfter (success), per
    message returned, one request id per queue's share; a message left in the cache is not traced. Off, the
    consumer's hook hears no holds."""
    monkeypatch.setattr(client.lite_pull_consumer, "open_remoting",
                        lambda config, handler=None: fake_remoting_ctx(push_cluster))
    await send_numbered(3)
    t0 = MessageQueue("T", "broker-a", 0)
    async with open_lite_pull_consumer(NAMESRV, consumer_group="plain") as consumer:
        assert not consumer.consume_hook().holds_heard
    async with open_lite_pull_consumer(NAMESRV, consumer_group="LG", consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                                       enable_msg_trace=True, client_ip="10.0.0.9") as consumer:
        consumer.assign([t0])
        polled = await consumer.poll(timeout_s=10, max_messages=2)
        assert [m.body for m in polled] == [b"0", b"1"]
        while consumer.statistics().cached < 1:
            await trio.sleep(0.01)
    contexts = [c for c in _traces(push_cluster) if c.group == "LG"]
    a, b = (m.msg_id for m in polled)
    assert [(c.trace_type, c.msg_id, c.success) for c in contexts] == [
        (TraceType.SUB_BEFORE, a, None), (TraceType.SUB_BEFORE, b, None), (TraceType.SUB_AFTER, a, True),
        (TraceType.SUB_AFTER, b, True)]
    assert len({c.request_id for c in contexts}) == 1 and {c.client_host for c in contexts} == {"10.0.0.9"}
