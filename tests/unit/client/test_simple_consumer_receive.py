"""The simple consumer's receive against the in-memory fake cluster, on trio's MockClock: a receive that finds no
readable queue waits (asking the name servers again, at a bounded rate) instead of returning at once, and a POP
held by the leader for its await duration is a long poll to the leader watch, not silence."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import client.simple_consumer
from client import ClientClosedError, open_simple_consumer
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from tests.unit.client.fake_cluster import NAMESRV, FakeConnection, FakeGroup, FakeRemoting, fake_remoting_ctx

WRITE_ONLY, READ_WRITE = 2, 6  # a topic's perm (update_topic_perm)


@pytest.fixture
def cluster(monkeypatch):
    """Two broker groups serving topic T with ``cluster.perm``. A POP finds nothing: it is answered at once when it
    asks not to wait, else held for its ``poll_time_ms`` (waiting on its connection, where the leader watch looks)
    as a broker holds it. Recorded in ``cluster.pops``: (addr, poll_time_ms, the client's timeout_s)."""
    fake = FakeRemoting([FakeGroup("broker-a", ["a:1", "a:2", "a:3"]), FakeGroup("broker-b", ["b:1", "b:2", "b:3"])])
    monkeypatch.setattr(client.simple_consumer, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    fake.perm = READ_WRITE
    fake.pops = []
    route, answer = fake.route, fake.invoke

    def route_with_perm(topic: str) -> dict:
        data = route(topic)
        for queue_data in data["queue_datas"]:
            queue_data["perm"] = fake.perm
        return data

    async def invoke(addr, request, timeout_s=3.0):
        if request.code != RequestCode.POP_MESSAGE:
            return await answer(addr, request, timeout_s)
        await trio.lowlevel.checkpoint()
        fake.calls.append((addr, request.code))
        poll_time_ms = request.ext["poll_time_ms"]
        fake.pops.append((addr, poll_time_ms, timeout_s))
        conn = fake.conns.setdefault(addr, FakeConnection())
        key = object()
        conn.waiting[key] = (trio.current_time(), request.code, trio.Event())
        try:
            await trio.sleep(poll_time_ms / 1000)
        finally:
            del conn.waiting[key]
        conn.last_received_at = trio.current_time()
        return make_response(request, ResponseCode.PULL_NOT_FOUND, remark="no new message")

    fake.route, fake.invoke = route_with_perm, invoke
    return fake


def _count(cluster, code: int) -> int:
    return sum(1 for _, c in cluster.calls if c == code)


async def test_with_no_readable_queue_a_receive_waits_asking_for_the_route_until_reads_come_back(
        cluster, autojump_clock):
    # The topic made write-only: receive returned [] without a checkpoint, so `while True: receive()` never let
    # the heartbeats or route refreshes run (a million receives in 2 s on a real broker).
    cluster.perm = WRITE_ONLY
    async with open_simple_consumer(NAMESRV, consumer_group="G", subscriptions={"T": "*"},
                                    await_duration_ms=2_000) as consumer:
        queries = _count(cluster, RequestCode.GET_ROUTEINFO_BY_TOPIC)
        start = trio.current_time()
        assert await consumer.receive() == []
        assert trio.current_time() - start >= 2.0
        asked = _count(cluster, RequestCode.GET_ROUTEINFO_BY_TOPIC) - queries
        assert 1 <= asked <= 3  # once a second (at 0, 1 and 2 s), not once per loop of a spin
        assert cluster.pops == []

        # Read permission comes back while a receive waits: its next route query (at 3 s) sees it, and what is
        # left of its 2 s goes to the brokers: each group's leader asked without waiting, then a long poll.
        async def restore() -> None:
            await trio.sleep(0.5)
            cluster.perm = READ_WRITE

        async with trio.open_nursery() as nursery:
            nursery.start_soon(restore)
            assert await consumer.receive() == []
        assert [(addr, poll) for addr, poll, _ in cluster.pops[:2]] == [("a:1", 0), ("b:1", 0)]
        assert len(cluster.pops) == 3 and 0 < cluster.pops[2][1] <= 1_000


async def test_with_no_readable_queue_and_no_await_a_receive_still_yields_and_asks_once_a_second(
        cluster, autojump_clock):
    cluster.perm = WRITE_ONLY
    async with open_simple_consumer(NAMESRV, consumer_group="G", subscriptions={"T": "*"},
                                    await_duration_ms=0) as consumer:
        queries = _count(cluster, RequestCode.GET_ROUTEINFO_BY_TOPIC)
        for _ in range(3):
            with trio.testing.assert_checkpoints():
                assert await consumer.receive() == []
        assert _count(cluster, RequestCode.GET_ROUTEINFO_BY_TOPIC) - queries == 1
        await trio.sleep(1)
        assert await consumer.receive() == []
        await trio.testing.wait_all_tasks_blocked()  # the refresh it started runs in the consumer's background
        assert _count(cluster, RequestCode.GET_ROUTEINFO_BY_TOPIC) - queries == 2


async def test_a_pop_the_leader_holds_is_a_long_poll_not_silence(cluster, autojump_clock):
    # Counted as a request the leader did not answer, every idle receive had the leader watch ask the name servers
    # and the group's other nodes four times a second from its first second on (31 route queries in two idle 5 s
    # receives on a real broker).
    async with open_simple_consumer(NAMESRV, consumer_group="G", subscriptions={"T": "*"}, await_duration_ms=5_000,
                                    leader_silence_timeout_ms=50) as consumer:
        queries = _count(cluster, RequestCode.GET_ROUTEINFO_BY_TOPIC)
        assert await consumer.receive() == []
        assert [poll for _, poll, _ in cluster.pops] == [0, 0, 5_000]
        # What bounds a held POP instead: its own timeout, the request timeout plus the time it asked to be held.
        assert cluster.pops[-1][2] == pytest.approx(3.0 + 5.0)
        assert _count(cluster, RequestCode.GET_ROUTEINFO_BY_TOPIC) == queries
        assert _count(cluster, RequestCode.GET_BROKER_RUNTIME_INFO) == 0


async def test_a_name_server_dropping_requests_does_not_hold_a_receive_past_its_await_duration(
        cluster, autojump_clock):
    # The routes were refreshed in the receive, topic after topic, each query waiting out its request timeout
    # (3 s) against a name server that answers nothing: a 200 ms receive took 6 s.
    cluster.perm = WRITE_ONLY
    answered = []
    invoke = cluster.invoke

    async def invoke_noting_route_answers(addr, request, timeout_s=3.0):
        try:
            return await invoke(addr, request, timeout_s)
        finally:
            if request.code == RequestCode.GET_ROUTEINFO_BY_TOPIC:
                answered.append(request.ext["topic"])

    cluster.invoke = invoke_noting_route_answers
    async with open_simple_consumer(NAMESRV, consumer_group="G", subscriptions={"T": "*", "U": "*"},
                                    await_duration_ms=200) as consumer:
        answered.clear()
        cluster.hung.add(NAMESRV)
        queries = _count(cluster, RequestCode.GET_ROUTEINFO_BY_TOPIC)
        start = trio.current_time()
        assert await consumer.receive() == []
        assert trio.current_time() - start >= 0.2
        assert answered == []  # it returned with the query still out, not when the name server gave up on it
        # The query still out is not asked again by the next receives, however many.
        for _ in range(3):
            assert await consumer.receive() == []
        assert _count(cluster, RequestCode.GET_ROUTEINFO_BY_TOPIC) - queries == 1 and answered == []


async def test_a_receive_looks_at_the_routes_each_time_it_wakes(cluster, autojump_clock):
    # Woken by its deadline with no refresh due, it returned [] without looking: a readable queue another refresh
    # had brought meanwhile waited for the next receive.
    cluster.perm = WRITE_ONLY
    async with open_simple_consumer(NAMESRV, consumer_group="G", subscriptions={"T": "*"},
                                    await_duration_ms=1_500) as consumer:
        async def refresh_elsewhere() -> None:
            await trio.sleep(1.2)  # after the receive's second refresh (at 1 s), before its deadline
            cluster.perm = READ_WRITE
            await consumer._instance.routes.refresh("T")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(refresh_elsewhere)
            assert await consumer.receive() == []
        # At its deadline it saw the queues, and asked each group's leader without waiting.
        assert [(addr, poll) for addr, poll, _ in cluster.pops] == [("a:1", 0), ("b:1", 0)]
        cluster.perm = WRITE_ONLY  # closed, it waited for routes it could no longer ask for, and returned []
        await consumer._instance.routes.refresh("T")
    with pytest.raises(ClientClosedError, match="the simple consumer is closed"):
        await consumer.receive()


async def test_a_receive_waiting_when_its_consumer_closes_raises_that_it_is_closed(cluster, autojump_clock):
    cluster.perm = WRITE_ONLY
    raised = []

    async def receive(consumer) -> None:
        with pytest.raises(ClientClosedError, match="the simple consumer is closed") as error:
            await consumer.receive()
        raised.append(error.value)

    async with trio.open_nursery() as nursery:
        async with open_simple_consumer(NAMESRV, consumer_group="G", subscriptions={"T": "*"},
                                        await_duration_ms=5_000) as consumer:
            nursery.start_soon(receive, consumer)
            await trio.sleep(0.5)  # between two route refreshes of the receive
    assert len(raised) == 1
