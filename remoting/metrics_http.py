"""``serve_metrics``: a server's ``/metrics`` endpoint, Prometheus's text format over a minimal HTTP/1.1.

Every broker node and name server may serve one (``metrics_listen`` in its config). The registry, the metric
families and the exposition are prometheus-client's (``generate_latest``); the HTTP is h11's sans-IO state
machine driven by a trio task in the server's own nursery, as the remoting server is. No thread: the collectors
read the server's live objects, which only the trio thread may touch, and prometheus-client's
``start_http_server`` would run them in a thread of its own.

Rules this module keeps:

* **Scrapes cost the server nothing between scrapes.** The registry holds custom collectors that read at
  scrape time what the server counts anyway; nothing here is called per message or per request of the server's
  own protocol. A scrape runs the collectors in the trio thread, so its cost (proportional to topics, queues and
  consumer groups) is paid once per scrape by the server's event loop; ``render_exposition`` formats a family,
  or a slice of a big one, at a time with a checkpoint in between, so the server's other tasks run meanwhile.
* **Only GET (and HEAD) of /metrics.** ``200`` with the exposition (a query string is ignored); another path
  ``404``; another method ``405`` with ``Allow``; a request h11 cannot parse ``400`` (``431`` when its head
  exceeds ``MAX_REQUEST_HEAD_BYTES``, a request line alone included); a GET with a body ``400``; a collector
  that raises ``500``, logged with its traceback. Every answer but ``200`` closes the connection, so a request's
  body is never read.
* **A bad client cannot hold the server.** A request must arrive whole within ``REQUEST_TIMEOUT_S`` of the
  connection's opening or of the previous answer (an idle keep-alive connection is closed then too), and its
  head may take at most ``MAX_REQUEST_HEAD_BYTES``; an answer that cannot be written within ``SEND_TIMEOUT_S``
  (a client that does not read) closes the connection. At most ``MAX_CONNECTIONS`` connections are served at
  once; one more is answered ``503`` and closed.
"""

from __future__ import annotations

import copy
import http
import logging
from collections.abc import Sequence
from typing import TypeVar

import h11
import trio
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from remoting.config import ConfigError, parse_host_port
from remoting.transport import open_listeners

log = logging.getLogger(__name__)

__all__ = ["serve_metrics", "render_exposition", "metrics_registry", "MetricFamilies", "METRICS_PATH",
           "MAX_REQUEST_HEAD_BYTES", "MAX_CONNECTIONS", "REQUEST_TIMEOUT_S", "SEND_TIMEOUT_S",
           "EXPOSITION_CHUNK_SAMPLES"]

METRICS_PATH = b"/metrics"
# Prometheus sends a request line and a handful of headers, a few hundred bytes.
MAX_REQUEST_HEAD_BYTES = 8 * 1024
RECEIVE_CHUNK_BYTES = 4 * 1024
# Prometheus's scrape timeout is 10 s by default; a scrape every 15 s or more reconnects after an idle keep-alive.
REQUEST_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 10.0
# A few Prometheus servers and an operator's curl; more at once is a misbehaving client.
MAX_CONNECTIONS = 16
ALLOWED_METHODS = (b"GET", b"HEAD")
# Samples formatted between two checkpoints: ~10 us each, so a few ms of the event loop at a time.
EXPOSITION_CHUNK_SAMPLES = 500

_Family = TypeVar("_Family", GaugeMetricFamily, CounterMetricFamily)

_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
         b"content-length: 35\r\n\r\ntoo many metrics connections open\r\n")


