"""The name server's route table, driven with explicit clock values and connection keys."""

from __future__ import annotations

import dataclasses

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from namesrv.requests import (InvalidRequestError, TopicConfigCache, decode_topic_configs, encode_topic_configs,
                              parse_register_broker, parse_topic, parse_unregister_broker)
from namesrv.route_info import (BrokerData, QueueData, Registration, RouteConflictError, RouteInfoManager,
                                TopicConfig)

RW = TopicConfig(read_queue_nums=4, write_queue_nums=4, perm=6)


def reg(broker_id: int, role: str = "FOLLOWER", term: int = 1, *, broker_name: str = "broker-a",
        cluster: str = "DefaultCluster", topics: dict | None = None, data_version: int = 1,
        addr: str | None = None) -> Registration:
    return Registration(cluster, broker_name, broker_id, addr or f"127.0.0.1:{10910 + broker_id}", role, term,
                        data_version, {"TopicA": RW} if topics is None else topics)


def addrs(table: RouteInfoManager, topic: str = "TopicA", broker_name: str = "broker-a") -> dict[int, str]:
    route = table.pickup_topic_route(topic)
    assert route is not None
    return dict(next(b for b in route.broker_datas if b.broker_name == broker_name).broker_addrs)


def three_node_group(table: RouteInfoManager, now_ms: int = 0, leader: int = 1, term: int = 1) -> None:
    for node_id in (1, 2, 3):
        role = "LEADER" if node_id == leader else "FOLLOWER"
        table.register_broker(reg(node_id, role, term), now_ms=now_ms, conn_key=f"conn-{node_id}")


def test_route_lists_master_as_0_and_followers_by_node_id():
    table = RouteInfoManager()
    three_node_group(table, leader=2)
    route = table.pickup_topic_route("TopicA")
    assert route is not None
    assert route.queue_datas == (QueueData("broker-a", 4, 4, 6, 0, False),)
    assert route.broker_datas == (BrokerData("DefaultCluster", "broker-a",
                                             {0: "127.0.0.1:10912", 1: "127.0.0.1:10911", 3: "127.0.0.1:10913"}),)
    assert route.to_wire()["broker_datas"][0]["broker_addrs"] == {
        "0": "127.0.0.1:10912", "1": "127.0.0.1:10911", "3": "127.0.0.1:10913"}
    assert table.pickup_topic_route("NoSuchTopic") is None


def test_register_result_names_the_master():
    table = RouteInfoManager()
    first = table.register_broker(reg(2), now_ms=0)
    assert (first.master_addr, first.master_id, first.master_term) == (None, None, None)
    result = table.register_broker(reg(1, "LEADER", 3), now_ms=0)
    assert (result.master_addr, result.master_id, result.master_term) == ("127.0.0.1:10911", 1, 3)


def test_topic_spread_over_two_groups_and_cluster_info():
    table = RouteInfoManager()
    table.register_broker(reg(1, "LEADER", topics={"TopicA": RW, "OnlyA": RW}), now_ms=0)
    table.register_broker(reg(1, "LEADER", broker_name="broker-b", addr="127.0.0.1:20911",
                              topics={"TopicA": TopicConfig(8, 8, 4, 0, True)}), now_ms=10)
    route = table.pickup_topic_route("TopicA")
    assert route is not None
    assert [q.broker_name for q in route.queue_datas] == ["broker-a", "broker-b"]
    assert route.queue_datas[1] == QueueData("broker-b", 8, 8, 4, 0, True)
    assert table.topic_list() == ["OnlyA", "TopicA"]
    info = table.cluster_info(now_ms=110)
    assert info.cluster_addr_table == {"DefaultCluster": ("broker-a", "broker-b")}
    assert info.broker_addr_table["broker-b"].broker_addrs == {0: "127.0.0.1:20911"}
    node = info.nodes["broker-a"][0]
    assert (node.broker_id, node.role, node.is_master, node.last_update_age_ms) == (1, "LEADER", True, 110)
    wire = info.to_wire()
    assert wire["cluster_addr_table"] == {"DefaultCluster": ["broker-a", "broker-b"]}
    assert wire["nodes"]["broker-b"][0]["broker_addr"] == "127.0.0.1:20911"
    stats = table.statistics()
    assert (stats.clusters, stats.broker_names, stats.nodes, stats.topics) == (1, 2, 2, 2)


