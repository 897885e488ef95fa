"""A cached route of a topic the name servers no longer know (deleted) is dropped once they have said so for
``UNKNOWN_TOPIC_GRACE_S``, not at the first "unknown" (a restarted name server), and not kept for ever
(client/route.py). On trio's MockClock."""

from __future__ import annotations

import pytest
import trio

from client import NoRouteError
from client.route import UNKNOWN_TOPIC_GRACE_S, RouteCache

NS1, NS2 = "ns:1", "ns:2"


def _route(group: str) -> dict:
    return {"queue_datas": [{"broker_name": group, "read_queue_nums": 4, "write_queue_nums": 4}],
            "broker_datas": [{"cluster": "c", "broker_name": group, "broker_addrs": {"0": f"127.0.0.1:{len(group)}"}}]}


def _cache(known: dict[str, set[str]]) -> RouteCache:
    """Name servers answering from ``known`` (name server -> topics it routes); topic T on broker-t, S on broker-s."""
    async def query(addr, topic):
        await trio.lowlevel.checkpoint()
        return _route(f"broker-{topic.lower()}x") if topic in known[addr] else None

    return RouteCache([NS1, NS2], query)


async def test_a_deleted_topics_route_is_dropped_after_the_grace_and_looked_up_again_on_demand(autojump_clock):
    known = {NS1: {"T", "S"}, NS2: {"T", "S"}}
    cache = _cache(known)
    await cache.refresh("T")
    await cache.refresh("S")
    assert cache.master_addr("broker-tx") is not None
    known[NS1].discard("T")
    known[NS2].discard("T")  # deleted
    for _ in range(3):  # within the grace: the route stands (a restarted name server knows nothing for a while)
        with pytest.raises(NoRouteError, match="no name server knows topic 'T'"):
            await cache.refresh("T")
        assert cache.cached("T") is not None and cache.cached_publish_info("T") is not None
        await trio.sleep(UNKNOWN_TOPIC_GRACE_S / 4)
    await trio.sleep(UNKNOWN_TOPIC_GRACE_S / 4)
    with pytest.raises(NoRouteError):
        await cache.refresh("T")
    # Dropped: as a topic never routed, for every user (sends, rebalances, receives look it up again).
    assert cache.cached("T") is None and cache.cached_publish_info("T") is None
    assert cache.topics == ["S"]
    assert cache.master_addr("broker-tx") is None  # no route names its group any more
    assert cache.master_addr("broker-sx") is not None
    with pytest.raises(NoRouteError, match="no name server knows topic 'T'"):
        await cache.get("T")
    known[NS2].add("T")  # created again
    assert (await cache.get("T")).topic == "T"
    assert cache.master_addr("broker-tx") is not None


async def test_a_topic_known_again_within_the_grace_starts_it_over(autojump_clock):
    # A name server restarted (the only one answering) knows nothing until the brokers register again.
    known = {NS1: {"T"}, NS2: {"T"}}
    cache = _cache(known)
    await cache.refresh("T")
    saved = dict(known)
    known[NS1], known[NS2] = set(), set()
    with pytest.raises(NoRouteError):
        await cache.refresh("T")
    await trio.sleep(UNKNOWN_TOPIC_GRACE_S * 0.9)
    known.update(saved)  # registered again
    await cache.refresh("T")
    known[NS1], known[NS2] = set(), set()
    with pytest.raises(NoRouteError):
        await cache.refresh("T")
    await trio.sleep(UNKNOWN_TOPIC_GRACE_S * 0.9)  # 1.8 graces since the first "unknown", 0.9 since the last route
    with pytest.raises(NoRouteError):
        await cache.refresh("T")
    assert cache.cached("T") is not None


async def test_name_servers_that_do_not_answer_drop_no_route(autojump_clock):
    known = {NS1: {"T"}, NS2: {"T"}}
    failing = {"on": False}

    async def query(addr, topic):
        await trio.lowlevel.checkpoint()
        if failing["on"]:
            raise OSError("connection refused")
        return _route("broker-tx") if topic in known[addr] else None

    cache = RouteCache([NS1, NS2], query)
    await cache.refresh("T")
    failing["on"] = True
    for _ in range(3):
        with pytest.raises(NoRouteError, match="no name server answered"):
            await cache.refresh("T")
        await trio.sleep(UNKNOWN_TOPIC_GRACE_S)
    assert cache.cached("T") is not None


async def test_the_grace_counts_an_unbroken_run_of_unknown_only(autojump_clock):
    """Found by review: one "unknown", then name servers down for 150 s, then back restarted (one "unknown" before
    the brokers register again) dropped the route at once: the grace was counted from the first "unknown"."""
    state = {"mode": "ok"}

    async def query(addr, topic):
        await trio.lowlevel.checkpoint()
        if state["mode"] == "down":
            raise OSError("connection refused")
        return None if state["mode"] == "empty" else _route("broker-tx")

    cache = RouteCache([NS1, NS2], query)
    await cache.refresh("T")
    state["mode"] = "empty"
    with pytest.raises(NoRouteError):
        await cache.refresh("T")
    state["mode"] = "down"
    for _ in range(5):
        await trio.sleep(30)
        with pytest.raises(NoRouteError, match="no name server answered"):
            await cache.refresh("T")
    state["mode"] = "empty"
    with pytest.raises(NoRouteError):
        await cache.refresh("T")
    assert cache.cached("T") is not None
    await trio.sleep(UNKNOWN_TOPIC_GRACE_S + 1)  # an unbroken run of "unknown" past the grace still drops it
    with pytest.raises(NoRouteError):
        await cache.refresh("T")
    assert cache.cached("T") is None
