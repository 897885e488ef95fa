"""A simple consumer subscribed to a topic that does not exist yet receives its other topics (the in-memory fake
cluster, on trio's MockClock), finds the new topic once it is created, and raises only when no topic is routed."""

from __future__ import annotations

import pytest
import trio

import client.simple_consumer
from client import NoRouteError, open_simple_consumer
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from tests.unit.client.fake_cluster import NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx


@pytest.fixture
def cluster(monkeypatch):
    """One group; topic B unknown to the name server; a POP finds nothing and is answered at once."""
    fake = FakeRemoting([FakeGroup("broker-a", ["a:1"])])
    fake.unknown_topics.add("B")
    answer = fake.invoke

    async def invoke(addr, request, timeout_s=3.0):
        if request.code == RequestCode.POP_MESSAGE:
            await trio.lowlevel.checkpoint()
            fake.calls.append((addr, request.ext["topic"]))
            return make_response(request, ResponseCode.PULL_NOT_FOUND, remark="none")
        return await answer(addr, request, timeout_s)

    fake.invoke = invoke
    monkeypatch.setattr(client.simple_consumer, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    return fake


def _pops(fake: FakeRemoting, topic: str) -> int:
    return sum(1 for _, what in fake.calls if what == topic)


def _route_queries(fake: FakeRemoting) -> int:
    return sum(1 for _, what in fake.calls if what == RequestCode.GET_ROUTEINFO_BY_TOPIC)


async def test_a_subscribed_topic_not_created_yet_keeps_no_other_from_being_received(cluster, autojump_clock):
    # Every receive raised NoRouteError for B: A was never received.
    async with open_simple_consumer(NAMESRV, consumer_group="G", subscriptions={"A": "*", "B": "*"},
                                    await_duration_ms=0, poll_name_server_interval_ms=1_000) as consumer:
        for _ in range(3):
            assert await consumer.receive(4) == []
        assert _pops(cluster, "A") == 3
        queries = _route_queries(cluster)
        for _ in range(3):  # within the interval: B is not asked for again by each receive
            await consumer.receive(4)
        assert _route_queries(cluster) == queries
        # Created: the background refresh finds it once the interval is over, and B is received too.
        cluster.unknown_topics.discard("B")
        await trio.sleep(1.5)
        await consumer.receive(4)
        await trio.sleep(0.1)
        await consumer.receive(4)
        assert _pops(cluster, "B") >= 1


async def test_receive_raises_when_no_subscribed_topic_is_routed(cluster, autojump_clock):
    cluster.unknown_topics.add("A")
    async with open_simple_consumer(NAMESRV, consumer_group="G", subscriptions={"A": "*", "B": "*"},
                                    await_duration_ms=0) as consumer:
        for _ in range(2):
            with pytest.raises(NoRouteError, match="no name server knows topic"):
                await consumer.receive(4)
