"""A consumer's one instrumentation hook: its call sites tell it of every pull and handler call, and consumer
running info (``client/running_info.py``) and message trace (``client/trace.py``) subscribe to it.

A consumer owns a ``ConsumeHook`` (``consume_hook()``, made on first asking) and its call sites tell it of every pull
answered (``pulled``), every handler call as it starts and ends (``call_started`` / ``call_ended``: concurrent, batch
and orderly, the last with how many of the call's messages, its head, were consumed) and every message handed out
without a handler call (``handed_out``: the iterator's, as the loop asks for the next one; what a lite pull consumer's
``poll`` returns; no RT, the rest is the caller's). Messages handed out so are also *held* by the caller: a hold starts
as they go to it (``hold_started``: the iterator's ``__anext__`` returns one; ``poll`` returns a queue's share) and
ends once they count as consumed (``hold_ended``: the iterator's acknowledgement; at once, in ``poll``, as RocketMQ's
lite pull consumer runs its hooks); a hold whose messages were not consumed (its queue taken away, the iterator's
block left by an exception) is not ended. ``attach_push_consumer`` / ``attach_lite_pull_consumer`` subscribe the
recorder when the consumer is opened, and message trace (``client/trace.py``) its ``ConsumeTracer``; each subscriber
is a plain callback per event. Nothing of the consumer is wrapped or replaced, so both see the same calls and the same
outcome, and the order they subscribed in changes nothing. The cost on the handler path: the hook's two calls and a loop
over each event's subscribers (an event nobody subscribed to, as ``call_started`` without trace: an empty one); no
wrapper, no closure. Holds only the tracer hears: a call site asks ``holds_heard`` first, so without trace a message
handed out costs one attribute test and no call, tuple or list. A consumer nothing subscribed to has no hook and pays
one attribute test (never one opened by ``open_*``: running info always subscribes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from client.message import MessageExt, MessageQueue, PullResult, PullStatus

if TYPE_CHECKING:
    from client.listener import ReconsumeLater

__all__ = ["ConsumeCall", "ConsumeHook", "told_pull"]

# A ConsumeHook's subscribers, one plain callback per event (the hook's methods of the same names say when).
PulledListener = Callable[[MessageQueue, float, "int | None"], None]
CallStartedListener = Callable[["ConsumeCall"], None]
CallEndedListener = Callable[["ConsumeCall", "ReconsumeLater | None", int], None]
HandedOutListener = Callable[[MessageQueue, int], None]
HoldEndedListener = Callable[["ConsumeCall"], None]


class ConsumeCall:
    """One handler call, or one hold, as a ``ConsumeHook``'s subscribers see it (RocketMQ's ConsumeMessageContext):
    the queue its messages came from, the messages (one, or a batch in offset order), when it started (the hook's
    ``clock``) and the consume timeout bounding it (inf: none; a hold's is). ``trace`` is the tracer's, set as the
    call or hold starts."""

    __slots__ = ("mq", "msgs", "started", "timeout_s", "trace")

    def __init__(self, mq: MessageQueue, msgs: Sequence[MessageExt], started: float, timeout_s: float) -> None:
        self.mq = mq
        self.msgs = msgs
        self.started = started
        self.timeout_s = timeout_s
        self.trace: Any = None


class ConsumeHook:
    """Where a consumer's call sites tell of its pulls and handler calls, and who is told (the module's rules).
    Subscribers are called in the order they subscribed, each event's with nothing awaited."""

    __slots__ = ("clock", "holds_heard", "_pulled", "_call_started", "_call_ended", "_handed_out", "_hold_started",
                 "_hold_ended")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # what ``started`` is read from, for pulls and calls alike
        # Whether anything subscribed to hold_started: a call site asks before it builds a hold's messages.
        self.holds_heard = False
        self._pulled: tuple[PulledListener, ...] = ()
        self._call_started: tuple[CallStartedListener, ...] = ()
        self._call_ended: tuple[CallEndedListener, ...] = ()
        self._handed_out: tuple[HandedOutListener, ...] = ()
        self._hold_started: tuple[CallStartedListener, ...] = ()
        self._hold_ended: tuple[HoldEndedListener, ...] = ()

    def subscribe(self, *, pulled: PulledListener | None = None, call_started: CallStartedListener | None = None,
                  call_ended: CallEndedListener | None = None, handed_out: HandedOutListener | None = None,
                  hold_started: CallStartedListener | None = None,
                  hold_ended: HoldEndedListener | None = None) -> None:
        """From now on call each callback given on its event: ``pulled(mq, started, messages)``,
        ``call_started(call)``, ``call_ended(call, failure, ok)``, ``handed_out(mq, messages)``,
        ``hold_started(call)``, ``hold_ended(call)``."""
        given = {"pulled": pulled, "call_started": call_started, "call_ended": call_ended, "handed_out": handed_out,
                 "hold_started": hold_started, "hold_ended": hold_ended}
        for name, callback in given.items():
            if callback is not None and not callable(callback):
                raise TypeError(f"ConsumeHook.subscribe: {name} must be callable, got {callback!r}")
        if all(callback is None for callback in given.values()):
            raise TypeError("ConsumeHook.subscribe needs a callback for at least one of pulled, call_started, "
                            "call_ended, handed_out, hold_started, hold_ended")
        # Tuples, replaced rather than appended to: an event in progress goes on over the ones it started with.
        if pulled is not None:
            self._pulled += (pulled,)
        if call_started is not None:
            self._call_started += (call_started,)
        if call_ended is not None:
            self._call_ended += (call_ended,)
        if handed_out is not None:
            self._handed_out += (handed_out,)
        if hold_started is not None:
            self._hold_started += (hold_started,)
            self.holds_heard = True
        if hold_ended is not None:
            self._hold_ended += (hold_ended,)

    def pulled(self, mq: MessageQueue, started: float, messages: int | None) -> None:
        """A pull of ``mq`` sent at ``started`` was answered: it found ``messages`` messages (FOUND; 0 if the
        client's tag check left none), or None if it found none (no new message, none matched, an offset moved). A
        failed or cancelled one is not told."""
        for listener in self._pulled:
            listener(mq, started, messages)

    def call_started(self, mq: MessageQueue, msgs: Sequence[MessageExt], timeout_s: float = math.inf) -> ConsumeCall:
        """A handler call on ``msgs`` of ``mq`` starts now; what it returns goes to ``call_ended``."""
        call = ConsumeCall(mq, msgs, self.clock(), timeout_s)
        for listener in self._call_started:
            listener(call)
        return call

    def call_ended(self, call: ConsumeCall, failure: ReconsumeLater | None, ok: int) -> None:
        """``call`` returned: ``failure`` None, or how it failed; ``ok`` of its messages, its head, were consumed and
        the rest failed (the call site counts them: only a batch handler's ``ack_index`` splits a call). A call
        cancelled (its queue taken away) is not told: its messages are delivered again."""
        for listener in self._call_ended:
            listener(call, failure, ok)

    def handed_out(self, mq: MessageQueue, messages: int) -> None:
        """``messages`` messages of ``mq`` were consumed without a handler call: the caller's own (the iterator's
        loop body, what a lite pull consumer's poll returned)."""
        for listener in self._handed_out:
            listener(mq, messages)

    def hold_started(self, mq: MessageQueue, msgs: Sequence[MessageExt]) -> ConsumeCall:
        """``msgs`` of ``mq`` go to the caller's own code now (the iterator's one, a poll's share of one queue); what
        it returns goes to ``hold_ended`` once they count as consumed. Call sites ask ``holds_heard`` first."""
        call = ConsumeCall(mq, msgs, self.clock(), math.inf)
        for listener in self._hold_started:
            listener(call)
        return call

    def hold_ended(self, call: ConsumeCall) -> None:
        """The caller is done with the messages of the hold ``call``: consumed. A hold whose messages were not (its
        queue taken away, the iterator's block left by an exception) is not told: they are delivered again."""
        for listener in self._hold_ended:
            listener(call)


async def told_pull(hook: ConsumeHook | None, mq: MessageQueue, pull: Awaitable[PullResult]) -> PullResult:
    """Await ``pull``, a pull of ``mq`` not yet started, and tell ``hook`` (None: nobody listens) of its answer."""
    if hook is None:
        return await pull
    started = hook.clock()
    result = await pull
    hook.pulled(mq, started, len(result.messages) if result.status is PullStatus.FOUND else None)
    return result
