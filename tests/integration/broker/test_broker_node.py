"""One broker node in-process (a single-member group: it elects itself), a name server, and a RemotingClient
speaking the broker protocol over loopback."""

from __future__ import annotations

import cbor2
import trio

from remoting.codes import RequestCode, ResponseCode
from remoting.message import MessageInput, encode_batch, iter_records
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, start_namesrv, wait_leader


async def _send(client, addr, topic="TopicTest", body=b"hello", queue_id=0, **ext):
    return await call(client, addr, RequestCode.SEND_MESSAGE,
                      {"producer_group": "pg", "topic": topic, "queue_id": queue_id, "born_timestamp": 1,
                       "properties": {"TAGS": "TagA", "KEYS": "k1 k2"}, **ext}, body)


async def test_send_auto_creates_registers_and_pull_returns_records(nursery, tmp_path):
    namesrv = await start_namesrv(nursery)
    (config,) = broker_configs(tmp_path, namesrv)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        r = await _send(client, addr)
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert r.ext["queue_id"] == 0 and r.ext["queue_offset"] == 0 and len(r.ext["msg_id"]) == 32
        r2 = await _send(client, addr, body=b"second")
        assert r2.ext["queue_offset"] == 1

        # The auto-created topic has RocketMQ's defaults and reaches the name server at once.
        with trio.fail_after(5):
            while True:
                route = await call(client, namesrv, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "TopicTest"})
                if route.code == ResponseCode.SUCCESS:
                    break
                await trio.sleep(0.05)
        data = cbor2.loads(route.body)
        assert data["queue_datas"][0]["write_queue_nums"] == 4 and data["queue_datas"][0]["perm"] == 6
        assert data["broker_datas"][0]["broker_addrs"]["0"] == addr

        pull = await call(client, addr, RequestCode.PULL_MESSAGE,
                          {"consumer_group": "cg", "topic": "TopicTest", "queue_id": 0, "queue_offset": 0,
                           "max_msg_nums": 32, "sys_flag": 0})
        assert pull.code == ResponseCode.SUCCESS, pull.remark
        views = list(iter_records(pull.body))
        assert [v.body for v in views] == [b"hello", b"second"]
        assert views[0].tags == "TagA" and views[0].keys == ["k1", "k2"] and views[0].msg_id == r.ext["msg_id"]
        assert pull.ext["next_begin_offset"] == 2 and pull.ext["max_offset"] == 2

        # Batch send: one request, many messages, one queue.
        batch = encode_batch([MessageInput("TopicTest", 0, f"b{i}".encode(), {"KEYS": f"bk{i}"})
                              for i in range(10)], ("127.0.0.1", 1))
        r = await call(client, addr, RequestCode.SEND_BATCH_MESSAGE,
                       {"producer_group": "pg", "topic": "TopicTest", "queue_id": 1}, batch)
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert r.ext["queue_id"] == 1 and r.ext["queue_offset"] == 0 and len(r.ext["msg_id"].split(",")) == 10

        # Lookups: min/max, by id, by key, by timestamp, earliest store time.
        r = await call(client, addr, RequestCode.GET_MAX_OFFSET, {"topic": "TopicTest", "queue_id": 1})
        assert r.ext["offset"] == 10
        r = await call(client, addr, RequestCode.GET_MIN_OFFSET, {"topic": "TopicTest", "queue_id": 1})
        assert r.ext["offset"] == 0
        first_id = r2.ext["msg_id"]
        r = await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID, {"msg_id": first_id})
        assert r.code == ResponseCode.SUCCESS and next(iter_records(r.body)).body == b"second"
        with trio.fail_after(5):
            while True:
                r = await call(client, addr, RequestCode.QUERY_MESSAGE, {"topic": "TopicTest", "key": "bk3"})
                if r.code == ResponseCode.SUCCESS:
                    break
                await trio.sleep(0.05)
        assert [v.body for v in iter_records(r.body)] == [b"b3"]
        r = await call(client, addr, RequestCode.SEARCH_OFFSET_BY_TIMESTAMP,
                       {"topic": "TopicTest", "queue_id": 0, "timestamp": 0})
        assert r.code == ResponseCode.SUCCESS and r.ext["offset"] == 0
        r = await call(client, addr, RequestCode.GET_EARLIEST_MSG_STORETIME, {"topic": "TopicTest", "queue_id": 0})
        assert r.ext["timestamp"] > 0

        info = cbor2.loads((await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)).body)
        assert info["put_messages"] == 12 and info["broker_name"] == "broker-a" and info["topics"] >= 1
        assert info["commit_log_max_offset"] > 0 and 0 <= info["disk_usage_ratio"] <= 1 and not info["disk_full"]


async def test_a_name_server_expiry_shorter_than_the_registration_interval_keeps_the_group_routed(nursery, tmp_path):
    # The name server evicted a node silent for its broker_expired_ms, which it cannot hold to the brokers'
    # registration interval: set below it, the live group fell out of every route between two registrations
    # (here after 300 ms of each 1 s). Each registration now carries the broker's own heartbeat_timeout_ms.
    import functools

    from namesrv import NamesrvConfig, serve_namesrv

    host, port = await nursery.start(functools.partial(
        serve_namesrv, NamesrvConfig(listen="127.0.0.1:0", broker_expired_ms=300, scan_interval_ms=20)))
    namesrv = f"{host}:{port}"
    (config,) = broker_configs(tmp_path, namesrv, register_interval_ms=1000)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": "Routed"})
        assert r.code == ResponseCode.SUCCESS, r.remark
        missing = 0
        for _ in range(50):  # 2.5 s: two registration intervals and more
            route = await call(client, namesrv, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "Routed"})
            missing += route.code != ResponseCode.SUCCESS
            await trio.sleep(0.05)
        assert missing == 0, f"unrouted in {missing} of 50 route queries"
        info = cbor2.loads((await call(client, namesrv, RequestCode.GET_BROKER_CLUSTER_INFO)).body)
        assert [n["heartbeat_timeout_ms"] for n in info["nodes"]["broker-a"]] == [120_000]
