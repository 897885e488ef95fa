"""The /metrics responder (remoting/metrics_http.py) on a real loopback socket: what it answers to good and bad
HTTP, and that no client, slow, idle, greedy or malformed, keeps it from serving the next scrape."""

from __future__ import annotations

import functools

import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest

from remoting import metrics_http
from remoting.config import ConfigError
from remoting.metrics_http import (EXPOSITION_CHUNK_SAMPLES, MAX_REQUEST_HEAD_BYTES, MetricFamilies, metrics_registry,
                                   render_exposition, serve_metrics)
from tests.metrics_scrape import exchange, parse_samples, read_answer, scrape, value

GET = b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n"


class Figures:
    """A collector over a dict the test changes between scrapes, as a server's collector reads live counts."""

    def __init__(self) -> None:
        self.counts = {"sent": 3, "queued": 7}
        self.fail = False
        self._families = MetricFamilies(node_type="test", node_id="t1")

    def collect(self):
        if self.fail:
            raise RuntimeError("collector broke")
        f = self._families
        yield f.counter("test_sent_total", "things sent", self.counts["sent"])
        queued = f.gauge("test_queued", "things queued, by kind", labels=["kind"])
        f.add(queued, self.counts["queued"], "a")
        f.add(queued, 1, "b")
        yield queued


async def _serve(nursery, figures: Figures) -> tuple[str, int]:
    return await nursery.start(functools.partial(serve_metrics, metrics_registry(figures), "127.0.0.1:0"))


async def test_get_metrics_answers_the_exposition_read_at_scrape_time_and_keeps_the_connection(nursery):
    figures = Figures()
    addr = await _serve(nursery, figures)
    stream = await trio.open_tcp_stream(*addr)
    async with stream:
        await stream.send_all(GET)
        first = await read_answer(stream)
        assert first.status == 200 and not first.closed
        assert first.headers["content-type"].startswith("text/plain; version=")
        samples = parse_samples(first.body.decode())
        assert value(samples, "test_sent_total", node_type="test", node_id="t1") == 3
        assert value(samples, "test_queued", kind="a") == 7 and value(samples, "test_queued", kind="b") == 1
        # The process collectors come with every registry.
        assert value(samples, "process_cpu_seconds_total") > 0 and "python_info" in samples

        # Keep-alive: the next request on the same connection sees the figures as they are now.
        figures.counts["sent"] = 10
        await stream.send_all(b"GET /metrics?name[]=x HTTP/1.1\r\nHost: test\r\n\r\n")
        second = await read_answer(stream)
        assert second.status == 200
        assert value(parse_samples(second.body.decode()), "test_sent_total") == 10


async def _read_head_only(addr, request: bytes) -> tuple[bytes, bytes]:
    """The answer's head, and everything after it until the server closes (nothing, for a HEAD)."""
    stream = await trio.open_tcp_stream(*addr)
    async with stream:
        await stream.send_all(request)
        data = b""
        with trio.fail_after(10):
            while True:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


