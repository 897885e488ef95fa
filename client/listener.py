"""What a push consumer's handler answers (RocketMQ's listener statuses and context settings), and what
``max_reconsume_times`` -1 means; the rules are in ``client.push_consumer``'s docstring, "Handler results"."""

from __future__ import annotations

import enum
from collections.abc import Callable

import trio

from client.message import I32_MAX

__all__ = ["ConsumeStatus", "ReconsumeLater", "FailureCause", "CONCURRENT_MAX_RECONSUME_TIMES",
           "ORDERLY_MAX_RECONSUME_TIMES", "asked_reconsume_later", "grouped_failure", "failure_of"]

# What max_reconsume_times -1 means, as RocketMQ's getMaxReconsumeTimes: 16 for concurrent consumption (its retries
# then take the broker's backoff levels 3 to 18, the last), unlimited for orderly (a queue's later messages may need
# this one handled first).
CONCURRENT_MAX_RECONSUME_TIMES = 16
ORDERLY_MAX_RECONSUME_TIMES = I32_MAX
# RocketMQ's clamp of ConsumeOrderlyContext.suspendCurrentQueueTimeMillis (submitConsumeRequestLater).
SUSPEND_MS_MIN, SUSPEND_MS_MAX = 10, 30_000


class ConsumeStatus(enum.Enum):
    """What a handler may return (RocketMQ's ConsumeConcurrentlyStatus / ConsumeOrderlyStatus). ``SUCCESS`` (or
    None): consumed. ``RECONSUME_LATER``: failed, as if it raised (orderly: RocketMQ's
    SUSPEND_CURRENT_QUEUE_A_MOMENT). Any other return value is a failure too, logged (see ``client.push_consumer``).
    A ``batch_handler``'s answer is about its whole batch (to fail only its tail: ``ReconsumeLater.ack_index``)."""

    SUCCESS = "SUCCESS"
    RECONSUME_LATER = "RECONSUME_LATER"


class FailureCause(enum.Enum):
    """How a failed handler call failed, a ``ReconsumeLater``'s ``cause``: what message trace tells as the call's
    ConsumeReturnType (``client/trace.py``, as RocketMQ's consume services set it). A call past its consume timeout is
    told by how long it took, whatever its cause."""

    ASKED = "asked"  # raised ReconsumeLater or returned RECONSUME_LATER: RocketMQ's FAILED
    RAISED = "raised"  # raised anything else: RocketMQ's EXCEPTION (its listener threw)
    # Returned what is no ConsumeStatus: RocketMQ's RETURNNULL (a Java listener's one way to answer no status; None
    # is success here).
    NO_STATUS = "no_status"


