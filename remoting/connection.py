"""One remoting connection, either end: the trio shell around the codec (``remoting/transport.py`` has the
server loop and the client pool).

Rules of a connection (both ends are the same ``RemotingConnection``: a server may send requests to a client
too, as RocketMQ's broker does for transaction check-backs):

* One reader task decodes frames in arrival order. A response wakes the task that waits for its ``opaque``;
  a request is handed to the handler *inline*, in the reader task, because a task per request costs ~25 µs
  against ~9 µs inline (notes/platform.md). A handler that must wait (long polling, a Raft commit) returns
  None and answers later with ``await conn.send_response(frame)`` from a task of its own, e.g. in
  ``conn.nursery``, whose tasks end with the connection. For the same reason a handler must never await
  ``conn.invoke`` inline: the reader that would deliver that response is the task waiting for it.
* One writer task owns the socket's send side. Everybody else appends encoded frames to a list, and the
  writer sends whatever accumulated as ONE ``send_all``: with many requests in flight this alone doubles
  throughput, because a syscall and a trio checkpoint per frame cost more than the frame itself. Past
  ``HIGH_WATER_BYTES`` queued, senders wait for the writer (so a peer that stops reading stops us too), first
  come first served: a sender that arrives while others wait queues behind them, and each drain lets the
  longest waiter in. (Waking them all and letting the first to run win made the wait a lottery: with 4 MB
  frames one send in a hundred waited eight times as long as the average.) A request's timeout counts this
  wait too, and so does the deadline of a oneway request's caller (its cancel scope). A request waiting for room
  with a deadline is a request in flight (``oldest_request_sent_at``), and one whose deadline passes there
  counts for the silent close below as a request that timed out, if the socket also took nothing of ours
  meanwhile (counted per slice of a long write: ``WRITE_SLICE_BYTES``; counted per whole write, a peer reading
  1.3 MB/s took 3 s a 4 MB queue and was closed as silent): a peer that stopped reading (a stopped leader) fills
  the queue, after which every request waits here, none is sent, and neither the client's leader watch nor the
  silent close saw any request waiting (a ``send_oneway`` was still blocked after 20 s).
* ``corked()``: synchronous code that answers many requests at once (a Raft commit's callbacks) queues its
  frames without waking any writer; when the outermost ``corked()`` block ends, each connection that got
  frames and whose writer is idle has its queue written straight to the socket with one non-blocking
  ``send``, and only what the socket did not take goes to the writer task. The answer leaves before control
  returns to the scheduler (one task switch and one scheduling round less per commit, which is most of what
  sequential latency is made of), and still as one write per connection.
* A request sent while nothing else is in flight on its connection is written at once the same way: there is
  nothing to coalesce it with.
* Waiting for a response uses trio's low-level park/reschedule, not an Event per request; a per-request
  deadline raises ``RequestTimeoutError``, and a late response is dropped. A request that times out on a
  connection that received nothing at all since it was sent, and nothing for ``SILENT_CLOSE_MIN_S`` (1 s),
  closes the connection (``_close_silent``).
* When the connection ends for any reason (peer closed, bad frame, send failure, ``close()``) every waiting
  request fails with ``ConnectionClosedError`` naming the reason, the handler's ``connection_closed(conn)``
  runs, and the pool forgets the connection so the next invoke reconnects.
* A bad frame (garbage, oversize, malformed header) closes that connection only, with a WARNING naming the
  peer and the reason; the decoder refuses an oversize length before buffering any of it.
* Every TCP connection, accepted or dialled, plain or TLS, has TCP_NODELAY and keepalive (``KEEPALIVE_IDLE_S``,
  ``KEEPALIVE_INTERVAL_S``, ``KEEPALIVE_COUNT``): a peer that vanished without a FIN or RST (host powered off, link
  cut) breaks the connection after about two minutes of silence instead of never.
"""
from __future__ import annotations

import heapq
import logging
import math
import os
import socket
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import outcome
import trio

from remoting.codec import (
    DEFAULT_MAX_FRAME_SIZE,
    FLAG_ONEWAY,
    FLAG_RESPONSE,
    MAX_HEADER_INT,
    NEED_DATA,
    Frame,
    FrameDecoder,
    encode,
    make_response,
)
from remoting.codes import ResponseCode
from remoting.errors import BrokerError, ConnectionClosedError, FrameTooLargeError, ProtocolError, RequestTimeoutError

