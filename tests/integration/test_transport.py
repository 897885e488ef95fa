"""The trio transport in-process on port 0: multiplexing, coalescing, timeouts, oneway, errors, reconnects."""

from __future__ import annotations

import functools
import logging
import socket
import struct

import pytest
import trio

from remoting.codec import FLAG_ONEWAY, Frame, encode, make_request, make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import (
    ConnectError,
    ConnectionClosedError,
    FrameTooLargeError,
    RequestTimeoutError,
    TopicNotExistError,
)
from remoting import transport
from remoting.transport import open_connection, open_remoting_client, serve_remoting

SLOW = 2000  # a request code the test handler never answers by itself
CLOSE = 2001  # the handler closes the connection
BOOM = 2002  # the handler raises
LATER = 2003  # answered from a task after handle() returned None
NO_TOPIC = 2004  # the handler raises a BrokerError subclass
HUGE = 2005  # the handler returns a response over the maximum frame size
NOT_A_FRAME = 2006  # the handler returns something that is not a response frame
HELD = 2007  # never answered either, as a long poll the client should not count


class Handler:
    def __init__(self) -> None:
        self.seen: list[Frame] = []
        self.closed: list[str] = []
        self.oneway = trio.Event()

    async def handle(self, request: Frame, conn):
        self.seen.append(request)
        if request.code == CLOSE:
            conn.close("test asked to close")
            return None
        if request.is_oneway:
            self.oneway.set()
            return make_response(request, ResponseCode.SUCCESS)  # must not be sent
        if request.code == RequestCode.ECHO:
            return make_response(request, ResponseCode.SUCCESS, ext=request.ext, body=request.body)
        if request.code in (SLOW, HELD):
            return None
        if request.code == BOOM:
            raise RuntimeError("handler bug")
        if request.code == NO_TOPIC:
            raise TopicNotExistError("topic 'nope' does not exist", topic="nope")
        if request.code == LATER:
            async def answer_later():
                await trio.sleep(0.05)
                await conn.send_response(make_response(request, ResponseCode.SUCCESS, body=b"later"))
            conn.nursery.start_soon(answer_later)
            return None
        if request.code == NOT_A_FRAME:
            return {"code": 0} if request.ext.get("dict") else request  # a dict, or the request itself
        if request.code == HUGE:
            return make_response(request, ResponseCode.SUCCESS, body=b"h" * 70_000)
        return make_response(request, ResponseCode.REQUEST_CODE_NOT_SUPPORTED, remark="unknown")

    def connection_closed(self, conn) -> None:
        self.closed.append(conn.close_reason)


@pytest.fixture
async def server(nursery):
    handler = Handler()
    host, port = await nursery.start(lambda task_status: serve_remoting(
        handler, "127.0.0.1", 0, max_frame_size=64 * 1024, task_status=task_status))
    return handler, f"{host}:{port}"


async def test_echo_round_trip(server):
    handler, addr = server
    async with open_remoting_client() as client:
        response = await client.invoke(addr, make_request(RequestCode.ECHO, ext={"k": [1, "v"]}, body=b"hi"))
    assert response.code == ResponseCode.SUCCESS and response.is_response
    assert (response.ext, response.body) == ({"k": [1, "v"]}, b"hi")
    assert response.opaque == handler.seen[0].opaque != 0


async def test_many_requests_in_flight_on_one_connection_are_matched_and_coalesced(server):
    _, addr = server
    results: dict[int, bytes] = {}
    async with open_remoting_client() as client:
        conn = await client.get_connection(addr)

        async def one(i: int) -> None:
            response = await client.invoke(addr, make_request(RequestCode.ECHO, body=i.to_bytes(4, "big")))
            results[i] = response.body

        async with trio.open_nursery() as nursery:
            for i in range(500):
                nursery.start_soon(one, i)
        stats = conn.statistics()
        assert len(client.connections()) == 1
    assert results == {i: i.to_bytes(4, "big") for i in range(500)}
    assert stats.frames_sent == 500 and stats.frames_received == 500 and stats.pending_requests == 0
    # 500 requests queued before the writer ran go out in far fewer send_all calls.
    assert stats.send_calls < 50, stats


