"""``raftmq admin update-topic-perm`` against a real ``raftmq dev`` (mqadmin's updateTopicPerm): only the
permission changes, on every node of the group; a dead-letter topic, created write-only, becomes readable. Also
NAMESRV_ADDR, read by ``raftmq admin`` and by clients when no name server is given."""

from __future__ import annotations

import json
import os
import subprocess
import time

import cbor2
import pytest
import trio

from client import Message, MessageQueue, open_admin, open_producer, open_pull_consumer
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError
from remoting.transport import open_remoting_client
from tests.cluster.test_admin_cli import _admin, _admin_json
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

GROUP = "PermGroup"
DLQ = f"%DLQ%{GROUP}"


def _cluster_from_env(namesrv: str) -> dict:
    """``raftmq admin cluster`` as its own process, told the name server by NAMESRV_ADDR only; polled until the
    group has a leader and three nodes (they register within a second of their ready lines)."""
    env = {**os.environ, "NAMESRV_ADDR": namesrv}
    while True:
        done = subprocess.run(raftmq_argv("--log-level", "WARNING", "admin", "--json", "cluster"), env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        [group] = json.loads(done.stdout.strip().splitlines()[-1])["groups"] or [None]
        if group and group["leader_addr"] and len(group["nodes"]) == 3:
            return group
        time.sleep(0.3)


async def _topic_configs(addrs: list[str], topic: str) -> list[dict]:
    """``topic``'s config on each node, once every node holds what the first (the leader) holds."""
    async with open_remoting_client() as client:
        while True:
            configs = []
            for addr in addrs:
                r = await client.invoke(addr, make_request(RequestCode.GET_ALL_TOPIC_CONFIG))
                assert r.code == ResponseCode.SUCCESS, (addr, r.remark)
                configs.append(cbor2.loads(r.body)["topic_configs"].get(topic))
            if all(c == configs[0] for c in configs):  # followers apply the change a moment after the leader
                return configs
            await trio.sleep(0.1)


async def _send_to_dead_letters() -> None:
    """One message of DeadTopic handed back to its broker straight into GROUP's dead-letter topic; the clients
    find the name servers through NAMESRV_ADDR (set by the caller), given none."""
    mq = MessageQueue("DeadTopic", "broker-a", 0)
    async with open_admin() as admin:
        await admin.create_topic("DeadTopic")
    async with open_producer() as producer:
        await producer.send(Message("DeadTopic", b"dead letter"), queue=mq)
    async with open_pull_consumer(consumer_group=GROUP) as consumer:
        [message] = (await consumer.pull(mq, 0, 1)).messages
        await consumer._api.send_back(mq, message, 16, delay_level=-1)  # -1: to the DLQ at once


async def _pull_dead_letters(namesrv: str) -> list[bytes]:
    async with open_pull_consumer(namesrv, consumer_group="DeadReader") as consumer:
        return [m.body for m in (await consumer.pull(MessageQueue(DLQ, "broker-a", 0), 0, 8)).messages]


def test_update_topic_perm_changes_only_the_perm_and_makes_dead_letters_readable(spawn, tmp_path, monkeypatch):
    dev = spawn(raftmq_argv("--log-level", "WARNING", "dev", "--data-dir", str(tmp_path / "dev"), "--base-port", "0"),
                ready_timeout_s=90)
    namesrv = dev.fields["namesrv"]
    group = _cluster_from_env(namesrv)
    nodes = [group["leader_addr"]] + sorted(n["broker_addr"] for n in group["nodes"]
                                            if n["broker_addr"] != group["leader_addr"])

    # 16 queues and ordered: create-topic --perm 4 would have made it 8 and 8, unordered.
    _admin(namesrv, "create-topic", "PermTopic", "--read-queues", "16", "--write-queues", "12", "--order")
    done = _admin_json(namesrv, "update-topic-perm", "PermTopic", "--perm", "4")
    assert done["groups"] == [{"broker_name": "broker-a", "previous_perm": 6, "perm": 4, "changed": True,
                               "read_queue_nums": 16, "write_queue_nums": 12, "order": True}]
    # Re-registered before the leader answered: the route says so at once.
    assert done["route"]["queue_datas"] == [{"broker_name": "broker-a", "read_queue_nums": 16,
                                             "write_queue_nums": 12, "perm": 4}]
    configs = trio.run(_topic_configs, nodes, "PermTopic")
    assert configs[0] == {"topic_name": "PermTopic", "read_queue_nums": 16, "write_queue_nums": 12, "perm": 4,
                          "topic_filter_type": "SINGLE_TAG", "topic_sys_flag": 0, "order": True}
    again = _admin(namesrv, "update-topic-perm", "PermTopic", "--perm", "4", "--broker", "broker-a").stdout
    assert "broker-a: perm of PermTopic already 4, unchanged" in again

    # The dead letters of a group: write-only as the broker creates them, readable once the perm says so.
    monkeypatch.setenv("NAMESRV_ADDR", namesrv)
    trio.run(_send_to_dead_letters)
    assert _admin_json(namesrv, "route", DLQ)["queue_datas"][0]["perm"] == 2
    with pytest.raises(RaftMQError, match="not readable"):
        trio.run(_pull_dead_letters, namesrv)
    text = _admin(namesrv, "update-topic-perm", DLQ, "--perm", "6").stdout
    assert f"broker-a: perm of {DLQ} 2 -> 6 (read queues 1, write queues 1 kept)" in text
    assert trio.run(_pull_dead_letters, namesrv) == [b"dead letter"]
    assert trio.run(_topic_configs, nodes, DLQ)[0]["perm"] == 6

    # Refusals: the cluster's, exit 1 naming what is missing.
    missing = _admin(namesrv, "update-topic-perm", "NoSuchTopic", "--perm", "6", expect_rc=1)
    assert "topic 'NoSuchTopic' is on none of broker group(s) broker-a" in missing.stderr
    unknown = _admin(namesrv, "update-topic-perm", "PermTopic", "--perm", "6", "--broker", "broker-zz", expect_rc=1)
    assert "broker-zz" in unknown.stderr
