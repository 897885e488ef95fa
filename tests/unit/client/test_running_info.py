"""A consumer's running info (GET_CONSUMER_RUNNING_INFO, ``client/running_info.py``): the per-topic rates, the config
shown with its secret left out, the client's answer to a broker's request (a real push or lite pull consumer on the
in-memory fake cluster, its queues, caches and counts read back through ``parse_consumer_running_info``), the task
dump, and ``raftmq admin consumer-status`` / ``clone-group-offset``'s argument checks and printing."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json

import cbor2
import pytest
import trio
from rich.console import Console

import client.lite_pull_consumer
import client.push_consumer
from client import ConsumeStatus, MessageQueue, open_lite_pull_consumer, open_push_consumer
from client.admin_types import parse_consumer_running_info
from client.instance import ServerRequests
from client.push_consumer import PushConsumerConfig
from client.running_info import ConsumeStatsRecorder, config_properties, task_dump
from raftmq.commands import admin_groups
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.config import ConfigError
from tests.unit.client.fake_cluster import NAMESRV, fake_remoting_ctx, recording_fake, send_numbered, wait_until
from tests.unit.client.test_concurrent_handlers import FIRST, GROUP, Calls

T0, T1 = MessageQueue("T", "broker-a", 0), MessageQueue("T", "broker-a", 1)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rates_count_the_last_minute_per_topic_and_failures_the_last_hour():
    clock = _Clock()
    recorder = ConsumeStatsRecorder(clock=clock, wall=lambda: 1_700_000_000 + clock.now)
    clock.now += 10  # started 10 s ago: rates over those 10 s, not a whole minute
    recorder.pulled(T0, clock.now - 0.5, 30)
    recorder.pulled(T1, clock.now - 1.5, 10)
    recorder.consumed(T0, clock.now - 0.01, 28, 2)
    recorder.consumed(T0, clock.now - 0.03, 10, 0)
    recorder.consumed(T0, None, 5, 0)  # not timed (the iterator form): counted, no RT
    assert recorder.status("T") == {"pull_tps": 4.0, "pull_rt_ms": 1000.0, "consume_ok_tps": 4.3,
                                    "consume_failed_tps": 0.2, "consume_rt_ms": 20.0, "consume_failed_msgs": 2}
    assert recorder.status("Other") == {"pull_tps": 0.0, "pull_rt_ms": 0.0, "consume_ok_tps": 0.0,
                                        "consume_failed_tps": 0.0, "consume_rt_ms": 0.0, "consume_failed_msgs": 0}
    assert recorder.timestamp_ms(recorder.last_pull[T0]) == (1_700_000_000 + 1010) * 1000
    assert recorder.timestamp_ms(None) is None
    # A minute on, the rates are of the last minute only; the failures are kept for the hour.
    clock.now += 61
    recorder.pulled(T0, clock.now - 0.1, 60)
    status = recorder.status("T")
    assert (status["pull_tps"], status["consume_ok_tps"], status["consume_failed_msgs"]) == (1.0, 0.0, 2)
    clock.now += 3600
    assert recorder.status("T")["consume_failed_msgs"] == 0
    assert "T" not in recorder._topics  # nothing left to tell: forgotten


def test_config_properties_are_scalars_and_leave_the_secret_key_out():
    config = PushConsumerConfig(namesrv_addrs=("127.0.0.1:1", "127.0.0.1:2"), consumer_group="G",
                                access_key="admin-ak", secret_key="s3cr3t-value")
    properties = config_properties(config)
    assert properties["namesrv_addrs"] == "127.0.0.1:1;127.0.0.1:2" and properties["consumer_group"] == "G"
    assert properties["secret_key"] == "<set>" and properties["access_key"] == "admin-ak"
    assert "s3cr3t-value" not in json.dumps(properties)
    assert properties["allocate_strategy"] == "AllocateMessageQueueAveragely"
    assert config_properties(PushConsumerConfig(allocate_strategy=_allocate))["allocate_strategy"] == "_allocate"
    assert {type(v) for v in properties.values()} <= {str, int, float, bool, type(None)}


def _allocate(group, current, mqs, cids):  # pragma: no cover - only its name is read
    return list(mqs)


async def test_a_client_without_a_consumer_refuses_and_a_failing_one_says_so():
    requests = ServerRequests()
    ask = make_request(RequestCode.GET_CONSUMER_RUNNING_INFO, ext={"consumer_group": "g", "client_id": "c",
                                                                   "jstack": True})
    answer = await requests.handle(ask, None)
    assert answer.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED and "runs no consumer" in answer.remark
    asked = []
    requests.on_consumer_running_info = lambda jstack: asked.append(jstack) or {"client_id": "c"}
    answer = await requests.handle(ask, None)
    assert answer.code == ResponseCode.SUCCESS and cbor2.loads(answer.body) == {"client_id": "c"}
    assert asked == [True]

    def broken(jstack):
        raise RuntimeError("bug")

    requests.on_consumer_running_info = broken
    answer = await requests.handle(ask, None)
    assert answer.code == ResponseCode.SYSTEM_ERROR and "failed to draw its running info" in answer.remark


@pytest.fixture
def push_cluster(monkeypatch):
    """The push consumer's fake cluster, two queues, and the ``ServerRequests`` each consumer opened with."""
    fake = recording_fake(monkeypatch, 2)
    fake.server_requests = []

    def remoting(config, handler=None):
        fake.server_requests.append(handler)
        return fake_remoting_ctx(fake)

    monkeypatch.setattr(client.push_consumer, "open_remoting", remoting)
    return fake


