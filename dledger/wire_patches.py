"""pysyncobj's TCP layer, contained: the authenticated frame codec and the connection and listener fixes.

The fixes here are numbers 1, 12, 13, 14, 18 and the write-buffer half of 26 of the rules in
``dledger/patches.py``, which installs them (``apply_patches``) and explains each; their regression tests are in
``tests/unit/dledger/test_patches.py``. Every function here replaces one method of ``pysyncobj.tcp_connection``,
``pysyncobj.transport`` or ``pysyncobj.tcp_server``, written against the pinned version only.
"""

from __future__ import annotations

import errno
import hmac
import logging
import pickle
import socket
import struct
from typing import Any

import blake3
import pysyncobj.tcp_connection as pso_tcp
import pysyncobj.tcp_server as pso_tcp_server
import pysyncobj.transport as pso_transport
from pysyncobj.monotonic import monotonic as monotonic_time
from pysyncobj.poller import POLL_EVENT_TYPE

from remoting.errors import RESOURCE_ERRNOS

log = logging.getLogger(__name__)

__all__ = ["FrameAuthenticator", "encode_frame", "WIRE_PICKLE_PROTOCOL", "ACCEPT_PAUSE_S", "resume_accepting"]

WIRE_PICKLE_PROTOCOL = 5
_TAG_SIZE = 32
_LENGTH = struct.Struct("i")  # pysyncobj's own length prefix (native int); both ends run this code


# The tag's key is derived from the cluster secret in this context: a new context is a new wire version.
_KEY_CONTEXT = "raftmq-dledger-v4 2026-11-28 raft frame MAC key"


class FrameAuthenticator:
    """Authenticates each frame body: keyed BLAKE3, its key derived from the cluster secret, over the
    connection's random key and the BLAKE3 digest of the body (hash, then MAC).

    The random key (pysyncobj's handshake, one per connection and direction) ties a frame to its connection, so
    a frame recorded on one connection is refused on any other before it is unpickled. Hashing first lets a
    leader hash an append_entries body once for all its followers, who usually get the same bytes: the sender
    keeps the digest of the last body it tagged. The body hash is BLAKE3 rather than SHA-256 because every
    replicated byte passes through it on every member: SHA-256 (1.3-1.5 GB/s here, with SHA-NI) cost ~0.8 µs
    per 1 KiB message on the leader and again on each follower, BLAKE3 (4.5-6.5 GB/s) ~0.2 µs. Both are
    collision-resistant 256-bit hashes, which is what hash-then-MAC needs of the inner hash. The MAC is BLAKE3's
    keyed mode (a PRF, as HMAC is) rather than HMAC-SHA256 because OpenSSL 3's one-shot HMAC, cheap in a loop
    (1.3 µs), took ~10 µs a call inside a member that wakes for each frame, and every Raft hop pays two: the
    change cut one-at-a-time send latency by ~12 % (docs/benchmarks.md, twenty-fourth session). Stands where
    pysyncobj expects its Fernet encryptor (its truthiness turns on the random-key handshake); only
    ``tag``/``verify`` are used, by the frame codec below.
    """

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("a DLedger member needs a non-empty cluster secret")
        # v4: keyed BLAKE3 instead of HMAC-SHA256 (v3; v2 also hashed bodies with SHA-256); a member of another
        # version fails authentication.
        self._key = blake3.blake3(secret.encode(), derive_key_context=_KEY_CONTEXT).digest()
        self._last: tuple[bytes, bytes] = (b"", blake3.blake3(b"").digest())  # one tuple: swapped atomically

    def tag(self, body: bytes, rand_key: bytes | None = None) -> bytes:
        last_body, digest = self._last
        if body is not last_body and body != last_body:
            digest = blake3.blake3(body).digest()
            self._last = (body, digest)
        return blake3.blake3((rand_key or b"") + digest, key=self._key).digest()

    def verify(self, tag: bytes, body: bytes | memoryview, rand_key: bytes | None = None) -> bool:
        expected = blake3.blake3((rand_key or b"") + blake3.blake3(body).digest(), key=self._key).digest()
        return hmac.compare_digest(tag, expected)

    def __bool__(self) -> bool:
        return True


def encode_frame(auth: FrameAuthenticator, message: Any, rand_key: bytes | None = None) -> bytes:
    body = pickle.dumps(message, protocol=WIRE_PICKLE_PROTOCOL)
    return _LENGTH.pack(_TAG_SIZE + len(body)) + auth.tag(body, rand_key) + body


