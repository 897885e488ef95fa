"""One broker group named by many topics' routes: its nodes and master come from the route queried last."""

from __future__ import annotations

import trio

from client.route import RouteCache

N1, N2, N3 = "127.0.0.1:10911", "127.0.0.1:10912", "127.0.0.1:10913"


def _route(master: str, group: str = "broker-a") -> dict:
    replicas = {str(i + 1): a for i, a in enumerate((N1, N2, N3))}
    return {"queue_datas": [{"broker_name": group, "read_queue_nums": 4, "write_queue_nums": 4}],
            "broker_datas": [{"cluster": "c", "broker_name": group, "broker_addrs": {"0": master} | replicas}]}


async def test_refreshing_one_topic_after_a_failover_moves_every_topic_on_the_group():
    # The group's master was read from the first cached route naming it (topic B here), so refreshing topic A
    # changed nothing, and A's route agreeing with the hint dropped it: sends went to the dead N1 first and
    # were redirected, each of them, until B's own periodic refresh.
    state = {"master": N1}

    async def query(addr, topic):
        return _route(state["master"])

    cache = RouteCache(["ns:1"], query)
    await cache.refresh("B")
    await cache.refresh("A")
    assert cache.master_addr("broker-a") == N1
    state["master"] = N2  # N1 died, N2 was elected and registered
    cache.set_leader_hint("broker-a", N2)  # what a NOT_LEADER from N3 said
    await cache.refresh("A")
    assert cache.master_addr("broker-a") == N2
    assert cache.routed_master_addr("broker-a") == N2
    assert cache.replica_addrs("broker-a")[0] == N2
    assert cache.cached("B").broker("broker-a").master_addr == N1  # B's own copy is stale, and not read


async def test_a_route_queried_before_another_but_answered_after_it_does_not_bring_the_old_master_back():
    state = {"master": N1, "hold_b": False}
    hold_b = trio.Event()
    b_sent = trio.Event()

    async def query(addr, topic):
        answer = _route(state["master"])  # the name server reads its table when the query arrives
        if topic == "B" and state["hold_b"]:
            b_sent.set()
            await hold_b.wait()
        return answer

    cache = RouteCache(["ns:1"], query)
    await cache.refresh("B")
    await cache.refresh("A")
    state["hold_b"] = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(cache.refresh, "B")  # read while N1 was master, answered late
        await b_sent.wait()
        state["master"] = N2
        cache.set_leader_hint("broker-a", N2)
        await cache.refresh("A")  # agrees with the hint, which then ends
        assert cache.master_addr("broker-a") == N2
        hold_b.set()
    assert cache.cached("B").broker("broker-a").master_addr == N1
    assert cache.master_addr("broker-a") == N2  # not the dead N1 again
    assert cache.routed_master_addr("broker-a") == N2


async def test_a_group_no_route_names_any_more_is_forgotten_and_a_stand_in_only_fills_in():
    routes = {"A": _route(N1), "B": _route(N1)}

    async def query(addr, topic):
        return routes[topic]

    cache = RouteCache(["ns:1"], query)
    await cache.refresh("A")
    await cache.refresh("B")
    routes["A"] = routes["B"] = _route(N3, group="broker-b")
    await cache.refresh("A")
    assert cache.master_addr("broker-a") == N1  # B still names it
    await cache.refresh("B")
    assert cache.master_addr("broker-a") is None
    assert cache.broker_names() == ["broker-b"]
    # A stand-in route (from cluster info, for a topic not routed yet) does not override what a route said.
    cache.install_default("C", {"broker-b": {0: N2}, "broker-c": {0: N2}}, 4)
    assert cache.master_addr("broker-b") == N3
    assert cache.master_addr("broker-c") == N2
