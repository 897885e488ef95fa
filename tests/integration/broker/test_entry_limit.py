"""What one DLedger entry holds, against an in-process broker whose entries are small (128 KiB).

A message's record is what ``max_message_size`` bounds, but its entry carries more: a 20-byte queue unit and a
12-byte index entry per key, six times what a key takes in KEYS. So a round of a broker service (delayed delivery,
transaction checks, POP revive) sized by records, or a producer's batch within the message limit, could make an
entry the group refuses. Found by review: the delivery round's bare ValueError stopped the broker, and every restart
met the same round; a batch was answered SYSTEM_ERROR, which a producer retries, with a traceback in the log.
Here each message takes ~4 KB of record and ~28 KB of entry (2,000 keys), so four of them fill an entry.
"""

from __future__ import annotations

import functools
import logging
import time

import cbor2
import trio

from broker.node import BrokerNode, serve_broker
from broker.pop import now_ms
from broker.service_rounds import alone_entry_bytes, entry_room
from remoting.codes import RequestCode, ResponseCode
from remoting.message import MessageInput, decode_record, encode_batch, iter_records
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, wait_leader

KEYS = "k " * 2000  # 4,000 bytes of KEYS: 2,000 index entries, 24,000 bytes of entry
# An entry of at most 128 KiB - 4,096 bytes; max_batch_bytes within what that allows (dledger/config.py).
SMALL_ENTRIES = {"dledger.append_entries_batch_size_bytes": 256 * 1024, "dledger.max_batch_bytes": 16 * 1024}
COUNT = 10  # messages: ~40 KB of records, well within max_message_size (~94 KB), ~280 KB of entry


async def _serve(nursery, config) -> tuple[BrokerNode, str]:
    nodes: list[BrokerNode] = []
    host, port = await nursery.start(functools.partial(serve_broker, config, on_serving=nodes.append))
    return nodes[0], f"{host}:{port}"


async def _send(client, addr: str, topic: str, body: bytes, **properties: str) -> None:
    # Awaited one by one (sent together, the group would propose them in as many entries as they need:
    # docs/architecture.md, "Message size").
    r = await call(client, addr, RequestCode.SEND_MESSAGE,
                   {"producer_group": "pg", "topic": topic, "queue_id": 0, "properties": {"KEYS": KEYS, **properties}},
                   body)
    assert r.code == ResponseCode.SUCCESS, r.remark


async def _pull_all(client, addr: str, topic: str) -> list:
    r = await call(client, addr, RequestCode.PULL_MESSAGE,
                   {"consumer_group": "cg", "topic": topic, "queue_id": 0, "queue_offset": 0, "max_msg_nums": 64})
    return list(iter_records(r.body)) if r.code == ResponseCode.SUCCESS else []


async def test_delayed_messages_due_together_past_one_entry_are_delivered_in_rounds_that_fit_after_a_restart(
        tmp_path):
    (config,) = broker_configs(tmp_path, None, message_delay_level="1s 1h", **SMALL_ENTRIES)
    async with trio.open_nursery() as nursery:
        node, addr = await _serve(nursery, config)
        async with open_remoting_client() as client:
            await wait_leader(client, addr)
            assert sum(alone_entry_bytes(node, MessageInput("DelayK", 0, b"x", {"KEYS": KEYS})) for _ in
                       range(COUNT)) > 2 * entry_room(node) and COUNT * 4200 < node.max_message_size
            sent_at = time.monotonic()
            for i in range(COUNT):
                await _send(client, addr, "DelayK", b"d%d" % i, DELAY="1")
        nursery.cancel_scope.cancel()
    # Down while they fall due: the restarted leader finds all of them due in its first round.
    await trio.sleep(max(0.0, 1.2 - (time.monotonic() - sent_at)))
    async with trio.open_nursery() as nursery:
        node, addr = await _serve(nursery, config)
        async with open_remoting_client() as client:
            await wait_leader(client, addr)
            with trio.fail_after(10):
                # Delivered, and the progress past them replicated (it follows each round's append).
                while node.schedule.offsets().get(1) != COUNT or node.schedule.delivered < COUNT:
                    await trio.sleep(0.05)
            delivered = await _pull_all(client, addr, "DelayK")
            assert sorted(m.body for m in delivered) == sorted(b"d%d" % i for i in range(COUNT))
            assert all(m.properties["KEYS"] == KEYS for m in delivered)
            r = await call(client, addr, RequestCode.GET_ALL_DELAY_OFFSET, {})
            level1 = cbor2.loads(r.body)["levels"][0]
            assert level1["delivered_offset"] == level1["max_offset"] == COUNT
            assert node.schedule.delivered == COUNT and node.schedule.dropped == 0
        nursery.cancel_scope.cancel()


