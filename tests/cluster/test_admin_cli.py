"""``raftmq admin`` against a real ``raftmq dev``: what each command reports is checked against what the
cluster is (one leader among three nodes, the topic it just created), and refusals exit 1 naming the cause."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import trio

from client import Message, MessageQueue, open_producer, open_pull_consumer
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def _admin(namesrv: str, *args: str, expect_rc: int = 0) -> subprocess.CompletedProcess:
    done = subprocess.run(raftmq_argv("--log-level", "WARNING", "admin", "--namesrv", namesrv, *args),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == expect_rc, (args, done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    return done


def _admin_json(namesrv: str, *args: str) -> dict:
    return json.loads(_admin(namesrv, "--json", *args).stdout.strip().splitlines()[-1])


def test_admin_reports_the_group_creates_routes_and_deletes_a_topic(spawn, tmp_path):
    dev = spawn(raftmq_argv("--log-level", "WARNING", "dev", "--data-dir", str(tmp_path / "dev"), "--base-port", "0"),
                ready_timeout_s=90)
    namesrv, brokers = dev.fields["namesrv"], dev.fields["brokers"].split(",")

    deadline = time.monotonic() + 30
    while True:  # the nodes register within a second of their ready lines; the leader may still be elected
        groups = _admin_json(namesrv, "cluster")["groups"]
        if groups and groups[0]["leader_addr"] and len(groups[0]["nodes"]) == 3:
            break
        assert time.monotonic() < deadline, groups
        time.sleep(0.3)
    [group] = groups
    assert group["broker_name"] == "broker-a"
    assert sorted(n["broker_addr"] for n in group["nodes"]) == sorted(brokers)
    leaders = [n for n in group["nodes"] if n["role"] == "LEADER"]
    assert len(leaders) == 1 and leaders[0]["broker_addr"] == group["leader_addr"]
    table = _admin(namesrv, "cluster").stdout
    assert "broker-a" in table and group["leader_addr"] in table and "LEADER" in table

    created = _admin_json(namesrv, "create-topic", "AdminTopic", "--read-queues", "4", "--write-queues", "2")
    assert created["route"]["queue_datas"] == [{"broker_name": "broker-a", "read_queue_nums": 4,
                                                 "write_queue_nums": 2, "perm": 6}]
    assert "AdminTopic" in _admin_json(namesrv, "topics")["topics"]
    route = _admin_json(namesrv, "route", "AdminTopic")
    assert route["broker_datas"][0]["broker_addrs"]["0"] == group["leader_addr"]

    status = _admin_json(namesrv, "status")["nodes"]
    assert list(status) == [group["leader_addr"]] and status[group["leader_addr"]]["role"] == "LEADER"
    follower = next(a for a in brokers if a != group["leader_addr"])
    assert _admin_json(namesrv, "status", "--addr", follower)["nodes"][follower]["role"] == "FOLLOWER"

    # Consumer progress: 15 messages in each write queue, the group committed 10 of queue 0 and 5 of queue 1.
    trio.run(_produce_and_commit, namesrv, {0: 10, 1: 5})
    progress = _admin_json(namesrv, "consumer-progress", "AdminGroup")
    assert progress["total_lag"] == 15 and progress["consumer_group"] == "AdminGroup"
    assert [(q["topic"], q["broker_name"], q["queue_id"], q["broker_offset"], q["consumer_offset"], q["lag"])
            for q in progress["queues"]] == [("AdminTopic", "broker-a", 0, 15, 10, 5),
                                             ("AdminTopic", "broker-a", 1, 15, 5, 10),
                                             ("AdminTopic", "broker-a", 2, 0, None, 0),
                                             ("AdminTopic", "broker-a", 3, 0, None, 0)]
    assert all(q["last_timestamp"] > 0 for q in progress["queues"][:2])
    assert _admin_json(namesrv, "consumer-progress", "AdminGroup", "--topic", "AdminTopic") == progress
    text = _admin(namesrv, "consumer-progress", "AdminGroup").stdout
    assert "AdminGroup" in text and "total lag: 15" in text
    idle = _admin(namesrv, "consumer-progress", "IdleGroup", expect_rc=1)
    assert "IdleGroup" in idle.stderr and "no progress" in idle.stderr
    bad = _admin(namesrv, "consumer-progress", "bad group", expect_rc=2)
    assert "'bad group'" in bad.stderr

    _admin(namesrv, "delete-topic", "AdminTopic")
    deadline = time.monotonic() + 30
    while "AdminTopic" in _admin_json(namesrv, "topics")["topics"]:  # gone once the leader re-registers
        assert time.monotonic() < deadline, "the deleted topic is still routed"
        time.sleep(0.3)

    # Refusals: the cluster's own reason, exit status 1; a bad argument: exit status 2 naming it.
    bad_topic = _admin(namesrv, "create-topic", "bad topic!", expect_rc=1)
    assert "bad topic!" in bad_topic.stderr
    missing = _admin(namesrv, "route", "NoSuchTopic", expect_rc=1)
    assert "NoSuchTopic" in missing.stderr
    unknown_group = _admin(namesrv, "status", "--broker", "broker-zz", expect_rc=1)
    assert "broker-zz" in unknown_group.stderr
    bad_perm = _admin(namesrv, "create-topic", "T", "--perm", "8", expect_rc=2)
    assert "--perm" in bad_perm.stderr and "8" in bad_perm.stderr


async def _produce_and_commit(namesrv: str, commits: dict[int, int]) -> None:
    async with open_producer(namesrv) as producer:
        for queue_id in commits:
            for i in range(15):
                await producer.send(Message("AdminTopic", b"m%d" % i),
                                    queue=MessageQueue("AdminTopic", "broker-a", queue_id))
    async with open_pull_consumer(namesrv, consumer_group="AdminGroup") as consumer:
        for queue_id, offset in commits.items():
            await consumer.commit(MessageQueue("AdminTopic", "broker-a", queue_id), offset)