def _send(self: Any, message: Any) -> None:
    auth = self.encryptor
    if not auth:
        # Never reached in dledger (the member refuses to start without a secret); refuse rather than
        # fall back to an unauthenticated wire.
        raise RuntimeError("pysyncobj connection without an authenticator")
    # 12: judge the connection's silence before this send counts as talking. 13: a connection that was dropped
    # here loses the message, as pysyncobj's own disconnect does; its reconnect must begin with the handshake.
    if _connection_timed_out(self):
        return
    self._dledger_last_send = monotonic_time()
    # pysyncobj wraps the message as (sendRandKey, message); here the key goes into the tag instead.
    frame = encode_frame(auth, message, self.sendRandKey)
    buf = self._TcpConnection__writeBuffer
    if not buf:
        # 26: the usual case, nothing waiting: the frame itself goes to the socket, not a copy of it.
        self._TcpConnection__writeBuffer = frame
    else:
        if type(buf) is not bytearray:
            buf = self._TcpConnection__writeBuffer = bytearray(buf)
        buf += frame
    self._TcpConnection__trySendBuffer()


def _process_send(self: Any) -> bool:
    """26: stock ``__processSend``, cutting what the socket took from the front of the buffer in place."""
    buf = self._TcpConnection__writeBuffer
    if not buf:
        return False
    try:
        res = self._TcpConnection__socket.send(buf)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
            self.disconnect()
        return False
    if res < 0:
        self.disconnect()
        return False
    if res == 0:
        return False
    if type(buf) is bytearray:
        del buf[:res]
    elif res == len(buf):
        self._TcpConnection__writeBuffer = b""
    else:
        # What the socket did not take is copied once into a bytearray, then cut from its front in place.
        self._TcpConnection__writeBuffer = bytearray(memoryview(buf)[res:])
    return True


def _transport_send(self: Any, node: Any, message: Any) -> bool:
    """13: an outgoing connection is not connected for Raft messages until the peer's key arrived."""
    conn = self._connections.get(node)
    if conn is not None and conn.sendRandKey is None and self._syncObj.encryptor:
        return False
    return _original_transport_send(self, node, message)


def _try_read_buffer(self: Any) -> None:
    """14: read until the socket is empty, as pysyncobj does, but no more than one receive buffer per event.
    The buffer is made a ``bytearray`` first (pysyncobj resets it to ``bytes()`` on every (re)connect): stock
    ``__processRead``'s ``+=`` then appends in place, and ``_parse_message`` cuts frames from its front."""
    buf = self._TcpConnection__readBuffer
    if type(buf) is not bytearray:
        buf = self._TcpConnection__readBuffer = bytearray(buf)
    budget = len(buf) + self._TcpConnection__recvBufferSize
    while self._TcpConnection__processRead() and len(self._TcpConnection__readBuffer) < budget:
        pass
    self._TcpConnection__lastReadTime = monotonic_time()


def _connection_timed_out(self: Any) -> bool:
    """12: pysyncobj's read timeout (nothing read for ``timeout``), counted only while this side is talking: it
    sent within the timeout, as a leader does to a follower that stopped answering. A connected link quiet both
    ways (two followers') is idle, not dead: its clock restarts. Still applies while connecting. Returns
    whether it disconnected."""
    now = monotonic_time()
    timeout = self._TcpConnection__timeout
    if now - self._TcpConnection__lastReadTime <= timeout:
        return False
    if (self._TcpConnection__state == pso_tcp.CONNECTION_STATE.CONNECTED
            and now - getattr(self, "_dledger_last_send", float("-inf")) > timeout):
        self._TcpConnection__lastReadTime = now
        return False
    self.disconnect()
    return True