def test_higher_term_leader_wins_and_the_other_is_a_replica():
    table = RouteInfoManager()
    table.register_broker(reg(1, "LEADER", 5), now_ms=0)
    table.register_broker(reg(2, "LEADER", 6), now_ms=1)
    assert addrs(table) == {0: "127.0.0.1:10912", 1: "127.0.0.1:10911"}
    # The deposed leader keeps heart-beating its old claim: it must not displace the newer one.
    table.register_broker(reg(1, "LEADER", 5), now_ms=2)
    assert addrs(table) == {0: "127.0.0.1:10912", 1: "127.0.0.1:10911"}
    # Order of arrival does not matter: the stale claim first, then the newer one, the same answer.
    other = RouteInfoManager()
    other.register_broker(reg(2, "LEADER", 6), now_ms=0)
    other.register_broker(reg(1, "LEADER", 5), now_ms=1)
    assert addrs(other) == addrs(table)


def test_stale_claim_stays_a_replica_after_the_newer_leader_steps_down_or_leaves():
    table = RouteInfoManager()
    table.register_broker(reg(1, "LEADER", 5), now_ms=0, conn_key="c1")
    table.register_broker(reg(2, "LEADER", 6), now_ms=0, conn_key="c2")
    table.register_broker(reg(2, "CANDIDATE", 7), now_ms=1, conn_key="c2")
    assert addrs(table) == {1: "127.0.0.1:10911", 2: "127.0.0.1:10912"}
    table.connection_closed("c2")
    assert addrs(table) == {1: "127.0.0.1:10911"}
    # A real election at a newer term gives the group a master again.
    table.register_broker(reg(1, "LEADER", 8), now_ms=2, conn_key="c1")
    assert addrs(table) == {0: "127.0.0.1:10911"}


def test_leadership_moves_with_a_new_term():
    table = RouteInfoManager()
    three_node_group(table, leader=1, term=1)
    table.register_broker(reg(3, "LEADER", 2), now_ms=5)
    table.register_broker(reg(1, "FOLLOWER", 2), now_ms=5)
    assert addrs(table) == {0: "127.0.0.1:10913", 1: "127.0.0.1:10911", 2: "127.0.0.1:10912"}


def test_equal_term_claims_keep_the_sitting_master():
    table = RouteInfoManager()
    table.register_broker(reg(2, "LEADER", 4), now_ms=0)
    table.register_broker(reg(1, "LEADER", 4), now_ms=0)
    assert addrs(table)[0] == "127.0.0.1:10912"


def test_queue_data_follows_the_master_and_deleted_topics_disappear():
    table = RouteInfoManager()
    table.register_broker(reg(1, "LEADER", 1, topics={"TopicA": RW, "TopicB": RW}, data_version=2), now_ms=0)
    # A lagging follower's older topic set does not overwrite the master's.
    table.register_broker(reg(2, "FOLLOWER", 1, topics={"TopicA": RW}, data_version=1), now_ms=0)
    assert table.topic_list() == ["TopicA", "TopicB"]
    table.register_broker(reg(1, "LEADER", 1, topics={"TopicA": TopicConfig(2, 2, 6)}, data_version=3), now_ms=1)
    assert table.topic_list() == ["TopicA"]
    route = table.pickup_topic_route("TopicA")
    assert route is not None and route.queue_datas[0].read_queue_nums == 2


def test_without_a_master_queue_data_come_from_the_newest_data_version():
    table = RouteInfoManager()
    table.register_broker(reg(1, "FOLLOWER", 3, topics={"Old": RW}, data_version=4), now_ms=0)
    table.register_broker(reg(2, "CANDIDATE", 4, topics={"Old": RW, "New": RW}, data_version=5), now_ms=0)
    assert table.topic_list() == ["New", "Old"]
    assert addrs(table, "New") == {1: "127.0.0.1:10911", 2: "127.0.0.1:10912"}


