"""Delayed messages against one in-process broker node: where they wait, when and how they arrive, bad levels."""

from __future__ import annotations

import dataclasses
import time

import cbor2
import pytest
import trio

from broker.delay_level import format_delay, parse_delay_levels
from remoting.codes import RequestCode, ResponseCode
from remoting.config import ConfigError
from remoting.message import MessageInput, decode_record, encode_batch, iter_records
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, wait_leader

LEVELS = "300ms 600ms 1s"


def test_delay_levels_take_rocketmqs_format_and_bad_ones_are_refused_at_start(tmp_path):
    assert parse_delay_levels("1s 5s 10s 30s 1m 2m 1h 2d 250ms") == (
        1000, 5000, 10_000, 30_000, 60_000, 120_000, 3_600_000, 172_800_000, 250)
    # And back, in each delay's largest whole unit (raftmq admin delay-offsets prints them so).
    assert [format_delay(ms) for ms in parse_delay_levels("1s 5s 90s 1m 2h 2d 250ms 1500ms")] == [
        "1s", "5s", "90s", "1m", "2h", "2d", "250ms", "1500ms"]
    for bad, needle in (("", "at least one"), ("1s 5x", "level 2 is '5x'"), ("0s", "level 1 is '0s'"),
                        ("1.5s", "level 1"), ("1s " * 65, "at most 64")):
        with pytest.raises(ConfigError, match="message_delay_level") as e:
            broker_configs(tmp_path, None, message_delay_level=bad)
        assert needle in str(e.value)


async def _pull(client, addr, topic, queue_id, offset=0):
    r = await call(client, addr, RequestCode.PULL_MESSAGE,
                   {"consumer_group": "cg", "topic": topic, "queue_id": queue_id, "queue_offset": offset,
                    "max_msg_nums": 32})
    return list(iter_records(r.body)) if r.code == ResponseCode.SUCCESS else []


async def _delay_offsets(client, addr) -> list[tuple[int, int, int, int]]:
    """GET_ALL_DELAY_OFFSET: (level, delay_ms, delivered_offset, max_offset) per level."""
    r = await call(client, addr, RequestCode.GET_ALL_DELAY_OFFSET, {})
    assert r.code == ResponseCode.SUCCESS, r.remark
    return [(row["level"], row["delay_ms"], row["delivered_offset"], row["max_offset"])
            for row in cbor2.loads(r.body)["levels"]]


async def test_a_delayed_message_waits_its_level_then_arrives_with_its_properties_and_a_new_offset(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None, message_delay_level=LEVELS)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        r = await call(client, addr, RequestCode.SEND_MESSAGE, {"topic": "DelayT", "queue_id": 1, "properties": {}},
                       b"plain")
        assert r.code == ResponseCode.SUCCESS
        props = {"TAGS": "TagD", "KEYS": "order-7", "UNIQ_KEY": "U-1", "color": "red", "DELAY": "3"}
        sent_at = time.time()
        r = await call(client, addr, RequestCode.SEND_MESSAGE,
                       {"topic": "DelayT", "queue_id": 1, "born_timestamp": 42, "flag": 7, "properties": props},
                       b"later")
        assert r.code == ResponseCode.SUCCESS, r.remark
        # It waits in SCHEDULE_TOPIC_XXXX queue level - 1, with where it goes.
        viewed = await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID, {"msg_id": r.ext["msg_id"]})
        waiting = decode_record(viewed.body)
        assert (waiting.topic, waiting.queue_id, waiting.body) == ("SCHEDULE_TOPIC_XXXX", 2, b"later")
        assert waiting.properties["REAL_TOPIC"] == "DelayT" and waiting.properties["REAL_QID"] == "1"
        assert len(await _pull(client, addr, "DelayT", 1)) == 1
        assert await _delay_offsets(client, addr) == [(1, 300, 0, 0), (2, 600, 0, 0), (3, 1000, 0, 1)]
        with trio.fail_after(10):
            while len(got := await _pull(client, addr, "DelayT", 1)) < 2:
                await trio.sleep(0.05)
        waited = time.time() - sent_at
        assert waited >= 0.95, f"delivered after {waited:.2f}s, level 3 is 1s"
        delivered = got[1]
        assert delivered.queue_offset == 1 and delivered.body == b"later"
        assert (delivered.flag, delivered.born_timestamp) == (7, 42)
        assert "DELAY" not in delivered.properties
        assert {k: delivered.properties[k] for k in ("TAGS", "KEYS", "UNIQ_KEY", "color")} == \
            {k: props[k] for k in ("TAGS", "KEYS", "UNIQ_KEY", "color")}
        found = await call(client, addr, RequestCode.QUERY_MESSAGE, {"topic": "DelayT", "key": "order-7"})
        assert found.code == ResponseCode.SUCCESS
        assert [v.body for v in iter_records(found.body)] == [b"later"]
        # Delivered once: progress is replicated metadata, so later rounds start past it.
        await trio.sleep(0.5)
        assert len(await _pull(client, addr, "DelayT", 1)) == 2
        assert await _delay_offsets(client, addr) == [(1, 300, 0, 0), (2, 600, 0, 0), (3, 1000, 1, 1)]
        status = await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)
        assert status.code == ResponseCode.SUCCESS