def metrics_registry(collector: Collector) -> CollectorRegistry:
    """A registry of its own for one server (several may share a process: the integration tests run brokers and
    a name server in one) holding ``collector`` and prometheus-client's process, platform and GC collectors
    (``process_cpu_seconds_total``, ``process_resident_memory_bytes``, ``process_open_fds``, ``python_info``,
    ``python_gc_*``), which also read their figures at scrape time."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class MetricFamilies:
    """Builds the metric families of one scrape, every sample carrying a server's constant labels first (RocketMQ
    5 puts ``cluster``, ``node_type`` and ``node_id`` on every series), then the family's own."""

    def __init__(self, **constant: str) -> None:
        self._names = list(constant)
        self._values = list(constant.values())

    def gauge(self, name: str, doc: str, value: float | None = None, *,
              labels: Sequence[str] = ()) -> GaugeMetricFamily:
        """A gauge; with ``value``, its one sample (no labels of its own), else samples are ``add``ed."""
        return self._with_value(GaugeMetricFamily(name, doc, labels=[*self._names, *labels]), value)

    def counter(self, name: str, doc: str, value: float | None = None, *,
                labels: Sequence[str] = ()) -> CounterMetricFamily:
        """A counter (``name`` ends in ``_total``); ``value`` as for ``gauge``."""
        return self._with_value(CounterMetricFamily(name, doc, labels=[*self._names, *labels]), value)

    def add(self, family: GaugeMetricFamily | CounterMetricFamily, value: float, *label_values: str) -> None:
        family.add_metric([*self._values, *label_values], value)

    def _with_value(self, family: _Family, value: float | None) -> _Family:
        if value is not None:
            self.add(family, value)
        return family


