"""UPDATE_BROKER_CONFIG (25) and ``broker_permission`` against in-process broker nodes and a name server: each
runtime key holds from the next request on, refusals change nothing, and a change outlives a restart of the node."""

from __future__ import annotations

import functools
import json

import cbor2
import pytest
import trio

from broker.config import RUNTIME_KEYS
from broker.node import serve_broker
from remoting.codes import RequestCode, ResponseCode
from remoting.config import ConfigError
from remoting.message import MessageInput, encode_batch, iter_records
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, start_namesrv, wait_leader


async def _update(client, addr: str, values: dict) -> object:
    return await call(client, addr, RequestCode.UPDATE_BROKER_CONFIG, body=cbor2.dumps(values), timeout_s=10)


async def _config(client, addr: str) -> dict:
    r = await call(client, addr, RequestCode.GET_BROKER_CONFIG)
    assert r.code == ResponseCode.SUCCESS, r.remark
    return cbor2.loads(r.body)


async def _send(client, addr: str, topic: str, body: bytes = b"x", queue_id: int = 0):
    return await call(client, addr, RequestCode.SEND_MESSAGE, {"topic": topic, "queue_id": queue_id}, body)


async def _pull(client, addr: str, topic: str, max_msg_nums: int = 32, **ext):
    r = await call(client, addr, RequestCode.PULL_MESSAGE,
                   {"consumer_group": "cg", "topic": topic, "queue_id": 0, "queue_offset": 0,
                    "max_msg_nums": max_msg_nums, **ext}, timeout_s=30)
    return r, (list(iter_records(r.body)) if r.code == ResponseCode.SUCCESS else [])


async def _route_perm(client, namesrv: str, topic: str) -> int:
    r = await call(client, namesrv, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
    assert r.code == ResponseCode.SUCCESS, r.remark
    [queue_data] = cbor2.loads(r.body)["queue_datas"]
    return queue_data["perm"]


async def _node(nursery, tmp_path, namesrv=None, **overrides):
    (config,) = broker_configs(tmp_path, namesrv, **overrides)
    addr = await start_broker(nursery, config)
    return config, addr


async def test_read_only_refuses_sends_and_send_backs_keeps_pulls_and_read_write_restores_them(nursery, tmp_path):
    namesrv = await start_namesrv(nursery)
    config, addr = await _node(nursery, tmp_path, namesrv)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        assert (await _send(client, addr, "Drained", b"before")).code == ResponseCode.SUCCESS
        (stored,) = (await _pull(client, addr, "Drained"))[1]
        with trio.fail_after(10):  # liveness: the auto-created topic is registered a moment after the send
            while (await call(client, namesrv, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "Drained"})).code:
                await trio.sleep(0.05)
        assert await _route_perm(client, namesrv, "Drained") == 6

        r = await _update(client, addr, {"broker_permission": "4"})
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert cbor2.loads(r.body) == {"values": {"broker_permission": 4}, "previous": {"broker_permission": 6}}
        assert (await _config(client, addr))["broker_permission"] == 4
        # Registered before the answer: the route says not writable at once.
        assert await _route_perm(client, namesrv, "Drained") == 4

        refused = await _send(client, addr, "Drained", b"during")
        assert refused.code == ResponseCode.NO_PERMISSION
        assert "broker-a" in refused.remark and "sending messages to it is forbidden" in refused.remark
        batch = encode_batch([MessageInput("Drained", 0, b"a"), MessageInput("Drained", 0, b"b")], ("127.0.0.1", 1))
        r = await call(client, addr, RequestCode.SEND_BATCH_MESSAGE, {"topic": "Drained", "queue_id": 0}, batch)
        assert r.code == ResponseCode.NO_PERMISSION and "forbidden" in r.remark
        # Not even a new topic: nothing is auto-created on a node that takes no writes.
        assert (await _send(client, addr, "NeverCreated")).code == ResponseCode.NO_PERMISSION
        r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK,
                       {"offset": stored.phy_offset, "group": "billing", "origin_topic": "Drained"})
        assert r.code == ResponseCode.NO_PERMISSION and "forbidden" in r.remark
        r, pulled = await _pull(client, addr, "Drained")
        assert r.code == ResponseCode.SUCCESS and [m.body for m in pulled] == [b"before"]

        assert (await _update(client, addr, {"broker_permission": "6"})).code == ResponseCode.SUCCESS
        assert await _route_perm(client, namesrv, "Drained") == 6
        assert (await _send(client, addr, "Drained", b"after")).code == ResponseCode.SUCCESS
        assert [m.body for m in (await _pull(client, addr, "Drained"))[1]] == [b"before", b"after"]
    # Set back to the config file's value: no override is kept.
    assert json.loads(config.runtime_overrides_path.read_text()) == {}