async def _echo_every(conn, interval_s: float, stop: trio.Event) -> None:
    """Keep ``conn`` hearing from its peer, so a request that times out on it is slow, not on a silent link."""
    while not stop.is_set():
        await conn.invoke(make_request(RequestCode.ECHO, body=b"tick"))
        await trio.sleep(interval_s)


async def test_request_timeout_on_a_connection_that_answers_others_keeps_it(server):
    _, addr = server
    async with open_remoting_client() as client:
        conn = await client.get_connection(addr)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_echo_every, conn, 0.02, stop)
            start = trio.current_time()
            with trio.fail_after(5), pytest.raises(RequestTimeoutError,  # liveness: its 0.2 s, not the echoes'
                                                   match=r"did not answer request code 2000 within 0.2 s") as info:
                await client.invoke(addr, make_request(SLOW), timeout_s=0.2)
            assert trio.current_time() - start >= 0.2
            stop.set()
        assert info.value.retriable
        response = await client.invoke(addr, make_request(RequestCode.ECHO, body=b"still"))
        assert response.body == b"still"
        assert client.connections()[addr] is conn and not conn.closed
        assert conn.statistics().pending_requests == 0


async def test_a_request_timing_out_on_a_silent_connection_closes_it(server):
    """Nothing at all received while a request waited its whole timeout, and for a second at least: the peer or
    the path is gone (a cut link would resume only at TCP's next, backed-off retransmission), so the connection
    is closed, the other waiting requests fail with the reason, and the next request connects afresh (RocketMQ
    closes the socket after any timeout: clientCloseSocketIfTimeout)."""
    _, addr = server
    async with open_remoting_client() as client:
        conn = await client.get_connection(addr)
        held: list[BaseException] = []

        async def hold() -> None:
            try:
                await conn.invoke(make_request(HELD), timeout_s=None)
            except ConnectionClosedError as e:
                held.append(e)

        with trio.fail_after(5):  # else the held request would wait for ever
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hold)
                await trio.sleep(0.05)
                # Silent for less than SILENT_CLOSE_MIN_S (1 s): that says more about a short timeout than about
                # the peer, and the connection stays.
                with pytest.raises(RequestTimeoutError):
                    await client.invoke(addr, make_request(SLOW), timeout_s=0.2)
                assert not conn.closed
                with pytest.raises(RequestTimeoutError):
                    await client.invoke(addr, make_request(SLOW), timeout_s=1.2)
        assert conn.closed and "nothing received for" in conn.close_reason
        assert len(held) == 1 and "nothing received for" in str(held[0]) and held[0].retriable
        response = await client.invoke(addr, make_request(RequestCode.ECHO, body=b"afresh"))
        assert response.body == b"afresh" and client.connections()[addr] is not conn


async def test_timeouts_of_different_lengths_fire_in_order(server):
    _, addr = server
    fired: list[float] = []
    async with open_connection(addr) as conn:
        async def wait(timeout_s: float) -> None:
            with pytest.raises(RequestTimeoutError):
                await conn.invoke(make_request(SLOW), timeout_s=timeout_s)
            fired.append(timeout_s)

        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_echo_every, conn, 0.02, stop)
            async with trio.open_nursery() as waiters:
                waiters.start_soon(wait, 0.6)
                await trio.sleep(0.05)
                waiters.start_soon(wait, 0.1)  # shorter than the one already waiting: must wake the timer
            stop.set()
    assert fired == [0.1, 0.6]


async def test_no_timeout_and_cancellation(server):
    _, addr = server
    async with open_connection(addr) as conn:
        with trio.move_on_after(0.1) as scope:
            await conn.invoke(make_request(SLOW), timeout_s=None)
        assert scope.cancelled_caught
        assert conn.statistics().pending_requests == 0
        with pytest.raises(ValueError, match="timeout_s"):
            await conn.invoke(make_request(RequestCode.ECHO), timeout_s=0)


