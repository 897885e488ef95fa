"""``raftmq admin consumer-status`` (mqadmin consumerStatus: GET_CONSUMER_RUNNING_INFO relayed by the leader to a
running push consumer), ``clone-group-offset`` (cloneGroupOffset), the consume type in ``consumer-connection``, the
subscription group config a heartbeat creates and ``delete-group``'s report of it, against one real ``raftmq dev``."""

from __future__ import annotations

import json
import time

import cbor2
import pytest
import trio

from client import Message, MessageQueue, open_producer, open_push_consumer
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.cluster.test_admin_cli import _admin, _admin_json, _wait_for_leader
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

TOPIC = "StatusTopic"


async def _send(namesrv: str, prefix: str, per_queue: int) -> None:
    async with open_producer(namesrv) as producer:
        for queue_id in (0, 1):
            for i in range(per_queue):
                await producer.send(Message(TOPIC, f"{prefix}-{queue_id}-{i}".encode()),
                                    queue=MessageQueue(TOPIC, "broker-a", queue_id))


def _admin_in_thread(namesrv: str, *args: str, expect_rc: int | None = 0):
    return trio.to_thread.run_sync(lambda: _admin(namesrv, *args, expect_rc=expect_rc))


async def _status_of_a_running_consumer(namesrv: str) -> None:
    handled: list[bytes] = []

    async def handler(msg) -> None:
        handled.append(msg.body)

    await _send(namesrv, "old", 10)
    async with open_push_consumer(namesrv, topic=TOPIC, consumer_group="StatusGroup", handler=handler,
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", max_concurrent_handlers=3,
                                  persist_consumer_offset_interval_ms=100) as consumer:
        with trio.fail_after(30):  # liveness
            while len(handled) < 20:
                await trio.sleep(0.05)
        await trio.sleep(0.5)  # its offsets handed to its store, and committed
        done = await _admin_in_thread(namesrv, "--json", "consumer-status", "-g", "StatusGroup")
        [member] = json.loads(done.stdout)["members"]
        assert member["client_id"] == consumer.client_id and member["broker_name"] == "broker-a"
        props = member["properties"]
        assert (props["consume_type"], props["message_model"], props["max_concurrent_handlers"]) == (
            "CONSUME_PASSIVELY", "CLUSTERING", 3)
        assert member["subscriptions"] == {TOPIC: "*", "%RETRY%StatusGroup": "*"}
        rows = {(q["topic"], q["queue_id"]): q for q in member["queues"]}
        for queue_id in (0, 1):
            row = rows[(TOPIC, queue_id)]
            assert (row["committed_offset"], row["cached_msg_count"], row["cached_msg_min_offset"]) == (10, 0, None)
            assert row["last_pull_timestamp"] and row["last_consume_timestamp"]
        status = member["status"][TOPIC]
        assert status["pull_tps"] > 0 and status["consume_ok_tps"] > 0 and status["consume_failed_msgs"] == 0
        text = (await _admin_in_thread(namesrv, "consumer-status", "-g", "StatusGroup", "-i", consumer.client_id,
                                       "--jstack")).stdout
        assert f"consumer {consumer.client_id} of group StatusGroup" in text and "CONSUME_PASSIVELY (push)" in text
        assert "queues held by" in text and "task dump of" in text
        members = json.loads((await _admin_in_thread(namesrv, "--json", "consumer-connection", "StatusGroup")).stdout)
        assert (members["consume_type"], members["message_model"]) == ("CONSUME_PASSIVELY", "CLUSTERING")
        text = (await _admin_in_thread(namesrv, "consumer-connection", "StatusGroup")).stdout
        assert "consume type: CONSUME_PASSIVELY (push)" in text
        gone = await _admin_in_thread(namesrv, "consumer-status", "-g", "StatusGroup", "-i", "10.0.0.9@1#x#1",
                                      expect_rc=1)
        assert "the consumer '10.0.0.9@1#x#1' of group 'StatusGroup' is not online" in gone.stderr


