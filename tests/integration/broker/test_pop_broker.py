"""POP on an in-process single-node broker (broker/pop.py, broker/processor/pop_message.py): the POP retry topic's
name and who may use it, admin moves (reset, clone, delete) of POP state and POP retry topics, receipt handles of
another group or queue, an ack or change losing the race to revive, revive going on past a checkpoint it cannot
revive, and batch acks (one write, an outcome per handle). Deletes racing POP writes: test_pop_delete_race.py.

The revive task's own interval is long here: each test calls ``PopService.revive_expired`` with a clock far ahead,
or revives one checkpoint itself, so nothing depends on timing but the one race test's wait for a deadline.
"""

from __future__ import annotations

import logging

import cbor2
import trio

from broker.node import BrokerNode, serve_broker
from broker.pop import POP_TABLE, CheckPoint, ReceiptHandle, now_ms
from broker.pop import MAX_BATCH_ACK
from broker.topic_config import PERM_READ_WRITE, TopicConfig
from remoting.codes import RequestCode, ResponseCode
from remoting.message import MAX_PROPERTIES_SIZE, encode_properties, iter_records, pop_retry_topic
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, wait_leader
from tests.unit.broker.test_pop import CountingTable

FAR = 10 ** 9  # ms: a clock this far ahead finds every checkpoint expired


async def _broker(nursery, tmp_path, **overrides) -> tuple[BrokerNode, str]:
    (config,) = broker_configs(tmp_path, None, pop_revive_interval_ms=60_000, **overrides)
    nodes: list[BrokerNode] = []
    host, port = await nursery.start(lambda task_status: serve_broker(config, on_serving=nodes.append,
                                                                      task_status=task_status))
    return nodes[0], f"{host}:{port}"


async def _send(client, addr: str, topic: str, body: bytes, queue_id: int = 0, **properties: str) -> None:
    r = await call(client, addr, RequestCode.SEND_MESSAGE,
                   {"producer_group": "pg", "topic": topic, "queue_id": queue_id, "born_timestamp": 1,
                    "properties": {"TAGS": "TagA", **properties}}, body)
    assert r.code == ResponseCode.SUCCESS, r.remark


async def _pop(client, addr: str, group: str, topic: str, *, invisible_ms: int = 60_000, n: int = 32,
               queue_id: int = 0) -> list:
    """(message, receipt handle) pairs of one POP of a queue (and the group's retry topic), from the first offset."""
    r = await call(client, addr, RequestCode.POP_MESSAGE,
                   {"consumer_group": group, "topic": topic, "queue_id": queue_id, "max_msg_nums": n,
                    "invisible_time_ms": invisible_ms, "init_mode": 0})
    if r.code == ResponseCode.PULL_NOT_FOUND:
        return []
    assert r.code == ResponseCode.SUCCESS, r.remark
    return list(zip(iter_records(r.body), r.ext["receipt_handles"]))


async def _ack(client, addr: str, group: str, topic: str, handle: str):
    return await call(client, addr, RequestCode.ACK_MESSAGE,
                      {"consumer_group": group, "topic": topic, "receipt_handle": handle})


def _pop_keys(node: BrokerNode) -> list[str]:
    return sorted(node.pop.table())


async def test_the_pop_retry_topic_is_v2_and_nobody_sends_to_pulls_or_pops_it(nursery, tmp_path):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _send(client, addr, "PopT", b"m0")
        (first,) = await _pop(client, addr, "g", "PopT")
        assert await node.pop.revive_expired(now=now_ms() + FAR) == 1
        retry = "%RETRY%g+PopT"
        assert node.topic(retry) is not None and node.topic("%RETRY%g_PopT") is None  # not group g_PopT's
        (again,) = await _pop(client, addr, "g", "PopT")
        assert again[0].topic == retry and again[0].reconsume_times == 1 and again[0].body == b"m0"

        # Only revive writes it, only the group's POPs of PopT read it.
        r = await call(client, addr, RequestCode.SEND_MESSAGE,
                       {"producer_group": "pg", "topic": retry, "queue_id": 0}, b"forged")
        assert r.code == ResponseCode.NO_PERMISSION and "reserved" in r.remark and retry in r.remark
        r = await call(client, addr, RequestCode.PULL_MESSAGE,
                       {"consumer_group": "g", "topic": retry, "queue_id": 0, "queue_offset": 0, "max_msg_nums": 8})
        assert r.code == ResponseCode.NO_PERMISSION and retry in r.remark and "POP retry topic" in r.remark
        r = await call(client, addr, RequestCode.POP_MESSAGE,
                       {"consumer_group": "thief", "topic": retry, "invisible_time_ms": 60_000, "init_mode": 0})
        assert r.code == ResponseCode.NO_PERMISSION and retry in r.remark
        # A '+' anywhere else is no legal name.
        for name in ("a+b", "%RETRY%+PopT", "%RETRY%g+", "%RETRY%g+a+b", "%DLQ%g+PopT"):
            r = await call(client, addr, RequestCode.SEND_MESSAGE,
                           {"producer_group": "pg", "topic": name, "queue_id": 0}, b"x")
            assert r.code == ResponseCode.INVALID_REQUEST and r.ext.get("field") == "topic", (name, r.remark)


