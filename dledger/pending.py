"""One record waiting for its commit: what ``DLedgerGroup.append`` and ``append_nowait`` queue.

A pending append is finished exactly once, by whichever comes first: the commit callback (``index`` and
``result`` filled), a failure (``error`` set) or the expiry of its deadline (``AppendTimeoutError``). Tens of
thousands are made a second, so they are slotted, carry no Event, and read one coarse clock the group
refreshes instead of trio's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

__all__ = ["Pending", "CallbackPending"]


class Pending:
    """One ``append`` call. Its task parks with ``wait_task_rescheduled`` and is rescheduled once, by
    ``finish`` (commit, failure or expiry, whichever comes first): cheaper than an Event per record."""

    __slots__ = ("record", "task", "index", "result", "error", "deadline", "timeout_s", "done")

    def __init__(self, record: bytes, timeout_s: float, now: float) -> None:
        self.record = record
        self.timeout_s = timeout_s
        self.deadline = now + timeout_s
        self.task = trio.lowlevel.current_task()
        self.index = 0
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False

    @property
    def queued_at(self) -> float:
        return self.deadline - self.timeout_s

    def finish(self) -> None:
        if not self.done:
            self.done = True
            trio.lowlevel.reschedule(self.task)

    def abort(self, _raise_cancel: Any) -> trio.lowlevel.Abort:
        self.done = True  # cancelled caller: the record may still commit, nobody is told
        return trio.lowlevel.Abort.SUCCEEDED


class CallbackPending(Pending):
    """One ``append_nowait`` call: no task parks; ``finish`` calls ``on_done(self)`` once instead."""

    __slots__ = ("on_done", "waiting")

    def __init__(self, record: bytes, timeout_s: float, now: float, on_done: Callable[[Pending], None],
                 waiting: set[Pending]) -> None:
        self.record = record
        self.timeout_s = timeout_s
        self.deadline = now + timeout_s
        self.task = None
        self.index = 0
        self.result = None
        self.error = None
        self.done = False
        self.on_done = on_done
        self.waiting = waiting

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self.waiting.discard(self)
            try:
                self.on_done(self)
            except Exception:
                log.exception("append_nowait callback failed")
