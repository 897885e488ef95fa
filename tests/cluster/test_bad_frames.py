"""Bad input against a real server process: garbage, truncated frames, oversize lengths, malformed headers.

The server is `raftmq bench rpc-server` (the echo handler on the real transport). Every bad connection must
be closed by the server with a logged reason, and afterwards a well-behaved client is still served correctly
by the same, still running, process.
"""

from __future__ import annotations

import random
import socket
import struct

import cbor2
import pytest
import trio

from remoting.codec import encode, make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.procs import raftmq_argv

pytestmark = pytest.mark.cluster

MAX_FRAME_SIZE = 64 * 1024
GOOD_HEADER = {"code": 1000, "opaque": 1, "flag": 0, "version": 0}


def _frame(header: bytes, body: bytes = b"") -> bytes:
    return struct.pack(">II", 4 + len(header) + len(body), len(header)) + header + body


def _bad_payloads(rng: random.Random) -> list[tuple[str, bytes]]:
    good = encode(make_request(RequestCode.ECHO, body=b"payload"), opaque=7)
    payloads = [
        ("http", b"GET / HTTP/1.1\r\nHost: raftmq\r\n\r\n"),
        ("oversize-length", struct.pack(">I", MAX_FRAME_SIZE + 1) + b"\x00" * 16),
        ("max-uint32-length", b"\xff\xff\xff\xff"),
        ("zero-length", b"\x00\x00\x00\x00\x00\x00\x00\x00"),
        ("header-longer-than-frame", struct.pack(">II", 10, 50) + b"\xa0" * 6),
        ("not-cbor", _frame(b"\xff\xfe\xfd")),
        ("cbor-array-header", _frame(cbor2.dumps([1000, 1, 0, 0]))),
        ("cbor-text-header", _frame(cbor2.dumps("hello"))),
        ("code-as-text", _frame(cbor2.dumps({**GOOD_HEADER, "code": "ECHO"}))),
        ("negative-opaque", _frame(cbor2.dumps({**GOOD_HEADER, "opaque": -5}))),
        ("missing-flag", _frame(cbor2.dumps({"code": 1000, "opaque": 1, "version": 0}))),
        ("ext-not-map", _frame(cbor2.dumps({**GOOD_HEADER, "ext": "x"}))),
        ("regex-tag", _frame(cbor2.dumps({**GOOD_HEADER, "ext": {"a": cbor2.CBORTag(35, "(a+)+$")}}))),
        ("shared-ref-tag", _frame(b"\xd8\x1c\x81\xd8\x1d\x00")),
        ("trailing-bytes-in-header", _frame(cbor2.dumps(GOOD_HEADER) + b"\x00\x00")),
        ("deep-nesting", _frame(b"\x81" * 5000 + b"\x00")),
        ("truncated-header-item", _frame(cbor2.dumps(GOOD_HEADER)[:-3])),
        ("good-then-garbage", good + b"\x00\x00\x00\x09garbage!!"),
        ("truncated-frame-then-eof", good[: len(good) // 2]),
        ("length-only-then-eof", good[:4]),
    ]
    for i in range(40):
        payloads.append((f"random-{i}", rng.randbytes(rng.randint(1, 300))))
    for i in range(20):
        # Plausible prefixes with a random header: the decoder must get past the length checks.
        header = rng.randbytes(rng.randint(1, 60))
        payloads.append((f"random-header-{i}", _frame(header, rng.randbytes(rng.randint(0, 40)))))
    return payloads


async def _throw(host: str, port: int, payload: bytes) -> None:
    """Send ``payload`` then read until the server closes, bounded in time (a truncated frame only ends
    when we close our side, so stop waiting after a moment)."""
    stream = await trio.open_tcp_stream(host, port)
    try:
        with trio.move_on_after(3):
            await stream.send_all(payload)
            await stream.send_eof()
            while await stream.receive_some(65536):
                pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the server closed on us mid-send: exactly what a bad frame earns
    finally:
        await trio.aclose_forcefully(stream)


async def test_bad_frames_close_their_connection_and_the_server_keeps_serving(spawn):
    proc = spawn(raftmq_argv("--log-level", "WARNING", "bench", "rpc-server", "--listen", "127.0.0.1:0",
                             "--max-frame-size", str(MAX_FRAME_SIZE)))
    host, port = proc.address()
    rng = random.Random(20261122)
    payloads = _bad_payloads(rng)
    limit = trio.CapacityLimiter(20)  # bounded: at most 20 hostile connections at once

    async def one(payload: bytes) -> None:
        async with limit:
            await _throw(host, port, payload)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _name, payload in payloads:
                nursery.start_soon(one, payload)

    # A raw socket reset mid-frame is also survived.
    with socket.create_connection((host, port)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.sendall(struct.pack(">II", 100, 20) + b"\xa4")

    assert proc.alive
    proc.wait_output("reason=bad frame: frame of 65537 bytes exceeds the maximum frame size of 65536 bytes")
    proc.wait_output("malformed frame header: expected a CBOR map")
    proc.wait_output("peer closed the connection in the middle of a frame")

    async with open_remoting_client() as client:
        addr = f"{host}:{port}"
        bodies: dict[int, bool] = {}

        async def echo(i: int) -> None:
            body = rng.randbytes(1 + i * 7)
            response = await client.invoke(addr, make_request(RequestCode.ECHO, ext={"i": i}, body=body))
            assert response.code == ResponseCode.SUCCESS and response.ext == {"i": i}
            bodies[i] = response.body == body

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(200):
                    nursery.start_soon(echo, i)
    assert bodies == {i: True for i in range(200)}
    assert proc.alive
