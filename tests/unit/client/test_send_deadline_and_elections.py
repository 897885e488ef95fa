"""The producer's send against the in-memory fake cluster: the deadline covers route lookups and auto-create, a
oneway send auto-creates an unknown topic as ``send`` does, and a send waits for the election of the only group
with writable queues (a read-only group in the route is no other group), counting those tries in its error."""

from __future__ import annotations

import pytest
import trio

import client.producer
from client import Message, SendFailedError, open_producer
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import ConnectError, RequestTimeoutError
from tests.unit.client.fake_cluster import NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx

READ_ONLY = 4  # a topic's perm: PERM_READ only


def _patch(monkeypatch, fake: FakeRemoting) -> FakeRemoting:
    monkeypatch.setattr(client.producer, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    return fake


def _sends_to(fake: FakeRemoting, prefix: str) -> int:
    return sum(1 for addr, code in fake.calls if code == RequestCode.SEND_MESSAGE and addr.startswith(prefix))


async def test_a_send_waits_for_the_election_of_the_only_writable_group_beside_a_read_only_one(monkeypatch,
                                                                                               autojump_clock):
    # len(route.queue_datas) counted broker-b, read-only for the topic: the send spent its retries in 150 ms on the
    # electing broker-a and failed, where with broker-b absent it waited for the new leader.
    fake = _patch(monkeypatch, FakeRemoting([FakeGroup("broker-a", ["a:1", "a:2", "a:3"]),
                                             FakeGroup("broker-b", ["b:1"])]))
    route, answer = fake.route, fake.invoke

    def route_with_read_only_b(topic: str) -> dict:
        data = route(topic)
        for queue_data in data["queue_datas"]:
            if queue_data["broker_name"] == "broker-b":
                queue_data["perm"] = READ_ONLY
        return data

    electing_until = [None]

    async def invoke(addr, request, timeout_s=3.0):
        until = electing_until[0]
        if until is not None and request.code == RequestCode.SEND_MESSAGE and addr.startswith("a:"):
            if trio.current_time() < until:
                fake.calls.append((addr, request.code))
                if addr == "a:1":
                    raise ConnectError(addr, "connection refused")
                return make_response(request, ResponseCode.NOT_LEADER, remark="no leader yet", ext={})
            fake.groups[0].leader = "a:2"
        return await answer(addr, request, timeout_s)

    fake.route, fake.invoke = route_with_read_only_b, invoke
    async with open_producer(NAMESRV, send_msg_timeout_ms=5_000) as p:
        await p.send(Message("T", b"warm"))
        electing_until[0] = trio.current_time() + 1.0
        result = await p.send(Message("T", b"x"))
    assert result.message_queue.broker_name == "broker-a"
    assert _sends_to(fake, "b:") == 0


async def test_the_deadline_of_a_send_covers_its_route_lookup(monkeypatch, autojump_clock):
    # publish_info ran unbounded: a silent name server held a 300 ms send for its request timeout per query (6 s).
    fake = _patch(monkeypatch, FakeRemoting([FakeGroup("broker-a", ["a:1"])]))
    async with open_producer(NAMESRV, send_msg_timeout_ms=300) as p:
        fake.hung.add(NAMESRV)
        with pytest.raises(SendFailedError, match="while fetching the route of topic 'New'") as caught:
            await p.send(Message("New", b"x"))
        fake.hung.discard(NAMESRV)
    assert isinstance(caught.value.last_error, trio.TooSlowError)
    assert caught.value.retriable is False and caught.value.attempts == 0


async def test_what_the_route_lookup_took_is_not_given_again_to_the_send(monkeypatch):
    # The attempt's timeout was the time left before the lookup: a 0.5 s lookup and a silent leader made a 1 s send
    # take 1.5 s. (The send's deadline is on the real clock, so this runs on it: ~1 s.)
    fake = _patch(monkeypatch, FakeRemoting([FakeGroup("broker-a", ["a:1"])]))
    answer = fake.invoke
    given: list[float] = []

    async def slow_routes(addr, request, timeout_s=3.0):
        if request.code == RequestCode.GET_ROUTEINFO_BY_TOPIC:
            await trio.sleep(0.5)
        elif request.code == RequestCode.SEND_MESSAGE:
            given.append(timeout_s)
        return await answer(addr, request, timeout_s)

    fake.invoke = slow_routes
    async with open_producer(NAMESRV, send_msg_timeout_ms=1000, retry_times_when_send_failed=0) as p:
        fake.hung.add("a:1")
        with pytest.raises(SendFailedError):
            await p.send(Message("T", b"x"))
        fake.hung.discard("a:1")
    # What the lookup left of the second: it can only be less than this, never the whole second again.
    assert given and given[0] <= 0.5 + 1e-3, given


async def test_the_deadline_of_a_send_covers_the_cluster_info_of_an_auto_created_topic(monkeypatch, autojump_clock):
    fake = _patch(monkeypatch, FakeRemoting([FakeGroup("broker-a", ["a:1"])]))
    fake.unknown_topics.add("New")
    answer = fake.invoke

    async def invoke(addr, request, timeout_s=3.0):
        if request.code == RequestCode.GET_BROKER_CLUSTER_INFO:  # a name server that stopped answering just now
            await trio.sleep(timeout_s)
            raise RequestTimeoutError(addr, timeout_s, request.code)
        return await answer(addr, request, timeout_s)

    fake.invoke = invoke
    async with open_producer(NAMESRV) as p:
        with pytest.raises(SendFailedError) as caught:
            await p.send(Message("New", b"x"), timeout_s=0.3)
    # Before: the cluster info's own 3 s timeout, past the send's 0.3 s.
    assert isinstance(caught.value.last_error, trio.TooSlowError), caught.value.last_error
    assert "while fetching the cluster info, to auto-create the topic" in str(caught.value)
    assert _sends_to(fake, "a:") == 0


async def test_the_deadline_of_a_oneway_send_covers_its_route_lookup(monkeypatch, autojump_clock):
    # The route was fetched before the oneway's move_on_at: a silent name server held it 3 s and raised NoRouteError.
    fake = _patch(monkeypatch, FakeRemoting([FakeGroup("broker-a", ["a:1"])]))
    async with open_producer(NAMESRV, send_msg_timeout_ms=300) as p:
        fake.hung.add(NAMESRV)
        with pytest.raises(RequestTimeoutError, match="did not give its route in time") as caught:
            await p.send_oneway(Message("New", b"x"))
        fake.hung.discard(NAMESRV)
    assert caught.value.timeout_s == pytest.approx(0.3) and caught.value.retriable


async def test_a_oneway_send_auto_creates_a_topic_no_name_server_knows(monkeypatch, autojump_clock):
    # send_oneway raised NoRouteError where send installs the stand-in route the first send creates the topic with.
    fake = _patch(monkeypatch, FakeRemoting([FakeGroup("broker-a", ["a:1"])]))
    fake.unknown_topics.add("New")
    async with open_producer(NAMESRV) as p:
        await p.send_oneway(Message("New", b"x"))
    assert _sends_to(fake, "a:1") == 1
    assert sum(len(log) for (topic, _), log in fake.groups[0].logs.items() if topic == "New") == 1


async def test_a_pinned_send_counts_its_tries_while_its_group_has_no_leader(monkeypatch):
    # Real clock: the send waits for a leader until its deadline. It said "failed after 0 attempt(s)" after tens.
    fake = _patch(monkeypatch, FakeRemoting([FakeGroup("broker-a", ["a:1"]), FakeGroup("broker-b", ["b:1"])]))
    async with open_producer(NAMESRV, send_msg_timeout_ms=300, retry_times_when_send_failed=0) as p:
        await p.send(Message("T", b"warm"))
        for group in fake.groups:
            group.dead.add(group.addrs[0])
        before = _sends_to(fake, "")
        with pytest.raises(SendFailedError, match=r"of them waiting for a leader to be elected") as caught:
            await p.send(Message("T", b"x"), sharding_key="k")
    tries = _sends_to(fake, "") - before
    assert tries > 1  # waited for a leader, not stopped by retry_times_when_send_failed=0
    assert caught.value.attempts == tries
    assert f"failed after {tries} attempt(s) ({tries} of them waiting" in str(caught.value)
