"""What the bench figures count, without a cluster: ``bench produce`` and ``bench consume`` driven against fake
clients on trio's mock clock (so the measured window is checked to the virtual second), ``bench rpc`` against an
echo handler in this process, the JSON line and the table, and ``bench store``'s message count."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
from functools import partial

import pytest
import trio
from rich.console import Console

import raftmq.bench.consume as consume_bench
import raftmq.bench.produce as produce_bench
from client import MessageQueue, SendFailedError, SendResult, SendStatus
from raftmq.bench.common import BenchError, print_json, print_table, summarize_latencies
from raftmq.bench.produce import CpuSample
from raftmq.bench.rpc import EchoHandler, run_rpc_client
from raftmq.bench.store import bench_mode
from remoting.codec import make_response
from remoting.codes import ResponseCode
from remoting.errors import RequestTimeoutError
from remoting.transport import serve_remoting

MQ = MessageQueue("BenchTopic", "broker-a", 0)


def _result(status: SendStatus = SendStatus.SEND_OK) -> SendResult:
    return SendResult(status, "uniq", "" if status is not SendStatus.SEND_OK else "offset-id", MQ, 0)


class FakeProducer:
    """Answers each send after ``send_s`` of (virtual) time with what ``answer(sends so far)`` says: a status, or
    an exception to raise."""

    def __init__(self, answer=lambda n: SendStatus.SEND_OK, send_s: float = 0.01) -> None:
        self.answer, self.send_s = answer, send_s
        self.sizes: list[int] = []  # messages per send, in order

    async def _send(self, n: int) -> SendResult:
        self.sizes.append(n)
        outcome = self.answer(len(self.sizes))
        await trio.sleep(self.send_s)
        if isinstance(outcome, BaseException):
            raise outcome
        return _result(outcome)

    async def send(self, message) -> SendResult:
        return await self._send(1)

    async def send_batch(self, messages) -> SendResult:
        return await self._send(len(messages))


@pytest.fixture
def samples(monkeypatch) -> list[float]:
    """The (virtual) times the bench took its CPU samples at; no cluster, no machine timing."""
    taken: list[float] = []

    async def cpu_sample(namesrv):
        taken.append(trio.current_time())
        return CpuSample(0.0, {})

    async def ensure_topic(*args, **kwargs):
        pass

    for module in (produce_bench, consume_bench):
        monkeypatch.setattr(module, "cpu_sample", cpu_sample)
        monkeypatch.setattr(module, "machine_speed", dict)
        monkeypatch.setattr(module, "ensure_topic", ensure_topic)
    return taken


def _with_producer(monkeypatch, producer: FakeProducer) -> None:
    @contextlib.asynccontextmanager
    async def open_producer(*args, **kwargs):
        yield producer

    monkeypatch.setattr(produce_bench, "open_producer", open_producer)


def _produce_args(**overrides) -> argparse.Namespace:
    args = dict(topic="BenchTopic", queues=8, size=16, concurrency=4, seconds=30.0, batch=1, auto_batch=False,
                send_timeout_ms=None, messages=10_000_000, warmup_seconds=0.0)
    return argparse.Namespace(**{**args, **overrides})


async def test_a_run_bounded_by_messages_ends_with_its_last_send_and_sends_exactly_that_many(
        monkeypatch, samples, autojump_clock):
    producer = FakeProducer()
    _with_producer(monkeypatch, producer)
    start = trio.current_time()
    report = await produce_bench.produce("ns", _produce_args(messages=100))
    # 4 senders, 0.01 s a send: 100 messages take 0.25 s. It was reported as --seconds (30), and the second CPU
    # sample taken then: msgs/s and CPU per message read 120 times too low.
    assert [t - start for t in samples] == [pytest.approx(0), pytest.approx(0.25)]
    assert report.elapsed_s == pytest.approx(0.25)
    # Exactly --messages: every sender checked the count before its send, so up to concurrency - 1 more went.
    assert report.messages == 100 and sum(producer.sizes) == 100 and report.latency.count == 100
    assert report.msgs_per_s == pytest.approx(400)


async def test_batches_stop_at_exactly_messages_with_a_last_partial_batch(monkeypatch, samples, autojump_clock):
    producer = FakeProducer()
    _with_producer(monkeypatch, producer)
    report = await produce_bench.produce("ns", _produce_args(messages=100, batch=32))
    # Was 4 sends of 32 (128): every sender checked the count before sending, none reserved what it sent.
    assert report.messages == 100 and sorted(producer.sizes) == [4, 32, 32, 32]


async def test_only_send_ok_is_acknowledged_the_rest_are_errors_by_status(monkeypatch, samples, autojump_clock):
    # Every third send: the broker's Raft commit timed out (outcome unknown), answered, not raised.
    producer = FakeProducer(lambda n: SendStatus.FLUSH_SLAVE_TIMEOUT if n % 3 == 0 else SendStatus.SEND_OK)
    _with_producer(monkeypatch, producer)
    report = await produce_bench.produce("ns", _produce_args(messages=60, concurrency=1))
    timed_out = producer.sizes.count(1) - 60
    assert timed_out > 0 and report.messages == 60 and report.latency.count == 60
    assert report.errors == timed_out and report.error_kinds == {"FLUSH_SLAVE_TIMEOUT": timed_out}


async def test_warm_up_errors_are_reported_apart_from_the_window(monkeypatch, samples, autojump_clock):
    start = trio.current_time()

    def answer(n):  # the cluster refuses sends for the first half second: the warm-up's
        if trio.current_time() - start < 0.5:
            return SendFailedError("no", attempts=1, last_error=RequestTimeoutError("a:1", 1.0), topic="BenchTopic")
        return SendStatus.SEND_OK

    _with_producer(monkeypatch, FakeProducer(answer))
    report = await produce_bench.produce("ns", _produce_args(seconds=1.0, warmup_seconds=1.0))
    assert report.errors == 0 and report.error_kinds == {} and report.messages > 0
    assert report.warmup_errors > 0 and report.warmup_error_kinds == {"RequestTimeoutError": report.warmup_errors}


async def test_nothing_acknowledged_is_a_bench_error_naming_why_and_failures_are_paced(
        monkeypatch, samples, autojump_clock):
    error = SendFailedError("no", attempts=1, last_error=RequestTimeoutError("a:1", 1.0), topic="BenchTopic")
    producer = FakeProducer(lambda n: error, send_s=0.0)
    _with_producer(monkeypatch, producer)
    with pytest.raises(BenchError, match=r"no send was acknowledged .*: (\d+) failed \(\1 RequestTimeoutError\)"):
        await produce_bench.produce("ns", _produce_args(seconds=2.0))
    # Each sender pauses after a failure, 10 ms doubling to 1 s: 8 or 9 sends each in 2 s, not as many as the loop
    # could spin (and the run exited 0 with msgs/s 0).
    assert 4 <= len(producer.sizes) <= 4 * 20


class FakePushConsumer:
    """Pulls part of the backlog as it opens (as the push consumer's first rebalance does), then hands out one
    message per millisecond."""

    def __init__(self, messages: int, open_s: float) -> None:
        self.messages, self.open_s = messages, open_s

    def __aiter__(self) -> FakePushConsumer:
        return self

    async def __anext__(self):
        if not self.messages:
            raise StopAsyncIteration
        self.messages -= 1
        await trio.sleep(0.001)
        return type("Msg", (), {"born_timestamp": 0})()


async def test_the_consume_window_opens_before_the_consumer_does(monkeypatch, samples, autojump_clock):
    consumer = FakePushConsumer(1000, open_s=2.0)

    @contextlib.asynccontextmanager
    async def open_push_consumer(*args, **kwargs):
        await trio.sleep(consumer.open_s)  # starting, and pulling from the backlog meanwhile
        yield consumer

    async def produce_backlog(namesrv, args, sent):
        sent["n"] = args.messages
        await trio.sleep_forever()

    monkeypatch.setattr(consume_bench, "open_push_consumer", open_push_consumer)
    monkeypatch.setattr(consume_bench, "_produce", produce_backlog)
    args = argparse.Namespace(topic="T", queues=8, size=16, messages=1000, seconds=60.0, pull_batch=64, live=False,
                              simple=0, ack_batch=False)
    report = await consume_bench.consume("ns", args)
    # Was 1 s (the window opened once the consumer was open): 1000 msgs/s where 333 were consumed per second.
    assert report.messages == 1000 and report.elapsed_s == pytest.approx(3.0)
    assert samples[1] - samples[0] == pytest.approx(3.0)


async def test_rpc_warm_up_failures_do_not_count_as_the_windows_errors(nursery):
    opened = []

    class RefusingAtFirst(EchoHandler):
        # Refuses for 0.1 s after the first request (which must be echoed: it checks the server is one).
        async def handle(self, request, conn):
            now = trio.current_time()
            if opened and now - opened[0] < 0.1:
                return make_response(request, ResponseCode.SYSTEM_BUSY, remark="warming up")
            opened.append(now)
            return await super().handle(request, conn)

    host, port = await nursery.start(partial(serve_remoting, RefusingAtFirst(), "127.0.0.1", 0))
    result = await run_rpc_client(f"{host}:{port}", size=16, concurrency=4, seconds=0.2, warmup_s=0.3)
    # Every refusal answered a request started in the warm-up (it ends 0.3 s after the first answer).
    assert result.errors == 0 and result.requests > 0
    assert result.warmup_errors > 0


def test_json_has_null_where_a_figure_is_not_a_number(capsys):
    print_json(latency=summarize_latencies([]), rate=float("inf"), nested={"cpu": [float("nan"), 1.5]})
    line = capsys.readouterr().out

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    parsed = json.loads(line, parse_constant=refuse)
    assert parsed["latency"] == {"count": 0, "mean_ms": None, "p50_ms": None, "p90_ms": None, "p99_ms": None,
                                 "max_ms": None}
    assert parsed["rate"] is None and parsed["nested"] == {"cpu": [None, 1.5]}


def test_the_table_prints_flags_as_true_and_false_not_1_and_0():
    out = io.StringIO()
    print_table(Console(file=out, width=100), "t", [("live", True), ("auto_batch", False), ("messages", 12345),
                                                    ("seconds", 1.5)])
    lines = out.getvalue().replace("│", "|").replace("┃", "|").splitlines()
    cells = {tuple(line.split("|")[1:3]) for line in lines}
    rows = {name.strip(): value.strip() for name, value in (c for c in cells if len(c) == 2)}
    assert rows == {"metric": "value", "live": "true", "auto_batch": "false", "messages": "12,345",
                    "seconds": "1.500"}


def test_bench_store_stores_exactly_messages_with_a_last_short_batch(tmp_path):
    result = bench_mode("ASYNC_FLUSH", size=64, batch=64, messages=100, queues=2, segment_size_mb=8,
                        parent=str(tmp_path))
    assert result.messages == 100  # was 64: --messages rounded down to a multiple of --batch
    small = bench_mode("ASYNC_FLUSH", size=64, batch=64, messages=10, queues=2, segment_size_mb=8,
                       parent=str(tmp_path))
    assert small.messages == 10  # was a whole batch of 64
    assert dataclasses.asdict(small)["commit_log_bytes"] < dataclasses.asdict(result)["commit_log_bytes"]