def test_expiry_scan_with_explicit_times():
    table = RouteInfoManager(broker_expired_ms=1000)
    three_node_group(table, now_ms=0, leader=1)
    table.register_broker(reg(2), now_ms=600)
    assert table.scan_not_active(1000) == []           # exactly at the limit is still alive
    evicted = table.scan_not_active(1001)
    assert sorted((e.broker_id, e.reason) for e in evicted) == [(1, "expired"), (3, "expired")]
    assert addrs(table) == {2: "127.0.0.1:10912"}       # the master expired: no "0" until a new leader
    assert [e.broker_id for e in table.scan_not_active(1601)] == [2]
    assert table.pickup_topic_route("TopicA") is None
    assert table.topic_list() == []
    assert table.cluster_info(2000).cluster_addr_table == {}
    assert table.statistics().evictions == 3


def test_each_node_expires_by_the_heartbeat_timeout_its_registration_carries():
    # broker_expired_ms below a broker's registration interval evicted the live group between registrations; the
    # name server cannot know the interval, so a broker sends its own timeout (RocketMQ 5's heartbeatTimeoutMillis).
    table = RouteInfoManager(broker_expired_ms=1000)
    for node_id, timeout in ((1, 5000), (2, None), (3, 3000)):
        registration = dataclasses.replace(reg(node_id, "LEADER" if node_id == 1 else "FOLLOWER"),
                                           heartbeat_timeout_ms=timeout)
        table.register_broker(registration, now_ms=0, conn_key=f"conn-{node_id}")
    assert [n.heartbeat_timeout_ms for n in table.cluster_info(0).nodes["broker-a"]] == [5000, 1000, 3000]
    assert table.scan_not_active(1000) == []
    assert [e.broker_id for e in table.scan_not_active(1001)] == [2]   # no timeout of its own: the default
    assert table.scan_not_active(3000) == []
    assert [e.broker_id for e in table.scan_not_active(3001)] == [3]
    assert addrs(table) == {0: "127.0.0.1:10911"}
    # A registration without the field (a broker downgraded) takes the default again.
    table.register_broker(reg(1, "LEADER"), now_ms=4000, conn_key="conn-1")
    assert [e.broker_id for e in table.scan_not_active(5001)] == [1]
    assert table.cluster_info(5001).to_wire()["nodes"] == {}


def test_a_group_whose_last_node_leaves_disappears_but_shared_topics_stay():
    table = RouteInfoManager()
    table.register_broker(reg(1, "LEADER"), now_ms=0, conn_key="a")
    table.register_broker(reg(1, "LEADER", broker_name="broker-b", addr="127.0.0.1:20911"), now_ms=0,
                          conn_key="b")
    assert table.connection_closed("a")[0].reason == "connection_closed"
    route = table.pickup_topic_route("TopicA")
    assert route is not None and [b.broker_name for b in route.broker_datas] == ["broker-b"]
    assert table.cluster_info(0).broker_addr_table.keys() == {"broker-b"}


def test_closed_connection_evicts_only_nodes_still_registered_over_it():
    table = RouteInfoManager()
    table.register_broker(reg(1, "LEADER"), now_ms=0, conn_key="old")
    table.register_broker(reg(2), now_ms=0, conn_key="old")
    table.register_broker(reg(1, "LEADER"), now_ms=1, conn_key="new")   # node 1 reconnected
    evicted = table.connection_closed("old")
    assert [e.broker_id for e in evicted] == [2]
    assert addrs(table) == {0: "127.0.0.1:10911"}
    assert table.connection_closed("old") == []
    assert table.connection_closed("never-seen") == []


def test_unregister_removes_one_node_and_ignores_an_old_incarnation():
    table = RouteInfoManager()
    three_node_group(table)
    assert table.unregister_broker("DefaultCluster", "broker-a", 2, "127.0.0.1:9999") is None
    assert table.unregister_broker("OtherCluster", "broker-a", 2) is None
    assert table.unregister_broker("DefaultCluster", "broker-a", 7) is None
    gone = table.unregister_broker("DefaultCluster", "broker-a", 2, "127.0.0.1:10912")
    assert gone is not None and gone.reason == "unregistered"
    assert addrs(table) == {0: "127.0.0.1:10911", 3: "127.0.0.1:10913"}
    # Its connection closing later must not touch anything else.
    assert table.connection_closed("conn-2") == []


