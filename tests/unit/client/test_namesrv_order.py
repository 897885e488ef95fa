"""Which name server the route cache asks first, which last, and which it does not wait for (``RouteCache
.ask_namesrvs``), with the name servers faked by an injected query."""

from __future__ import annotations

import pytest
import trio

from client.errors import NoRouteError
from client.route import RouteCache
from remoting.errors import RequestTimeoutError
from tests.unit.client.test_pure import ROUTE


async def test_a_hung_name_server_is_not_waited_for_once_another_said_the_topic_is_unknown():
    """Found by review: a stopped name server accepts connections and answers nothing; once the others had said
    "unknown", each lookup of a new topic waited its whole request timeout there, which is a send's whole deadline,
    so no send to a new topic reached the auto-create. Now a second opinion is given up, and the topic is unknown
    (what the answering name servers said), while a known topic is still found."""
    calls: list[str] = []
    given_up: list[str] = []

    async def query(addr, topic):
        calls.append(addr)
        if addr == "ns:2":  # hung: its request would time out after the client's request timeout
            try:
                await trio.sleep(3)
            except trio.Cancelled:
                given_up.append(topic)
                raise
            raise RequestTimeoutError(addr, 3)
        return ROUTE if topic == "T" else None

    cache = RouteCache(["ns:1", "ns:2"], query)
    cache._ns_index = 0
    with pytest.raises(NoRouteError, match="no name server that answered knows topic 'New' \\(ns:1; ns:2 did not "
                                           "answer: ns:2 did not answer the request within 0.5 s\\)") as e:
        await cache.get("New")
    assert e.value.topic_unknown is True
    # ns:2 was cut short, not heard: it may know the topic (found by review: a slow name server taken for "unknown"
    # made a new consumer take an existing topic for one created after it subscribed, and consume its history).
    assert e.value.unknown_for_sure is False
    assert given_up == ["New"] and calls == ["ns:1", "ns:2"]
    assert (await cache.get("T")).broker("broker-a").master_addr == "127.0.0.1:1"


async def test_a_name_server_that_failed_is_asked_after_the_others():
    """It was asked in its turn again on every lookup, its failure forgotten: a hung one cost each lookup its request
    timeout before the next was asked."""
    calls: list[str] = []
    routes = {"ns:1": None, "ns:2": {"V": ROUTE}, "ns:3": {"T": ROUTE}}

    async def query(addr, topic):
        calls.append(addr)
        if routes[addr] is None:
            raise ConnectionRefusedError("down")
        return routes[addr].get(topic)

    cache = RouteCache(["ns:1", "ns:2", "ns:3"], query)
    cache._ns_index = 0
    await cache.get("T")
    assert calls == ["ns:1", "ns:2", "ns:3"]
    calls.clear()
    # ns:3 answered last and is asked first; ns:1 failed a moment ago and waits behind ns:2.
    await cache.get("V")
    assert calls == ["ns:3", "ns:2"]
    calls.clear()
    await cache.refresh("V")
    assert calls == ["ns:2"]
    # Asked last, not skipped: when the others know nothing, it is asked, and an answer clears its failure.
    routes["ns:1"] = {"W": ROUTE}
    calls.clear()
    await cache.get("W")
    assert calls == ["ns:2", "ns:3", "ns:1"]
    assert cache.namesrv_order() == ["ns:1", "ns:2", "ns:3"]


async def test_a_topic_is_unknown_for_sure_only_when_no_name_server_was_cut_short():
    async def query(addr, topic):
        if addr == "ns:2":
            raise RequestTimeoutError(addr, 3)  # down: failed, not cut short
        return None

    cache = RouteCache(["ns:1", "ns:2"], query)
    cache._ns_index = 0
    with pytest.raises(NoRouteError) as e:
        await cache.get("New")
    assert e.value.topic_unknown is True and e.value.unknown_for_sure is True
