"""Timer messages (RocketMQ 5's TIMER_DELIVER_MS / TIMER_DELAY_MS / TIMER_DELAY_SEC) against one in-process broker
node: where they wait, the hops that bring them to their time, what is refused, and a delivery round whose
progress is not replicated, as when the leader dies between the two steps."""

from __future__ import annotations

import functools
import time

import cbor2
import trio

from broker.node import serve_broker
from broker.schedule import SCHEDULE_TABLE
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError
from remoting.message import MessageInput, decode_record, encode_batch, iter_records
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, wait_leader

LEVELS = "300ms 600ms 1s"


async def _start(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None, message_delay_level=LEVELS)
    nodes: list = []
    host, port = await nursery.start(functools.partial(serve_broker, config, on_serving=nodes.append))
    return f"{host}:{port}", nodes[0]


async def _send(client, addr, topic, props, body, queue_id=0):
    return await call(client, addr, RequestCode.SEND_MESSAGE, {"topic": topic, "queue_id": queue_id,
                                                               "properties": props}, body)


async def _pull(client, addr, topic, queue_id=0):
    r = await call(client, addr, RequestCode.PULL_MESSAGE,
                   {"consumer_group": "cg", "topic": topic, "queue_id": queue_id, "queue_offset": 0,
                    "max_msg_nums": 32})
    return list(iter_records(r.body)) if r.code == ResponseCode.SUCCESS else []


async def _parked(client, addr) -> list[int]:
    """How many records each level's schedule queue holds (GET_ALL_DELAY_OFFSET's max_offset)."""
    r = await call(client, addr, RequestCode.GET_ALL_DELAY_OFFSET, {})
    return [row["max_offset"] for row in cbor2.loads(r.body)["levels"]]


async def test_a_timer_message_hops_through_the_levels_and_arrives_not_before_its_time_as_sent(nursery, tmp_path):
    addr, node = await _start(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        deliver_ms = int(time.time() * 1000) + 1500
        props = {"TAGS": "TagT", "KEYS": "timer-1", "UNIQ_KEY": "U-T1", "color": "red",
                 "TIMER_DELIVER_MS": str(deliver_ms)}
        r = await _send(client, addr, "TimerT", props, b"at-time", queue_id=1)
        assert r.code == ResponseCode.SUCCESS, r.remark
        # It waits first in the longest level not past its time: 1 s, level 3, schedule queue 2.
        waiting = decode_record((await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID,
                                            {"msg_id": r.ext["msg_id"]})).body)
        assert (waiting.topic, waiting.queue_id) == ("SCHEDULE_TOPIC_XXXX", 2)
        assert waiting.properties["DELAY"] == "3" and waiting.properties["TIMER_DELIVER_MS"] == str(deliver_ms)
        with trio.fail_after(10):
            while not (got := await _pull(client, addr, "TimerT", 1)):
                await trio.sleep(0.02)
        arrived_ms = time.time() * 1000
        assert arrived_ms >= deliver_ms, f"delivered {deliver_ms - arrived_ms:.0f} ms early"
        (delivered,) = got
        assert delivered.body == b"at-time" and delivered.queue_offset == 0
        assert "DELAY" not in delivered.properties
        assert {k: delivered.properties[k] for k in props} == props  # its id, keys, tags and time kept
        # After the 1 s level, 0.5 s or less were left: parked again in the 300 ms level, once, or twice when
        # more than 0.3 s were left (how long a round took decides).
        parked = await _parked(client, addr)
        assert parked[1:] == [0, 1] and parked[0] in (1, 2), parked
        await trio.sleep(0.5)
        assert len(await _pull(client, addr, "TimerT", 1)) == 1  # once
        # (Counted once the round's progress is replicated, after the message is readable.)
        assert node.schedule.timer_hops == parked[0] and node.schedule.delivered == 1
        found = await call(client, addr, RequestCode.QUERY_MESSAGE, {"topic": "TimerT", "key": "timer-1"})
        assert [v.body for v in iter_records(found.body)] == [b"at-time"]


