"""The name server against four review findings: one node id claimed by two addresses, a topic-config cache that
outgrew the table, a bignum in a registration body, and registrations of one node arriving out of order."""

from __future__ import annotations

import logging

import cbor2
import pytest

from namesrv.processor import NamesrvProcessor
from namesrv.requests import TopicConfigCache, encode_topic_configs
from namesrv.route_info import Registration, RouteConflictError, RouteInfoManager, TopicConfig
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode

RW = TopicConfig(read_queue_nums=4, write_queue_nums=4, perm=6)
TOPICS = {"T": RW}


def reg(broker_id: int, addr: str, role: str = "FOLLOWER", term: int = 1, *, sequence: int | None = None,
        broker_name: str = "broker-a") -> Registration:
    if sequence is None:
        return Registration("C", broker_name, broker_id, addr, role, term, 1, TOPICS)
    return Registration("C", broker_name, broker_id, addr, role, term, 1, TOPICS, registration_sequence=sequence)


def route_addrs(table: RouteInfoManager) -> dict[int, str]:
    route = table.pickup_topic_route("T")
    assert route is not None
    return dict(route.broker_datas[0].broker_addrs)


# ---- 1. one broker_id, two addresses ----------------------------------------------------------------------

def test_a_second_address_for_a_live_node_id_is_refused_and_the_master_stays_routed():
    # n1 (the leader) lists members n1, n2, n3; n2 lists n2, n1, n3: both are node 1 (/tmp probe dupid.py).
    table = RouteInfoManager()
    table.register_broker(reg(1, "10.0.0.1:10911", "LEADER", 2), now_ms=0, conn_key="c1")
    table.register_broker(reg(3, "10.0.0.3:10911", "FOLLOWER", 2), now_ms=0, conn_key="c3")
    with pytest.raises(RouteConflictError) as info:
        table.register_broker(reg(1, "10.0.0.2:10911", "FOLLOWER", 2), now_ms=1, conn_key="c2")
    assert info.value.field == "broker_id"
    text = str(info.value)
    for part in ("broker_id 1", "'broker-a'", "10.0.0.1:10911", "10.0.0.2:10911",
                 "list the members in the same order"):
        assert part in text
    assert route_addrs(table) == {0: "10.0.0.1:10911", 3: "10.0.0.3:10911"}
    # The refused node's connection closing must not take the leader's entry with it.
    assert table.connection_closed("c2") == []
    assert route_addrs(table) == {0: "10.0.0.1:10911", 3: "10.0.0.3:10911"}


def test_a_leader_claim_takes_the_id_over_and_the_displaced_node_is_refused_in_turn():
    # The other order of arrival (a name server restarted): the follower got the id first. The group must keep
    # its master in routes, so the leader's claim wins the id.
    table = RouteInfoManager()
    table.register_broker(reg(1, "10.0.0.2:10911", "FOLLOWER", 2), now_ms=0, conn_key="c2")
    table.register_broker(reg(1, "10.0.0.1:10911", "LEADER", 2), now_ms=1, conn_key="c1")
    assert route_addrs(table) == {0: "10.0.0.1:10911"}
    with pytest.raises(RouteConflictError):
        table.register_broker(reg(1, "10.0.0.2:10911", "FOLLOWER", 2), now_ms=2, conn_key="c2")
    assert route_addrs(table) == {0: "10.0.0.1:10911"}
    # A stale leader claim does not take it over from the sitting master.
    with pytest.raises(RouteConflictError):
        table.register_broker(reg(1, "10.0.0.2:10911", "LEADER", 1), now_ms=3, conn_key="c2")


def test_the_id_is_free_again_once_its_holder_expired_or_its_connection_closed():
    table = RouteInfoManager(broker_expired_ms=1000)
    table.register_broker(reg(1, "10.0.0.1:10911"), now_ms=0, conn_key="c1")
    with pytest.raises(RouteConflictError):
        table.register_broker(reg(1, "10.0.0.2:10911"), now_ms=1000, conn_key="c2")
    table.register_broker(reg(1, "10.0.0.2:10911"), now_ms=1001, conn_key="c2")  # silent past its timeout
    assert route_addrs(table) == {1: "10.0.0.2:10911"}
    table.connection_closed("c2")
    table.register_broker(reg(1, "10.0.0.3:10911"), now_ms=1002, conn_key="c3")
    # The same connection changing its address is the same process: followed.
    table.register_broker(reg(1, "10.0.0.4:10911"), now_ms=1003, conn_key="c3")
    assert route_addrs(table) == {1: "10.0.0.4:10911"}


