"""``raftmq admin`` against a real ``raftmq dev``: what each command reports is checked against what the
cluster is (one leader among three nodes, the topic it just created), and refusals exit 1 naming the cause."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import subprocess
import time

import cbor2
import pytest
import trio

from client import Message, MessageQueue, SendResult, open_producer, open_pull_consumer, open_push_consumer
from raftmq import cli
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def _admin(namesrv: str, *args: str, expect_rc: int | None = 0, process: bool = False) -> subprocess.CompletedProcess:
    """One ``raftmq admin`` command, in this process (what the entry point runs: argument checks, the command,
    its output and exit status, without a new interpreter's 0.4 s per call) or, with ``process``, as its own."""
    argv = ["--log-level", "WARNING", "admin", "--namesrv", namesrv, *args]
    if process:
        done = subprocess.run(raftmq_argv(*argv), capture_output=True, text=True, timeout=60)
    else:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(argv)
            except SystemExit as e:  # argparse's and the CLI's own "error: ..." exits
                rc = e.code
        done = subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())
    assert expect_rc is None or done.returncode == expect_rc, (args, done.returncode, done.stdout[-2000:],
                                                               done.stderr[-2000:])
    return done


def _admin_json(namesrv: str, *args: str) -> dict:
    out = _admin(namesrv, "--json", *args).stdout.strip().splitlines()
    assert len(out) == 1, out  # --json: one line
    return json.loads(out[0])


def _wait_for_leader(namesrv: str) -> list[dict]:
    deadline = time.monotonic() + 30
    while True:  # the nodes register within a second of their ready lines; the leader may still be elected
        groups = _admin_json(namesrv, "cluster")["groups"]
        if groups and groups[0]["leader_addr"] and len(groups[0]["nodes"]) == 3:
            return groups
        assert time.monotonic() < deadline, groups
        time.sleep(0.3)


