"""/metrics of a real ``raftmq dev`` cluster (a name server and the 3-node group, every process serving metrics
on a free port it prints): after N sends and a consumer group that consumed part of them, the leader's and a
follower's scrapes agree with what the cluster did, and bad HTTP leaves every server serving."""

from __future__ import annotations

import pytest
import trio

from client import Message, open_admin, open_producer, open_pull_consumer
from tests.cluster.test_e2e_produce_consume import routed_master
from tests.metrics_scrape import exchange, scrape, value
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(240)]

TOPIC = "MetricsTopic"
GROUP = "metrics-cg"
N = 300


async def _produce_and_consume_part(namesrv: str) -> tuple[dict[int, int], dict[int, int], int]:
    """N sends, then the group consumes queue 0 whole and 5 messages of every other queue, committing where it
    stopped: (max offset per queue, committed offset per queue, messages its pulls returned)."""
    async with open_producer(namesrv) as producer:
        async with trio.open_nursery() as nursery:
            for i in range(N):
                nursery.start_soon(producer.send, Message(TOPIC, b"metrics-%04d" % i))
    max_offsets, committed, pulled = {}, {}, 0
    async with open_pull_consumer(namesrv, consumer_group=GROUP) as consumer:
        for mq in sorted(await consumer.fetch_queues(TOPIC), key=lambda q: q.queue_id):
            max_offsets[mq.queue_id] = await consumer.max_offset(mq)
            want = max_offsets[mq.queue_id] if mq.queue_id == 0 else min(5, max_offsets[mq.queue_id])
            offset = 0
            while offset < want:
                result = await consumer.pull(mq, offset, max_nums=min(32, want - offset))
                assert result.messages, result
                offset += len(result.messages)
                pulled += len(result.messages)
            await consumer.commit(mq, offset)
            committed[mq.queue_id] = offset
    return max_offsets, committed, pulled


async def _check(dev_fields: dict[str, str]) -> None:
    namesrv = dev_fields["namesrv"]
    brokers = dev_fields["brokers"].split(",")
    metrics_of = dict(zip(brokers, dev_fields["broker_metrics"].split(",")))
    assert len(metrics_of) == 3 and all(metrics_of.values()), dev_fields
    async with open_admin(namesrv) as admin:
        leader = await routed_master(admin, timeout_s=30)
    max_offsets, committed, pulled = await _produce_and_consume_part(namesrv)
    stored = sum(max_offsets.values())
    expected_lag = stored - sum(committed.values())
    assert stored >= N and 0 < expected_lag < stored and committed[0] == max_offsets[0]

    # The leader's lag follows the replicated offsets (every consumer_offset_flush_interval_ms).
    with trio.fail_after(20):
        while value(lead := await scrape(metrics_of[leader]), "rocketmq_consumer_lag_messages", topic=TOPIC,
                    consumer_group=GROUP) != expected_lag:
            await trio.sleep(0.1)
    assert value(lead, "raftmq_raft_role", role="LEADER") == 1 and value(lead, "raftmq_raft_role", role="FOLLOWER") == 0
    assert value(lead, "raftmq_raft_connected_peers") == 2
    assert value(lead, "rocketmq_messages_in_total", topic=TOPIC, cluster="DefaultCluster",
                 node_id="broker-a") == stored
    assert value(lead, "rocketmq_messages_out_total", topic=TOPIC, consumer_group=GROUP) == pulled
    assert value(lead, "rocketmq_consumer_group_number") == 1

    follower = next(addr for addr in brokers if addr != leader)
    with trio.fail_after(20):  # the follower applies what the leader committed a moment later
        while value(foll := await scrape(metrics_of[follower]), "raftmq_store_commit_log_max_offset") \
                != value(lead, "raftmq_store_commit_log_max_offset"):
            await trio.sleep(0.1)
    assert value(foll, "raftmq_raft_role", role="FOLLOWER") == 1 and value(foll, "raftmq_raft_role", role="LEADER") == 0
    assert value(foll, "raftmq_raft_term") == value(lead, "raftmq_raft_term")
    assert value(foll, "raftmq_raft_leader_changes_total") >= 1
    assert value(foll, "rocketmq_messages_in_total", topic=TOPIC) is None  # acknowledged by the leader only
    assert "rocketmq_consumer_lag_messages" not in foll  # the leader's alone
    assert value(foll, "rocketmq_consumer_group_number") == 1  # the replicated table is everyone's

    names = await scrape(dev_fields["namesrv_metrics"])
    assert value(names, "raftmq_namesrv_brokers", role="LEADER") == 1
    assert value(names, "raftmq_namesrv_brokers", role="FOLLOWER") == 2
    assert value(names, "raftmq_namesrv_route_queries_total", result="found") >= 1

    # Bad HTTP at the leader's and the name server's endpoints: answered, and every server goes on serving.
    for addr in (metrics_of[leader], dev_fields["namesrv_metrics"]):
        for request, status in ((b"GET /admin HTTP/1.1\r\nHost: t\r\n\r\n", 404),
                                (b"POST /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi", 405),
                                (b"not http at all\r\n\r\n", 400),
                                (b"GET /" + b"m" * 16_384 + b" HTTP/1.1\r\n\r\n", 431)):
            assert (await exchange(addr, request)).status == status
    async with open_producer(namesrv) as producer:
        await producer.send(Message(TOPIC, b"after the bad requests"))
    assert value(await scrape(metrics_of[leader]), "rocketmq_messages_in_total", topic=TOPIC) == stored + 1


def test_the_leader_and_a_follower_report_sends_roles_and_lag(spawn, tmp_path):
    dev = spawn(raftmq_argv("--log-level", "WARNING", "dev", "--data-dir", str(tmp_path / "dev"), "--base-port", "0"),
                ready_timeout_s=90)
    dev.wait_output("  metrics: namesrv http://127.0.0.1:")
    trio.run(_check, dev.fields)