async def test_the_processor_answers_a_taken_id_with_invalid_request_naming_broker_id():
    processor = NamesrvProcessor(RouteInfoManager(), clock_ms=lambda: 0)

    def request(addr: str):
        ext = dict(cluster_name="C", broker_name="broker-a", broker_id=1, broker_addr=addr, role="FOLLOWER",
                   term=1, data_version=1)
        return make_request(RequestCode.REGISTER_BROKER, ext=ext, body=encode_topic_configs(TOPICS))

    assert (await processor.handle(request("10.0.0.1:10911"), "c1")).code == ResponseCode.SUCCESS
    response = await processor.handle(request("10.0.0.2:10911"), "c2")
    assert response.code == ResponseCode.INVALID_REQUEST and response.ext == {"field": "broker_id"}
    assert "10.0.0.1:10911" in response.remark and "dledger.members" in response.remark


# ---- 2. the topic-config cache holds only what the table holds, within a byte bound -----------------------

def _register(i: int, *, broker_name: str | None = None, body: bytes | None = None):
    ext = dict(cluster_name="C", broker_name=broker_name or f"b{i}", broker_id=1, broker_addr="10.0.0.1:1",
               role="LEADER", term=1, data_version=1)
    return make_request(RequestCode.REGISTER_BROKER, ext=ext,
                        body=body if body is not None else encode_topic_configs({f"T{i}": RW}))


async def test_the_cache_forgets_nodes_evicted_by_a_closed_connection_or_by_expiry():
    now = [0]
    table = RouteInfoManager(broker_expired_ms=1000)
    processor = NamesrvProcessor(table, clock_ms=lambda: now[0])
    cached = processor._topic_config_cache._last  # by node
    for i in range(3):
        assert (await processor.handle(_register(i), "closing")).code == ResponseCode.SUCCESS
    assert (await processor.handle(_register(9), "silent")).code == ResponseCode.SUCCESS
    assert len(cached) == 4
    processor.connection_closed("closing")
    assert list(cached) == [("b9", 1)]
    now[0] = 5000
    assert [e.broker_name for e in processor.scan_not_active(now[0])] == ["b9"]
    assert not cached and processor._topic_config_cache.cached_bytes == 0 and table.statistics().nodes == 0


async def test_a_refused_registration_is_not_cached():
    processor = NamesrvProcessor(RouteInfoManager(), clock_ms=lambda: 0)
    for i in range(64):  # the most one connection registers
        assert (await processor.handle(_register(i), "conn")).code == ResponseCode.SUCCESS
    refused = await processor.handle(_register(64), "conn")
    assert refused.code == ResponseCode.INVALID_REQUEST
    cached = processor._topic_config_cache._last
    assert len(cached) == 64 and ("b64", 1) not in cached


def test_the_cache_is_bounded_by_bytes_dropping_the_oldest_entries_first():
    body = encode_topic_configs({f"T{i:04d}": RW for i in range(50)})
    cache = TopicConfigCache(max_bytes=3 * len(body))
    configs = {f"T{i:04d}": RW for i in range(50)}
    for i in range(5):
        cache.store(("b", i), body, configs)
    assert len(cache) == 3 and cache.cached_bytes == 3 * len(body)
    assert cache.lookup(("b", 0), body) is None and cache.lookup(("b", 4), body) is configs
    assert cache.lookup(("b", 4), body[:-1]) is None            # another body: decoded again
    cache.store(("b", 9), b"x" * (4 * len(body)), {})           # larger than the whole bound: not kept
    assert len(cache) == 3 and cache.lookup(("b", 9), b"x" * (4 * len(body))) is None
    cache.forget(("b", 4))
    assert len(cache) == 2 and cache.cached_bytes == 2 * len(body)
    with pytest.raises(ValueError, match="max_bytes must be > 0"):
        TopicConfigCache(max_bytes=0)


# ---- 3. a bignum in a registration body ---------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    cbor2.dumps({"T": {"read_queue_nums": 10**5000, "write_queue_nums": 1, "perm": 6}}),
    cbor2.dumps({"T": 10**5000}),
    cbor2.dumps({"T": {"read_queue_nums": -(10**30), "write_queue_nums": 1, "perm": 6}}),
], ids=["bignum-queue-nums", "bignum-config", "negative-bignum"])
async def test_a_bignum_in_a_registration_body_is_invalid_request_naming_the_body(body, caplog):
    processor = NamesrvProcessor(RouteInfoManager(), clock_ms=lambda: 0)
    with caplog.at_level(logging.ERROR):
        response = await processor.handle(_register(0, body=body), "conn")
    assert response.code == ResponseCode.INVALID_REQUEST and response.ext == {"field": "body"}
    assert "tag" in response.remark and len(response.remark) < 300
    assert not caplog.records