__all__ = ["ClientConnection", "ConnectionStatistics", "RemotingConnection", "RequestHandler", "ServerConnection",
           "corked"]

log = logging.getLogger(__name__)

RECEIVE_SIZE = 128 * 1024
FRAMES_PER_YIELD = 64
HIGH_WATER_BYTES = 4 * 1024 * 1024
# The writer hands a queue larger than this to the socket in slices of it, each counted (``_write_progress``):
# large enough that a frame or a usual coalesced queue is one send_all, small enough that a peer reading slowly
# shows progress well within a request's timeout.
WRITE_SLICE_BYTES = 256 * 1024
# How long a connection whose peer went away keeps trying to flush responses already queued.
DRAIN_TIMEOUT_S = 0.5
# Request timeouts fire up to this much late; coarser buckets mean fewer timer wake-ups.
TIMEOUT_RESOLUTION_S = 0.01
# A request timing out on a connection that received nothing since it was sent, and nothing for at least this
# long, closes the connection (``_close_silent``). Below it, silence says more about a short timeout than
# about the peer: a 1 ms timeout runs out on any healthy connection.
SILENT_CLOSE_MIN_S = 1.0
# A client connection closed before any answer within this long of connecting may have been refused (TLS, in
# ``_refused_hint``); later, it more likely lost its server.
REFUSED_WITHIN_S = 1.0
# TCP keepalive, on every connection at both ends. A peer whose host lost power or was cut off sends no FIN or RST,
# and a connection that waits for the peer's next request (a name server's, a broker's for an idle client) sends
# nothing that could fail: without probes it stayed ESTABLISHED forever, with its descriptor and tasks. After
# KEEPALIVE_IDLE_S without a packet the kernel probes every KEEPALIVE_INTERVAL_S, and KEEPALIVE_COUNT probes
# unanswered break the connection: two minutes in all, as long as RocketMQ's server leaves an idle channel open
# (serverChannelMaxIdleTimeSeconds, 120 s). A live peer's kernel answers the probes, however busy the process is.
# Read when each connection is made (a test may shorten them).
KEEPALIVE_IDLE_S = 60
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_COUNT = 6


def _tune_socket(stream: trio.abc.Stream) -> None:
    """TCP_NODELAY and keepalive on the TCP socket under ``stream``, below TLS too (setsockopt is the socket's, not
    the SSLStream's); nothing for a stream that is no TCP socket (a test's in-memory or UNIX stream)."""
    raw = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    if not isinstance(raw, trio.SocketStream) or raw.socket.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock = raw.socket
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        # Linux has all three; a platform without one keeps its system default for it.
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                            ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
            option = getattr(socket, name, None)
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
    except OSError:
        pass  # reset before we got to it: the reader meets the same error and says so


# Connections that queued frames inside the current ``corked()`` block (None: not corked). The trio thread is
# the only one that touches connections, so a module-level list is enough.
_cork: list[RemotingConnection] | None = None


@contextmanager
def corked() -> Iterator[None]:
    """Hold every connection's writer while the block queues frames, then write each connection's queue
    straight to its socket (see the module rules). Nested blocks flush once, at the outermost end."""
    global _cork
    if _cork is not None:
        yield
        return
    _cork = held = []
    try:
        yield
    finally:
        _cork = None
        for conn in held:
            conn._write_through()


class RequestHandler(Protocol):
    """What ``serve_remoting`` (and a client that accepts requests) calls for every incoming request.
    It may also define ``connection_closed(conn)``, called once when a connection ends."""

    async def handle(self, request: Frame, conn: RemotingConnection) -> Frame | None: ...


@dataclass(frozen=True, slots=True)
class ConnectionStatistics:
    frames_received: int
    frames_sent: int
    bytes_received: int
    bytes_sent: int
    send_calls: int
    """Socket writes (the writer's ``send_all`` calls and ``corked`` write-throughs): fewer than ``frames_sent``
    when writes were coalesced."""
    pending_requests: int