async def test_a_batch_whose_keys_overflow_one_entry_is_message_illegal_naming_the_sizes_not_a_system_error(
        nursery, tmp_path, caplog):
    (config,) = broker_configs(tmp_path, None, **SMALL_ENTRIES)
    node, addr = await _serve(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        body = encode_batch([MessageInput("BatchK", 0, b"x", {"KEYS": KEYS}) for _ in range(COUNT)], ("127.0.0.1", 1))
        assert len(body) < node.max_message_size
        with caplog.at_level(logging.WARNING):
            r = await call(client, addr, RequestCode.SEND_BATCH_MESSAGE, {"topic": "BatchK", "queue_id": 0}, body)
        # MESSAGE_ILLEGAL is not retriable: a producer does not send again a batch that can never fit.
        assert r.code == ResponseCode.MESSAGE_ILLEGAL, (r.code, r.remark)
        assert f"the batch of {COUNT} messages ({len(body)} bytes) makes a DLedger entry of " in r.remark, r.remark
        limit = node.config.dledger.max_entry_bytes
        assert f"more than the {limit} one entry holds" in r.remark and f"its {COUNT * 2000} index entries" in r.remark
        assert not [rec for rec in caplog.records if rec.exc_info], "a refusal, not a defect: no traceback"
        assert await _pull_all(client, addr, "BatchK") == []
        # Within the entry, the same messages go: nothing of the refusal stayed behind.
        body = encode_batch([MessageInput("BatchK", 0, b"x", {"KEYS": KEYS}) for _ in range(3)], ("127.0.0.1", 1))
        r = await call(client, addr, RequestCode.SEND_BATCH_MESSAGE, {"topic": "BatchK", "queue_id": 0}, body)
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert len(await _pull_all(client, addr, "BatchK")) == 3


async def test_a_transaction_check_round_and_a_pop_revive_split_what_does_not_fit_one_entry(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None, pop_revive_interval_ms=60_000, transaction_check_interval_ms=3_600_000,
                               **SMALL_ENTRIES)
    node, addr = await _serve(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        # Transaction checks: COUNT halves older than the timeout, re-stored with their op records.
        for i in range(COUNT):
            await _send(client, addr, "TxK", b"h%d" % i, TRAN_MSG="true", PGROUP="pg", UNIQ_KEY=f"U-{i}")
        later = int(time.time() * 1000) + 3_600_000
        first = await node.transactions.check_round(now_ms=later)
        assert 1 < first < COUNT  # cut by the entry, not by CHECKS_PER_BATCH (32)
        while node.transactions.checks < COUNT:  # (the copies re-stored are old too at ``later``: checked again)
            assert await node.transactions.check_round(now_ms=later) > 0
        # POP revive: one POP hands out COUNT messages, one checkpoint, revived into the retry topic.
        for i in range(COUNT):
            await _send(client, addr, "PopK", b"p%d" % i)
        r = await call(client, addr, RequestCode.POP_MESSAGE,
                       {"consumer_group": "g", "topic": "PopK", "queue_id": 0, "max_msg_nums": 32,
                        "invisible_time_ms": 60_000, "init_mode": 0})
        assert r.code == ResponseCode.SUCCESS and len(r.ext["receipt_handles"]) == COUNT, r.remark
        assert await node.pop.revive_expired(now=now_ms() + 10 ** 9) == COUNT
        retry = "%RETRY%g+PopK"  # no client may pull it: read from the store
        retried = [decode_record(raw).body for queue_id in range(node.topic(retry).write_queue_nums)
                   for raw in node.store.get_messages(retry, queue_id, 0, 64, 1 << 20).messages]
        assert sorted(retried) == sorted(b"p%d" % i for i in range(COUNT))
        assert [key for key in node.pop.table() if key.startswith("c")] == []  # the checkpoint went with the last