async def test_oneway(server):
    handler, addr = server
    async with open_connection(addr) as conn:
        await conn.invoke_oneway(make_request(RequestCode.HEART_BEAT, ext={"client_id": "c1"}))
        with trio.fail_after(2):
            await handler.oneway.wait()
        assert handler.seen[-1].flag & FLAG_ONEWAY and handler.seen[-1].ext == {"client_id": "c1"}
        # A plain request sent with invoke_oneway is flagged oneway on the wire.
        await conn.invoke_oneway(make_request(RequestCode.ECHO))
        response = await conn.invoke(make_request(RequestCode.ECHO, body=b"after"))
        assert response.body == b"after"
        assert conn.statistics().frames_received == 1  # no response to either oneway request
        with pytest.raises(ValueError, match="oneway"):
            await conn.invoke(make_request(RequestCode.ECHO, oneway=True))


async def test_handler_exception_is_system_error_and_connection_lives(server, caplog):
    _, addr = server
    async with open_connection(addr) as conn:
        response = await conn.invoke(make_request(BOOM))
        assert response.code == ResponseCode.SYSTEM_ERROR
        assert "RuntimeError: handler bug" in response.remark
        assert (await conn.invoke(make_request(RequestCode.ECHO, body=b"ok"))).body == b"ok"
    assert any("handler failed" in r.message and r.exc_info for r in caplog.records)


async def test_broker_error_raised_by_handler_becomes_its_response(server):
    _, addr = server
    async with open_connection(addr) as conn:
        response = await conn.invoke(make_request(NO_TOPIC))
    assert response.code == ResponseCode.TOPIC_NOT_EXIST
    assert response.remark == "topic 'nope' does not exist" and response.ext == {"topic": "nope"}


async def test_deferred_response_from_a_task(server):
    _, addr = server
    async with open_connection(addr) as conn:
        response = await conn.invoke(make_request(LATER))
    assert response.body == b"later"


async def test_broken_connection_fails_every_pending_request_and_the_pool_reconnects(server):
    handler, addr = server
    async with open_remoting_client() as client:
        first = await client.get_connection(addr)
        failures: list[BaseException] = []

        async def pending() -> None:
            try:
                await client.invoke(addr, make_request(SLOW), timeout_s=10)
            except ConnectionClosedError as e:
                failures.append(e)

        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(pending)
            await trio.sleep(0.1)
            await client.invoke_oneway(addr, make_request(CLOSE))
        assert len(failures) == 20
        assert all(e.retriable and e.refresh_route for e in failures)
        assert "closed by peer" in str(failures[0])
        assert first.closed
        response = await client.invoke(addr, make_request(RequestCode.ECHO, body=b"again"))
        assert response.body == b"again"
        assert client.connections()[addr] is not first
    with trio.fail_after(2):
        while not handler.closed:
            await trio.sleep(0.01)
    assert "test asked to close" in handler.closed[0]


async def test_server_going_away(nursery):
    handler = Handler()
    serve_scope = trio.CancelScope()

    async def serve(task_status):
        with serve_scope:
            await serve_remoting(handler, "127.0.0.1", 0, task_status=task_status)

    host, port = await nursery.start(serve)
    addr = f"{host}:{port}"
    async with open_remoting_client(connect_timeout_s=1.0) as client:
        async with trio.open_nursery() as inner:
            async def pending() -> None:
                with pytest.raises(ConnectionClosedError):
                    await client.invoke(addr, make_request(SLOW), timeout_s=10)

            inner.start_soon(pending)
            await trio.sleep(0.1)
            serve_scope.cancel()
        with pytest.raises(ConnectError, match=f"could not connect to {addr}") as info:
            await client.invoke(addr, make_request(RequestCode.ECHO))
        assert info.value.retriable and info.value.refresh_route


async def test_connect_to_nothing():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectError, match="could not connect"):
        async with open_connection(f"127.0.0.1:{port}"):
            pass
    with pytest.raises(ValueError, match="HOST:PORT"):
        async with open_remoting_client() as client:
            await client.invoke("no-port", make_request(RequestCode.ECHO))