class RemotingConnection:
    """One TCP connection, either end. Built by ``serve_remoting`` or a client, never directly."""

    @staticmethod
    def _decoder_limits(max_frame_size: int) -> dict[str, int]:
        return {}  # a server's: MAX_HEADER_SIZE

    def __init__(self, stream: trio.SocketStream | trio.SSLStream, remote_address: str,
                 handler: RequestHandler | None, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.remote_address = remote_address
        self.max_frame_size = max_frame_size
        self.nursery: trio.Nursery | None = None
        self._stream = stream
        self._handler = handler
        # A server bounds the headers of requests from whoever connects; a client the answers of servers it dialled
        # by its frame size alone (``FrameDecoder``).
        self._decoder = FrameDecoder(max_frame_size, **self._decoder_limits(max_frame_size))
        # opaque -> (task, deadline, timeout_s, request code); a plain tuple is cheapest to build
        self._pending: dict[int, tuple[trio.lowlevel.Task, float, float | None, int]] = {}
        self._wheel: dict[int, list[int]] = {}
        self._ticks: list[int] = []
        self._timer_tick: float = math.inf
        self._clock = trio.lowlevel.current_clock()
        self._last_received_at = self._clock.current_time()
        self._timer_parked: trio.lowlevel.Task | None = None
        self._next_opaque = 1
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._sending = False
        self._writer_parked: trio.lowlevel.Task | None = None
        self._drained = trio.lowlevel.ParkingLot()
        # Senders waiting for the queue to drop below HIGH_WATER_BYTES, longest waiting first.
        self._room_waiters: deque[trio.lowlevel.Task] = deque()
        # The waiter let in but not yet run: it holds the room, so a newcomer queues behind it (seeing room and no
        # waiters, one went first, and the longest waiter's frame left after a newcomer's).
        self._admitted: trio.lowlevel.Task | None = None
        # Requests among the waiters: task -> (waiting since, its deadline, request code), longest waiting first.
        self._room_requests: dict[trio.lowlevel.Task, tuple[float, float, int]] = {}
        self._close_reason: str | None = None
        self._bad_frame = False  # closed for bytes that were no frame (ConnectionClosedError.bad_frame)
        self._on_close: Callable[[RemotingConnection], None] | None = None
        self._frames_received = self._frames_sent = self._bytes_received = self._bytes_sent = 0
        self._send_calls = 0
        # Moves whenever the socket takes bytes of ours, also in the middle of a long write (the writer sends a big
        # queue in slices of WRITE_SLICE_BYTES): what tells a peer that reads slowly from one that reads nothing.
        self._write_progress = 0
        self._corked = False
        # The descriptor for writes that bypass the writer task (``corked``; trio keeps it non-blocking); None for
        # a stream that is not a plain socket (TLS, a test's in-memory stream), whose frames always use the writer.
        self._fd: int | None = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else None
        _tune_socket(stream)

    def __repr__(self) -> str:
        state = "open" if self._close_reason is None else f"closed ({self._close_reason})"
        return f"<{type(self).__name__} {self.remote_address} {state}>"

    @property
    def closed(self) -> bool:
        return self._close_reason is not None

    @property
    def close_reason(self) -> str | None:
        return self._close_reason

    def statistics(self) -> ConnectionStatistics:
        return ConnectionStatistics(self._frames_received, self._frames_sent, self._bytes_received,
                                    self._bytes_sent, self._send_calls, len(self._pending))

    @property
    def last_received_at(self) -> float:
        """When (trio's clock) bytes last arrived on this connection; when it was opened if none have yet."""
        return self._last_received_at

    def oldest_request_sent_at(self, skip_codes: frozenset[int] = frozenset()) -> float | None:
        """When (trio's clock) the longest-waiting request with a timeout was sent, or began to wait for room in
        the write queue, requests whose code is in ``skip_codes`` (long polls, answered late on purpose) aside;
        None if no such request waits."""
        oldest = None
        for _task, deadline, timeout_s, code in self._pending.values():  # a dict keeps insertion order: send order
            if timeout_s is not None and code not in skip_codes:
                oldest = deadline - timeout_s
                break
        for since, deadline, code in self._room_requests.values():  # in arrival order too
            if deadline != math.inf and code not in skip_codes:
                return since if oldest is None or since < oldest else oldest
        return oldest

    # ------------------------------------------------------------------------------------------ requests

    async def invoke(self, request: Frame, timeout_s: float | None = 3.0) -> Frame:
        """Send ``request`` and return the response frame, whatever its code. Raises ``RequestTimeoutError``,
        ``ConnectionClosedError`` or ``FrameTooLargeError`` (before sending anything)."""
        if request.flag & FLAG_ONEWAY:
            raise ValueError("invoke() waits for a response but the request is flagged oneway; "
                             "use invoke_oneway()")
        opaque = self._next_opaque
        self._next_opaque = opaque + 1 if opaque < MAX_HEADER_INT else 1
        data = encode(request, opaque=opaque)
        if timeout_s is None:
            deadline = math.inf
        elif timeout_s > 0:
            deadline = self._clock.current_time() + timeout_s
        else:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s!r}")
        if (len(data) - 4 > self.max_frame_size or self._out_bytes > HIGH_WATER_BYTES or self._room_waiters
                or self._admitted is not None or self._close_reason):
            with trio.move_on_at(deadline) as waiting:
                await self._request_room(data, request.code)
            if waiting.cancelled_caught:  # the queue never had room for it: nothing was sent
                raise RequestTimeoutError(self.remote_address, timeout_s or 0.0, request.code)
        if deadline != math.inf:
            tick = -int(-deadline // TIMEOUT_RESOLUTION_S)
            bucket = self._wheel.get(tick)
            if bucket is None:
                self._wheel[tick] = [opaque]
                heapq.heappush(self._ticks, tick)
                if tick < self._timer_tick and self._timer_parked is not None:
                    task, self._timer_parked = self._timer_parked, None
                    trio.lowlevel.reschedule(task)
            else:
                bucket.append(opaque)
        pending = self._pending
        idle = not pending and not self._out
        pending[opaque] = (trio.lowlevel.current_task(), deadline, timeout_s, request.code)
        if idle and _cork is None:
            # Nothing else in flight, so nothing to coalesce with: write it now rather than wake the writer
            # (one task switch less on a sequential caller's round trip).
            self._out.append(data)
            self._out_bytes += len(data)
            self._write_through()
        else:
            self._enqueue(data)

        def abort(_: Any) -> trio.lowlevel.Abort:
            pending.pop(opaque, None)
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)

    async def invoke_oneway(self, request: Frame) -> None:
        """Queue ``request`` with the oneway flag; returns once it is queued (no response will come). It may wait
        for room in the write queue: bound it with a cancel scope (``send_oneway`` does, by its send timeout),
        which also makes it count as a request in flight while it waits (see the module rules)."""
        data = encode(request, opaque=self._take_opaque()) if request.flag & FLAG_ONEWAY else encode(
            Frame(request.code, 0, request.flag | FLAG_ONEWAY, request.version, request.remark, request.ext,
                  request.body), opaque=self._take_opaque())
        if (len(data) - 4 > self.max_frame_size or self._out_bytes > HIGH_WATER_BYTES or self._room_waiters
                or self._admitted is not None or self._close_reason):
            await self._request_room(data, request.code)
        self._enqueue(data)
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def send_response(self, response: Frame) -> None:
        """Send a response later than ``handle`` returned (long polling). Raises ``ConnectionClosedError`` if
        the peer is gone by now."""
        if not response.flag & FLAG_RESPONSE:
            raise ValueError(f"send_response() needs a response frame (make_response), got {response!r}")
        data = encode(response)
        await self._prepare_send(data)
        self._enqueue(data)
        await trio.lowlevel.cancel_shielded_checkpoint()

    def send_response_nowait(self, response: Frame) -> bool:
        """``send_response`` from synchronous code (a completion callback): queues the frame on the coalesced
        write queue at once, without waiting for the high-water mark (the request it answers was already
        admitted; the read loop admits no more while the queue is above the mark). Returns False, dropping the
        frame, if the connection is closed."""
        if not response.flag & FLAG_RESPONSE:
            raise ValueError(f"send_response_nowait() needs a response frame (make_response), got {response!r}")
        if self._close_reason is not None:
            return False
        data = encode(response)
        if len(data) - 4 > self.max_frame_size:
            raise FrameTooLargeError(len(data) - 4, self.max_frame_size)
        self._enqueue(data)
        return True

    def close(self, reason: str = "closed locally") -> None:
        """Close the connection now; waiting requests fail with ``ConnectionClosedError``."""
        self._mark_closed(reason)
        if self.nursery is not None:
            self.nursery.cancel_scope.cancel()

    # ------------------------------------------------------------------------------------------ internals

    def _take_opaque(self) -> int:
        opaque = self._next_opaque
        self._next_opaque = opaque + 1 if opaque < MAX_HEADER_INT else 1
        return opaque

    async def _request_room(self, data: bytes, code: int) -> None:
        """``_prepare_send`` for a request, which counts as in flight while it waits (``_room_requests``). Its
        deadline is its caller's (trio's effective deadline): past it, on a connection that received nothing
        since the wait began, nor for SILENT_CLOSE_MIN_S, and whose socket took none of our bytes meanwhile (a
        peer reading slowly is alive: only one that reads nothing leaves every write stuck), the connection is
        closed as for a request that timed out unanswered (``_close_silent``)."""
        task = trio.lowlevel.current_task()
        since = self._clock.current_time()
        deadline = trio.current_effective_deadline()
        writes = self._write_progress
        self._room_requests[task] = (since, deadline, code)
        try:
            await self._prepare_send(data)
        except trio.Cancelled:
            now = self._clock.current_time()
            if (now >= deadline and self._write_progress == writes and self._last_received_at < since
                    and now - self._last_received_at >= SILENT_CLOSE_MIN_S and self._close_reason is None):
                self._close_silent(now, deadline - since)
            raise
        finally:
            del self._room_requests[task]

    async def _prepare_send(self, data: bytes) -> None:
        if len(data) - 4 > self.max_frame_size:
            raise FrameTooLargeError(len(data) - 4, self.max_frame_size)
        await self._wait_below_high_water()

    async def _wait_below_high_water(self) -> None:
        """Wait until the queued bytes are back under HIGH_WATER_BYTES and no earlier sender still waits (see the
        module rules); ConnectionClosedError if the connection closes meanwhile (or was closed). The caller
        queues its frame before its next checkpoint."""
        if (self._out_bytes > HIGH_WATER_BYTES or self._room_waiters or self._admitted is not None) \
                and self._close_reason is None:
            waiters = self._room_waiters
            task = trio.lowlevel.current_task()
            waiters.append(task)

            def abort(_: Any) -> trio.lowlevel.Abort:
                waiters.remove(task)
                return trio.lowlevel.Abort.SUCCEEDED

            while True:
                await trio.lowlevel.wait_task_rescheduled(abort)  # _admit_waiter took us off the queue
                self._admitted = None
                if self._out_bytes <= HIGH_WATER_BYTES or self._close_reason is not None:
                    break
                waiters.appendleft(task)  # a newcomer took the room first: keep our place at the head
            # The next waiter runs after our frame is queued, and goes back to the head if it left no room.
            self._admit_waiter()
        if self._close_reason is not None:
            raise ConnectionClosedError(self.remote_address, self._close_reason, bad_frame=self._bad_frame)

    def _admit_waiter(self) -> None:
        """Wake the longest-waiting sender if there is room (or the connection closed: it then raises)."""
        if self._room_waiters and self._admitted is None and (self._out_bytes <= HIGH_WATER_BYTES
                                                              or self._close_reason is not None):
            self._admitted = self._room_waiters.popleft()
            trio.lowlevel.reschedule(self._admitted)

    def _enqueue(self, data: bytes) -> None:
        self._out.append(data)
        self._out_bytes += len(data)
        task = self._writer_parked
        if task is not None:
            if _cork is not None and self._fd is not None:
                if not self._corked:
                    self._corked = True
                    _cork.append(self)
                return
            self._writer_parked = None
            trio.lowlevel.reschedule(task)

    def _write_through(self) -> None:
        """End of a ``corked()`` block: one non-blocking write of the queue if the writer is idle; whatever the
        socket does not take (or an error, which the writer then meets and reports) is left to the writer."""
        self._corked = False
        out = self._out
        task = self._writer_parked
        if not out or task is None:
            return  # nothing queued, or the writer is busy and takes the queue next
        if self._fd is not None and self._close_reason is None:
            data = out[0] if len(out) == 1 else b"".join(out)
            try:
                sent = os.write(self._fd, data)
            except OSError:  # BlockingIOError: the socket buffer is full; others: the writer reports them
                sent = 0
            if sent:
                self._send_calls += 1
                self._write_progress += 1
                self._bytes_sent += sent
            if sent == len(data):
                self._frames_sent += len(out)
                out.clear()
                self._out_bytes = 0
                self._drained.unpark_all()
                self._admit_waiter()
                return
            if sent:
                self._frames_sent += len(out) - 1  # the rest of the last one is counted by the writer
                out[:] = [data[sent:]]
                self._out_bytes = len(data) - sent
        self._writer_parked = None
        trio.lowlevel.reschedule(task)

    def _mark_closed(self, reason: str) -> None:
        if self._close_reason is None:
            self._close_reason = reason

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The connection's life: reader in this task, writer beside it; returns when the connection ends."""
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                nursery.start_soon(self._write_loop)
                nursery.start_soon(self._timeout_loop)
                task_status.started()
                await self._read_loop()
                with trio.move_on_after(DRAIN_TIMEOUT_S):
                    while self._out or self._sending:
                        await self._drained.park()
                nursery.cancel_scope.cancel()
        except Exception:
            # A bug in this module must cost one connection, never the server's or the client's nursery.
            log.exception("connection task failed remote=%s", self.remote_address)
            self._mark_closed("internal error in the connection task (see the server log)")
        finally:
            self._mark_closed("connection closed")
            self._finish()
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self._stream)

    def _finish(self) -> None:
        reason = self._close_reason or "connection closed"
        waiters = list(self._pending.values())
        self._pending.clear()
        self._wheel.clear()
        self._ticks.clear()
        for waiter in waiters:
            trio.lowlevel.reschedule(waiter[0], outcome.Error(
                ConnectionClosedError(self.remote_address, reason, bad_frame=self._bad_frame)))
        self._out.clear()
        self._out_bytes = 0
        self._drained.unpark_all()
        while self._room_waiters:  # each raises ConnectionClosedError
            trio.lowlevel.reschedule(self._room_waiters.popleft())
        if self._on_close is not None:
            try:
                self._on_close(self)
            except Exception:
                log.exception("close callback failed remote=%s", self.remote_address)
        closed_hook = getattr(self._handler, "connection_closed", None)
        if closed_hook is not None:
            try:
                closed_hook(self)
            except Exception:
                log.exception("handler.connection_closed failed remote=%s", self.remote_address)

    async def _read_loop(self) -> None:
        stream, decoder = self._stream, self._decoder
        pending = self._pending
        try:
            while True:
                data = await stream.receive_some(RECEIVE_SIZE)
                if not data:
                    if decoder.buffered_bytes:
                        reason = f"peer closed the connection in the middle of a frame " \
                                 f"({decoder.buffered_bytes} bytes of it received)"
                        log.warning("closing connection remote=%s reason=%s", self.remote_address, reason)
                    else:
                        reason = "closed by peer" + self._refused_hint()
                        log.debug("connection closed by peer remote=%s", self.remote_address)
                    self._mark_closed(reason)
                    return
                self._bytes_received += len(data)
                self._last_received_at = self._clock.current_time()
                decoder.feed(data)
                since_yield = 0
                while True:
                    frame = decoder.next_frame()
                    if frame is NEED_DATA:
                        break
                    self._frames_received += 1
                    since_yield += 1
                    if since_yield == FRAMES_PER_YIELD:
                        # Let the writer (and the tasks just woken) run now and then inside a large receive,
                        # so the peer gets work while we finish this batch: both processes busy at once
                        # instead of taking turns.
                        since_yield = 0
                        await trio.lowlevel.cancel_shielded_checkpoint()
                    if frame.flag & FLAG_RESPONSE:
                        waiter = pending.pop(frame.opaque, None)
                        if waiter is not None:
                            trio.lowlevel.reschedule(waiter[0], outcome.Value(frame))
                        else:
                            log.debug("response without a waiting request (timed out?) remote=%s opaque=%d",
                                      self.remote_address, frame.opaque)
                    else:
                        if self._out_bytes > HIGH_WATER_BYTES:
                            # Answers this peer has not read yet (deferred ones from send_response_nowait
                            # included) pass the mark: read no more of its requests until they drain, so
                            # a peer that stops reading stops us too instead of growing our memory.
                            try:
                                await self._wait_below_high_water()
                            except ConnectionClosedError:
                                return
                        await self._handle_request(frame)
        except ProtocolError as e:
            reason = f"bad frame: {e}"
            log.warning("closing connection remote=%s reason=%s", self.remote_address, reason)
            self._bad_frame = self._close_reason is None
            self._mark_closed(reason)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            self._mark_closed(f"connection broken: {e.__cause__ or e or type(e).__name__}{self._refused_hint()}")

    def _refused_hint(self) -> str:
        # A client's connection closed (or reset) at once, before any answer, is what a server refusing it looks
        # like: one enforcing TLS refuses a plain client, one requiring client certificates a TLS client without one
        # (TLS 1.3 ends the client's handshake before the server judged its certificate). Said in the reason the
        # waiting requests fail with, as nothing else would tell them why. Only a guess: a server that crashed or
        # was killed looks the same, hence "if", and only within REFUSED_WITHIN_S of connecting, as a refusal
        # comes on the first bytes. Nothing received yet, _last_received_at is still when the connection began.
        if self._bytes_received or not isinstance(self, ClientConnection):
            return ""
        if self._clock.current_time() - self._last_received_at > REFUSED_WITHIN_S:
            return ""
        if isinstance(self._stream, trio.SSLStream):
            return (" before any answer (if the server requires client certificates: a server with "
                    "tls_need_client_auth closes TLS connections without a client certificate it trusts; are "
                    "tls_cert_file and tls_key_file set?)")
        return (" before any answer (if the server enforces TLS: a server with tls_mode = \"enforcing\" closes plain "
                "connections; does this client need TLS enabled?)")

    async def _handle_request(self, request: Frame) -> None:
        handler = self._handler
        try:
            if handler is None:
                response = make_response(request, ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                                         remark=f"this endpoint serves no requests (request code {request.code})")
            else:
                response = await handler.handle(request, self)
        except BrokerError as e:
            response = make_response(request, e.code, e.remark, ext=e.fields)
        except Exception as e:
            log.exception("handler failed code=%d remote=%s", request.code, self.remote_address)
            response = make_response(request, ResponseCode.SYSTEM_ERROR,
                                     remark=f"unexpected error handling request code {request.code}: "
                                            f"{type(e).__name__}: {e}")
        if response is None or request.flag & FLAG_ONEWAY:
            return
        data = self._encode_response(request, response)
        if self._out_bytes > HIGH_WATER_BYTES or self._close_reason is not None:
            try:
                await self._prepare_send(data)
            except ConnectionClosedError:
                return
        self._enqueue(data)

    def _encode_response(self, request: Frame, response: Frame) -> bytes:
        problem = None
        if not isinstance(response, Frame):
            problem = f"the handler returned {type(response).__name__}, not a Frame or None"
        elif not response.flag & FLAG_RESPONSE:
            problem = "the handler returned a frame without the response flag (use make_response)"
        else:
            try:
                data = encode(response)
            except ProtocolError as e:
                problem = f"the handler's response cannot be encoded: {e}"
            else:
                if len(data) - 4 <= self.max_frame_size:
                    return data
                problem = (f"the response of {len(data) - 4} bytes exceeds the maximum frame size of "
                           f"{self.max_frame_size} bytes")
        log.error("bad response code=%d remote=%s: %s", request.code, self.remote_address, problem)
        return encode(make_response(request, ResponseCode.SYSTEM_ERROR, remark=problem))

    async def _timeout_loop(self) -> None:
        # One timer per connection instead of a cancel scope per request: on this machine entering and
        # leaving ``move_on_after`` costs ~20 us, more than the rest of a request. Requests are filed in
        # buckets of TIMEOUT_RESOLUTION_S by deadline (a dict append per request); a heap holds the bucket
        # numbers only, and the timer sleeps until the earliest bucket. Answered requests are skipped there.
        wheel, ticks, pending = self._wheel, self._ticks, self._pending
        while True:
            now = self._clock.current_time()
            silent_for: float | None = None
            while ticks and ticks[0] * TIMEOUT_RESOLUTION_S <= now:
                for opaque in wheel.pop(heapq.heappop(ticks)):
                    waiter = pending.get(opaque)
                    # The tolerance absorbs float rounding of tick * resolution against the deadline.
                    if waiter is not None and waiter[1] <= now + TIMEOUT_RESOLUTION_S:
                        del pending[opaque]
                        error = RequestTimeoutError(self.remote_address, waiter[2], waiter[3])
                        trio.lowlevel.reschedule(waiter[0], outcome.Error(error))
                        if (self._last_received_at < waiter[1] - waiter[2]  # nothing arrived since it was sent
                                and now - self._last_received_at >= SILENT_CLOSE_MIN_S):
                            silent_for = waiter[2]
            if silent_for is not None:
                self._close_silent(now, silent_for)
                return
            self._timer_tick = ticks[0] if ticks else math.inf
            with trio.move_on_at(self._timer_tick * TIMEOUT_RESOLUTION_S if ticks else math.inf):
                self._timer_parked = trio.lowlevel.current_task()

                def abort(_: Any) -> trio.lowlevel.Abort:
                    self._timer_parked = None
                    return trio.lowlevel.Abort.SUCCEEDED

                await trio.lowlevel.wait_task_rescheduled(abort)

    def _close_silent(self, now: float, timeout_s: float) -> None:
        # RocketMQ's clientCloseSocketIfTimeout, kept to connections that went silent: a peer that answers other
        # requests meanwhile is slow on this one, not gone. One that sent nothing for a request's whole timeout is
        # a dead process, a dead host or a cut path, and TCP would take long to tell: after a partition heals, a
        # connection whose packets were dropped resumes only at its next retransmission, which backs off to
        # several seconds, while a new connection works at once. So close it; the waiting requests fail with
        # ConnectionClosedError (retriable) and the next one connects afresh.
        reason = (f"nothing received for {now - self._last_received_at:.1f} s, while a request waited its whole "
                  f"{timeout_s:g} s timeout: closed so that the next request connects afresh")
        log.warning("closing connection remote=%s reason=%s", self.remote_address, reason)
        self.close(reason)

    async def _write_loop(self) -> None:
        stream, out = self._stream, self._out
        try:
            while True:
                if not out:
                    self._writer_parked = trio.lowlevel.current_task()

                    def abort(_: Any) -> trio.lowlevel.Abort:
                        self._writer_parked = None
                        return trio.lowlevel.Abort.SUCCEEDED

                    await trio.lowlevel.wait_task_rescheduled(abort)
                    continue
                data = out[0] if len(out) == 1 else b"".join(out)
                self._frames_sent += len(out)
                out.clear()
                self._out_bytes = 0
                self._admit_waiter()  # the queue has room again while this is sent: keep the socket busy
                self._sending = True
                if len(data) <= WRITE_SLICE_BYTES:
                    await stream.send_all(data)
                else:
                    # In slices, each counted as it leaves: one send_all of a 4 MB queue to a peer reading 1.3 MB/s
                    # took 3 s, and a request waiting for room meanwhile took the connection for silent and closed it
                    # (with every oneway frame queued on it).
                    view = memoryview(data)
                    for at in range(0, len(data), WRITE_SLICE_BYTES):
                        await stream.send_all(view[at:at + WRITE_SLICE_BYTES])
                        self._write_progress += 1
                self._sending = False
                self._write_progress += 1
                self._send_calls += 1
                self._bytes_sent += len(data)
                self._drained.unpark_all()
                self._admit_waiter()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            self._sending = False
            self.close(f"send failed: {e.__cause__ or e or type(e).__name__}")


class ServerConnection(RemotingConnection):
    """A connection accepted by ``serve_remoting``; handlers receive it as ``conn``."""


class ClientConnection(RemotingConnection):
    """A connection opened by a client (``open_connection`` or the pool of ``open_remoting_client``)."""

    @staticmethod
    def _decoder_limits(max_frame_size: int) -> dict[str, int]:
        return {"max_header_size": max_frame_size}

