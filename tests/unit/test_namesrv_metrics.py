"""The name server collector's output, parsed back: nodes by role, groups without a master, removals by reason
and route queries, from a real route table and processor."""

from __future__ import annotations

from prometheus_client import generate_latest

from namesrv.metrics import namesrv_metrics_registry
from namesrv.processor import NamesrvProcessor
from namesrv.route_info import RouteInfoManager
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from tests.metrics_scrape import parse_samples, value
from tests.unit.test_route_info import reg, three_node_group


async def test_nodes_groups_removals_and_route_queries():
    table = RouteInfoManager(broker_expired_ms=1000)
    processor = NamesrvProcessor(table, clock_ms=lambda: 0)
    three_node_group(table)  # broker-a: node 1 leads
    table.register_broker(reg(1, "FOLLOWER", broker_name="broker-b", topics={}), now_ms=0, conn_key="b-1")
    table.register_broker(reg(2, "CANDIDATE", broker_name="broker-b", topics={}), now_ms=5000, conn_key="b-2")
    for topic, code in (("TopicA", ResponseCode.SUCCESS), ("TopicA", ResponseCode.SUCCESS),
                        ("Missing", ResponseCode.TOPIC_NOT_EXIST)):
        answer = await processor.handle(make_request(RequestCode.GET_ROUTEINFO_BY_TOPIC, ext={"topic": topic}), None)
        assert answer is not None and answer.code == code

    registry = namesrv_metrics_registry(processor, node_id="10.0.0.1:9876")
    s = parse_samples(generate_latest(registry).decode())
    assert value(s, "raftmq_namesrv_brokers", role="LEADER", node_type="namesrv", node_id="10.0.0.1:9876") == 1
    assert value(s, "raftmq_namesrv_brokers", role="FOLLOWER") == 3
    assert value(s, "raftmq_namesrv_brokers", role="CANDIDATE") == 1
    assert value(s, "raftmq_namesrv_broker_groups") == 2 and value(s, "raftmq_namesrv_clusters") == 1
    assert value(s, "raftmq_namesrv_broker_groups_without_master") == 1  # broker-b is electing
    assert value(s, "raftmq_namesrv_topics") == 1 and value(s, "raftmq_namesrv_registrations_total") == 5
    assert value(s, "raftmq_namesrv_route_queries_total", result="found") == 2
    assert value(s, "raftmq_namesrv_route_queries_total", result="not_found") == 1
    assert all(value(s, "raftmq_namesrv_node_removals_total", reason=r) == 0
               for r in ("expired", "connection_closed", "unregistered"))

    table.unregister_broker("DefaultCluster", "broker-a", 3)
    table.connection_closed("conn-2")
    table.scan_not_active(now_ms=3000)  # broker-b node 1 registered at 0, node 2 at 5000; broker-a's at 0
    s = parse_samples(generate_latest(registry).decode())
    assert value(s, "raftmq_namesrv_node_removals_total", reason="unregistered") == 1
    assert value(s, "raftmq_namesrv_node_removals_total", reason="connection_closed") == 1
    assert value(s, "raftmq_namesrv_node_removals_total", reason="expired") == 2
    assert value(s, "raftmq_namesrv_brokers", role="CANDIDATE") == 1 and value(s, "raftmq_namesrv_topics") == 0