async def test_write_only_refuses_pulls_and_answers_held_ones_at_once(nursery, tmp_path):
    namesrv = await start_namesrv(nursery)
    config, addr = await _node(nursery, tmp_path, namesrv, long_polling_timeout_ms=3_600_000)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        assert (await _send(client, addr, "WriteOnly")).code == ResponseCode.SUCCESS
        held: list = []

        async def hold() -> None:
            # Past the queue's end, allowed to wait an hour: only the permission change answers it.
            r = await call(client, addr, RequestCode.PULL_MESSAGE,
                           {"consumer_group": "cg", "topic": "WriteOnly", "queue_id": 0, "queue_offset": 1,
                            "sys_flag": 0x2, "suspend_timeout_millis": 3_600_000}, timeout_s=60)
            held.append(r)

        async with trio.open_nursery() as waiting:
            waiting.start_soon(hold)
            await trio.sleep(0.3)
            assert (await _update(client, addr, {"broker_permission": "2"})).code == ResponseCode.SUCCESS
        assert held[0].code == ResponseCode.NO_PERMISSION and "pulling messages from it is forbidden" in held[0].remark
        r, _ = await _pull(client, addr, "WriteOnly")
        assert r.code == ResponseCode.NO_PERMISSION
        assert await _route_perm(client, namesrv, "WriteOnly") == 2
        assert (await _send(client, addr, "WriteOnly")).code == ResponseCode.SUCCESS


async def test_each_runtime_key_holds_from_the_next_request(nursery, tmp_path):
    config, addr = await _node(nursery, tmp_path, long_polling_timeout_ms=3_600_000)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        tested = set()

        async def update(key: str, value: str) -> None:
            r = await _update(client, addr, {key: value})
            assert r.code == ResponseCode.SUCCESS, r.remark
            tested.add(key)

        # auto_create_topic_enable
        await update("auto_create_topic_enable", "false")
        r = await _send(client, addr, "Unknown")
        assert r.code == ResponseCode.TOPIC_NOT_EXIST and "auto_create_topic_enable is false" in r.remark
        await update("auto_create_topic_enable", "true")
        # default_topic_queue_nums
        await update("default_topic_queue_nums", "2")
        assert (await _send(client, addr, "Unknown")).code == ResponseCode.SUCCESS
        topics = cbor2.loads((await call(client, addr, RequestCode.GET_ALL_TOPIC_CONFIG)).body)["topic_configs"]
        assert (topics["Unknown"]["read_queue_nums"], topics["Unknown"]["write_queue_nums"]) == (2, 2)
        # max_topic_count: the group holds as many as it may now
        await update("max_topic_count", str(len(topics)))
        r = await _send(client, addr, "OneTooMany")
        assert r.code == ResponseCode.TOPIC_NOT_EXIST and f"max_topic_count is {len(topics)}" in r.remark
        await update("max_topic_count", "50000")
        # max_transfer_count and max_transfer_bytes
        for i in range(6):
            assert (await _send(client, addr, "Pulled", b"%0600d" % i)).code == ResponseCode.SUCCESS
        assert len((await _pull(client, addr, "Pulled"))[1]) == 6
        await update("max_transfer_count", "2")
        assert len((await _pull(client, addr, "Pulled"))[1]) == 2
        await update("max_transfer_count", "1024")
        await update("max_transfer_bytes", "1024")
        assert len((await _pull(client, addr, "Pulled"))[1]) == 1
        # max_batch_messages
        await update("max_batch_messages", "2")
        batch = encode_batch([MessageInput("Unknown", 0, b"%d" % i) for i in range(3)], ("127.0.0.1", 1))
        r = await call(client, addr, RequestCode.SEND_BATCH_MESSAGE, {"topic": "Unknown", "queue_id": 0}, batch)
        assert r.code == ResponseCode.INVALID_REQUEST and "at most 2 are accepted" in r.remark
        # long_polling_timeout_ms: the file's hour no longer holds a pull that may wait an hour
        await update("long_polling_timeout_ms", "100")
        with trio.fail_after(30):  # liveness: an hour without the change
            r = await call(client, addr, RequestCode.PULL_MESSAGE,
                           {"consumer_group": "cg", "topic": "Unknown", "queue_id": 1, "queue_offset": 0,
                            "sys_flag": 0x2, "suspend_timeout_millis": 3_600_000}, timeout_s=60)
        assert r.code == ResponseCode.PULL_NOT_FOUND
        # enable_property_filter: a SQL92 pull refused, then served
        sql = {"subscription": "a > 1", "expression_type": "SQL92"}
        r, _ = await _pull(client, addr, "Pulled", **sql)
        assert r.code == ResponseCode.SYSTEM_ERROR and "filter message by SQL92" in r.remark
        await update("enable_property_filter", "true")
        r, records = await _pull(client, addr, "Pulled", **sql)
        assert r.code == ResponseCode.PULL_RETRY_IMMEDIATELY and records == [], r.remark  # none has "a": passed over
        # timer_max_delay_sec: a delay within the default 3 days, then past a minute
        timer = {"topic": "Pulled", "queue_id": 0, "properties": {"TIMER_DELAY_SEC": "120"}}
        assert (await call(client, addr, RequestCode.SEND_MESSAGE, timer, b"t")).code == ResponseCode.SUCCESS
        await update("timer_max_delay_sec", "60")
        r = await call(client, addr, RequestCode.SEND_MESSAGE, timer, b"t")
        assert r.code == ResponseCode.MESSAGE_ILLEGAL and "timer_max_delay_sec 60" in r.remark
        await update("broker_permission", "6")
        assert tested == set(RUNTIME_KEYS)