async def test_timer_times_past_relative_and_refused_and_with_a_delay_level_or_a_transaction(nursery, tmp_path):
    addr, _ = await _start(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        now_ms = int(time.time() * 1000)
        # Past or now: stored at once in the topic, a normal message.
        for i, when in enumerate((now_ms - 60_000, now_ms)):
            r = await _send(client, addr, "TimerT", {"TIMER_DELIVER_MS": str(when)}, b"past-%d" % i)
            assert r.code == ResponseCode.SUCCESS, r.remark
        assert [v.body for v in await _pull(client, addr, "TimerT")] == [b"past-0", b"past-1"]
        # Relative: kept as the absolute time it stands for, on the broker's clock.
        r = await _send(client, addr, "TimerT", {"TIMER_DELAY_SEC": "2"}, b"rel")
        assert r.code == ResponseCode.SUCCESS
        waiting = decode_record((await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID,
                                            {"msg_id": r.ext["msg_id"]})).body)
        assert "TIMER_DELAY_SEC" not in waiting.properties and waiting.queue_id == 2
        assert now_ms + 2000 <= int(waiting.properties["TIMER_DELIVER_MS"]) <= int(time.time() * 1000) + 2000
        # Too far ahead: refused naming the limit; malformed: naming the property.
        r = await _send(client, addr, "TimerT", {"TIMER_DELIVER_MS": str(now_ms + 4 * 86_400_000)}, b"x")
        assert r.code == ResponseCode.MESSAGE_ILLEGAL and "259200000 ms" in r.remark, r.remark
        r = await _send(client, addr, "TimerT", {"TIMER_DELAY_MS": "1e3"}, b"x")
        assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == "properties"
        assert "'TIMER_DELAY_MS'" in r.remark and "'1e3'" in r.remark
        # A delay level wins, the timer dropped (RocketMQ's checkIfTimerMessage); level 0 leaves the timer.
        r = await _send(client, addr, "TimerT", {"DELAY": "1", "TIMER_DELAY_SEC": "100"}, b"lvl")
        waiting = decode_record((await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID,
                                            {"msg_id": r.ext["msg_id"]})).body)
        assert waiting.queue_id == 0 and "TIMER_DELAY_SEC" not in waiting.properties
        assert "TIMER_DELIVER_MS" not in waiting.properties
        r = await _send(client, addr, "TimerT", {"DELAY": "0", "TIMER_DELAY_MS": "700"}, b"lvl0")
        waiting = decode_record((await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID,
                                            {"msg_id": r.ext["msg_id"]})).body)
        assert (waiting.topic, waiting.queue_id) == ("SCHEDULE_TOPIC_XXXX", 1)
        # A transactional message may not wait for a time.
        r = await _send(client, addr, "TimerT", {"TRAN_MSG": "true", "PGROUP": "pg", "UNIQ_KEY": "tx-1",
                                                 "TIMER_DELAY_MS": "5000"}, b"tx")
        assert r.code == ResponseCode.INVALID_REQUEST and "TIMER_DELAY_MS" in r.remark
        # In a batch the timer properties are not read (as RocketMQ's broker): stored at once.
        batch = encode_batch([MessageInput("TimerB", 0, b"b", {"TIMER_DELAY_SEC": "100"})], ("127.0.0.1", 1))
        r = await call(client, addr, RequestCode.SEND_BATCH_MESSAGE, {"topic": "TimerB", "queue_id": 0}, batch)
        assert r.code == ResponseCode.SUCCESS
        assert [v.body for v in await _pull(client, addr, "TimerB")] == [b"b"]


async def test_a_round_whose_progress_is_not_replicated_is_redone_a_hop_twice_never_lost(nursery, tmp_path,
                                                                                        monkeypatch):
    addr, node = await _start(nursery, tmp_path)
    put_metadata = node.group.put_metadata
    failed: list[dict] = []

    async def fail_first_schedule_progress(table, items, **kwargs):
        # The leader dies after appending the round's batch (a hop here), before its progress is replicated.
        if table == SCHEDULE_TABLE and not failed:
            failed.append(items)
            raise RaftMQError("progress not replicated (injected)")
        return await put_metadata(table, items, **kwargs)

    monkeypatch.setattr(node.group, "put_metadata", fail_first_schedule_progress)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        deliver_ms = int(time.time() * 1000) + 1200
        r = await _send(client, addr, "TimerT", {"UNIQ_KEY": "U-R", "TIMER_DELIVER_MS": str(deliver_ms)}, b"redo")
        assert r.code == ResponseCode.SUCCESS, r.remark
        with trio.fail_after(10):
            while len(got := await _pull(client, addr, "TimerT")) < 2:
                await trio.sleep(0.02)
        assert time.time() * 1000 >= deliver_ms
        assert failed == [{"3": 1}]  # the 1 s level's round: its hop appended, its progress lost
        # The next round started from the replicated progress and parked it again: two copies, both on time.
        assert [(v.body, v.properties["UNIQ_KEY"]) for v in got] == [(b"redo", "U-R")] * 2
        assert all(int(v.properties["TIMER_DELIVER_MS"]) <= v.store_timestamp for v in got)
        await trio.sleep(0.5)
        assert len(await _pull(client, addr, "TimerT")) == 2