async def _ask(requests: ServerRequests, client_id: str, jstack: bool = False):
    answer = await requests.handle(make_request(RequestCode.GET_CONSUMER_RUNNING_INFO, ext={
        "consumer_group": GROUP, "client_id": client_id, "jstack": jstack}), None)
    assert answer.code == ResponseCode.SUCCESS, answer.remark
    return parse_consumer_running_info("broker-a", cbor2.loads(answer.body))


async def test_a_push_consumer_tells_its_queues_caches_offsets_and_handler_counts(push_cluster, tmp_path,
                                                                                  autojump_clock):
    """Queue 0 holds 10 messages, message 9 stuck in its handler and message 3 failing once (retried here: a
    broadcasting member); queue 1 holds none. The answer shows both queues as the consumer holds them."""
    calls = Calls(gated={b"9"})
    failed_once: list[bytes] = []

    async def handler(msg):
        if msg.body == b"3" and not failed_once:
            failed_once.append(msg.body)
            return ConsumeStatus.RECONSUME_LATER
        await calls(msg)

    await send_numbered(10)
    async with open_push_consumer(NAMESRV, topic="T", handler=handler, message_model="BROADCASTING",
                                  offset_store_dir=str(tmp_path), reconsume_delay_ms=10, max_concurrent_handlers=5,
                                  **FIRST) as consumer:
        await wait_until(lambda: len(calls.finished) == 9 and calls.running == 1)
        await trio.sleep(1)  # the offsets handed to the store (persist_consumer_offset_interval_ms)
        [requests] = push_cluster.server_requests
        info = await _ask(requests, consumer.client_id, jstack=True)
        calls.open_all()
    assert (info.consumer_group, info.client_id, info.broker_name) == (GROUP, consumer.client_id, "broker-a")
    props = info.properties
    assert (props["consume_type"], props["message_model"], props["consume_orderly"], props["consume_form"]) == (
        "CONSUME_PASSIVELY", "BROADCASTING", False, "handler")
    assert (props["max_concurrent_handlers"], props["assigned_queues"], props["cached"]) == (5, 2, 1)
    assert props["consumer_start_timestamp"] > 0 and props["client_version"].startswith("raftmq")
    assert info.subscriptions == {"T": "*"}  # broadcasting: no retry topic
    q0, q1 = info.queues
    assert (q0.queue, q0.cached_msg_count, q0.cached_msg_min_offset, q0.cached_msg_max_offset) == (T0, 1, 9, 9)
    assert q0.cached_msg_bytes == 1 and q0.committed_offset == 9 and not q0.locked and not q0.paused
    assert q0.last_pull_timestamp is not None and q0.last_consume_timestamp is not None
    assert (q1.queue, q1.cached_msg_count, q1.cached_msg_min_offset, q1.committed_offset) == (T1, 0, None, 0)
    assert q1.last_pull_timestamp is not None and q1.last_consume_timestamp is None
    [(topic, status)] = info.status.items()
    assert topic == "T" and status.consume_failed_msgs == 1
    assert status.pull_tps > 0 and status.consume_ok_tps > 0 and status.consume_failed_tps > 0
    assert "task " in info.jstack and "_pull_loop" in info.jstack