@pytest.mark.parametrize("values, field, words", [
    ({"listen": "127.0.0.1:1"}, "listen", ["'listen' cannot be changed at runtime"]),
    ({"store.flush_disk_type": "SYNC_FLUSH"}, "store.flush_disk_type", ["cannot be changed at runtime"]),
    ({"no_such_key": "1"}, "no_such_key", ["unknown config key 'no_such_key'"]),
    ({"broker_permission": "5"}, "broker_permission", ["broker_permission must be one of 2, 4, 6, got 5"]),
    ({"broker_permission": 4}, "broker_permission", ["broker_permission must be sent as text, got 4"]),
    ({"long_polling_timeout_ms": "soon"}, "long_polling_timeout_ms", ["must be an integer, got 'soon'"]),
    ({"auto_create_topic_enable": "0"}, "auto_create_topic_enable", ["must be true or false, got 0"]),
    ({"max_transfer_bytes": str(64 << 20)}, "max_transfer_bytes",
     [f"max_transfer_bytes = {64 << 20} refused", "max_frame_size must be >="]),
    ({"max_transfer_count": "7\nbroker_permission = 4"}, "max_transfer_count", ["one value on one line"]),
    # One bad key among good ones: none is applied.
    ({"broker_permission": "4", "max_transfer_count": "0"}, "max_transfer_count",
     ["max_transfer_count must be >= 1, got 0"]),
])
async def test_a_refused_update_names_the_key_and_changes_nothing(nursery, tmp_path, values, field, words):
    config, addr = await _node(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        before = await _config(client, addr)
        r = await _update(client, addr, values)
        assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == field, (r.code, r.remark, r.ext)
        assert all(w in r.remark for w in words), r.remark
        assert await _config(client, addr) == before
        assert (await _send(client, addr, "StillWritable")).code == ResponseCode.SUCCESS
    assert not config.runtime_overrides_path.exists()


async def test_an_update_without_a_map_is_refused(nursery, tmp_path):
    _, addr = await _node(nursery, tmp_path)
    async with open_remoting_client() as client:
        for body in (cbor2.dumps({}), cbor2.dumps(["broker_permission", "4"]), b"\xff"):
            r = await call(client, addr, RequestCode.UPDATE_BROKER_CONFIG, body=body)
            assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == "body", (body, r.remark)


async def test_an_update_outlives_a_restart_of_the_node_and_a_bad_overrides_file_stops_it(tmp_path):
    (config,) = broker_configs(tmp_path, None)
    async with open_remoting_client() as client:
        async with trio.open_nursery() as first:
            addr = await start_broker(first, config)
            r = await _update(client, addr, {"broker_permission": "4", "max_transfer_count": "7"})
            assert r.code == ResponseCode.SUCCESS, r.remark
            first.cancel_scope.cancel()
        assert json.loads(config.runtime_overrides_path.read_text()) == {"broker_permission": 4,
                                                                          "max_transfer_count": 7}
        async with trio.open_nursery() as second:
            addr = await start_broker(second, config)
            await wait_leader(client, addr)
            got = await _config(client, addr)
            assert (got["broker_permission"], got["max_transfer_count"]) == (4, 7)
            assert (await _send(client, addr, "AfterRestart")).code == ResponseCode.NO_PERMISSION
            second.cancel_scope.cancel()

    config.runtime_overrides_path.write_text('{"broker_permission": 5}')
    async with trio.open_nursery() as third:
        with pytest.raises(ConfigError, match=r"runtime_config\.json.*broker_permission must be one of 2, 4, 6, got 5"):
            await third.start(functools.partial(serve_broker, config))


async def test_a_held_sql92_pull_is_refused_once_enable_property_filter_is_turned_off(nursery, tmp_path):
    """Found by review: a held SQL92 pull kept its compiled filter and was answered by it (and read the commit log on
    every arrival) after enable_property_filter was turned off; "judged again when it resumes", as RUNTIME_KEYS says,
    it now gets the refusal a fresh pull gets."""
    config, addr = await _node(nursery, tmp_path, enable_property_filter=True, long_polling_timeout_ms=2_000)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        assert (await _send(client, addr, "Sql")).code == ResponseCode.SUCCESS  # creates the topic, no "a"
        answers = []

        async def held_pull() -> None:
            answers.append((await _pull(client, addr, "Sql", subscription="a > 1", expression_type="SQL92",
                                        queue_offset=1, sys_flag=0x2, suspend_timeout_millis=2_000))[0])

        async with trio.open_nursery() as inner:
            inner.start_soon(held_pull)
            await trio.sleep(0.3)  # held: nothing past offset 1
            assert not answers
            r = await _update(client, addr, {"enable_property_filter": "false"})
            assert r.code == ResponseCode.SUCCESS, r.remark
        (r,) = answers
        assert r.code == ResponseCode.SYSTEM_ERROR and "filter message by SQL92" in r.remark, (r.code, r.remark)
