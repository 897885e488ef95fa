"""The remoting server loop and client pool, around ``remoting.connection.RemotingConnection`` (whose module states
the rules every connection keeps). ``serve_remoting`` listens and serves each accepted connection (plain, or TLS:
``remoting/tls.py``); ``open_remoting_client`` is a pool with one connection per address, reconnecting on the next
request after a connection ended; ``open_connection`` is one connection that does not.
"""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import trio

from remoting.codec import DEFAULT_MAX_FRAME_SIZE, Frame, FrameDecoder
from remoting.config import ConfigError, parse_host_port
# The connection's names (and the tuning the tests read) as every module imported them before the connection had
# a module of its own.
from remoting.connection import (  # noqa: F401 - re-exported
    HIGH_WATER_BYTES,
    RECEIVE_SIZE,
    REFUSED_WITHIN_S,
    SILENT_CLOSE_MIN_S,
    ClientConnection,
    ConnectionStatistics,
    RemotingConnection,
    RequestHandler,
    ServerConnection,
    corked,
)
from remoting.errors import ConnectError, ConnectionClosedError
from remoting.tls import HANDSHAKE_TIMEOUT_S, TLS_MODES, is_tls_start

__all__ = [
    "ClientConnection", "ConnectionStatistics", "RemotingClient", "RemotingConnection", "RequestHandler",
    "ServerConnection", "background_nursery", "corked", "open_connection", "open_listeners", "open_remoting_client",
    "serve_remoting",
]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- server