async def test_head_sends_the_length_of_the_exposition_and_no_body(nursery):
    addr = await _serve(nursery, Figures())
    head, rest = await _read_head_only(addr, b"HEAD /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and rest == b""
    length = int(head.decode().lower().split("content-length:")[1].split("\r\n")[0])
    # What GET sends, but for the process figures (memory, GC counts) that moved in between.
    assert abs(length - len((await exchange(addr, GET)).body)) < 100


@pytest.mark.parametrize("request_bytes, status, needle", [
    (b"GET / HTTP/1.1\r\nHost: t\r\n\r\n", 404, "metrics are at /metrics"),
    (b"GET /metricsx HTTP/1.1\r\nHost: t\r\n\r\n", 404, "no such path"),
    (b"POST /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc", 405, "GET and HEAD only"),
    (b"DELETE /metrics HTTP/1.1\r\nHost: t\r\n\r\n", 405, "GET and HEAD only"),
    (b"GET /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello", 400, "carries no body"),
    (b"GET /metrics HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "carries no body"),
    (b"HELLO THERE\r\n\r\n", 400, "malformed HTTP request"),
    (b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n", 400, "malformed HTTP request"),
    (b"GET /metrics HTTP/1.1\r\n\r\n", 400, "malformed HTTP request"),  # HTTP/1.1 requires Host
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64) + b"\r\n\r\n", 400, "malformed"),  # TLS hello
    (b"GET /" + b"a" * (2 * MAX_REQUEST_HEAD_BYTES) + b" HTTP/1.1\r\n\r\n", 431, "exceeds 8192 bytes"),
    (b"GET /metrics HTTP/1.1\r\nHost: t\r\nX-Big: " + b"b" * (2 * MAX_REQUEST_HEAD_BYTES) + b"\r\n\r\n", 431,
     "exceeds"),
    # Just past the bound, completed within the receive that passed it (h11 checks only incomplete heads): was 200.
    (b"GET /metrics HTTP/1.1\r\nHost: t\r\nX-Big: " + b"b" * (MAX_REQUEST_HEAD_BYTES + 1000) + b"\r\n\r\n", 431,
     "exceeds"),
])
async def test_bad_requests_get_their_status_and_close_and_the_server_serves_on(nursery, request_bytes, status,
                                                                                needle):
    addr = await _serve(nursery, Figures())
    answer = await exchange(addr, request_bytes)
    assert answer.status == status and answer.closed, answer
    assert needle in answer.body.decode(), answer.body
    if status == 405:
        assert answer.headers["allow"] == "GET, HEAD"
    assert value(await scrape(addr), "test_sent_total") == 3


async def test_a_request_line_without_an_end_is_cut_at_the_head_limit(nursery):
    """A client streaming an endless request line: answered 431 once the head limit is passed, not buffered on."""
    addr = await _serve(nursery, Figures())
    stream = await trio.open_tcp_stream(*addr)
    async with stream:
        sent = 0
        with trio.move_on_after(10):
            try:
                await stream.send_all(b"GET /")
                while sent < 64 * MAX_REQUEST_HEAD_BYTES:
                    await stream.send_all(b"a" * 1024)
                    sent += 1024
            except trio.BrokenResourceError:
                pass  # the server answered and closed while we were still sending
        answer = await read_answer(stream)
    assert answer.status == 431 and sent < 64 * MAX_REQUEST_HEAD_BYTES
    assert value(await scrape(addr), "test_sent_total") == 3


async def test_idle_and_slow_clients_are_closed_and_the_connection_cap_holds(nursery, monkeypatch):
    monkeypatch.setattr(metrics_http, "REQUEST_TIMEOUT_S", 0.5)
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 2)
    addr = await _serve(nursery, Figures())
    idle = await trio.open_tcp_stream(*addr)
    slow = await trio.open_tcp_stream(*addr)
    async with idle, slow:
        await slow.send_all(b"GET /met")  # and never the rest
        # Both slots taken: one more connection is refused with 503.
        busy = await exchange(addr, GET)
        assert busy.status == 503 and busy.closed and b"too many" in busy.body
        # The idle and the slow one are closed within the request timeout: the server reads end-of-stream.
        with trio.fail_after(10):
            assert await idle.receive_some(100) == b""
            assert await slow.receive_some(100) == b""
    # Their slots are free again.
    with trio.fail_after(10):
        while True:
            answer = await exchange(addr, GET)
            if answer.status == 200:
                break
            await trio.sleep(0.05)


async def test_a_collector_that_raises_is_answered_500_and_logged_and_the_next_scrape_works(nursery, caplog):
    figures = Figures()
    addr = await _serve(nursery, figures)
    figures.fail = True
    answer = await exchange(addr, GET)
    assert answer.status == 500 and answer.closed and b"see the server log" in answer.body
    assert "metrics collection failed" in caplog.text and "collector broke" in caplog.text
    figures.fail = False
    assert value(await scrape(addr), "test_sent_total") == 3


async def test_an_address_in_use_is_a_config_error_naming_metrics_listen(nursery):
    host, port = await _serve(nursery, Figures())
    with pytest.raises(ConfigError, match=rf"metrics_listen '127.0.0.1:{port}' cannot be listened on: Address "
                                          r"already in use"):
        await serve_metrics(metrics_registry(Figures()), f"127.0.0.1:{port}")



class ManyTopics:
    def collect(self):
        f = MetricFamilies(node_type="test", node_id="t1")
        sent = f.counter("test_sent_total", "sent, by topic", labels=["topic"])
        for i in range(3 * EXPOSITION_CHUNK_SAMPLES + 17):
            f.add(sent, i, f"Topic{i}")
        yield sent
        yield f.gauge("test_after", "a family after the big one", 1)


async def test_a_big_family_is_rendered_in_slices_as_generate_latest_renders_it_whole():
    registry = CollectorRegistry()
    registry.register(ManyTopics())
    rendered = await render_exposition(registry)
    assert rendered == generate_latest(registry)
    assert rendered.count(b"# TYPE test_sent_total counter") == 1
    assert value(parse_samples(rendered.decode()), "test_sent_total", topic="Topic1516") == 1516