async def serve_metrics(registry: CollectorRegistry, listen: str, *,
                        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
    """Listen on ``listen`` (a server's ``metrics_listen``, HOST:PORT; port 0: any free port), report
    ``(host, bound_port)`` through ``task_status`` and answer scrapes of ``registry`` until cancelled. An address
    this host cannot listen on is a ConfigError naming ``metrics_listen``, as a bad value in the file is."""
    host, port = parse_host_port(listen, key="metrics_listen")
    try:
        listeners, bound_port = await open_listeners(host, port)
    except OSError as e:
        raise ConfigError(f"metrics_listen {listen!r} cannot be listened on: {e.strerror or e}") from None
    log.info("metrics endpoint listening host=%s port=%d path=%s", host, bound_port, METRICS_PATH.decode())
    server = _MetricsServer(registry)
    async with trio.open_nursery() as nursery:
        task_status.started((host, bound_port))
        await trio.serve_listeners(server.serve_connection, listeners, handler_nursery=nursery)


class _MetricsServer:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.connections = 0

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        try:
            if self.connections >= MAX_CONNECTIONS:
                log.warning("metrics connection refused: %d connections open already", self.connections)
                with trio.move_on_after(1.0):
                    await stream.send_all(_BUSY)
                return
            self.connections += 1
            try:
                await self._serve(stream)
            finally:
                self.connections -= 1
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            log.debug("metrics connection ended error=%s", e)
        finally:
            await trio.aclose_forcefully(stream)

    async def _serve(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES)
        while True:
            request = None
            with trio.move_on_after(REQUEST_TIMEOUT_S):
                try:
                    request = await _receive_request(stream, conn)
                except h11.RemoteProtocolError as e:
                    too_long = e.error_status_hint == http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE
                    text = (f"the request head exceeds {MAX_REQUEST_HEAD_BYTES} bytes" if too_long
                            else f"malformed HTTP request: {e}")
                    await _send(stream, conn, *_error(e.error_status_hint, text))
                    return
            if not isinstance(request, h11.Request):
                return  # closed by the client, or no whole request in time (idle or too slow)
            status, headers, body = await self._answer(request)
            if request.method == b"HEAD":
                await _send(stream, conn, status, headers, b"", content_length=len(body))
            else:
                await _send(stream, conn, status, headers, body)
            if status == http.HTTPStatus.OK:
                # The request's end: at hand, as a request without a body is answered 200 only.
                conn.next_event()
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return  # an error answer (connection: close), or the client asked to close
            conn.start_next_cycle()

    async def _answer(self, request: h11.Request) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        path = request.target.split(b"?", 1)[0]
        if path != METRICS_PATH:
            return _error(http.HTTPStatus.NOT_FOUND, f"no such path; metrics are at {METRICS_PATH.decode()}")
        if request.method not in ALLOWED_METHODS:
            status, headers, body = _error(http.HTTPStatus.METHOD_NOT_ALLOWED,
                                           f"{METRICS_PATH.decode()} answers GET and HEAD only")
            return status, headers + [(b"allow", b", ".join(ALLOWED_METHODS))], body
        if any(name in (b"content-length", b"transfer-encoding") and value != b"0"
               for name, value in request.headers):
            return _error(http.HTTPStatus.BAD_REQUEST, "a GET of /metrics carries no body")
        try:
            body = await render_exposition(self.registry)
        except Exception:
            log.exception("metrics collection failed")
            return _error(http.HTTPStatus.INTERNAL_SERVER_ERROR, "metrics collection failed; see the server log")
        return http.HTTPStatus.OK, [(b"content-type", CONTENT_TYPE_LATEST.encode())], body


async def render_exposition(registry: CollectorRegistry) -> bytes:
    """``generate_latest(registry)``, made a family at a time, and a big family ``EXPOSITION_CHUNK_SAMPLES`` samples
    at a time, with a checkpoint in between: the server's other tasks run while a big registry is formatted (a
    broker with 1,000 topics and five consumer groups has ~17,000 samples, ~100 ms of formatting)."""
    parts = []
    for family in registry.collect():
        samples = family.samples
        if len(samples) <= EXPOSITION_CHUNK_SAMPLES:
            parts.append(generate_latest(_Single(family)))
        else:
            for start in range(0, len(samples), EXPOSITION_CHUNK_SAMPLES):
                piece = copy.copy(family)
                piece.samples = samples[start:start + EXPOSITION_CHUNK_SAMPLES]
                text = generate_latest(_Single(piece))
                # Its HELP and TYPE lines once, before the first piece (each is one line: newlines are escaped).
                parts.append(text if start == 0 else text.split(b"\n", 2)[2])
                await trio.sleep(0)
        await trio.sleep(0)
    return b"".join(parts)


class _Single:
    """A collector of one family, for ``generate_latest``."""

    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> list[Metric]:
        return [self.family]


async def _receive_request(stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
    """The next request's head, or None once the client closed the connection. A head whose bytes pass
    ``MAX_REQUEST_HEAD_BYTES`` is refused 431: h11's own bound is checked only while a head is incomplete, so one
    that completed within the receive that passed it (up to ~12 KiB read 4 KiB at a time) was answered."""
    received = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(RECEIVE_CHUNK_BYTES)
            received += len(data)
            conn.receive_data(data)
        elif isinstance(event, h11.Request):
            if received > MAX_REQUEST_HEAD_BYTES:
                raise h11.RemoteProtocolError("request head too long",
                                              error_status_hint=http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
            return event
        elif isinstance(event, h11.ConnectionClosed):
            return None
        else:
            # Only a request's head or the end of the connection can come while the server waits for one.
            raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} before a request",
                                          error_status_hint=400)


def _error(status: int, text: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    return status, [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")], \
        (text + "\n").encode()


async def _send(stream: trio.SocketStream, conn: h11.Connection, status: int,
                headers: Sequence[tuple[bytes, bytes]], body: bytes, *, content_length: int | None = None) -> None:
    phrase = http.HTTPStatus(status).phrase.encode()
    length = len(body) if content_length is None else content_length
    data = conn.send(h11.Response(status_code=status, reason=phrase,
                                  headers=[*headers, (b"content-length", str(length).encode())]))
    if body:
        data += conn.send(h11.Data(data=body))
    data += conn.send(h11.EndOfMessage())
    with trio.move_on_after(SEND_TIMEOUT_S) as scope:
        await stream.send_all(data)
    if scope.cancelled_caught:
        log.debug("metrics answer not written within %.0f s; closing", SEND_TIMEOUT_S)
        raise trio.ClosedResourceError("the client did not read the answer")