# ---- 4. registrations of one node arriving out of order -----------------------------------------------------

def test_an_older_registration_over_the_same_connection_changes_nothing():
    table = RouteInfoManager()
    table.register_broker(reg(1, "10.0.0.1:10911", "LEADER", 7, sequence=2), now_ms=0, conn_key="c1")
    result = table.register_broker(reg(1, "10.0.0.1:10911", "FOLLOWER", 6, sequence=1), now_ms=5, conn_key="c1")
    assert route_addrs(table) == {0: "10.0.0.1:10911"}
    assert (result.master_addr, result.master_term) == ("10.0.0.1:10911", 7)
    assert table.cluster_info(5).nodes["broker-a"][0].last_update_age_ms == 0  # still shows it alive
    # A restarted process counts from 1 again, over a new connection: taken.
    table.register_broker(reg(1, "10.0.0.1:10911", "FOLLOWER", 8, sequence=1), now_ms=6, conn_key="c1-new")
    assert route_addrs(table) == {1: "10.0.0.1:10911"}
    # Brokers that send no sequence are taken in arrival order, as before.
    table.register_broker(reg(1, "10.0.0.1:10911", "LEADER", 9), now_ms=7, conn_key="c1-new")
    assert route_addrs(table) == {0: "10.0.0.1:10911"}


async def test_an_older_registration_arriving_late_leaves_the_newer_body_cached():
    # The table ignores it (registration_sequence), so the cache must too: holding the stale body, it had the
    # node's next heartbeat, which re-sends the newer topic set, decoded again into a dict the table never held.
    table = RouteInfoManager()
    processor = NamesrvProcessor(table, clock_ms=lambda: 0)
    newer = encode_topic_configs({"T": RW, "U": RW})
    older = encode_topic_configs({"T": RW})

    def registration(body: bytes, sequence: int):
        return make_request(RequestCode.REGISTER_BROKER, body=body, ext=dict(
            cluster_name="C", broker_name="broker-a", broker_id=1, broker_addr="10.0.0.1:10911", role="LEADER",
            term=7, data_version=1, registration_sequence=sequence))

    assert (await processor.handle(registration(newer, 2), "c1")).code == ResponseCode.SUCCESS
    late = await processor.handle(registration(older, 1), "c1")
    assert late.code == ResponseCode.SUCCESS and late.ext["master_addr"] == "10.0.0.1:10911"
    assert "ignored" not in late.ext  # the wire is as before
    assert sorted(table.topic_list()) == ["T", "U"]
    cache = processor._topic_config_cache
    assert cache.lookup(("broker-a", 1), older) is None
    assert cache.lookup(("broker-a", 1), newer) is not None


async def test_a_node_refused_again_every_second_is_warned_of_once_a_minute(caplog):
    # A node whose id another address holds registers again every second until its config is mended: each
    # refusal was a WARNING, one a second in the name server's log.
    now = [0]
    processor = NamesrvProcessor(RouteInfoManager(), clock_ms=lambda: now[0])

    def request(addr: str):
        ext = dict(cluster_name="C", broker_name="broker-a", broker_id=1, broker_addr=addr, role="FOLLOWER",
                   term=1, data_version=1)
        return make_request(RequestCode.REGISTER_BROKER, ext=ext, body=encode_topic_configs(TOPICS))

    caplog.set_level(logging.DEBUG, logger="namesrv.processor")
    assert (await processor.handle(request("10.0.0.1:10911"), "c1")).code == ResponseCode.SUCCESS
    for second in range(61):
        now[0] = second * 1000
        await processor.handle(request("10.0.0.1:10911"), "c1")
        assert (await processor.handle(request("10.0.0.2:10911"), "c2")).code == ResponseCode.INVALID_REQUEST
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "rejected" in r.getMessage()]
    assert len(warned) == 2, warned  # at 0 s and at 60 s
    assert "(0 more on broker_id" in warned[0] and "(59 more on broker_id" in warned[1]
    assert sum("rejected" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG) == 59
