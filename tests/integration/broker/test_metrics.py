"""/metrics of an in-process broker node and name server, scraped over HTTP with a plain trio socket: the figures
follow real sends, pulls and offset commits through the broker protocol."""

from __future__ import annotations

import functools

import pytest
import trio

from broker.node import BrokerNode, serve_broker
from namesrv import NamesrvConfig, serve_namesrv
from raftmq.runner import leaf_exceptions
from remoting.codes import RequestCode, ResponseCode
from remoting.config import ConfigError
from remoting.message import MessageInput, encode_batch
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, wait_leader
from tests.integration.broker.test_broker_node import _send
from tests.metrics_scrape import exchange, scrape, value


async def _start(nursery, tmp_path) -> tuple[str, tuple[str, int], str, tuple[str, int]]:
    """A name server and a one-member group, both serving /metrics: (namesrv, its metrics, broker, its metrics)."""
    namesrv_metrics: list[tuple[str, int]] = []
    host, port = await nursery.start(functools.partial(
        serve_namesrv, NamesrvConfig(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0"),
        on_metrics_serving=namesrv_metrics.append))
    namesrv = f"{host}:{port}"
    (config,) = broker_configs(tmp_path, namesrv, metrics_listen="127.0.0.1:0", consumer_offset_flush_interval_ms=50)
    nodes: list[BrokerNode] = []
    host, port = await nursery.start(functools.partial(serve_broker, config, on_serving=nodes.append))
    assert nodes[0].metrics_address is not None
    return namesrv, namesrv_metrics[0], f"{host}:{port}", nodes[0].metrics_address


async def test_sends_pulls_and_commits_show_in_the_leaders_metrics(nursery, tmp_path):
    namesrv, namesrv_metrics, addr, metrics = await _start(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        bodies = [b"m%03d" % i for i in range(20)]
        for body in bodies:  # 20 single sends to queue 0
            assert (await _send(client, addr, body=body)).code == ResponseCode.SUCCESS
        batch = encode_batch([MessageInput("TopicTest", 1, b"b%d" % i) for i in range(10)], ("127.0.0.1", 1))
        r = await call(client, addr, RequestCode.SEND_BATCH_MESSAGE, {"topic": "TopicTest", "queue_id": 1}, batch)
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert (await _send(client, addr, topic="Other", body=b"x")).code == ResponseCode.SUCCESS

        pull = await call(client, addr, RequestCode.PULL_MESSAGE,
                          {"consumer_group": "cg", "topic": "TopicTest", "queue_id": 0, "queue_offset": 0,
                           "max_msg_nums": 8})
        assert pull.code == ResponseCode.SUCCESS
        # The group consumed 8 of queue 0 and 4 of queue 1: lag 12 + 6.
        for queue_id, offset in ((0, 8), (1, 4)):
            r = await call(client, addr, RequestCode.UPDATE_CONSUMER_OFFSET,
                           {"consumer_group": "cg", "topic": "TopicTest", "queue_id": queue_id,
                            "commit_offset": offset})
            assert r.code == ResponseCode.SUCCESS, r.remark
        for topic in ("TopicTest", "NoSuchTopic"):
            await call(client, namesrv, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic})

    with trio.fail_after(10):  # the offsets are replicated every consumer_offset_flush_interval_ms
        while value(s := await scrape(metrics), "rocketmq_consumer_lag_messages", topic="TopicTest",
                    consumer_group="cg") != 18:
            await trio.sleep(0.05)
    assert value(s, "raftmq_raft_role", role="LEADER") == 1 and value(s, "raftmq_raft_term") >= 1
    assert value(s, "raftmq_raft_leader_changes_total") >= 1
    assert value(s, "raftmq_raft_applied_index") >= 3 and value(s, "raftmq_raft_committed_index") >= 3
    assert value(s, "rocketmq_messages_in_total", topic="TopicTest", node_id="broker-a", member_id="n1") == 30
    assert value(s, "rocketmq_messages_in_total", topic="Other") == 1
    assert value(s, "rocketmq_throughput_in_total", topic="TopicTest") == sum(map(len, bodies)) + len(batch)
    assert value(s, "rocketmq_messages_out_total", topic="TopicTest", consumer_group="cg") == 8
    assert value(s, "rocketmq_throughput_out_total", topic="TopicTest", consumer_group="cg") == len(pull.body)
    # TopicTest, Other and DefaultCluster_REPLY_TOPIC, which every leader creates (RocketMQ's request-reply).
    assert value(s, "rocketmq_topic_number") == 3 and value(s, "rocketmq_consumer_group_number") == 1
    assert value(s, "raftmq_broker_put_requests_total") == 22 and value(s, "raftmq_broker_put_messages_total") == 31
    assert value(s, "raftmq_broker_pulled_messages_total") == 8
    assert value(s, "rocketmq_storage_size_bytes") > 0 and value(s, "raftmq_broker_registrations_total",
                                                                 result="success") >= 1

    n = await scrape(namesrv_metrics)
    assert value(n, "raftmq_namesrv_brokers", role="LEADER", node_type="namesrv", node_id=namesrv) == 1
    assert value(n, "raftmq_namesrv_broker_groups") == 1 and value(n, "raftmq_namesrv_clusters") == 1
    assert value(n, "raftmq_namesrv_broker_groups_without_master") == 0
    assert value(n, "raftmq_namesrv_topics") == 3 and value(n, "raftmq_namesrv_registrations_total") >= 1
    assert value(n, "raftmq_namesrv_route_queries_total", result="found") == 1
    assert value(n, "raftmq_namesrv_route_queries_total", result="not_found") == 1


async def test_bad_http_to_a_broker_leaves_it_serving_scrapes_and_sends(nursery, tmp_path):
    _namesrv, _namesrv_metrics, addr, metrics = await _start(nursery, tmp_path)
    for request, status in ((b"GET /nope HTTP/1.1\r\nHost: t\r\n\r\n", 404),
                            (b"PUT /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n", 405),
                            (b"\x00\x00\x00\x08garbage\r\n\r\n", 400),
                            (b"GET /" + b"x" * 20_000 + b" HTTP/1.1\r\n\r\n", 431)):
        assert (await exchange(metrics, request)).status == status
    # A remoting frame sent to the metrics port, and HTTP sent to the remoting port: each refused, nothing stops.
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        host, port = addr.rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
            with trio.fail_after(5):
                assert await stream.receive_some(100) == b""
        assert (await _send(client, addr)).code == ResponseCode.SUCCESS
    assert value(await scrape(metrics), "rocketmq_messages_in_total", topic="TopicTest") == 1


async def test_a_metrics_address_in_use_stops_the_node_before_it_serves_naming_metrics_listen(tmp_path):
    taken = trio.socket.socket()
    with taken:
        await taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (config,) = broker_configs(tmp_path, None, metrics_listen=f"127.0.0.1:{port}")
        nodes: list[BrokerNode] = []
        with pytest.raises(BaseException) as raised:
            async with trio.open_nursery() as nursery:
                await nursery.start(functools.partial(serve_broker, config, on_serving=nodes.append))
    errors = leaf_exceptions(raised.value)
    assert [type(e) for e in errors] == [ConfigError] and not nodes
    assert str(errors[0]) == f"metrics_listen '127.0.0.1:{port}' cannot be listened on: Address already in use"