async def test_a_delayed_message_whose_topic_was_deleted_while_it_waited_is_not_delivered(nursery, tmp_path):
    # It was delivered behind the deletion's cut: once the name was created again (before or after it fell due),
    # it was served as that new topic's first message.
    (config,) = broker_configs(tmp_path, None, message_delay_level=LEVELS)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        for topic in ("DelGone", "DelAgain", "DelKept"):
            r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": topic})
            assert r.code == ResponseCode.SUCCESS, r.remark
            r = await call(client, addr, RequestCode.SEND_MESSAGE,
                           {"topic": topic, "queue_id": 0, "properties": {"DELAY": "2"}}, topic.encode())
            assert r.code == ResponseCode.SUCCESS, r.remark
        for topic in ("DelGone", "DelAgain"):
            r = await call(client, addr, RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": topic})
            assert r.code == ResponseCode.SUCCESS, r.remark
        r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": "DelAgain"})
        assert r.code == ResponseCode.SUCCESS, r.remark
        with trio.fail_after(10):  # the level's round passes all three: the kept topic's arrives
            while (await _delay_offsets(client, addr))[1][2] < 3:
                await trio.sleep(0.05)
        assert [m.body for m in await _pull(client, addr, "DelKept", 0)] == [b"DelKept"]
        r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": "DelGone"})
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert await _pull(client, addr, "DelGone", 0) == [] and await _pull(client, addr, "DelAgain", 0) == []
        status = cbor2.loads((await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)).body)
        assert (status["scheduled_delivered"], status["scheduled_dropped"]) == (1, 2)