def test_node_address_change_is_followed():
    table = RouteInfoManager()
    table.register_broker(reg(1, "LEADER"), now_ms=0)
    table.register_broker(reg(1, "LEADER", addr="127.0.0.1:30000"), now_ms=1)
    assert addrs(table) == {0: "127.0.0.1:30000"}


def test_one_broker_name_in_two_clusters_is_a_conflict():
    table = RouteInfoManager()
    table.register_broker(reg(1, "LEADER"), now_ms=0)
    with pytest.raises(RouteConflictError, match="already belongs to cluster 'DefaultCluster'") as info:
        table.register_broker(reg(2, cluster="Other"), now_ms=0)
    assert info.value.field == "cluster_name"
    # A group's only node may move to another cluster.
    table.register_broker(reg(1, "LEADER", cluster="Other"), now_ms=1)
    assert table.cluster_info(1).cluster_addr_table == {"Other": ("broker-a",)}


def test_expired_ms_must_be_positive():
    with pytest.raises(ValueError, match="broker_expired_ms must be > 0, got 0"):
        RouteInfoManager(broker_expired_ms=0)


# ---- request field parsing -------------------------------------------------------------------------------

GOOD_EXT = {"cluster_name": "DefaultCluster", "broker_name": "broker-a", "broker_id": 1,
            "broker_addr": "127.0.0.1:10911", "role": "LEADER", "term": 3, "data_version": 9}


def test_parse_register_broker_round_trip():
    body = encode_topic_configs({"TopicA": RW, "%RETRY%g": TopicConfig(1, 1, 6, 1, True)})
    r = parse_register_broker(GOOD_EXT, body)
    assert r == Registration("DefaultCluster", "broker-a", 1, "127.0.0.1:10911", "LEADER", 3, 9,
                             {"TopicA": RW, "%RETRY%g": TopicConfig(1, 1, 6, 1, True)})
    assert parse_register_broker(GOOD_EXT, b"").topic_configs == {}
    assert decode_topic_configs(cbor2.dumps({"T": {"read_queue_nums": 1, "write_queue_nums": 2, "perm": 6}})) \
        == {"T": TopicConfig(1, 2, 6, 0, False)}


def test_parse_register_broker_takes_an_optional_heartbeat_timeout():
    assert parse_register_broker(GOOD_EXT, b"").heartbeat_timeout_ms is None
    assert parse_register_broker({**GOOD_EXT, "heartbeat_timeout_ms": 30_000}, b"").heartbeat_timeout_ms == 30_000
    for bad in (0, -1, 86_400_001, "30000", True, 1.5):
        with pytest.raises(InvalidRequestError, match="'heartbeat_timeout_ms' must") as info:
            parse_register_broker({**GOOD_EXT, "heartbeat_timeout_ms": bad}, b"")
        assert info.value.field == "heartbeat_timeout_ms"