async def test_an_iterating_push_consumer_counts_what_the_loop_took(push_cluster, autojump_clock):
    await send_numbered(6)
    async with open_push_consumer(NAMESRV, topic="T", **FIRST) as consumer:
        seen = 0
        async for _msg in consumer:
            seen += 1
            if seen == 6:
                break
        consumer.ack_pending()
        [requests] = push_cluster.server_requests
        info = await _ask(requests, consumer.client_id)
    assert info.properties["consume_form"] == "iterator" and info.jstack is None
    assert info.subscriptions == {"T": "*", "%RETRY%g": "*"}
    assert info.status["T"].consume_ok_tps > 0 and info.status["T"].consume_rt_ms == 0.0
    assert [q.queue for q in info.queues if q.queue.topic == "T"] == [T0, T1]


async def test_a_lite_pull_consumer_tells_its_assigned_queues_and_what_poll_handed_out(push_cluster, monkeypatch,
                                                                                        autojump_clock):
    lite_requests = []

    def remoting(config, handler=None):
        lite_requests.append(handler)
        return fake_remoting_ctx(push_cluster)

    monkeypatch.setattr(client.lite_pull_consumer, "open_remoting", remoting)
    await send_numbered(5)
    async with open_lite_pull_consumer(NAMESRV, consumer_group=GROUP,
                                       consume_from_where="CONSUME_FROM_FIRST_OFFSET") as consumer:
        consumer.assign([T0, T1])
        consumer.pause([T1])
        polled = await consumer.poll(timeout_s=10, max_messages=3)
        assert len(polled) == 3
        info = await _ask(lite_requests[0], consumer.client_id)
    props = info.properties
    assert (props["consume_type"], props["mode"], props["polled"]) == ("CONSUME_ACTIVELY", "assign", 3)
    q0, q1 = info.queues
    assert (q0.queue, q0.cached_msg_count, q0.cached_msg_min_offset, q0.cached_msg_max_offset) == (T0, 2, 3, 4)
    assert (q1.queue, q1.paused, q0.paused) == (T1, True, False)
    assert q0.last_consume_timestamp is not None and q1.last_consume_timestamp is None
    assert info.status["T"].consume_ok_tps > 0


async def test_the_task_dump_is_a_tree_cut_at_its_bound():
    async def waits_here():
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waits_here, name="the-waiting-task")
        await trio.sleep(0)
        dump = task_dump()
        assert "task the-waiting-task" in dump and "at waits_here (client/test_running_info.py:" in dump
        short = task_dump(max_chars=40)
        assert len(short) < 100 and short.endswith("... cut at 40 characters")
        nursery.cancel_scope.cancel()