async def test_reset_and_clone_move_a_pop_groups_offsets(nursery, tmp_path):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        for i in range(3):
            await _send(client, addr, "PopReset", f"m{i}".encode())
        for group in ("g", "g2"):
            got = await _pop(client, addr, group, "PopReset")
            assert len(got) == 3
            for _msg, handle in got:
                assert (await _ack(client, addr, group, "PopReset", handle)).code == ResponseCode.SUCCESS
        assert await _pop(client, addr, "g", "PopReset") == []

        # Back to the first message (timestamp 0): the POP group reads it all again, as a pull group would.
        r = await call(client, addr, RequestCode.INVOKE_BROKER_TO_RESET_OFFSET,
                       {"consumer_group": "g", "topic": "PopReset", "timestamp": 0})
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert node.pop.pop_offset("g", "PopReset", 0) == 0
        assert sorted(m.body for m, _h in await _pop(client, addr, "g", "PopReset")) == [b"m0", b"m1", b"m2"]

        r = await call(client, addr, RequestCode.INVOKE_BROKER_TO_RESET_OFFSET,
                       {"consumer_group": "g", "topic": "PopReset", "timestamp": 0})
        assert r.code == ResponseCode.SUCCESS, r.remark
        r = await call(client, addr, RequestCode.CLONE_GROUP_OFFSET,
                       {"src_group": "g", "dest_group": "g2", "topic": "PopReset"})
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert len(await _pop(client, addr, "g2", "PopReset")) == 3