class ReconsumeLater(Exception):
    """Raised by a handler: this message failed, consume it again later (``RECONSUME_LATER`` with the settings
    RocketMQ's listener puts in its context).

    ``delay_level`` (ConsumeConcurrentlyContext.setDelayLevelWhenNextConsume): concurrent consumption, the delay level
    of the send-back; 0 or None: the broker's backoff (level 3 + reconsume times); -1: straight to the group's
    dead-letter topic (broadcasting: no more retries, logged and skipped). Orderly consumption ignores a positive
    level (``suspend_ms`` applies) but takes -1 the same way: the one way to let a queue past a message it can never
    handle without waiting out ``max_reconsume_times``, unlimited by default.

    ``suspend_ms`` (ConsumeOrderlyContext.setSuspendCurrentQueueTimeMillis): orderly consumption, how long the queue
    waits before this message is handled again, this time; clamped to 10..30000 ms as RocketMQ; None:
    ``suspend_current_queue_time_ms``. Concurrent consumption ignores it.

    ``ack_index`` (ConsumeConcurrentlyContext.setAckIndex): a ``batch_handler``'s call, the index of the last message
    of its batch that was consumed: messages ``0..ack_index`` count as consumed, the ones after it failed (sent back,
    or retried here, as any failure). None or -1: the whole batch failed; an index at or past the batch's last
    message: none failed (RocketMQ clamps it so). A handler of one message at a time ignores it (what it raises is
    about its one message), as orderly consumption does.

    ``cause`` (``FailureCause``, not an argument): ``ASKED`` for a handler's own; the consumer's failures for a
    handler that raised anything else or returned no status say so (``failure_of``), for message trace's code."""

    def __init__(self, reason: str = "", *, delay_level: int | None = None, suspend_ms: int | None = None,
                 ack_index: int | None = None) -> None:
        # Checked here, in the handler that raises it, where a mistake can be read, not in the consumer: the broker
        # refused a level past a Java int, and a level below -1 meant nothing to it.
        if delay_level is not None and (type(delay_level) is not int or not -1 <= delay_level <= I32_MAX):
            raise ValueError(f"ReconsumeLater.delay_level must be None or an int from -1 to {I32_MAX}, got "
                             f"{delay_level!r}")
        if suspend_ms is not None and type(suspend_ms) is not int:
            raise ValueError(f"ReconsumeLater.suspend_ms must be None or an int (ms), got {suspend_ms!r}")
        # Below -1 a slice from ack_index + 1 would count from the batch's end, and mark its head consumed.
        if ack_index is not None and (type(ack_index) is not int or ack_index < -1):
            raise ValueError(f"ReconsumeLater.ack_index must be None or an int >= -1 (the index of the batch's last "
                             f"consumed message), got {ack_index!r}")
        super().__init__(reason or "the handler asked to consume the message again later")
        self.delay_level = delay_level
        self.suspend_ms = None if suspend_ms is None else min(max(suspend_ms, SUSPEND_MS_MIN), SUSPEND_MS_MAX)
        self.ack_index = ack_index
        self.cause = FailureCause.ASKED  # the consumer's own failures say otherwise (``failure_of``)


_CAUSE_REASONS = {FailureCause.RAISED: "the handler raised",
                  FailureCause.NO_STATUS: "the handler returned no ConsumeStatus"}


def failure_of(cause: FailureCause) -> ReconsumeLater:
    """The failure the consumer makes of a handler call that did not raise ``ReconsumeLater`` itself: a plain one
    (no settings) with ``cause``."""
    failure = ReconsumeLater(_CAUSE_REASONS.get(cause, ""))
    failure.cause = cause
    return failure


def asked_reconsume_later(group: BaseExceptionGroup) -> ReconsumeLater | None:
    """The ``ReconsumeLater`` a group of them asks for (the dead letters, -1, if any does), None if the group holds
    anything else too (then it is a failure like any other)."""
    asked, other = group.split(ReconsumeLater)
    if asked is None or other is not None:
        return None
    leaves: list[ReconsumeLater] = []
    pending: list[BaseException] = [asked]
    while pending:
        e = pending.pop()
        if isinstance(e, BaseExceptionGroup):
            pending.extend(e.exceptions)
        else:
            leaves.append(e)  # type: ignore[arg-type]
    return next((e for e in leaves if e.delay_level == -1), leaves[0])


def grouped_failure(group: BaseExceptionGroup, log_failure: Callable[[BaseExceptionGroup], None]) -> ReconsumeLater:
    """The failure a handler's grouped exceptions stand for (a handler with a nursery of its own raises grouped):
    the ``ReconsumeLater`` they ask for if that is all they hold (its settings kept), else a plain one, the rest
    given to ``log_failure`` and the failure's cause ``RAISED``. A Cancelled in the group (the call's timeout, or its
    queue going away) is raised as one, which the cancelling scope takes: raised as the group, the other errors in it
    ended the whole consumer."""
    cancelled, rest = group.split(trio.Cancelled)
    if rest is not None:
        asked = asked_reconsume_later(rest)
        if asked is not None and cancelled is None:
            return asked
        log_failure(rest)
    if cancelled is not None:
        raise cancelled from None
    return failure_of(FailureCause.RAISED)