def _parse_message(self: Any) -> Any:
    buf = self._TcpConnection__readBuffer
    if len(buf) < 4:
        return None
    (length,) = _LENGTH.unpack_from(buf, 0)
    if length < _TAG_SIZE:
        log.warning("raft frame rejected reason=short_frame length=%d", length)
        self.disconnect()
        return None
    if len(buf) - 4 < length:
        return None
    auth = self.encryptor
    tag = bytes(buf[4:4 + _TAG_SIZE])
    # No copy of a frame that may be 512 KiB. The views are released before the frame is cut from the buffer
    # (a bytearray cannot shrink while exported); unpickling copies every bytes object out of them.
    whole = memoryview(buf)
    body = whole[4 + _TAG_SIZE:4 + length]
    try:
        if not auth or not auth.verify(tag, body, self.recvRandKey):
            # The only path to pickle.loads goes through this check: an unauthenticated peer, or a frame replayed
            # from another connection, never gets a byte unpickled.
            log.warning("raft frame rejected reason=bad_authentication")
            self.disconnect()
            return None
        try:
            message = pickle.loads(body)
        except Exception as e:  # an authenticated peer sent nonsense: drop the connection, keep the node
            log.warning("raft frame rejected reason=%s", e)
            self.disconnect()
            return None
    finally:
        body.release()
        whole.release()
    if type(buf) is bytearray:
        del buf[:4 + length]  # in place: CPython moves the start of a bytearray, it copies nothing
    else:
        self._TcpConnection__readBuffer = buf[4 + length:]
    return message


_original_parse_message = pso_tcp.TcpConnection._TcpConnection__processParseMessage
_original_process_connection_timeout = pso_tcp.TcpConnection._TcpConnection__processConnectionTimeout
_original_send = pso_tcp.TcpConnection.send
_original_transport_send = pso_transport.TCPTransport.send
_original_try_read_buffer = pso_tcp.TcpConnection._TcpConnection__tryReadBuffer
_original_process_send = pso_tcp.TcpConnection._TcpConnection__processSend


ACCEPT_PAUSE_S = 0.1
_original_on_new_connection = pso_tcp_server.TcpServer._TcpServer__onNewConnection


def _on_new_connection_kept(self: Any, descr: Any, event: int) -> None:
    """18: stock ``TcpServer.__onNewConnection``, except that a failed accept leaves the listener listening."""
    if event & POLL_EVENT_TYPE.READ:
        try:
            sock, _addr = self._TcpServer__socket.accept()
        except OSError as e:
            if e.errno in RESOURCE_ERRNOS:
                _pause_accepting(self, e)
            elif e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                log.warning("raft listener: an accept failed; still listening error=%s", e)
        else:
            pauses = getattr(self, "_dledger_accept_pauses", 0)
            if pauses:
                self._dledger_accept_pauses = 0
                log.info("raft listener: accepting again after %d pause(s)", pauses)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._TcpServer__sendBufferSize)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._TcpServer__recvBufferSize)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setblocking(False)
                conn = pso_tcp_server.TcpConnection(
                    poller=self._TcpServer__poller, socket=sock, timeout=self._TcpServer__connectionTimeout,
                    sendBufferSize=self._TcpServer__sendBufferSize, recvBufferSize=self._TcpServer__recvBufferSize,
                    keepalive=self._TcpServer__keepalive)
            except OSError as e:  # the peer reset it already, or no descriptor for the connection's timer
                sock.close()
                log.warning("raft listener: an accepted connection failed to set up error=%s", e)
            else:
                self._TcpServer__onNewConnectionCallback(conn)
    if event & POLL_EVENT_TYPE.ERROR:
        self.unbind()


def _pause_accepting(server: Any, error: OSError) -> None:
    fileno = server._TcpServer__fileno
    if fileno is None:
        return
    server._TcpServer__poller.unsubscribe(fileno)
    server._dledger_accept_resume_at = monotonic_time() + ACCEPT_PAUSE_S
    pauses = getattr(server, "_dledger_accept_pauses", 0)
    server._dledger_accept_pauses = pauses + 1
    if not pauses:
        log.warning("raft listener: accept failed (%s); not accepting for %.0f ms at a time until it succeeds",
                    error, ACCEPT_PAUSE_S * 1000)


def resume_accepting(server: Any) -> None:
    """Poll a listener paused by a failed accept again once its pause is over (18). Called after every tick."""
    resume_at = getattr(server, "_dledger_accept_resume_at", None)
    if resume_at is None or monotonic_time() < resume_at:
        return
    server._dledger_accept_resume_at = None
    fileno = server._TcpServer__fileno
    if fileno is not None and server._TcpServer__state == pso_tcp_server.SERVER_STATE.BINDED:
        server._TcpServer__poller.subscribe(fileno, server._TcpServer__onNewConnection,
                                            POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR)


_original_bind = pso_tcp_server.TcpServer.bind


def _bind_closing_on_failure(self: Any) -> None:
    try:
        _original_bind(self)
    except Exception:
        sock = getattr(self, "_TcpServer__socket", None)
        if sock is not None:
            sock.close()
        raise