def test_admin_reports_the_group_creates_routes_and_deletes_a_topic(spawn, tmp_path):
    dev = spawn(raftmq_argv("--log-level", "WARNING", "dev", "--data-dir", str(tmp_path / "dev"), "--base-port", "0"),
                ready_timeout_s=90)
    namesrv, brokers = dev.fields["namesrv"], dev.fields["brokers"].split(",")

    [group] = _wait_for_leader(namesrv)
    assert group["broker_name"] == "broker-a"
    assert sorted(n["broker_addr"] for n in group["nodes"]) == sorted(brokers)
    leaders = [n for n in group["nodes"] if n["role"] == "LEADER"]
    assert len(leaders) == 1 and leaders[0]["broker_addr"] == group["leader_addr"]
    table = _admin(namesrv, "cluster", process=True).stdout
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
    # getBrokerConfig: a follower tells its own effective config, the defaults it was left included, never the
    # cluster secret (raftmq dev writes one into every node's file).
    config = _admin_json(namesrv, "broker-config", "--addr", follower)["nodes"][follower]
    assert config["dledger"]["members"][0]["service_address"] in brokers
    assert config["dledger"]["secret"] == "<set>" and config["long_polling_timeout_ms"] == 15_000
    text = _admin(namesrv, "broker-config").stdout
    assert f"config of broker node {group['leader_addr']}" in text and "store.flush_disk_type" in text
    assert "<set>" in text

    # Consumer progress: 15 messages in each write queue, the group committed 10 of queue 0 and 5 of queue 1.
    sent = trio.run(_produce_and_commit, namesrv, {0: 10, 1: 5})
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

    status = _admin_json(namesrv, "topic-status", "AdminTopic")["queues"]
    assert [(q["queue_id"], q["min_offset"], q["max_offset"]) for q in status] == [(0, 0, 15), (1, 0, 15),
                                                                                  (2, 0, 0), (3, 0, 0)]
    assert status[0]["last_update_timestamp"] >= progress["queues"][0]["last_timestamp"]  # message 14 vs 9
    assert "status of AdminTopic" in _admin(namesrv, "topic-status", "AdminTopic").stdout
    offline = _admin(namesrv, "consumer-connection", "AdminGroup", expect_rc=1)
    assert "'AdminGroup' has no member online" in offline.stderr

    # Message lookups: by key, by the broker's offset id, by the producer's unique id; each finds the same one.
    result = sent[(0, 3)]
    [by_key] = _admin_json(namesrv, "query-msg-key", "AdminTopic", "key-0-3")["messages"]
    assert (by_key["queue_id"], by_key["queue_offset"], by_key["keys"]) == (0, 3, ["key-0-3", "shared"])
    assert (by_key["msg_id"], by_key["offset_msg_id"]) == (result.msg_id, result.offset_msg_id)
    assert base64.b64decode(by_key["body_base64"]) == b"m3" and by_key["tags"] == "TagQ0"
    assert _admin_json(namesrv, "query-msg-id", result.offset_msg_id)["messages"] == [by_key]
    body_file = tmp_path / "body.bin"
    by_uniq = _admin_json(namesrv, "query-msg-id", result.msg_id, "--topic", "AdminTopic", "--body-file",
                          str(body_file))
    assert by_uniq["messages"] == [by_key] and body_file.read_bytes() == b"m3"
    shown = _admin(namesrv, "query-msg-id", result.offset_msg_id).stdout
    assert result.msg_id in shown and "key-0-3" in shown and "m3" in shown
    several = _admin_json(namesrv, "query-msg-key", "AdminTopic", "shared", "--max", "4")["messages"]
    assert len(several) == 4 and all("shared" in m["keys"] for m in several)
    stamps = [m["store_timestamp"] for m in several]
    assert stamps == sorted(stamps, reverse=True)
    absent = _admin(namesrv, "query-msg-key", "AdminTopic", "no-such-key", expect_rc=1)
    assert "no-such-key" in absent.stderr
    elsewhere = _admin(namesrv, "query-msg-id", "7F00000100000001" + "0" * 16, expect_rc=1)
    assert "127.0.0.1:1" in elsewhere.stderr
    unknown_uniq = _admin(namesrv, "query-msg-id", "AB" * 12, "--topic", "AdminTopic", expect_rc=1)
    assert "AB" * 12 in unknown_uniq.stderr
    needs_topic = _admin(namesrv, "query-msg-id", result.msg_id, expect_rc=2)
    assert "--topic" in needs_topic.stderr
    bad_max = _admin(namesrv, "query-msg-key", "AdminTopic", "k", "--max", "65", expect_rc=2)
    assert "--max" in bad_max.stderr and "65" in bad_max.stderr

    # Delayed messages: one of 1 s, delivered within seconds, and one of 2 h (level 18), still waiting.
    trio.run(_send_delayed, namesrv)
    deadline = time.monotonic() + 30
    while True:
        [levels] = _admin_json(namesrv, "delay-offsets")["nodes"].values()
        if levels[0]["delivered_offset"] == 1:
            break
        assert time.monotonic() < deadline, levels[0]
        time.sleep(0.3)
    assert len(levels) == 18 and [r["level"] for r in levels] == list(range(1, 19))
    assert levels[0] == {"level": 1, "delay_ms": 1000, "delivered_offset": 1, "max_offset": 1, "waiting": 0}
    assert levels[17] == {"level": 18, "delay_ms": 7_200_000, "delivered_offset": 0, "max_offset": 1, "waiting": 1}
    [on_follower] = _admin_json(namesrv, "delay-offsets", "--addr", follower)["nodes"].values()
    assert on_follower[17]["max_offset"] == 1  # a follower answers from its own replica
    table = _admin(namesrv, "delay-offsets", "--broker", "broker-a").stdout
    assert "delayed messages on broker node" in table and "2h" in table

    _admin(namesrv, "delete-topic", "AdminTopic")
    deadline = time.monotonic() + 30
    while "AdminTopic" in _admin_json(namesrv, "topics")["topics"]:  # gone once the leader re-registers
        assert time.monotonic() < deadline, "the deleted topic is still routed"
        time.sleep(0.3)

    # Refusals: the cluster's own reason, exit status 1; a bad argument: exit status 2 naming it.
    bad_topic = _admin(namesrv, "create-topic", "bad topic!", expect_rc=2)
    assert "TOPIC 'bad topic!' contains illegal characters" in bad_topic.stderr
    missing = _admin(namesrv, "route", "NoSuchTopic", expect_rc=1)
    assert "NoSuchTopic" in missing.stderr
    unknown_group = _admin(namesrv, "status", "--broker", "broker-zz", expect_rc=1)
    assert "broker-zz" in unknown_group.stderr
    bad_perm = _admin(namesrv, "create-topic", "T", "--perm", "8", expect_rc=2, process=True)
    assert "--perm" in bad_perm.stderr and "8" in bad_perm.stderr


