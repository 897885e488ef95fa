"""A request waiting for room in a connection's write queue, on a peer that reads nothing (a stopped leader): it
counts as a request in flight, and a silent connection closes when its deadline passes. In-memory streams, whose
``send_all`` returns only once the peer read everything, stand in for a socket whose peer stopped reading."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from remoting.codec import encode, make_request, make_response
from remoting.codes import RequestCode
from remoting.connection import HIGH_WATER_BYTES, SILENT_CLOSE_MIN_S, ClientConnection
from remoting.errors import RequestTimeoutError

BIG = b"x" * (HIGH_WATER_BYTES + 1024)  # one frame past the mark: the second one queued makes the third wait


async def _stuck_connection(nursery: trio.Nursery) -> tuple[ClientConnection, trio.testing.MemoryReceiveStream]:
    """A connection whose writer is stuck in its first write and whose queue is past the mark."""
    client_end, server_end = trio.testing.lockstep_stream_pair()
    conn = ClientConnection(client_end, "peer:1", None)
    await nursery.start(conn._run)
    for _ in range(2):
        await conn.invoke_oneway(make_request(RequestCode.SEND_MESSAGE, body=BIG))
        await trio.sleep(0)  # the writer takes the first and stays in its send_all
    return conn, server_end


async def _wait_for_room(conn: ClientConnection, kind: str, timeout_s: float) -> None:
    request = make_request(RequestCode.SEND_MESSAGE, body=b"small")
    if kind == "oneway":
        with trio.move_on_after(timeout_s):  # send_oneway's deadline
            await conn.invoke_oneway(request)
    else:
        with pytest.raises(RequestTimeoutError):
            await conn.invoke(request, timeout_s=timeout_s)


@pytest.mark.parametrize("kind", ["oneway", "request"])
async def test_a_request_waiting_for_room_on_a_silent_peer_is_in_flight_and_its_deadline_closes_the_connection(
        autojump_clock, kind):
    # Neither counted: with every request stuck behind a full queue, the client's leader watch saw nothing waiting
    # and no request timed out unanswered, so a send_oneway to a stopped leader stayed blocked (20 s in a probe).
    async with trio.open_nursery() as nursery:
        conn, _server = await _stuck_connection(nursery)
        await trio.sleep(2 * SILENT_CLOSE_MIN_S)  # nothing received for longer than the silent close asks
        assert conn.oldest_request_sent_at() is None
        began = trio.current_time()
        nursery.start_soon(_wait_for_room, conn, kind, 3.0)
        await trio.sleep(1.0)
        assert conn.oldest_request_sent_at() == pytest.approx(began)
        assert conn.oldest_request_sent_at(frozenset({RequestCode.SEND_MESSAGE})) is None
        assert not conn.closed
        await trio.sleep(2.5)  # its deadline passes
        assert conn.closed and "nothing received for" in conn.close_reason, conn.close_reason
        assert conn.oldest_request_sent_at() is None


async def test_a_wait_for_room_given_up_early_or_on_a_peer_heard_from_meanwhile_keeps_the_connection(autojump_clock):
    async def give_up(scope: trio.CancelScope) -> None:
        await trio.sleep(1.0)
        scope.cancel()

    async with trio.open_nursery() as nursery:
        conn, server = await _stuck_connection(nursery)
        await trio.sleep(2 * SILENT_CLOSE_MIN_S)
        with trio.CancelScope() as caller:  # its caller gives up before the request's own deadline
            nursery.start_soon(give_up, caller)
            with trio.move_on_after(5.0):
                await conn.invoke_oneway(make_request(RequestCode.SEND_MESSAGE, body=b"small"))
        assert caller.cancelled_caught and not conn.closed
        # The peer says something while a request waits (an answer to an earlier request, a heartbeat's).
        nursery.start_soon(_wait_for_room, conn, "oneway", 3.0)
        await trio.sleep(1.0)
        await server.send_all(encode(make_response(make_request(RequestCode.HEART_BEAT), 0), opaque=12345))
        await trio.sleep(3.0)
        assert not conn.closed and conn.oldest_request_sent_at() is None
        nursery.cancel_scope.cancel()


async def test_a_peer_that_reads_slowly_keeps_its_connection_under_oneway_sends_that_wait_for_room(autojump_clock):
    # A writer's one send_all of a 4 MB queue to a peer reading 1.3 MB/s took 3 s, and nothing counted the bytes
    # leaving meanwhile: a oneway send waiting for room past its 3 s took the connection for silent and closed it,
    # dropping every oneway frame queued on it (a review's probe, on the real writer).
    client_end, server_end = trio.testing.lockstep_stream_pair()
    conn = ClientConnection(client_end, "peer:1", None)
    read = 0

    async def slow_reader() -> None:
        nonlocal read
        while True:
            data = await server_end.receive_some(64 * 1024)
            if not data:
                return
            read += len(data)
            await trio.sleep(0.05)

    async with trio.open_nursery() as nursery:
        await nursery.start(conn._run)
        nursery.start_soon(slow_reader)
        body = b"x" * (1 << 20)
        sent = given_up = 0
        began = trio.current_time()
        while trio.current_time() - began < 30 and not conn.closed:
            with trio.move_on_after(3.0) as waiting:  # send_oneway's deadline
                await conn.invoke_oneway(make_request(RequestCode.SEND_MESSAGE, body=body))
                sent += 1
            given_up += waiting.cancelled_caught
        assert not conn.closed, conn.close_reason
        assert given_up >= 1 and sent >= 20 and read >= 20 << 20  # waits ran out, and the peer kept reading
        nursery.cancel_scope.cancel()