@pytest.mark.parametrize("change, field, text", [
    ({"cluster_name": None}, "cluster_name", "'cluster_name' is missing"),
    ({"broker_name": 7}, "broker_name", "'broker_name' must be a string, got 7"),
    ({"broker_name": "a b"}, "broker_name", "got 'a b'"),
    # Names no broker can be configured with (remoting.config.name_problem): the table took '.' and refused none.
    ({"cluster_name": "prod.eu"}, "cluster_name", "'cluster_name' must be letters, digits, - or _ .*'prod.eu'"),
    ({"broker_name": "broker.a"}, "broker_name", "got 'broker.a'"),
    ({"broker_name": "x" * 128}, "broker_name", "1 to 127 characters"),
    ({"broker_id": 0}, "broker_id", "'broker_id' must be within 1..9223372036854775807, got 0"),
    ({"broker_id": "1"}, "broker_id", "'broker_id' must be an integer, got '1'"),
    ({"broker_id": True}, "broker_id", "must be an integer, got True"),
    ({"broker_addr": "nohost"}, "broker_addr", "broker_addr must look like HOST:PORT, got 'nohost'"),
    ({"broker_addr": "127.0.0.1:0"}, "broker_addr",
     "^request field broker_addr needs a fixed port .*, got '127.0.0.1:0'$"),
    # Addresses no broker advertises (its service_address is IPv4 and a port): they went into routes as is.
    *(({"broker_addr": addr}, "broker_addr", "must be an IPv4 address and a port, as a broker's service_address")
      for addr in ("[::1]:10911", "::1", "broker-host:10911", "a b:10911")),
    # Ports int() took (parse_host_port now refuses them, for brokers' configs too).
    *(({"broker_addr": addr}, "broker_addr", "must end in a numeric port")
      for addr in ("127.0.0.1:+5", "127.0.0.1:1_0", "127.0.0.1: 5", "127.0.0.1:010911")),
    ({"role": "MASTER"}, "role", "must be one of LEADER, FOLLOWER, CANDIDATE, got 'MASTER'"),
    ({"term": -1}, "term", "'term' must be within 0..9223372036854775807, got -1"),
    # CBOR carries up to 2**64 - 1; such a term outranked every real leader of the group for good.
    ({"term": 2**64 - 1}, "term", "'term' must be within 0..9223372036854775807, got 18446744073709551615"),
    ({"broker_id": 2**63}, "broker_id", "'broker_id' must be within 1..9223372036854775807"),
    ({"data_version": 2**63}, "data_version", "'data_version' must be within 0..9223372036854775807"),
    ({"data_version": 1.5}, "data_version", "must be an integer, got 1.5"),
])
def test_parse_register_broker_names_the_bad_field(change, field, text):
    ext = {k: v for k, v in {**GOOD_EXT, **change}.items() if v is not None}
    with pytest.raises(InvalidRequestError, match=text.replace("(", r"\(")) as info:
        parse_register_broker(ext, b"")
    assert info.value.field == field


def test_unknown_topic_config_keys_are_ignored_as_header_keys_are():
    # A field a newer broker adds must not cost it its registration at a name server not upgraded yet.
    for extra in ({"color": 1}, {7: [1]}, {"attributes": {"+message.type": "FIFO"}}):
        body = cbor2.dumps({"T": {"read_queue_nums": 2, "write_queue_nums": 1, "perm": 6, **extra}})
        assert decode_topic_configs(body) == {"T": TopicConfig(2, 1, 6, 0, False)}


@pytest.mark.parametrize("body, field, text", [
    (b"\xff\xfe", "body", "not valid CBOR"),
    (cbor2.dumps([1, 2]), "body", "must be a CBOR map"),
    (cbor2.dumps({"Bad Topic": {}}), "body topic",
     "^request field 'body topic': topic 'Bad Topic' contains characters "),
    (cbor2.dumps({"T": 5}), "body['T']", "must be a map"),
    (cbor2.dumps({"T": {"read_queue_nums": 1, "perm": 6}}), "body['T'].write_queue_nums", "is missing"),
    (cbor2.dumps({"T": {"read_queue_nums": 1, "write_queue_nums": 1, "perm": 99}}), "body['T'].perm",
     "within 0..15, got 99"),
    (cbor2.dumps({"T": {"read_queue_nums": 1, "write_queue_nums": 1, "perm": 6, "order": 1}}),
     "body['T'].order", "true or false, got 1"),
    # Unhashable values once escaped the fast path's cache lookup as a TypeError (found by fuzzing).
    (cbor2.dumps({"T": {"read_queue_nums": 1, "write_queue_nums": 1, "perm": 6, "order": [7]}}),
     "body['T'].order", "true or false, got [7]"),
    (cbor2.dumps({"T": {"read_queue_nums": {"n": 1}, "write_queue_nums": 1, "perm": 6}}),
     "body['T'].read_queue_nums", "must be an integer"),
])
def test_bad_topic_config_bodies(body, field, text):
    with pytest.raises(InvalidRequestError, match=text.replace("[", r"\[")) as info:
        decode_topic_configs(body)
    assert info.value.field == field