async def _send_delayed(namesrv: str) -> None:
    async with open_producer(namesrv) as producer:
        for level in (1, 18):
            await producer.send(Message("AdminTopic", b"delayed %d" % level, delay_level=level))


async def _produce_and_commit(namesrv: str, commits: dict[int, int]) -> dict[tuple[int, int], SendResult]:
    """15 messages into each queue of ``commits``, then the group's offsets; returns the sends' results."""
    sent = {}
    async with open_producer(namesrv) as producer:
        for queue_id in commits:
            for i in range(15):
                message = Message("AdminTopic", b"m%d" % i, tags=f"TagQ{queue_id}",
                                  keys=[f"key-{queue_id}-{i}", "shared"])
                sent[(queue_id, i)] = await producer.send(message, queue=MessageQueue("AdminTopic", "broker-a",
                                                                                       queue_id))
    async with open_pull_consumer(namesrv, consumer_group="AdminGroup") as consumer:
        for queue_id, offset in commits.items():
            await consumer.commit(MessageQueue("AdminTopic", "broker-a", queue_id), offset)
    return sent


def test_admin_resets_a_groups_offsets_and_its_online_members_follow(spawn, tmp_path):
    dev = spawn(raftmq_argv("--log-level", "WARNING", "dev", "--data-dir", str(tmp_path / "dev"), "--base-port", "0"),
                ready_timeout_s=90)
    namesrv, brokers = dev.fields["namesrv"], dev.fields["brokers"].split(",")
    _wait_for_leader(namesrv)
    _admin(namesrv, "create-topic", "ResetTopic", "--read-queues", "2", "--write-queues", "2")
    trio.run(_reset_while_consuming, namesrv, brokers)

    # Offline: the next member starts where the reset put the group.
    done = _admin_json(namesrv, "reset-offset", "ResetGroup", "ResetTopic", "--to", "latest")
    assert [(q["queue_id"], q["offset"]) for q in done["queues"]] == [(0, 20), (1, 20)]
    assert done["consumer_ids"] == {"broker-a": []}
    progress = _admin_json(namesrv, "consumer-progress", "ResetGroup")
    assert progress["total_lag"] == 0
    text = _admin(namesrv, "reset-offset", "ResetGroup", "ResetTopic", "--to", "1970-01-01T00:00:00Z").stdout
    assert "ResetGroup" in text and "members online told to pull from the new offsets: 0" in text
    assert _admin_json(namesrv, "consumer-progress", "ResetGroup")["total_lag"] == 40

    bad_when = _admin(namesrv, "reset-offset", "ResetGroup", "ResetTopic", "--to", "yesterday", expect_rc=2)
    assert "--to" in bad_when.stderr and "yesterday" in bad_when.stderr
    missing = _admin(namesrv, "reset-offset", "ResetGroup", "NoSuchTopic", "--to", "now", expect_rc=1)
    assert "NoSuchTopic" in missing.stderr

    # The group runs no more: deleting it removes its offsets (mqadmin deleteSubGroup -r), and a member started
    # afterwards finds none (consumer-progress has nothing to show).
    done = _admin_json(namesrv, "delete-group", "ResetGroup")
    assert done == {"consumer_group": "ResetGroup", "removed_offsets": {"broker-a": 2}, "retry_topic_deleted_from": [],
                    "config_removed_from": ["broker-a"]}
    gone = _admin(namesrv, "consumer-progress", "ResetGroup", expect_rc=1)
    assert "has no progress" in gone.stderr
    assert _admin_json(namesrv, "delete-group", "ResetGroup")["removed_offsets"] == {"broker-a": 0}
    assert "'bad group'" in _admin(namesrv, "delete-group", "bad group", expect_rc=2).stderr

    trio.run(_producers_listed, namesrv)
    assert "has no producer online" in _admin(namesrv, "producer-connection", "AdminPG", expect_rc=1).stderr


async def _producers_listed(namesrv: str) -> None:
    async with open_producer(namesrv, producer_group="AdminPG") as producer:
        await producer.send(Message("ResetTopic", b"p"))  # its heartbeats reach the group it sends to
        with trio.fail_after(30):  # liveness: the first heartbeat follows the route
            while True:
                done = await trio.to_thread.run_sync(lambda: _admin(namesrv, "--json", "producer-connection",
                                                                    "AdminPG", expect_rc=None))
                if done.returncode == 0:
                    break
                await trio.sleep(0.2)
        [row] = json.loads(done.stdout)["connections"]
        assert row["client_id"] == producer.client_id and row["broker_names"] == ["broker-a"]