async def open_listeners(host: str, port: int) -> tuple[list[trio.SocketListener], int]:
    """TCP listeners on ``host:port`` (0: any free port) and the port they are bound to; every server of ours
    (remoting, the metrics endpoint) listens through this."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    if port == 0 and len(listeners) > 1:
        # A name resolving to several addresses gets a different free port on each: keep one, so the port
        # reported is the port every listener uses.
        for extra in listeners[1:]:
            await extra.aclose()
        listeners = listeners[:1]
    return listeners, listeners[0].socket.getsockname()[1]


@dataclass(frozen=True, slots=True)
class _ServerTLS:
    mode: str  # "permissive" or "enforcing" (remoting/tls.py)
    # Asked for each TLS connection: a ContextReloader hands out the certificate as it is on disk now.
    context: Callable[[], ssl.SSLContext]
    handshake_timeout_s: float


async def serve_remoting(handler: RequestHandler, host: str, port: int, *,
                         max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, tls_mode: str = "disabled",
                         tls_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None,
                         tls_handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                         task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
    """Listen on ``host:port`` (0: any free port), report ``(host, bound_port)`` through ``task_status`` and
    serve every connection with ``handler`` until cancelled. ``tls_mode`` (remoting/tls.py): "disabled" (plain
    only), "enforcing" (TLS only) or "permissive" (both on this port), with ``tls_context``
    (``remoting.tls.server_context``, or a callable such as ``remoting.tls.ContextReloader`` asked for each TLS
    connection) for the last two; a handshake not done within ``tls_handshake_timeout_s`` closes its connection."""
    FrameDecoder(max_frame_size)  # validates the size now rather than on the first connection
    if tls_mode not in TLS_MODES:
        raise ValueError(f"tls_mode must be one of {', '.join(map(repr, TLS_MODES))}, got {tls_mode!r}")
    tls: _ServerTLS | None = None
    if tls_mode != "disabled":
        if not isinstance(tls_context, ssl.SSLContext) and not callable(tls_context):
            raise ValueError(f"tls_mode {tls_mode!r} needs a server tls_context (remoting.tls.server_context)")
        if not tls_handshake_timeout_s > 0:
            raise ValueError(f"tls_handshake_timeout_s must be > 0, got {tls_handshake_timeout_s!r}")
        get_context = tls_context if callable(tls_context) else partial(_same, tls_context)
        tls = _ServerTLS(tls_mode, get_context, tls_handshake_timeout_s)
    listeners, bound_port = await open_listeners(host, port)
    log.info("remoting server listening host=%s port=%d max_frame_size=%d tls_mode=%s", host, bound_port,
             max_frame_size, tls_mode)
    async with trio.open_nursery() as nursery:
        task_status.started((host, bound_port))
        await trio.serve_listeners(partial(_serve_stream, handler, max_frame_size, tls), listeners,
                                   handler_nursery=nursery)


def _same(context: ssl.SSLContext) -> ssl.SSLContext:
    return context


async def _serve_stream(handler: RequestHandler, max_frame_size: int, tls: _ServerTLS | None,
                        stream: trio.SocketStream) -> None:
    try:
        peer = stream.socket.getpeername()
        remote = f"{peer[0]}:{peer[1]}"
    except OSError:
        await trio.aclose_forcefully(stream)
        return  # reset before we looked at it
    log.debug("connection accepted remote=%s", remote)
    if tls is None:
        await ServerConnection(stream, remote, handler, max_frame_size=max_frame_size)._run()
        return
    served = await _accept_tls(stream, remote, tls)
    if served is None:
        await trio.aclose_forcefully(stream)
        return
    await ServerConnection(served, remote, handler, max_frame_size=max_frame_size)._run()


async def _accept_tls(stream: trio.SocketStream, remote: str,
                      tls: _ServerTLS) -> trio.SocketStream | trio.SSLStream | None:
    """The stream to serve ``remote`` on: TLS once its handshake is done, or the plain stream itself when the mode
    is permissive and the peer does not start with a handshake; None when it must be closed (logged why)."""
    what = "waiting for its first byte"
    with trio.move_on_after(tls.handshake_timeout_s):
        try:
            # Peeked, not read: a plain connection's first frame stays in the socket for the connection to read.
            first = await stream.socket.recv(1, socket.MSG_PEEK)
            if not first:
                log.debug("connection closed by peer before sending anything remote=%s", remote)
                return None
            if not is_tls_start(first):
                if tls.mode == "permissive":
                    return stream
                log.warning("plain connection refused remote=%s reason=tls_mode is enforcing: every connection "
                            "must start with a TLS handshake", remote)
                return None
            what = "TLS handshake"
            secure = trio.SSLStream(stream, tls.context(), server_side=True, https_compatible=True)
            await secure.do_handshake()
            return secure
        except (OSError, trio.BrokenResourceError) as e:
            reason = e.__cause__ or e
            log.warning("TLS handshake failed, connection closed remote=%s reason=%s", remote, reason)
            return None
    log.warning("TLS handshake timed out, connection closed remote=%s reason=nothing completed within %g s (%s)",
                remote, tls.handshake_timeout_s, what)
    return None


# ---------------------------------------------------------------------------------------------- client


@asynccontextmanager
async def background_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery for connection tasks around a caller's ``async with`` body. Those tasks never raise (they log
    and close), so an exception group out of it holds what the body raised: unwrap a lone exception, so the
    caller's ``except TopicNotExistError`` works as if no nursery were there."""
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        if len(group.exceptions) != 1:
            raise
        error = group.exceptions[0]
        context = error.__context__
        try:
            raise error
        finally:
            error.__context__ = context
            del error, context


async def _open_stream(addr: str, connect_timeout_s: float,
                       tls_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None
                       ) -> trio.SocketStream | trio.SSLStream:
    """A connected stream to ``addr``; with ``tls_context``, TLS with its handshake done. The connect timeout
    covers both. A callable ``tls_context`` (a ``ContextReloader``) is asked now, for this connection: a certificate
    or CA file replaced on disk is used from the next connection on, and the connections open keep theirs."""
    try:
        host, port = parse_host_port(addr, key="remote address")
    except ConfigError as e:
        raise ValueError(str(e)) from None
    with trio.move_on_after(connect_timeout_s):
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError as e:
            # trio wraps the per-address errors in a group: the first one says what happened.
            cause = e.__cause__
            if isinstance(cause, BaseExceptionGroup) and cause.exceptions:
                e = cause.exceptions[0]
            reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
            raise ConnectError(addr, reason) from e
        if tls_context is None:
            return stream
        context = tls_context if isinstance(tls_context, ssl.SSLContext) else tls_context()
        secure = trio.SSLStream(stream, context, server_hostname=host, https_compatible=True)
        done = False
        try:
            await secure.do_handshake()
            done = True
            return secure
        except trio.BrokenResourceError as e:
            # The SSL error says what failed: "certificate verify failed: ...", "wrong version number" (the
            # server speaks plain TCP), an alert from the server.
            raise ConnectError(addr, f"TLS handshake failed: {e.__cause__ or e}") from e
        finally:
            if not done:  # failed, or cancelled by the timeout: do not leave the socket open
                await trio.aclose_forcefully(stream)
    raise ConnectError(addr, f"no answer within {connect_timeout_s:g} s")