def test_the_running_info_reader_refuses_a_malformed_answer():
    good = {"consumer_group": "g", "client_id": "c", "properties": {"a": 1}, "subscriptions": [],
            "queues": [], "status": {}, "jstack": None}
    assert parse_consumer_running_info("b", good).properties == {"a": 1}
    for bad in ({**good, "properties": {"a": [1]}}, {**good, "status": {"T": {"pull_tps": "fast"}}},
                {**good, "queues": [{"topic": "T"}]}, {**good, "jstack": 5}, [good]):
        with pytest.raises((TypeError, KeyError)):
            parse_consumer_running_info("b", bad)


def _args(command: str, **values) -> argparse.Namespace:
    return argparse.Namespace(admin_command=command, **values)


def test_the_commands_check_their_names_before_asking():
    admin_groups.check(_args("consumer-status", group="G", client_id=None, jstack=False))
    admin_groups.check(_args("clone-group-offset", src_group="A", dest_group="B", topic="T"))
    for args, message in ((_args("consumer-status", group="bad group", client_id=None), "--group 'bad group'"),
                          (_args("consumer-status", group="G", client_id=" "), "--client-id must not be empty"),
                          (_args("clone-group-offset", src_group="A", dest_group="A", topic="T"),
                           "--src-group and --dest-group are both 'A'"),
                          (_args("clone-group-offset", src_group="A", dest_group="B", topic="bad topic"),
                           "--topic 'bad topic'")):
        with pytest.raises(ConfigError, match=message):
            admin_groups.check(args)


def test_consumer_status_prints_each_member_and_delete_group_its_config(capsys):
    info = {"client_id": "c1", "broker_name": "broker-a",
            "properties": {"consume_type": "CONSUME_PASSIVELY", "message_model": "CLUSTERING",
                           "consume_orderly": True, "consume_form": "handler", "consumer_start_timestamp": 0,
                           "client_version": "raftmq 0.1.0", "pull_batch_size": 32},
            "subscriptions": {"T": "TagA"},
            "queues": [{"topic": "T", "broker_name": "broker-a", "queue_id": 0, "committed_offset": 7,
                        "cached_msg_count": 3, "cached_msg_bytes": 30, "cached_msg_min_offset": 7,
                        "cached_msg_max_offset": 9, "locked": True, "paused": False, "last_pull_timestamp": None,
                        "last_consume_timestamp": None}],
            "status": {"T": {"pull_tps": 1.5, "pull_rt_ms": 2.0, "consume_ok_tps": 1.0, "consume_failed_tps": 0.5,
                             "consume_rt_ms": 3.0, "consume_failed_msgs": 4}},
            "jstack": "task <init>"}
    console = Console(file=io.StringIO(), width=250)
    data = {"consumer_group": "G", "members": [info, {"client_id": "c2", "error": "gone"}]}
    admin_groups.print_result(console, "consumer-status", data)
    text = console.file.getvalue() + capsys.readouterr().out
    assert "consumer c1 of group G (asked through broker-a): CONSUME_PASSIVELY (push), CLUSTERING, orderly" in text
    assert "subscriptions: T (TagA)" in text and "task dump of c1:\ntask <init>" in text
    assert "consumer c2 of group G: not asked: gone" in text
    for cell in ("pull_batch_size", "32", "yes", "1.5", "4"):
        assert cell in text
    admin_groups.print_result(console, "delete-group", {"consumer_group": "G", "removed_offsets": {"broker-a": 2},
                                                        "retry_topic_deleted_from": [],
                                                        "config_removed_from": ["broker-a"]})
    assert "its subscription group config removed from broker-a" in capsys.readouterr().out
    admin_groups.print_result(console, "delete-group", {"consumer_group": "G", "removed_offsets": {"broker-a": 0},
                                                        "retry_topic_deleted_from": [], "config_removed_from": []})
    assert "it had no subscription group config on any group asked" in capsys.readouterr().out


def test_dataclass_results_are_frozen():
    info = parse_consumer_running_info("b", {"consumer_group": "g", "client_id": "c", "properties": {},
                                             "subscriptions": [], "queues": [], "status": {}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.client_id = "other"  # type: ignore[misc]
