"""Long polling: RocketMQ's PullRequestHoldService on trio.

A pull that finds no new message is *held* instead of answered: the processor returns no response and registers
the request here with the offset it is waiting past and a deadline (``suspend_timeout_millis`` from the client,
capped by the broker's ``long_polling_timeout_ms``). The request is resumed, i.e. the pull is executed again and
its response sent, as soon as one of these happens:

* the dispatch path reports a queue's new max offset beyond the held offset (``notify_message_arriving``), and,
  for a pull with a tag filter, a new unit carries a tags code the filter wants (RocketMQ's
  ``isMatchedByConsumeQueue``): units it does not want move the held offset past them instead, and the resumed
  pull starts there (a SQL92 pull's ``matches`` reads the new messages' properties instead:
  ``broker/property_filter.py``). Before, every arrival woke every held pull of the queue: a consumer of a rare tag
  on a busy queue made a round trip per arrival to be told "nothing for you";
* the deadline passes (the re-executed pull then answers PULL_NOT_FOUND, so the client simply pulls again);
* a periodic check (``check_interval_ms``) sees the queue's max offset moved, in case a notification was missed
  (dispatch on a follower can race a hold that was registered a moment later);
* the broker releases it (``release``): its topic was deleted, or its queue is no longer readable (read_queue_nums
  lowered below its queue_id, perm). The re-executed pull then gives the answer a fresh pull gets
  (TOPIC_NOT_EXIST, INVALID_REQUEST naming ``queue_id``) at once, not PULL_NOT_FOUND at the deadline, which told
  the consumer to keep pulling a queue that is gone. Counted neither as an arrival nor as a timeout. A node whose
  ``broker_permission`` lost read releases every held pull. A consumer group's subscription group narrowing
  (stopped, broadcasting refused, removed; ``broker/subscription_group.py``) releases that group's pulls only
  (``release_groups``; a pull or a POP names its ``consumer_group`` when held, and a hold that names none is
  released by every narrowing): the resume refuses them, or holds them again for the time they have left when the
  narrowing does not concern them (broadcasting refused, a clustering group). Before, every narrowing woke every
  held pull of the node, and each pull of every other group was re-run and held again.

``statistics().held`` counts pull requests held, each once: a pull its resume holds again (``rehold``) is not
counted again, as RocketMQ's PullRequestHoldService suspends a pull once (one it looks at and finds nothing for
stays in its table; the re-executed pull is never suspended again). A held pull is counted once more when it is
answered, by arrival or timeout, and not when released. Before, each re-hold counted as a new hold, and a
narrowing of one group added every pull held on the node to the count.

Resumes run as tasks in the service's nursery, never inline in ``notify_message_arriving``, because that is called
from the store's dispatch path which must not block on sockets.

A held pull answers nothing until it resumes, so nothing else limits how many one client keeps here: a pull names
its connection (``conn``), which holds at most ``max_held_per_connection`` (past that its oldest is answered as at
its deadline, the answer a consumer pulling each of its queues once never sees), and the pulls of a connection
that closed are dropped by the periodic check, unanswered (there is no one to answer). Before, one connection
sending suspended pulls in a loop held them all, some 2 KB each, each for up to ``long_polling_timeout_ms``, and
re-ran every one of them at its deadline, long after its connection was gone.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import math
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import trio

log = logging.getLogger(__name__)

ResumeFn = Callable[[bool, int], Awaitable[None]]  # resume(timed_out, offset to pull from)
# matches(begin, end): whether a unit of the queue in [begin, end) may match the held pull's filter
MatchFn = Callable[[int, int], bool]


@dataclasses.dataclass(eq=False)
class HeldPull:
    topic: str
    queue_id: int
    offset: int  # moves past units the filter does not want
    deadline: float  # trio.current_time() based
    resume: ResumeFn
    matches: MatchFn | None = None  # None: every message matches
    done: bool = False
    conn: Any = None  # the connection to answer on (None: not tracked per connection)
    consumer_group: str | None = None  # whose pull (None: not named, released by every group's narrowing)


@dataclasses.dataclass(frozen=True)
class LongPollingStatistics:
    held: int
    resumed_by_arrival: int
    resumed_by_timeout: int


# A push consumer holds one pull per queue it is given on a node. Past the bound each new pull answers the oldest
# at once and the client pulls it again at once, so a legit consumer over it spins: 16 topics of 1024 queues on one
# node fit (4,096 did not: 5 such topics spun), at some 2.4 KB a held pull, ~40 MB a connection at most.
MAX_HELD_PER_CONNECTION = 16_384
_COMPACT_MIN = 64  # finished entries the deadline heap may keep before a compaction is considered


class PullRequestHoldService:
    def __init__(self, max_offset: Callable[[str, int], int], *, check_interval_ms: int = 1000,
                 max_held_per_connection: int | None = None) -> None:
        if max_held_per_connection is None:
            max_held_per_connection = MAX_HELD_PER_CONNECTION  # read now: a test may lower it
        if max_held_per_connection < 1:
            raise ValueError(f"max_held_per_connection must be >= 1, got {max_held_per_connection}")
        self._max_offset = max_offset
        self._check_interval_s = check_interval_ms / 1000
        self._max_held_per_conn = max_held_per_connection
        self._by_queue: dict[tuple[str, int], list[HeldPull]] = {}
        # conn -> its held pulls, oldest first (a dict as an ordered set)
        self._by_conn: dict[Any, dict[HeldPull, None]] = {}
        self._deadlines: list[tuple[float, int, HeldPull]] = []
        # Entries of _deadlines finished before their deadline (an upper bound: those reaching the top are popped
        # without being counted off), for _compact_deadlines.
        self._finished_early = 0
        self._seq = itertools.count()
        self._held = 0
        self._by_arrival = 0
        self._by_timeout = 0
        self._send, self._receive = trio.open_memory_channel[tuple[HeldPull, bool]](math.inf)
        self._deadline_changed = trio.Event()
        self._running = False

    def statistics(self) -> LongPollingStatistics:
        return LongPollingStatistics(self._held, self._by_arrival, self._by_timeout)

    def held_now(self) -> int:
        """Pulls held at this moment."""
        return sum(len(waiting) for waiting in self._by_queue.values())

    def hold(self, topic: str, queue_id: int, offset: int, timeout_s: float, resume: ResumeFn,
             matches: MatchFn | None = None, *, conn: Any = None, consumer_group: str | None = None,
             rehold: bool = False) -> HeldPull:
        """Hold a pull of ``consumer_group`` waiting for messages at ``offset`` or beyond in (topic, queue_id) (that
        ``matches``, if given), which came over ``conn`` (anything with a ``closed`` flag; see the module rules).
        ``rehold``: the pull was held before and its resume holds it again, so it is not counted again. Returns the
        held pull, for ``withdraw``."""
        req = HeldPull(topic, queue_id, offset, trio.current_time() + timeout_s, resume, matches, conn=conn,
                       consumer_group=consumer_group)
        if not self._running:
            self._finish(req, True)
            return req
        if self._arrived(req, self._max_offset(topic, queue_id)):
            # The message arrived between the pull's read and this hold: resume at once.
            self._finish(req, False)
            return req
        if conn is not None:
            mine = self._by_conn.get(conn)
            if mine is not None and len(mine) >= self._max_held_per_conn:
                oldest = next(iter(mine))
                self._remove(oldest)
                self._finish(oldest, True)
            self._by_conn.setdefault(conn, {})[req] = None
        self._by_queue.setdefault((topic, queue_id), []).append(req)
        heapq.heappush(self._deadlines, (req.deadline, next(self._seq), req))
        if not rehold:
            self._held += 1
        if self._deadlines[0][2] is req:
            self._deadline_changed.set()
        return req

    def withdraw(self, req: HeldPull) -> None:
        """Forget ``req`` unanswered, never to be resumed: a POP waits on several queues at once
        (``broker/processor/pop_message.py``), and once one of them woke it the others are withdrawn. Its deadline
        entry stays in the heap until it is due, as a finished pull's does, unless finished entries come to dominate
        the heap: a POP waiting on 8 queues withdraws 7 holds each time, each alive (with its request) until its
        deadline, up to ``long_polling_timeout_ms`` away."""
        if req.done:
            return
        req.done = True
        self._remove(req)
        self._untrack(req)
        self._finished_early += 1
        self._compact_deadlines()

    def notify_message_arriving(self, topic: str, queue_id: int, max_offset: int) -> None:
        """Called on the trio thread by the dispatch path with the queue's new max offset (exclusive end)."""
        waiting = self._by_queue.get((topic, queue_id))
        if not waiting:
            return
        keep = []
        for req in waiting:
            if self._arrived(req, max_offset):
                self._finish(req, False)
                self._finished_early += 1
            else:
                keep.append(req)
        if keep:
            self._by_queue[(topic, queue_id)] = keep
        else:
            del self._by_queue[(topic, queue_id)]
        self._compact_deadlines()

    def release(self, refused: Callable[[str, int], bool]) -> None:
        """Resume at once every held pull whose (topic, queue_id) ``refused`` picks."""
        for (topic, queue_id), waiting in list(self._by_queue.items()):
            if refused(topic, queue_id):
                del self._by_queue[(topic, queue_id)]
                for req in waiting:
                    self._finish(req, False, counted=False)

    def release_groups(self, consumer_groups: Collection[str]) -> None:
        """Resume at once the held pulls of ``consumer_groups``, and those held without naming a group: they may
        be of one of them. The others stay held, untouched."""
        if not consumer_groups:
            return
        released = 0
        for key, waiting in list(self._by_queue.items()):
            keep = []
            for req in waiting:
                if req.consumer_group is None or req.consumer_group in consumer_groups:
                    self._finish(req, False, counted=False)
                    released += 1
                else:
                    keep.append(req)
            if len(keep) == len(waiting):
                continue
            if keep:
                self._by_queue[key] = keep
            else:
                del self._by_queue[key]
        # Their deadline entries go with the next compaction: the ones held again have new entries.
        self._finished_early += released
        self._compact_deadlines()

    @staticmethod
    def _arrived(req: HeldPull, max_offset: int) -> bool:
        if max_offset <= req.offset:
            return False
        if req.matches is None:
            return True
        try:
            if req.matches(req.offset, max_offset):
                return True
        except Exception:
            # A filter that fails must not end the hold service (and the node with it): the pull is woken and its
            # own read of the store answers it, or says what is wrong.
            log.exception("held pull's filter failed; the pull is woken topic=%s queue_id=%d offset=%d", req.topic,
                          req.queue_id, req.offset)
            return True
        req.offset = max_offset  # nothing there for this pull: it waits past those units
        return False

    def _finish(self, req: HeldPull, timed_out: bool, *, counted: bool = True) -> None:
        if req.done:
            return
        req.done = True
        self._untrack(req)
        if counted and not timed_out:
            self._by_arrival += 1
        elif counted:
            self._by_timeout += 1
        self._send.send_nowait((req, timed_out))

    def _expire_and_check(self) -> None:
        now = trio.current_time()
        while self._deadlines and (self._deadlines[0][2].done or self._deadlines[0][0] <= now):
            _, _, req = heapq.heappop(self._deadlines)
            if not req.done:
                self._remove(req)
                self._finish(req, True)

    def _check_moved(self) -> None:
        self._drop_closed()
        for (topic, queue_id), _ in list(self._by_queue.items()):
            self.notify_message_arriving(topic, queue_id, self._max_offset(topic, queue_id))

    def _drop_closed(self) -> None:
        """Forget, unanswered, the held pulls of connections that closed."""
        closed = [conn for conn in self._by_conn if getattr(conn, "closed", False)]
        if not closed:
            return
        dropped = 0
        for conn in closed:
            for req in list(self._by_conn.pop(conn)):
                req.done = True
                self._remove(req)
                dropped += 1
        # Their deadline entries would keep them (and their requests) alive until the deadlines pass.
        self._compact_deadlines(force=True)
        log.debug("held pulls of closed connections dropped connections=%d pulls=%d", len(closed), dropped)

    def _compact_deadlines(self, *, force: bool = False) -> None:
        """Drop finished entries from the deadline heap once they may be more than half of it (and more than 64):
        linear, but only after as many finishes as half the heap, so constant per finish."""
        stale = self._finished_early
        if force or (stale > _COMPACT_MIN and 2 * stale > len(self._deadlines)):
            self._deadlines = [entry for entry in self._deadlines if not entry[2].done]
            heapq.heapify(self._deadlines)
            self._finished_early = 0

    def _untrack(self, req: HeldPull) -> None:
        if req.conn is None:
            return
        mine = self._by_conn.get(req.conn)
        if mine is not None:
            mine.pop(req, None)
            if not mine:
                del self._by_conn[req.conn]

    def _remove(self, req: HeldPull) -> None:
        waiting = self._by_queue.get((req.topic, req.queue_id))
        if waiting and req in waiting:
            waiting.remove(req)
            if not waiting:
                del self._by_queue[(req.topic, req.queue_id)]

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._running = True
            nursery.start_soon(self._resumer, nursery)
            task_status.started()
            try:
                next_check = trio.current_time() + self._check_interval_s
                while True:
                    wake_at = next_check
                    if self._deadlines:
                        wake_at = min(wake_at, self._deadlines[0][0])
                    self._deadline_changed = trio.Event()
                    with trio.move_on_at(wake_at):
                        await self._deadline_changed.wait()
                    self._expire_and_check()
                    if trio.current_time() >= next_check:
                        self._check_moved()
                        next_check = trio.current_time() + self._check_interval_s
            finally:
                self._running = False
                # Held pulls die with their connections when the broker stops; the clients re-pull elsewhere.
                self._by_queue.clear()
                self._by_conn.clear()
                self._deadlines.clear()
                self._finished_early = 0

    async def _resumer(self, nursery: trio.Nursery) -> None:
        async for req, timed_out in self._receive:
            nursery.start_soon(self._run_resume, req, timed_out)

    @staticmethod
    async def _run_resume(req: HeldPull, timed_out: bool) -> None:
        try:
            await req.resume(timed_out, req.offset)
        except trio.Cancelled:
            raise
        except Exception:
            log.exception("resuming a held pull failed topic=%s queue_id=%d", req.topic, req.queue_id)