async def _start_connection(stream: trio.SocketStream | trio.SSLStream, addr: str, handler: RequestHandler | None,
                            max_frame_size: int, nursery: trio.Nursery) -> ClientConnection:
    conn = ClientConnection(stream, addr, handler, max_frame_size=max_frame_size)
    await nursery.start(conn._run)
    return conn


@asynccontextmanager
async def open_connection(addr: str, *, handler: RequestHandler | None = None,
                          max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
                          connect_timeout_s: float = 3.0,
                          tls_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None
                          ) -> AsyncIterator[ClientConnection]:
    """One connection to ``addr`` ("host:port"), closed on exit. It does not reconnect: use
    ``open_remoting_client`` for that. Raises ``ConnectError`` when it cannot connect (or its TLS handshake, with
    ``tls_context`` from ``remoting.tls.client_context`` or a ``ContextReloader``, fails)."""
    FrameDecoder(max_frame_size)
    stream = await _open_stream(addr, connect_timeout_s, tls_context)
    async with background_nursery() as nursery:
        conn = await _start_connection(stream, addr, handler, max_frame_size, nursery)
        try:
            yield conn
        finally:
            conn.close()


class _Connecting:
    """One connection attempt to an address, awaited by every request that needs it meanwhile."""

    __slots__ = ("done", "conn", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.conn: ClientConnection | None = None
        self.error: BaseException | None = None


def _raised_again(error: BaseException) -> BaseException:
    """A new exception like the one a connection attempt raised, for each request that waited on it: one object
    raised in several tasks would gather all their tracebacks."""
    if type(error) is ConnectError:
        again: BaseException = ConnectError(error.addr, error.reason)
    elif type(error) is ValueError:
        again = ValueError(*error.args)
    else:
        return error
    again.__cause__ = error.__cause__
    again.__suppress_context__ = True
    return again


class RemotingClient:
    """A pool with one connection per address; a closed connection is replaced on the next request."""

    def __init__(self, nursery: trio.Nursery, *, handler: RequestHandler | None, max_frame_size: int,
                 connect_timeout_s: float, signer: Callable[[Frame], Frame] | None = None,
                 tls_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None) -> None:
        self._nursery = nursery
        self._tls_context = tls_context
        self._handler = handler
        self._max_frame_size = max_frame_size
        self._connect_timeout_s = connect_timeout_s
        self._connections: dict[str, ClientConnection] = {}
        self._connecting: dict[str, _Connecting] = {}
        self._signer = signer
        if signer is not None:
            # Signing (remoting/acl.py) is bound in only for a client with credentials: without, a request pays
            # nothing for it, not even a test.
            self.invoke = self._invoke_signed  # type: ignore[method-assign]
            self.invoke_oneway = self._invoke_oneway_signed  # type: ignore[method-assign]

    async def _invoke_signed(self, addr: str, request: Frame, timeout_s: float | None = 3.0) -> Frame:
        assert self._signer is not None
        return await RemotingClient.invoke(self, addr, self._signer(request), timeout_s)

    async def _invoke_oneway_signed(self, addr: str, request: Frame) -> None:
        assert self._signer is not None
        await RemotingClient.invoke_oneway(self, addr, self._signer(request))

    async def invoke(self, addr: str, request: Frame, timeout_s: float | None = 3.0) -> Frame:
        conn = self._connections.get(addr)
        if conn is None or conn._close_reason is not None:
            if timeout_s is None:
                conn = await self.get_connection(addr)
            else:
                # The request's deadline covers connecting too: a host that does not answer SYNs held a 2 s
                # send for the whole connect timeout (3 s).
                deadline = trio.current_time() + timeout_s
                with trio.move_on_after(timeout_s):
                    conn = await self.get_connection(addr)
                if conn is None:
                    raise ConnectError(addr, f"no answer within the request's {timeout_s:g} s")
                if conn.closed:  # e.g. a TLS server's alert read right after the handshake: say what it said
                    raise ConnectError(addr, f"the connection closed as soon as it opened: {conn.close_reason}")
                timeout_s = max(deadline - trio.current_time(), 0.001)
        return await conn.invoke(request, timeout_s)

    async def invoke_oneway(self, addr: str, request: Frame) -> None:
        conn = self._connections.get(addr)
        if conn is None or conn._close_reason is not None:
            conn = await self.get_connection(addr)
        await conn.invoke_oneway(request)

    async def get_connection(self, addr: str) -> ClientConnection:
        """The pooled connection to ``addr``, connecting if needed: one attempt at a time per address, run by the
        pool rather than by the task that asked, so that a caller who stops waiting (its request's deadline
        passed) does not abandon it. When each caller connected itself, a send timeout shorter than a connect (a
        loaded machine) never connected at all: every request started an attempt that its deadline then
        cancelled (`raftmq bench produce --send-timeout-ms 1` once failed all of its 1,448 sends so)."""
        conn = self._connections.get(addr)
        if conn is not None and not conn.closed:
            return conn
        attempt = self._connecting.get(addr)
        if attempt is None:
            attempt = self._connecting[addr] = _Connecting()
            self._nursery.start_soon(self._connect, addr, attempt)
        await attempt.done.wait()
        if attempt.conn is None:
            assert attempt.error is not None
            raise _raised_again(attempt.error)
        return attempt.conn

    async def _connect(self, addr: str, attempt: _Connecting) -> None:
        try:
            if self._tls_context is None:
                stream = await _open_stream(addr, self._connect_timeout_s)
            else:
                stream = await _open_stream(addr, self._connect_timeout_s, self._tls_context)
            conn = await _start_connection(stream, addr, self._handler, self._max_frame_size, self._nursery)
            conn._on_close = self._forget
            self._connections[addr] = conn
            attempt.conn = conn
        except Exception as e:  # noqa: BLE001 - every waiter raises it; the pool itself must not fail
            attempt.error = e
        except BaseException:
            attempt.error = ConnectError(addr, "the client closed while connecting")
            raise
        finally:
            if self._connecting.get(addr) is attempt:
                del self._connecting[addr]
            attempt.done.set()

    def close_connection(self, addr: str, reason: str = "closed locally") -> None:
        """Close the pooled connection to ``addr``: its waiting requests fail with ``ConnectionClosedError``
        naming ``reason``, and the next request opens a new one."""
        conn = self._connections.pop(addr, None)
        if conn is not None:
            conn.close(reason)

    def connections(self) -> dict[str, ClientConnection]:
        return dict(self._connections)

    def _forget(self, conn: RemotingConnection) -> None:
        if self._connections.get(conn.remote_address) is conn:
            del self._connections[conn.remote_address]

    def _close_all(self) -> None:
        for conn in list(self._connections.values()):
            conn.close("client closed")
        self._connections.clear()


@asynccontextmanager
async def open_remoting_client(*, handler: RequestHandler | None = None,
                               max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
                               connect_timeout_s: float = 3.0,
                               signer: Callable[[Frame], Frame] | None = None,
                               tls_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None
                               ) -> AsyncIterator[RemotingClient]:
    """A ``RemotingClient``; every connection it opened is closed on exit. ``handler`` answers requests
    that servers send to this client (without one they get REQUEST_CODE_NOT_SUPPORTED). ``signer`` (ACL:
    ``remoting.acl.RequestSigner.sign``) turns each request into the one sent; responses are not signed.
    ``tls_context`` (``remoting.tls.client_context``, or a callable such as ``remoting.tls.ContextReloader`` asked for
    each connection): every connection is TLS, its handshake part of connecting."""
    FrameDecoder(max_frame_size)
    if not connect_timeout_s > 0:
        raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s!r}")
    async with background_nursery() as nursery:
        client = RemotingClient(nursery, handler=handler, max_frame_size=max_frame_size,
                                connect_timeout_s=connect_timeout_s, signer=signer, tls_context=tls_context)
        try:
            yield client
        finally:
            client._close_all()
            nursery.cancel_scope.cancel()