async def test_a_timer_message_whose_topic_was_deleted_is_not_parked_again_past_the_cut(nursery, tmp_path):
    # Its next hop stored it again after the deletion record, where the cut no longer covered it: once the name was
    # created again, it was delivered there.
    (config,) = broker_configs(tmp_path, None, message_delay_level=LEVELS)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": "HopT"})
        assert r.code == ResponseCode.SUCCESS, r.remark
        r = await call(client, addr, RequestCode.SEND_MESSAGE,
                       {"topic": "HopT", "queue_id": 0, "properties": {"TIMER_DELAY_MS": "2500"}}, b"old-timer")
        assert r.code == ResponseCode.SUCCESS, r.remark  # parked in the 1 s level, then hops
        for code, ext in ((RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": "HopT"}),
                          (RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic_name": "HopT"})):
            r = await call(client, addr, code, ext)
            assert r.code == ResponseCode.SUCCESS, r.remark

        async def runtime():
            return cbor2.loads((await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)).body)

        with trio.fail_after(10):  # its first hop judges it, then the round's progress is replicated
            while (await runtime())["scheduled_dropped"] < 1 or \
                    any(delivered < end for _, _, delivered, end in await _delay_offsets(client, addr)):
                await trio.sleep(0.05)
        offsets = await _delay_offsets(client, addr)
        assert [end for _, _, _, end in offsets] == [0, 0, 1], offsets  # not parked again: its first copy only
        assert (await runtime())["scheduled_delivered"] == 0 and await _pull(client, addr, "HopT", 0) == []


async def test_bad_delay_levels_are_refused_naming_the_property_and_batches_may_not_delay(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None, message_delay_level=LEVELS)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        for bad in ("4", "-1", "x", "", "1.5", "99999999999"):
            r = await call(client, addr, RequestCode.SEND_MESSAGE,
                           {"topic": "DelayT", "queue_id": 0, "properties": {"DELAY": bad}}, b"x")
            assert r.code == ResponseCode.INVALID_REQUEST, (bad, r.remark)
            assert "'DELAY'" in r.remark and "0..3" in r.remark and r.ext["field"] == "properties"
        r = await call(client, addr, RequestCode.SEND_MESSAGE,
                       {"topic": "DelayT", "queue_id": 0, "properties": {"DELAY": "0"}}, b"now")
        assert r.code == ResponseCode.SUCCESS
        batch = encode_batch([MessageInput("DelayT", 0, b"a"), MessageInput("DelayT", 0, b"b", {"DELAY": "1"})],
                             ("127.0.0.1", 1))
        r = await call(client, addr, RequestCode.SEND_BATCH_MESSAGE, {"topic": "DelayT", "queue_id": 0}, batch)
        assert r.code == ResponseCode.MESSAGE_ILLEGAL and "delayed" in r.remark
        # The bytes in a body are not a property.
        batch = encode_batch([MessageInput("DelayT", 0, b"DELAY\x011")], ("127.0.0.1", 1))
        r = await call(client, addr, RequestCode.SEND_BATCH_MESSAGE, {"topic": "DelayT", "queue_id": 0}, batch)
        assert r.code == ResponseCode.SUCCESS
        assert [v.body for v in await _pull(client, addr, "DelayT", 0)] == [b"now", b"DELAY\x011"]


async def test_messages_waiting_in_a_level_the_restarted_broker_no_longer_has_are_delivered_by_its_last_level(
        nursery, tmp_path, caplog):
    # Stored at level 3 of "300ms 600ms 30s", then the broker restarts with two levels: the message waits in a
    # schedule queue no configured level reads. Before, it stayed there for good, acknowledged and never delivered.
    (config,) = broker_configs(tmp_path, None, message_delay_level="300ms 600ms 30s")
    with trio.CancelScope() as first:
        async with trio.open_nursery() as inner:
            addr = await start_broker(inner, config)
            async with open_remoting_client() as client:
                await wait_leader(client, addr)
                r = await call(client, addr, RequestCode.SEND_MESSAGE,
                               {"topic": "DelayT", "queue_id": 0, "properties": {"DELAY": "3", "KEYS": "k3"}},
                               b"level-3")
                assert r.code == ResponseCode.SUCCESS, r.remark
            first.cancel()
    addr = await start_broker(nursery, dataclasses.replace(config, message_delay_level="300ms 600ms"))
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        assert ("schedule queues of delay levels [3] are past message_delay_level's 2 levels: their messages are "
                "delivered after the last level's delay, 600 ms") in caplog.text
        # Listed with the delay it now waits: the last configured level's.
        assert (await _delay_offsets(client, addr))[2] in ((3, 600, 0, 1), (3, 600, 1, 1))
        with trio.fail_after(10):
            while not (got := await _pull(client, addr, "DelayT", 0)):
                await trio.sleep(0.05)
        assert [(v.body, v.properties["KEYS"]) for v in got] == [(b"level-3", "k3")]
        assert "DELAY" not in got[0].properties
        await trio.sleep(0.5)
        assert len(await _pull(client, addr, "DelayT", 0)) == 1