async def _clone_then_consume(namesrv: str) -> None:
    await _send(namesrv, "new", 2)
    handled: list[bytes] = []

    async def handler(msg) -> None:
        handled.append(msg.body)

    # From the first offset if the group had none: all 24 messages. It has StatusGroup's: the 4 sent since.
    async with open_push_consumer(namesrv, topic=TOPIC, consumer_group="CloneGroup", handler=handler,
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET"):
        with trio.fail_after(30):  # liveness
            while len(handled) < 4:
                await trio.sleep(0.05)
        await trio.sleep(1)  # nothing else comes
    assert sorted(handled) == sorted(f"new-{q}-{i}".encode() for q in (0, 1) for i in range(2))


async def _heartbeat(namesrv: str, leader: str) -> None:
    body = cbor2.dumps({"client_id": "10.0.0.8@1#hb#1", "consumers": [{"consumer_group": "HbGroup",
                                                                      "subscriptions": [{"topic": TOPIC}]}]})
    async with open_remoting_client() as client:
        r = await client.invoke(leader, make_request(RequestCode.HEART_BEAT, body=body))
        assert r.code == ResponseCode.SUCCESS, r.remark
        with trio.fail_after(30):  # liveness: created in a task of the leader, replicated
            while True:
                done = await _admin_in_thread(namesrv, "--json", "sub-group-list", "-g", "HbGroup", expect_rc=None)
                if done.returncode == 0:
                    break
                await trio.sleep(0.2)
    [config] = json.loads(done.stdout)["subscription_groups"]
    assert (config["group_name"], config["broker_name"], config["consume_enable"]) == ("HbGroup", "broker-a", True)


def test_consumer_status_clone_group_offset_and_group_configs(spawn, tmp_path):
    dev = spawn(raftmq_argv("--log-level", "WARNING", "dev", "--data-dir", str(tmp_path / "dev"), "--base-port", "0"),
                ready_timeout_s=90)
    namesrv = dev.fields["namesrv"]
    [group] = _wait_for_leader(namesrv)
    _admin(namesrv, "create-topic", TOPIC, "--read-queues", "2", "--write-queues", "2")

    trio.run(_status_of_a_running_consumer, namesrv)
    offline = _admin(namesrv, "consumer-status", "-g", "NobodyGroup", expect_rc=1)
    assert "consumer group 'NobodyGroup' has no member online" in offline.stderr

    done = _admin_json(namesrv, "clone-group-offset", "-s", "StatusGroup", "-d", "CloneGroup", "-t", TOPIC)
    assert [(q["broker_name"], q["queue_id"], q["previous"], q["offset"]) for q in done["queues"]] == [
        ("broker-a", 0, None, 10), ("broker-a", 1, None, 10)]
    assert done["consumer_ids"] == {"broker-a": []}
    trio.run(_clone_then_consume, namesrv)
    nothing = _admin(namesrv, "clone-group-offset", "-s", "NobodyGroup", "-d", "CloneGroup", "-t", TOPIC,
                     expect_rc=1)
    assert "'NobodyGroup' has no committed offset of topic 'StatusTopic'" in nothing.stderr
    same = _admin(namesrv, "clone-group-offset", "-s", "A", "-d", "A", "-t", TOPIC, expect_rc=2)
    assert "--src-group and --dest-group are both 'A'" in same.stderr

    trio.run(_heartbeat, namesrv, group["leader_addr"])

    assert json.loads(_delete_group(namesrv, "--json", "CloneGroup").stdout)["config_removed_from"] == ["broker-a"]
    assert "its subscription group config removed from broker-a" in _delete_group(namesrv, "HbGroup").stdout
    text = _admin(namesrv, "delete-group", "NeverGroup").stdout
    assert "it had no subscription group config on any group asked" in text


def _delete_group(namesrv: str, *args: str):
    deadline = time.monotonic() + 30
    while True:  # a member that left may still be listed by the leader for a moment (refused: online)
        done = _admin(namesrv, "delete-group", *args, expect_rc=None)
        if done.returncode == 0:
            return done
        assert time.monotonic() < deadline, done.stderr
        time.sleep(0.3)