def test_parse_topic_and_unregister():
    assert parse_topic({"topic": "TopicA"}) == "TopicA"
    with pytest.raises(InvalidRequestError, match="'topic' is missing"):
        parse_topic({})
    with pytest.raises(InvalidRequestError, match="^request field 'topic': topic 'a/b' contains characters outside"):
        parse_topic({"topic": "a/b"})
    with pytest.raises(InvalidRequestError, match="^request field 'topic': topic is 128 chars long, more than 127$"):
        parse_topic({"topic": "t" * 128})
    with pytest.raises(InvalidRequestError, match="^request field 'topic': topic must be a non-empty string, got ''$"):
        parse_topic({"topic": ""})
    assert parse_unregister_broker({"cluster_name": "c", "broker_name": "b", "broker_id": 2}) == ("c", "b", 2, None)
    with pytest.raises(InvalidRequestError) as info:
        parse_unregister_broker({"cluster_name": "c", "broker_name": "b"})
    assert info.value.field == "broker_id"
    with pytest.raises(InvalidRequestError, match="within 1..9223372036854775807") as info:
        parse_unregister_broker({"cluster_name": "c", "broker_name": "b", "broker_id": 2**64 - 1})
    assert info.value.field == "broker_id"


# ---- caching: what lets a heartbeat and a route query stay cheap -----------------------------------------

def test_generation_moves_only_when_routes_can_change():
    table = RouteInfoManager()
    three_node_group(table)
    g = table.generation
    three_node_group(table, now_ms=5)                        # heartbeats, nothing new
    table.register_broker(reg(2, "CANDIDATE", 2), now_ms=6, conn_key="conn-2")   # a replica's role: same route
    assert table.generation == g
    for change in (lambda: table.register_broker(reg(3, "LEADER", 3), now_ms=7),          # master moves
                   lambda: table.register_broker(reg(3, "LEADER", 3, topics={"B": RW}), now_ms=8),  # topics
                   lambda: table.register_broker(reg(2, addr="127.0.0.1:1"), now_ms=9,     # address
                                                 conn_key="conn-2"),
                   lambda: table.unregister_broker("DefaultCluster", "broker-a", 1)):      # membership
        change()
        assert table.generation > g
        g = table.generation


def test_topic_config_cache_decodes_a_repeated_body_once():
    cache = TopicConfigCache()
    body = encode_topic_configs({"TopicA": RW, "TopicB": RW})
    first = parse_register_broker(_ext(), body, cache).topic_configs
    assert first == {"TopicA": RW, "TopicB": RW}
    assert first["TopicA"] is first["TopicB"]                # equal settings share one TopicConfig
    assert parse_register_broker(_ext(), bytes(body), cache).topic_configs is not first  # not stored yet
    cache.store(("broker-a", 1), body, first)                # the processor stores it once the table took it
    assert parse_register_broker(_ext(), bytes(body), cache).topic_configs is first
    assert parse_register_broker(_ext(broker_id=2), body, cache).topic_configs is not first  # per node
    changed = encode_topic_configs({"TopicA": RW})
    assert parse_register_broker(_ext(), changed, cache).topic_configs == {"TopicA": RW}
    cache.forget(("broker-a", 1))
    assert parse_register_broker(_ext(), body, cache).topic_configs is not first
    with pytest.raises(InvalidRequestError):
        parse_register_broker(_ext(broker_id=3), b"\xff", cache)


def _ext(**changes) -> dict:
    return {"cluster_name": "DefaultCluster", "broker_name": "broker-a", "broker_id": 1,
            "broker_addr": "127.0.0.1:10911", "role": "LEADER", "term": 1, "data_version": 1, **changes}


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(
    st.text(alphabet="%|_-abcXYZ019", min_size=1, max_size=20),
    st.builds(TopicConfig, st.integers(0, 1 << 16), st.integers(0, 1 << 16), st.integers(0, 15),
              st.integers(0, 2**31 - 1), st.booleans()),
    max_size=20))
def test_topic_configs_round_trip(configs):
    assert decode_topic_configs(encode_topic_configs(configs)) == configs


def test_public_api_is_pinned():
    import namesrv
    assert sorted(namesrv.__all__) == sorted([
        "MASTER_ID", "BrokerData", "ClusterInfo", "EvictedNode", "InvalidRequestError", "NamesrvConfig",
        "NamesrvProcessor", "NodeStatus", "QueueData", "Registration", "RegisterResult", "RouteConflictError",
        "RouteInfoManager", "RouteStatistics", "TopicConfig", "TopicRouteData", "decode_topic_configs",
        "encode_topic_configs", "load_namesrv_config", "serve_namesrv"])
    assert all(hasattr(namesrv, name) for name in namesrv.__all__)
