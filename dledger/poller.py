"""``EpollPoller``: pysyncobj's poller interface over one ``select.epoll``, so trio can drive pysyncobj.

pysyncobj normally runs its own tick thread, which shares the GIL with trio: every Raft hop then costs thread
wake-ups and GIL hand-offs (about six per append), which set the floor of sequential latency (p50 ~2 ms with
one append in flight) and cost each member several hundred microseconds of CPU per entry. With
``autoTick=False`` and this poller, ``dledger.group`` ticks pysyncobj from a trio task instead: it waits until
the epoll descriptor is readable (any socket or the command pipe has an event) or the tick interval passed, then
calls ``doTick(0)``. Everything pysyncobj does (network, apply, callbacks) then runs on the trio thread.

Level-triggered, like pysyncobj's own ``poll``/``select`` pollers. ``handled`` counts the events the last
``poll`` dispatched: the tick task ticks again at once when it is non-zero, because pysyncobj acts on what a
poll delivered (commit index, apply, replies) only at the start of its next tick.
"""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import Any

from pysyncobj.poller import POLL_EVENT_TYPE

__all__ = ["EpollPoller"]


def _fd(descr: Any) -> int:
    return descr if isinstance(descr, int) else descr.fileno()


class EpollPoller:
    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._callbacks: dict[int, tuple[Any, Callable[[Any, int], None]]] = {}
        self.handled = 0

    def fileno(self) -> int:
        return self._epoll.fileno()

    def subscribe(self, descr: Any, callback: Callable[[Any, int], None], event_mask: int) -> None:
        mask = 0
        if event_mask & POLL_EVENT_TYPE.READ:
            mask |= select.EPOLLIN
        if event_mask & POLL_EVENT_TYPE.WRITE:
            mask |= select.EPOLLOUT
        if event_mask & POLL_EVENT_TYPE.ERROR:
            mask |= select.EPOLLERR
        fd = _fd(descr)
        self._callbacks[fd] = (descr, callback)
        try:
            self._epoll.modify(fd, mask)
        except FileNotFoundError:  # not registered yet, or closed since (epoll forgets closed descriptors)
            self._epoll.register(fd, mask)

    def unsubscribe(self, descr: Any) -> None:
        try:
            fd = _fd(descr)
        except (OSError, ValueError):  # a socket already closed has no descriptor left to forget
            return
        self._callbacks.pop(fd, None)
        try:
            self._epoll.unregister(fd)
        except (FileNotFoundError, OSError, ValueError):
            pass

    def poll(self, timeout: float) -> None:
        events = self._epoll.poll(timeout if timeout > 0 else 0)
        self.handled = len(events)
        for fd, event in events:
            entry = self._callbacks.get(fd)
            if entry is None:
                continue
            mask = 0
            if event & select.EPOLLIN:
                mask |= POLL_EVENT_TYPE.READ
            if event & select.EPOLLOUT:
                mask |= POLL_EVENT_TYPE.WRITE
            if event & (select.EPOLLERR | select.EPOLLHUP):
                mask |= POLL_EVENT_TYPE.ERROR
            descr, callback = entry
            callback(descr, mask)

    def close(self) -> None:
        self._callbacks.clear()
        self._epoll.close()
