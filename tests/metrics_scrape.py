"""Scraping a ``/metrics`` endpoint from tests over a plain trio socket: raw HTTP/1.1 out, a small parse of the
answer in (status, headers, body), and the body parsed back with prometheus-client's own text parser."""

from __future__ import annotations

import dataclasses

import trio
from prometheus_client.parser import text_string_to_metric_families


@dataclasses.dataclass
class HttpAnswer:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes
    closed: bool  # the server closed the connection after the answer


async def read_answer(stream: trio.SocketStream, *, timeout_s: float = 10.0) -> HttpAnswer:
    """One HTTP answer from ``stream``: the head, then content-length bytes of body."""
    data = b""
    with trio.fail_after(timeout_s):
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            assert chunk, f"connection closed before a whole answer head: {data!r}"
            data += chunk
        head, _, data = data.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        version, status, _reason = status_line.split(" ", 2)
        assert version == "HTTP/1.1", status_line
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers["content-length"])
        while len(data) < length:
            chunk = await stream.receive_some(65536)
            assert chunk, f"connection closed after {len(data)} of {length} body bytes"
            data += chunk
    closed = headers.get("connection", "").lower() == "close"
    return HttpAnswer(int(status), headers, data[:length], closed)


async def exchange(addr: tuple[str, int] | str, request: bytes, *, timeout_s: float = 10.0) -> HttpAnswer:
    """Send ``request`` (raw bytes) on a new connection and read one answer."""
    host, port = _split(addr)
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(request)
        return await read_answer(stream, timeout_s=timeout_s)


async def scrape(addr: tuple[str, int] | str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """GET /metrics: ``{sample name: [(labels, value), ...]}``, every family parsed back."""
    answer = await exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n")
    assert answer.status == 200, answer
    return parse_samples(answer.body.decode())


def parse_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float | None:
    """The value of the one sample of ``name`` whose labels include ``labels``; None if there is none."""
    found = [v for sample_labels, v in samples.get(name, []) if labels.items() <= sample_labels.items()]
    assert len(found) <= 1, f"{name} {labels} matches {len(found)} samples"
    return found[0] if found else None


def _split(addr: tuple[str, int] | str) -> tuple[str, int]:
    if isinstance(addr, tuple):
        return addr
    host, _, port = addr.rpartition(":")
    return host, int(port)