async def test_delete_topic_and_delete_group_take_their_pop_state(nursery, tmp_path):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        for i in range(3):
            await _send(client, addr, "PopGone", f"old{i}".encode())
        assert len(await _pop(client, addr, "g", "PopGone", n=2)) == 2
        assert await node.pop.revive_expired(now=now_ms() + FAR) == 2  # its POP retry topic is created
        assert len(await _pop(client, addr, "g", "PopGone")) == 3  # one left of the topic, two revived
        assert any("PopGone" in key for key in _pop_keys(node))

        r = await call(client, addr, RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": "PopGone"})
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert [key for key in _pop_keys(node) if "PopGone" in key] == []
        assert node.topic(pop_retry_topic("g", "PopGone")) is None  # gone with its topic, as RocketMQ 5's
        # Created again: a POP from the first offset reads the new messages, all of them (a stale pop offset of 3
        # would skip the first three), and nothing revived of the old topic.
        for i in range(5):
            await _send(client, addr, "PopGone", f"new{i}".encode())
        got = await _pop(client, addr, "g", "PopGone")
        assert sorted(m.body for m, _h in got) == [f"new{i}".encode() for i in range(5)]
        assert await node.pop.revive_expired(now=now_ms() + FAR) == 5

        # Deleting the group (clean_offset) takes its pop offsets and checkpoints: nothing of it is revived.
        assert any(key.split("\x01")[1] == "g" for key in _pop_keys(node))
        r = await call(client, addr, RequestCode.DELETE_SUBSCRIPTIONGROUP, {"group_name": "g"})
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert [key for key in _pop_keys(node) if key.split("\x01")[1] == "g"] == []
        assert await node.pop.revive_expired(now=now_ms() + FAR) == 0
        # Its POP retry topic too: kept, a group of the name would read it again from its first message.
        assert node.topic(pop_retry_topic("g", "PopGone")) is None and node.topic("PopGone") is not None


async def test_handles_of_another_group_or_queue_are_refused_and_locks_are_freed(nursery, tmp_path):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _send(client, addr, "PopAck", b"m0")
        ((_msg, handle),) = await _pop(client, addr, "g", "PopAck")
        r = await _ack(client, addr, "other", "PopAck", handle)
        assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == "receipt_handle", r.remark
        assert "'g'" in r.remark and "'other'" in r.remark
        parsed = ReceiptHandle.decode(handle)
        for queue_id in (4, 2 ** 31 - 1):  # the topic has 4 queues
            forged = ReceiptHandle(parsed.broker_name, "g", "PopAck", queue_id, 0, 0, parsed.pop_time_ms,
                                   parsed.invisible_time_ms).encode()
            r = await _ack(client, addr, "g", "PopAck", forged)
            assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == "receipt_handle", r.remark
            assert f"queue {queue_id}" in r.remark
        r = await _ack(client, addr, "g", "PopAck", handle)
        assert r.code == ResponseCode.SUCCESS and r.ext["acked"] is True
        assert node.pop._locks == {}  # nobody holds or waits for one: none is kept


async def test_an_ack_or_change_that_waited_for_revive_is_told_its_message_comes_back(nursery, tmp_path):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _send(client, addr, "PopRace", b"m0")
        await _send(client, addr, "PopRace", b"m1")
        got = await _pop(client, addr, "g", "PopRace", invisible_ms=1_500)
        (h0, h1) = (handle for _m, handle in got)
        deadline = ReceiptHandle.decode(h0).deadline_ms
        answers: dict[str, object] = {}

        async def request(name: str, code: int, ext: dict) -> None:
            async with open_remoting_client() as own:  # a connection each: one may serve its requests in order
                answers[name] = await call(own, addr, code, ext)

        async with trio.open_nursery() as inner:
            async with node.pop.queue_lock("g", "PopRace", 0):
                # Both are in before the deadline and wait for the queue's lock, which the revive takes first.
                inner.start_soon(request, "ack", RequestCode.ACK_MESSAGE,
                                 {"consumer_group": "g", "topic": "PopRace", "receipt_handle": h0})
                inner.start_soon(request, "change", RequestCode.CHANGE_MESSAGE_INVISIBLETIME,
                                 {"consumer_group": "g", "topic": "PopRace", "receipt_handle": h1,
                                  "invisible_time_ms": 60_000})
                with trio.fail_after(10):  # liveness
                    while node.pop._locks[("g", "PopRace", 0)].users < 3:
                        await trio.sleep(0.01)
                    while now_ms() <= deadline:
                        await trio.sleep(0.05)
                ck = CheckPoint.from_wire(node.pop.table()[ReceiptHandle.decode(h0).checkpoint_key])
                assert await node.pop._revive(ck) == 2
        for name in ("ack", "change"):
            r = answers[name]
            assert r.code == ResponseCode.NO_MESSAGE and r.ext["field"] == "receipt_handle", (name, r.remark)
            assert "delivered again" in r.remark and "acked already" not in r.remark, r.remark


async def test_revive_goes_on_past_a_checkpoint_it_cannot_revive(nursery, tmp_path, caplog):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _send(client, addr, "PopStuck", b"m0")
        # g1's checkpoint is older, so first in each round; its retry topic cannot be created (max_topic_count),
        # g2's exists already.
        assert len(await _pop(client, addr, "g1", "PopStuck")) == 1
        await trio.sleep(0.01)
        assert len(await _pop(client, addr, "g2", "PopStuck")) == 1
        await node.ensure_topic(TopicConfig(pop_retry_topic("g2", "PopStuck"), 1, 1, PERM_READ_WRITE))
        r = await call(client, addr, RequestCode.UPDATE_BROKER_CONFIG,
                       body=cbor2.dumps({"max_topic_count": str(len(node.topics))}))
        assert r.code == ResponseCode.SUCCESS, r.remark
        with caplog.at_level(logging.WARNING, logger="broker.pop"):
            assert await node.pop.revive_expired(now=now_ms() + FAR) == 1
            keys = [key for key in _pop_keys(node) if key.startswith("c\x01")]
            assert len(keys) == 1 and keys[0].split("\x01")[1] == "g1"  # g2's went; g1's waits
            assert await node.pop.revive_expired(now=now_ms() + FAR) == 0  # backing off: not tried again at once
        warnings = [rec for rec in caplog.records if rec.name == "broker.pop" and rec.levelno == logging.WARNING]
        assert len(warnings) == 1 and "g1" in warnings[0].getMessage() and "max_topic_count" in warnings[0].getMessage()
        (again,) = await _pop(client, addr, "g2", "PopStuck")
        assert again[0].reconsume_times == 1


async def test_a_message_that_cannot_carry_the_retry_properties_goes_to_the_dlq_as_stored(nursery, tmp_path):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _send(client, addr, "PopBig", b"fits")
        # Properties a few bytes below the limit: stored, but not with RETRY_TOPIC and ORIGIN_MESSAGE_ID added.
        await _send(client, addr, "PopBig", b"big", BIG="x")
        stored = node.message_at("PopBig", 0, 1).properties
        room = MAX_PROPERTIES_SIZE - len(encode_properties(stored)) - 10
        await _send(client, addr, "PopBig", b"big", BIG="x" * (room + 1))
        await _send(client, addr, "PopBig", b"last")
        big = node.message_at("PopBig", 0, 2)
        assert MAX_PROPERTIES_SIZE - 20 < len(encode_properties(big.properties)) <= MAX_PROPERTIES_SIZE
        got = await _pop(client, addr, "g", "PopBig")
        assert [m.queue_offset for m, _h in got] == [0, 1, 2, 3]  # one checkpoint, the big one in the middle
        assert await node.pop.revive_expired(now=now_ms() + FAR) == 4
        assert [key for key in _pop_keys(node) if key.startswith("c\x01")] == []
        dlq = node.store.get_messages("%DLQ%g", 0, 0, 8, 1 << 30)
        (dead,) = iter_records(b"".join(bytes(m) for m in dlq.messages))
        assert dead.body == b"big" and dead.properties == big.properties and dead.reconsume_times == 1
        again = await _pop(client, addr, "g", "PopBig")
        assert sorted(m.body for m, _h in again) == [b"big", b"fits", b"last"]


async def _batch_ack(client, addr: str, group: str, handles) -> tuple[object, list[dict]]:
    r = await call(client, addr, RequestCode.BATCH_ACK_MESSAGE, {"consumer_group": group}, cbor2.dumps(handles))
    assert r.code == ResponseCode.SUCCESS, r.remark
    entries = cbor2.loads(r.body)
    assert len(entries) == len(handles)
    return r, entries


def _count_pop_writes(node: BrokerNode) -> list[dict]:
    """Every replicated write of the POP table from now on, as a list of their items."""
    writes: list[dict] = []
    put_metadata = node.group.put_metadata

    async def counting(table, items, **kw):
        if table == POP_TABLE:
            writes.append(dict(items))
        return await put_metadata(table, items, **kw)

    node.group.put_metadata = counting  # type: ignore[method-assign]
    return writes


def _count_pop_table_passes(node: BrokerNode):
    """From now on, count the passes over the POP table (its iterations) until the returned function is called."""
    table = CountingTable(node.pop.table())
    node.pop.table = lambda: table  # type: ignore[method-assign]

    def stop() -> int:
        del node.pop.table  # the method again
        return table.passes
    return stop


async def test_a_batch_ack_of_several_queues_and_the_retry_topic_is_one_write(nursery, tmp_path):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        for queue_id, body in ((0, b"a0"), (0, b"a1"), (1, b"b0"), (2, b"r0")):
            await _send(client, addr, "PopBatch", body, queue_id=queue_id)
        assert len(await _pop(client, addr, "g", "PopBatch", queue_id=2)) == 1
        assert await node.pop.revive_expired(now=now_ms() + FAR) == 1
        got = await _pop(client, addr, "g", "PopBatch", queue_id=0)  # queue 0's two and the retry topic's one
        got += await _pop(client, addr, "g", "PopBatch", queue_id=1)
        handles = {m.body: h for m, h in got}
        assert sorted(handles) == [b"a0", b"a1", b"b0", b"r0"]
        assert ReceiptHandle.decode(handles[b"r0"]).topic == pop_retry_topic("g", "PopBatch")
        assert len([k for k in _pop_keys(node) if k.startswith("c\x01")]) == 3

        writes = _count_pop_writes(node)
        batch = [handles[b"a0"], handles[b"b0"], handles[b"r0"], handles[b"a1"]]
        _r, entries = await _batch_ack(client, addr, "g", batch)
        assert entries == [{"code": 0, "acked": True}] * 4
        assert len(writes) == 1 and len(writes[0]) == 3  # the three checkpoints, each removed once
        assert [k for k in _pop_keys(node) if k.startswith("c\x01")] == []
        assert node.pop._locks == {}
        # Acked again (a retried batch): acked false each, and nothing to write; judged in one pass over the table,
        # not a scan of it per handle (held under the queues' locks, on the event loop).
        passes = _count_pop_table_passes(node)
        _r, entries = await _batch_ack(client, addr, "g", batch)
        assert entries == [{"code": 0, "acked": False}] * 4 and len(writes) == 1
        assert passes() == 1
        # Nothing comes back: the revive finds no checkpoint.
        assert await node.pop.revive_expired(now=now_ms() + FAR) == 0


async def test_a_batch_ack_says_per_handle_what_became_of_it(nursery, tmp_path):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        for i in range(3):
            await _send(client, addr, "PopMixed", f"m{i}".encode())
        (h0, h1, h2) = (h for _m, h in await _pop(client, addr, "g", "PopMixed"))
        r = await call(client, addr, RequestCode.CHANGE_MESSAGE_INVISIBLETIME,
                       {"consumer_group": "g", "topic": "PopMixed", "receipt_handle": h2, "invisible_time_ms": 60_000})
        assert r.code == ResponseCode.SUCCESS, r.remark
        h2_new = r.ext["receipt_handle"]
        ((_m, other_group),) = await _pop(client, addr, "other", "PopMixed", n=1)
        parsed = ReceiptHandle.decode(h0)
        expired = ReceiptHandle(parsed.broker_name, "g", "PopMixed", 0, 0, 0, 1_000, 1_000).encode()
        unknown = ReceiptHandle(parsed.broker_name, "g", "NoSuchTopic", 0, 0, 0, parsed.pop_time_ms,
                                parsed.invisible_time_ms).encode()
        thief = ReceiptHandle(parsed.broker_name, "g", pop_retry_topic("other", "PopMixed"), 0, 0, 0,
                              parsed.pop_time_ms, parsed.invisible_time_ms).encode()
        writes = _count_pop_writes(node)
        _r, entries = await _batch_ack(client, addr, "g",
                                       [h0, expired, other_group, "garbage", h2, unknown, thief, h1, h2_new])
        assert len(writes) == 1  # h0, h1 and h2_new: still one write
        ok, late, foreign, malformed, superseded, no_topic, retry_of_other, ok1, ok2 = entries
        assert ok == ok1 == ok2 == {"code": 0, "acked": True}
        assert late["code"] == ResponseCode.NO_MESSAGE and "expired" in late["remark"]
        assert "delivered again" in late["remark"]
        assert foreign["code"] == ResponseCode.INVALID_REQUEST and "'other'" in foreign["remark"]
        assert malformed["code"] == ResponseCode.INVALID_REQUEST and "'garbage'" in malformed["remark"]
        assert superseded["code"] == ResponseCode.NO_MESSAGE and "superseded" in superseded["remark"]
        assert no_topic["code"] == ResponseCode.TOPIC_NOT_EXIST and "NoSuchTopic" in no_topic["remark"]
        assert retry_of_other["code"] == ResponseCode.INVALID_REQUEST and "'other'" in retry_of_other["remark"]
        # Only the group "other" still has a message invisible: what g popped is acked.
        assert [k.split("\x01")[1] for k in _pop_keys(node) if k.startswith("c\x01")] == ["other"]
        assert node.pop._locks == {}


async def test_a_malformed_batch_ack_is_refused_whole_naming_the_field(nursery, tmp_path):
    node, addr = await _broker(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _send(client, addr, "PopBadBatch", b"m0")
        ((_m, handle),) = await _pop(client, addr, "g", "PopBadBatch")
        for body, problem in [
            (b"", "is required"),
            (b"\xff\x00", "not valid CBOR"),
            (cbor2.dumps({"receipt_handles": [handle]}), "got dict"),
            (cbor2.dumps([]), "got a list of 0"),
            (cbor2.dumps([handle] * (MAX_BATCH_ACK + 1)), f"got a list of {MAX_BATCH_ACK + 1}"),
            (cbor2.dumps([handle, 7]), "entry 1 is 7"),
        ]:
            r = await call(client, addr, RequestCode.BATCH_ACK_MESSAGE, {"consumer_group": "g"}, body)
            assert r.code == ResponseCode.INVALID_REQUEST and r.ext.get("field") == "body", (problem, r.remark)
            assert problem in r.remark, r.remark
        r = await call(client, addr, RequestCode.BATCH_ACK_MESSAGE, {}, cbor2.dumps([handle]))
        assert r.code == ResponseCode.INVALID_REQUEST and r.ext.get("field") == "consumer_group", r.remark
        # Nothing was acked by a refused request: the handle still acks its message.
        _r, entries = await _batch_ack(client, addr, "g", [handle])
        assert entries == [{"code": 0, "acked": True}]
