"""A send whose NOT_LEADER redirects run out moves to another group (the in-memory fake cluster)."""

from __future__ import annotations

import pytest
import trio

import client.producer
from client import Message, MessageQueue, SendFailedError, open_producer
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from tests.unit.client.fake_cluster import NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx


@pytest.fixture
def cluster(monkeypatch):
    fake = FakeRemoting([FakeGroup("broker-a", ["a:1", "a:2", "a:3"]), FakeGroup("broker-b", ["b:1", "b:2", "b:3"])])
    monkeypatch.setattr(client.producer, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    return fake


def _name_each_other(fake: FakeRemoting) -> None:
    """a:1 and a:2 each answer a send NOT_LEADER naming the other (a stale leader cut off in a partition and a
    node that still believes in it)."""
    answer = fake.invoke

    async def invoke(addr, request, timeout_s=3.0):
        if request.code == RequestCode.SEND_MESSAGE and addr in ("a:1", "a:2"):
            fake.calls.append((addr, request.code))
            return make_response(request, ResponseCode.NOT_LEADER, remark="not leader",
                                 ext={"leader_addr": "a:2" if addr == "a:1" else "a:1"})
        return await answer(addr, request, timeout_s)

    fake.invoke = invoke


async def test_a_send_whose_redirects_run_out_goes_to_another_group(cluster, autojump_clock):
    # The retry kept the queue while the last error named a leader, so it went back to the same group and followed
    # the same hint: each send that started on broker-a failed after its retries, broker-b never tried.
    _name_each_other(cluster)
    async with open_producer(NAMESRV, max_redirects=3) as p:
        results = [await p.send(Message("T", b"x%d" % i)) for i in range(8)]
        stats = p.statistics()
    assert {r.message_queue.broker_name for r in results} == {"broker-b"}
    assert stats.failed == 0 and stats.redirects > 0  # some started on broker-a, and left it
    assert any(addr in ("a:1", "a:2") for addr, _ in cluster.calls)


async def test_a_queue_the_caller_pinned_stays_pinned_when_its_redirects_run_out(cluster, autojump_clock):
    _name_each_other(cluster)
    async with open_producer(NAMESRV, max_redirects=2, send_msg_timeout_ms=500) as p:
        with pytest.raises(SendFailedError, match="NOT_LEADER"):
            await p.send(Message("T", b"x"), queue=MessageQueue("T", "broker-a", 1))
    assert not any(addr.startswith("b:") for addr, code in cluster.calls if code == RequestCode.SEND_MESSAGE)


async def test_a_oneway_send_that_timed_out_keeps_the_next_ones_off_its_group(cluster, autojump_clock):
    # A oneway left waiting its whole timeout (a leader that stopped reading) told nobody: the fault tracker kept
    # picking that group for the next oneway sends, each of which waited its whole timeout too.
    from remoting.errors import RequestTimeoutError

    answer = cluster.invoke_oneway
    stuck: list[str] = []

    async def invoke_oneway(addr, request):
        if addr.startswith("a:"):
            stuck.append(addr)
            await trio.sleep_forever()  # the write queue of a leader that stopped reading never has room
        return await answer(addr, request)

    cluster.invoke_oneway = invoke_oneway
    async with open_producer(NAMESRV, send_msg_timeout_ms=3000) as p:
        outcomes = []
        for i in range(8):
            try:
                await p.send_oneway(Message("T", b"x%d" % i))
                outcomes.append("sent")
            except RequestTimeoutError:
                outcomes.append("timed out")
    assert outcomes.count("timed out") == 1 and len(stuck) == 1, (outcomes, stuck)