async def test_a_request_deadline_covers_connecting_to_a_host_that_does_not_answer():
    """A listener whose backlog is full drops SYNs (as a dead host does): the connect hangs. The request's own
    deadline, not the pool's connect timeout, bounds it."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        addr = "127.0.0.1:%d" % listener.getsockname()[1]
        fillers = []
        try:
            for _ in range(4):
                filler = socket.socket()
                filler.setblocking(False)
                try:
                    filler.connect(listener.getsockname())
                except BlockingIOError:
                    pass
                fillers.append(filler)
            async with open_remoting_client(connect_timeout_s=30.0) as client:
                # Bound far below the 30 s connect timeout: without the fix this waits the whole 30 s.
                with trio.fail_after(10):
                    with pytest.raises(ConnectError, match=r"no answer within the request's 0.3 s") as info:
                        await client.invoke(addr, make_request(RequestCode.ECHO), timeout_s=0.3)
                assert info.value.retriable
        finally:
            for filler in fillers:
                filler.close()


def _slow_connects(monkeypatch, delay_s: float) -> list[str]:
    """Every connect the pool makes takes ``delay_s`` longer; returns the list of addresses it connected to."""
    opened: list[str] = []
    real = transport._open_stream

    async def slow_open(addr: str, connect_timeout_s: float):
        opened.append(addr)
        await trio.sleep(delay_s)
        return await real(addr, connect_timeout_s)

    monkeypatch.setattr(transport, "_open_stream", slow_open)
    return opened


async def test_a_connect_outlives_the_request_whose_deadline_passed_and_serves_the_next(server, monkeypatch):
    """A request that gives up waiting for its connection does not give up the connect. When it did, a timeout
    shorter than a connect never connected: each request started an attempt that its deadline cancelled."""
    _, addr = server
    opened = _slow_connects(monkeypatch, 0.3)
    async with open_remoting_client() as client:
        with pytest.raises(ConnectError, match=r"no answer within the request's 0.05 s"):
            await client.invoke(addr, make_request(RequestCode.ECHO), timeout_s=0.05)
        await trio.sleep(0.4)  # the attempt that request started ends meanwhile
        response = await client.invoke(addr, make_request(RequestCode.ECHO), timeout_s=0.05)
        assert response.code == ResponseCode.SUCCESS
        assert opened == [addr]


async def test_a_failed_connect_fails_every_request_that_waited_for_it_and_the_next_tries_again(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = "127.0.0.1:%d" % s.getsockname()[1]
    opened = _slow_connects(monkeypatch, 0.1)
    async with open_remoting_client() as client:
        errors: list[BaseException] = []

        async def echo() -> None:
            try:
                await client.invoke(addr, make_request(RequestCode.ECHO), timeout_s=2.0)
            except ConnectError as e:
                errors.append(e)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(echo)
        assert len(errors) == 3 and len({id(e) for e in errors}) == 3  # one attempt, an exception for each
        assert all("could not connect to " + addr in str(e) and e.retriable for e in errors), errors
        assert opened == [addr]
        with pytest.raises(ConnectError, match="could not connect"):
            await client.invoke(addr, make_request(RequestCode.ECHO), timeout_s=2.0)
        assert opened == [addr, addr]


async def test_client_refuses_an_oversize_request_before_sending(server):
    _, addr = server
    async with open_connection(addr, max_frame_size=64 * 1024) as conn:
        with pytest.raises(FrameTooLargeError, match="exceeds the maximum frame size of 65536"):
            await conn.invoke(make_request(RequestCode.ECHO, body=b"x" * 70_000))
        assert (await conn.invoke(make_request(RequestCode.ECHO, body=b"ok"))).body == b"ok"


async def test_oversize_response_becomes_system_error(server):
    _, addr = server
    async with open_connection(addr, max_frame_size=1 << 20) as conn:
        response = await conn.invoke(make_request(HUGE))
    assert response.code == ResponseCode.SYSTEM_ERROR
    assert "exceeds the maximum frame size" in response.remark


async def test_bad_frame_closes_only_that_connection(server, caplog):
    handler, addr = server
    host, port = addr.rsplit(":", 1)
    caplog.set_level(logging.WARNING, logger="remoting")
    async with open_connection(addr) as good:
        bad = await trio.open_tcp_stream(host, int(port))
        # A valid request first, then an oversize length prefix: the request is answered, then the server
        # logs the reason and closes.
        await bad.send_all(encode(make_request(RequestCode.ECHO, body=b"first"), opaque=5)
                           + struct.pack(">I", 10_000_000))
        received = b""
        with trio.fail_after(5):
            while chunk := await bad.receive_some(65536):
                received += chunk
        assert received.endswith(b"first")
        await bad.aclose()
        assert (await good.invoke(make_request(RequestCode.ECHO, body=b"fine"))).body == b"fine"
    assert any("bad frame" in r.getMessage() and "exceeds the maximum frame size" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("answer, bad_frame", [
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", True),  # another protocol on the port: asking again cannot help
    (b"", False),  # a peer that only closed: a restart, say, after which asking again may well help
])
async def test_a_request_failed_by_bytes_that_are_no_frame_says_so(nursery, answer, bad_frame):
    """The waiting request's ConnectionClosedError tells a peer that speaks another protocol from one that went
    away (bench produce gives up on the first at once, and waits for the second), by a flag, not the text."""
    async def answer_and_close(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        if answer:
            await stream.send_all(answer)
            await trio.sleep(1)  # the client must close on the bytes, not on our close
        await stream.aclose()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, answer_and_close, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    async with open_connection(f"127.0.0.1:{port}") as conn:
        with trio.fail_after(5), pytest.raises(ConnectionClosedError) as caught:
            await conn.invoke(make_request(RequestCode.ECHO, body=b"hello?"), timeout_s=None)
    assert caught.value.bad_frame is bad_frame
    assert caught.value.reason.startswith("bad frame") is bad_frame


async def test_server_can_call_the_client(nursery):
    """Both ends are the same connection class: a server may send requests (RocketMQ's check-backs)."""
    answers: list[Frame] = []

    class AskBack:
        async def handle(self, request, conn):
            # Never inline: this reader task is the one that would deliver the answer.
            async def ask() -> None:
                answers.append(await conn.invoke(make_request(RequestCode.CHECK_TRANSACTION_STATE), timeout_s=2))
                await conn.send_response(make_response(request, ResponseCode.SUCCESS))

            conn.nursery.start_soon(ask)
            return None

    class ClientSide:
        async def handle(self, request, conn):
            return make_response(request, ResponseCode.SUCCESS, ext={"state": "commit"})

    host, port = await nursery.start(serve_remoting, AskBack(), "127.0.0.1", 0)
    async with open_remoting_client(handler=ClientSide()) as client:
        await client.invoke(f"{host}:{port}", make_request(RequestCode.ECHO))
    async with open_connection(f"{host}:{port}") as conn:  # no handler: the server is told so
        await conn.invoke(make_request(RequestCode.ECHO))
    assert answers[0].ext == {"state": "commit"}
    assert answers[1].code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED


async def test_tcp_nodelay_is_set(server):
    _, addr = server
    async with open_connection(addr) as conn:
        assert conn._stream.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


async def test_close_connection_in_the_pool(server):
    _, addr = server
    async with open_remoting_client() as client:
        first = await client.get_connection(addr)
        client.close_connection(addr)
        await trio.sleep(0)
        assert first.closed
        assert addr not in client.connections()
        assert (await client.invoke(addr, make_request(RequestCode.ECHO, body=b"x"))).body == b"x"


async def test_oldest_waiting_request_and_a_pool_close_reason_reach_the_waiters(server):
    """What the client's leader watch reads: when the longest-waiting request was sent, codes it ignores
    (long polls) aside; closing a pooled connection with a reason fails its waiters with that reason."""
    _, addr = server
    async with open_remoting_client() as client:
        conn = await client.get_connection(addr)
        assert conn.oldest_request_sent_at() is None
        errors: list[BaseException] = []

        async def wait_for(code: int, timeout_s: float | None) -> None:
            try:
                await client.invoke(addr, make_request(code), timeout_s=timeout_s)
            except ConnectionClosedError as e:
                errors.append(e)

        async with trio.open_nursery() as n:
            n.start_soon(wait_for, HELD, 30.0)  # the handler answers neither
            await trio.sleep(0.05)
            first_slow = trio.current_time()
            n.start_soon(wait_for, SLOW, 30.0)
            await trio.sleep(0.05)
            n.start_soon(wait_for, SLOW, None)  # no deadline: nothing to tell its age by
            await trio.sleep(0.05)
            assert conn.oldest_request_sent_at() < first_slow  # the held one, sent first
            assert conn.oldest_request_sent_at(frozenset({HELD})) == pytest.approx(
                first_slow, abs=0.01)
            client.close_connection(addr, "the test closed it")
        assert len(errors) == 3 and all("the test closed it" in str(e) for e in errors)
        assert conn.oldest_request_sent_at() is None


async def test_a_peer_that_stops_reading_is_slowed_down_not_buffered(nursery):
    """Responses queue up to HIGH_WATER_BYTES, then the server stops reading that peer; others are served."""
    from remoting import transport

    conns = []

    class Echo:
        async def handle(self, request, conn):
            conns.append(conn)
            return make_response(request, ResponseCode.SUCCESS, body=request.body)

    host, port = await nursery.start(serve_remoting, Echo(), "127.0.0.1", 0)
    hog = await trio.open_tcp_stream(host, port)
    request = encode(make_request(RequestCode.ECHO, body=b"r" * 60_000), opaque=1)
    sent = 0
    with trio.move_on_after(2):
        while sent < 400:  # 24 MB of requests, far more than socket buffers plus the high-water mark
            await hog.send_all(request)
            sent += 1
    assert sent < 400, "the server kept reading although its peer never read a response"
    server_side = conns[0]
    assert server_side._out_bytes <= transport.HIGH_WATER_BYTES + len(request)
    async with open_connection(f"{host}:{port}") as other:
        assert (await other.invoke(make_request(RequestCode.ECHO, body=b"meanwhile"))).body == b"meanwhile"
    await trio.aclose_forcefully(hog)


async def test_a_peer_that_stops_reading_deferred_answers_is_slowed_down_too(nursery):
    """Answers sent later with send_response_nowait (a Raft commit's callbacks do that) count as well: once they
    pass HIGH_WATER_BYTES the server stops reading that peer's requests, so they cannot pile up without end."""
    from remoting import transport

    conns = []

    class Deferred:
        def __init__(self, nursery) -> None:
            self.nursery = nursery

        async def handle(self, request, conn):
            conns.append(conn)

            async def answer() -> None:
                await trio.sleep(0)
                conn.send_response_nowait(make_response(request, ResponseCode.SUCCESS, body=b"a" * 20_000))
            self.nursery.start_soon(answer)
            return None

    host, port = await nursery.start(serve_remoting, Deferred(nursery), "127.0.0.1", 0)
    hog = await trio.open_tcp_stream(host, port)
    request = encode(make_request(RequestCode.ECHO, body=b"r" * 100), opaque=1)
    sent = 0
    with trio.move_on_after(2):
        while sent < 20_000:  # 400 MB of answers if every request were admitted
            await hog.send_all(request)
            sent += 1
            if sent % 100 == 0:
                await trio.sleep(0)  # let the answers be queued
    assert sent < 20_000, "the server kept reading although its peer never read an answer"
    server_side = conns[0]
    # At most what was admitted before the mark was seen, plus one receive's worth of requests.
    assert server_side._out_bytes <= transport.HIGH_WATER_BYTES + transport.RECEIVE_SIZE // len(request) * 20_100
    await trio.aclose_forcefully(hog)


async def test_senders_waiting_for_room_are_let_in_first_come_first_served(nursery):
    """Frames larger than a third of HIGH_WATER_BYTES: most senders wait for the writer, and they leave in the
    order they called invoke (waking them all and letting the first to run win made some wait many rounds)."""
    from remoting import transport

    arrived: list[int] = []

    class Record:
        async def handle(self, request, conn):
            arrived.append(int(request.ext["i"]))
            return make_response(request, ResponseCode.SUCCESS)

    host, port = await nursery.start(serve_remoting, Record(), "127.0.0.1", 0)
    body = b"b" * (transport.HIGH_WATER_BYTES // 3 + 1)
    called: list[int] = []
    async with open_connection(f"{host}:{port}") as client:
        async def send(i: int) -> None:
            await trio.sleep(0.001 * (i % 3))  # not all in one scheduling batch
            called.append(i)
            response = await client.invoke(make_request(RequestCode.ECHO, ext={"i": i}, body=body), timeout_s=30)
            assert response.code == ResponseCode.SUCCESS

        with trio.fail_after(60):
            async with trio.open_nursery() as senders:
                for i in range(24):
                    senders.start_soon(send, i)
    assert len(arrived) == 24
    assert arrived == called


async def test_a_request_that_never_finds_room_in_the_queue_times_out(nursery):
    """A peer that stops reading fills the queue: a later request fails with RequestTimeoutError within its
    own timeout instead of waiting for room for ever. (Silent for less than SILENT_CLOSE_MIN_S, the connection
    is not closed meanwhile.)"""
    from remoting import transport

    accepted: list[trio.SocketStream] = []

    async def never_read(stream: trio.SocketStream) -> None:
        accepted.append(stream)
        await trio.sleep_forever()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, never_read, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    body = b"s" * (transport.HIGH_WATER_BYTES + 1)
    errors: list[BaseException] = []
    async with open_connection(f"127.0.0.1:{port}") as client:
        async def send() -> None:
            try:
                await client.invoke(make_request(RequestCode.ECHO, body=body), timeout_s=0.5)
            except RequestTimeoutError as e:
                errors.append(e)

        with trio.fail_after(10):
            async with trio.open_nursery() as senders:
                for _ in range(8):  # socket buffers and the writer take the first ones; the later ones find no room
                    senders.start_soon(send)
        assert client.statistics().bytes_sent < 4 * len(body)  # the peer never read: most were never sent
    assert len(errors) == 8 and all(e.code == RequestCode.ECHO for e in errors)
    for stream in accepted:
        await trio.aclose_forcefully(stream)


async def test_handler_returning_garbage_is_answered_system_error(server):
    _, addr = server
    async with open_connection(addr) as conn:
        as_dict = await conn.invoke(make_request(NOT_A_FRAME, ext={"dict": True}))
        as_request = await conn.invoke(make_request(NOT_A_FRAME))
        assert (await conn.invoke(make_request(RequestCode.ECHO, body=b"alive"))).body == b"alive"
    assert as_dict.code == ResponseCode.SYSTEM_ERROR and "returned dict, not a Frame" in as_dict.remark
    assert as_request.code == ResponseCode.SYSTEM_ERROR and "without the response flag" in as_request.remark


async def test_corked_answers_leave_in_one_write_per_connection_without_the_writer(nursery):
    """Frames queued inside ``corked()`` are written when the block ends, one write per connection, before any
    task runs; what the socket cannot take goes to the writer, and every byte still arrives in order."""
    from remoting.transport import corked

    held = []

    class Hold:
        async def handle(self, request, conn):
            held.append((request, conn))
            return None

    host, port = await nursery.start(serve_remoting, Hold(), "127.0.0.1", 0)
    async with open_connection(f"{host}:{port}") as client:
        results = []

        async def call(i):
            results.append((i, await client.invoke(make_request(RequestCode.ECHO, body=b"%d" % i))))

        async with trio.open_nursery() as calls:
            for i in range(20):
                calls.start_soon(call, i)
            with trio.fail_after(5):
                while len(held) < 20:
                    await trio.sleep(0.01)
            server_side = held[0][1]
            before = server_side.statistics()
            with corked():
                for request, conn in held:
                    assert conn.send_response_nowait(make_response(request, ResponseCode.SUCCESS, body=request.body))
                assert server_side._out and server_side.statistics().send_calls == before.send_calls  # held
            after = server_side.statistics()  # no checkpoint since the block ended: the writer did not run
            assert not server_side._out
            assert after.send_calls == before.send_calls + 1 and after.frames_sent == before.frames_sent + 20
        assert sorted(r.body for _, r in results) == sorted(b"%d" % i for i in range(20))

        # Larger than the socket can take at once: the remainder goes through the writer, in order.
        held.clear()
        big = b"x" * (3 << 20)
        async with trio.open_nursery() as calls:
            for i in range(3):
                calls.start_soon(call, 100 + i)
                await trio.sleep(0.01)
            with trio.fail_after(5):
                while len(held) < 3:
                    await trio.sleep(0.01)
            with corked():
                for request, conn in held:
                    conn.send_response_nowait(make_response(request, ResponseCode.SUCCESS, body=big + request.body))
            assert server_side._out  # the socket took part of it; the writer has the rest
        assert [r.body[-3:] for i, r in results if i >= 100] == [b"100", b"101", b"102"]