async def _reset_while_consuming(namesrv: str, brokers: list[str]) -> None:
    async with open_producer(namesrv) as producer:
        for i in range(40):
            await producer.send(Message("ResetTopic", b"r%d" % i), queue=MessageQueue("ResetTopic", "broker-a", i % 2))
    seen: list[tuple[int, int]] = []
    async with open_push_consumer(namesrv, topic="ResetTopic", consumer_group="ResetGroup",
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                                  persist_consumer_offset_interval_ms=100) as consumer:
        with trio.fail_after(30):
            async for msg in consumer:
                seen.append((msg.queue_id, msg.queue_offset))
                if len(seen) == 40:
                    break
            consumer.ack_pending()  # the iterator acknowledges a message when asked for the next one
            await trio.sleep(0.5)  # its offsets committed: the group is at the end
            progress = json.loads((await trio.to_thread.run_sync(
                lambda: _admin(namesrv, "--json", "consumer-progress", "ResetGroup"))).stdout)
            assert progress["total_lag"] == 0 and len(progress["consumer_ids"]["broker-a"]) == 1
            members = json.loads((await trio.to_thread.run_sync(
                lambda: _admin(namesrv, "--json", "consumer-connection", "ResetGroup"))).stdout)
            assert [c["client_id"] for c in members["connections"]] == [consumer.client_id]
            # Every clustering member also consumes its group's retry topic (RocketMQ's consumerConnection shows it
            # too).
            assert members["subscriptions"] == {"ResetTopic": "*", "%RETRY%ResetGroup": "*"}
            assert members["message_model"] == "CLUSTERING"
            # A group still running is not deleted: its members would commit their offsets again at once.
            refused = await trio.to_thread.run_sync(lambda: _admin(namesrv, "delete-group", "ResetGroup",
                                                                   expect_rc=1))
            assert f"has members online (broker-a: {consumer.client_id})" in refused.stderr
            assert "no offset was removed" in refused.stderr
            # Back to the start while the member is online: it drops its position and consumes everything again.
            done = json.loads((await trio.to_thread.run_sync(
                lambda: _admin(namesrv, "--json", "reset-offset", "ResetGroup", "ResetTopic", "--to",
                               "earliest"))).stdout)
            assert [(q["queue_id"], q["previous"], q["offset"]) for q in done["queues"]] == [(0, 20, 0), (1, 20, 0)]
            assert done["consumer_ids"]["broker-a"] == [consumer.client_id]
            again = []
            async for msg in consumer:
                again.append((msg.queue_id, msg.queue_offset))
                if len(again) == 40:
                    break
            consumer.ack_pending()
    assert sorted(seen) == sorted(again) == sorted((q, o) for q in (0, 1) for o in range(20))
    # The member's commits after the reset (on close) were replicated: every node's table holds the end.
    await trio.sleep(1.0)  # consumer_offset_flush_interval_ms (200 ms), with room
    async with open_remoting_client() as client:
        for addr in brokers:
            r = await client.invoke(addr, make_request(RequestCode.GET_CONSUME_STATS, ext={
                "consumer_group": "ResetGroup", "topic": "ResetTopic"}))
            assert r.code == ResponseCode.SUCCESS, (addr, r.remark)
            rows = cbor2.loads(r.body)["offsets"]
            assert [(row["queue_id"], row["consumer_offset"]) for row in rows] == [(0, 20), (1, 20)], (addr, rows)


def test_admin_against_a_name_server_with_no_broker_group_says_so(spawn):
    """``status`` printed nothing and exited 0 when no group was registered, as if every leader had answered;
    it now refuses as create-topic and the consumer commands do."""
    namesrv = spawn(raftmq_argv("namesrv", "--listen", "127.0.0.1:0")).fields["listen"]
    for command in (["status"], ["create-topic", "T"], ["consumer-progress", "G"]):
        refused = _admin(namesrv, *command, expect_rc=1)
        assert refused.stderr.strip() == (f"raftmq admin {command[0]}: no broker group is registered with the "
                                          f"name servers")
    assert _admin_json(namesrv, "cluster") == {"groups": []}
