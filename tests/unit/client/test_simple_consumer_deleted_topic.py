"""A simple consumer subscribed to a topic an admin deleted goes on receiving its other topics (the in-memory fake
cluster, on trio's MockClock): the refused pair is passed over and the long poll goes to one that answered; a
receive raises only when every pair failed; the deleted topic's route is dropped in time (client/route.py)."""

from __future__ import annotations

import pytest
import trio

import client.simple_consumer
from client import NoRouteError, open_simple_consumer
from client.route import UNKNOWN_TOPIC_GRACE_S
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import TopicNotExistError
from tests.unit.client.fake_cluster import NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx


@pytest.fixture
def cluster(monkeypatch):
    """One group with topics A and B; a POP finds nothing and is answered at once, TOPIC_NOT_EXIST (or, for the
    topics in ``fake.unreadable``, NO_PERMISSION) once its topic is deleted (``fake.unknown_topics``)."""
    fake = FakeRemoting([FakeGroup("broker-a", ["a:1"])])
    fake.unreadable = set()
    fake.pops = []  # (topic, poll_time_ms, answer code)
    answer = fake.invoke

    async def invoke(addr, request, timeout_s=3.0):
        if request.code == RequestCode.POP_MESSAGE:
            await trio.lowlevel.checkpoint()
            topic = request.ext["topic"]
            code = (ResponseCode.TOPIC_NOT_EXIST if topic in fake.unknown_topics else
                    ResponseCode.NO_PERMISSION if topic in fake.unreadable else ResponseCode.PULL_NOT_FOUND)
            fake.pops.append((topic, request.ext["poll_time_ms"], code))
            return make_response(request, code, remark="refused" if code else "none")
        return await answer(addr, request, timeout_s)

    fake.invoke = invoke
    monkeypatch.setattr(client.simple_consumer, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    return fake


async def test_a_deleted_topic_keeps_no_other_from_being_received(cluster, autojump_clock):
    # Every receive raised TopicNotExistError at A, for good, and B was never long-polled.
    async with open_simple_consumer(NAMESRV, consumer_group="G", subscriptions={"A": "*", "B": "*"},
                                    await_duration_ms=1_000, poll_name_server_interval_ms=5_000) as consumer:
        assert await consumer.receive(4) == []
        cluster.unknown_topics.add("A")  # deleted: the brokers refuse its POPs, the name server forgets it
        cluster.pops.clear()
        for _ in range(4):
            assert await consumer.receive(4) == []
        long_polls = [topic for topic, poll_ms, _code in cluster.pops if poll_ms > 0]
        assert long_polls == ["B"] * 4
        assert ("A", 0, ResponseCode.TOPIC_NOT_EXIST) in cluster.pops
        # Its route is asked for again (each refusal refreshes it) and, unknown for the grace, dropped: no more
        # POPs of A, B still received.
        start = trio.current_time()
        while consumer._instance.routes.cached("A") is not None:
            assert await consumer.receive(4) == []
            await trio.sleep(1)
            assert trio.current_time() - start < UNKNOWN_TOPIC_GRACE_S * 2, "A's route was kept"
        cluster.pops.clear()
        for _ in range(3):
            assert await consumer.receive(4) == []
        assert {topic for topic, _poll_ms, _code in cluster.pops} == {"B"}


async def test_a_topic_not_readable_is_passed_over_for_the_long_poll(cluster, autojump_clock):
    async with open_simple_consumer(NAMESRV, consumer_group="G", subscriptions={"A": "*", "B": "*"},
                                    await_duration_ms=1_000) as consumer:
        cluster.unreadable.add("A")
        for _ in range(4):
            assert await consumer.receive(4) == []
        assert [topic for topic, poll_ms, _code in cluster.pops if poll_ms > 0] == ["B"] * 4


async def test_receive_raises_when_every_subscribed_topic_is_deleted(cluster, autojump_clock):
    async with open_simple_consumer(NAMESRV, consumer_group="G", subscriptions={"A": "*", "B": "*"},
                                    await_duration_ms=1_000) as consumer:
        cluster.unknown_topics.update(("A", "B"))
        with pytest.raises(TopicNotExistError):
            await consumer.receive(4)
        assert not [poll_ms for _topic, poll_ms, _code in cluster.pops if poll_ms > 0]
        await trio.sleep(UNKNOWN_TOPIC_GRACE_S + 1)
        for _ in range(3):  # the routes refreshed past the grace are dropped: no route is left
            try:
                await consumer.receive(4)
            except TopicNotExistError:
                await trio.sleep(UNKNOWN_TOPIC_GRACE_S / 2)
                continue
            except NoRouteError:
                break
        with pytest.raises(NoRouteError, match="no name server knows topic"):
            await consumer.receive(4)


async def test_a_long_poll_refused_after_the_quick_pass_answers_nothing_found(cluster, autojump_clock):
    # Deleted between the quick pass (which found it empty) and the long poll: the receive found nothing, it did
    # not fail (the other topic answered).
    answer = cluster.invoke

    async def invoke(addr, request, timeout_s=3.0):
        if request.code == RequestCode.POP_MESSAGE and request.ext["poll_time_ms"] > 0:
            cluster.unknown_topics.add(request.ext["topic"])
        return await answer(addr, request, timeout_s)

    cluster.invoke = invoke
    async with open_simple_consumer(NAMESRV, consumer_group="G", subscriptions={"A": "*", "B": "*"},
                                    await_duration_ms=1_000) as consumer:
        assert await consumer.receive(4) == []
        ((deleted, _poll_ms, code),) = [pop for pop in cluster.pops if pop[1] > 0]
        assert code == ResponseCode.TOPIC_NOT_EXIST
        assert await consumer.receive(4) == []  # the other one is long-polled now
        assert [topic for topic, poll_ms, _code in cluster.pops if poll_ms > 0][1] != deleted
