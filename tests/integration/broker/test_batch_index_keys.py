"""A send's index keys against an in-process broker: judged from the batch's bytes, never by building its entry.

The leader builds a send's DLedger entry (a hash and 12 bytes per UNIQ_KEY and per key of KEYS) on the thread that
also ticks Raft. Found by review: a legal batch of 64 messages with 15,000 one-character keys each (1.9 MB) made a
13.4 MB entry, which the group refused only after building it (0.5 s), and the refusal built it once more to name
its index entries; the followers elected another leader meanwhile (tests/cluster/test_many_keys_batch.py). A
batch is now refused before anything is built when its entry cannot fit, or when it holds more than
``MAX_BATCH_INDEX_KEYS`` keys; a single send past the entry is refused by the group after one build, not two.
"""

from __future__ import annotations

import functools

import trio

from broker.node import BrokerNode, serve_broker
from broker.processor.send_message import MAX_BATCH_INDEX_KEYS
from remoting.codes import RequestCode, ResponseCode
from remoting.message import MessageInput, encode_batch
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, wait_leader

MOST_KEYS = " ".join("k" for _ in range(16_381))  # the most keys one message's 32 KiB of properties hold
# An entry of at most 128 KiB - 4,096 bytes; max_batch_bytes within what that allows (dledger/config.py).
SMALL_ENTRIES = {"dledger.append_entries_batch_size_bytes": 256 * 1024, "dledger.max_batch_bytes": 16 * 1024}


async def _serve(nursery: trio.Nursery, config) -> tuple[BrokerNode, str]:
    nodes: list[BrokerNode] = []
    host, port = await nursery.start(functools.partial(serve_broker, config, on_serving=nodes.append))
    return nodes[0], f"{host}:{port}"


def _count_builds(node: BrokerNode, monkeypatch) -> list[int]:
    """How many times the node's state machine builds an entry from here on (``MessageStore.prepare_append``)."""
    builds = [0]
    prepare = node.store.prepare_append

    def counted(*args, **kwargs):
        builds[0] += 1
        return prepare(*args, **kwargs)

    monkeypatch.setattr(node.store, "prepare_append", counted)
    return builds


def _batch(topic: str, keys: str, count: int) -> bytes:
    return encode_batch([MessageInput(topic, 0, b"b%d" % i, {"KEYS": keys}) for i in range(count)], ("127.0.0.1", 1))


async def _send_batch(client, addr: str, topic: str, body: bytes):
    return await call(client, addr, RequestCode.SEND_BATCH_MESSAGE, {"topic": topic, "queue_id": 0}, body)


async def _stored(client, addr: str, topic: str) -> int:
    r = await call(client, addr, RequestCode.GET_MAX_OFFSET, {"topic": topic, "queue_id": 0})
    return r.ext["offset"] if r.code == ResponseCode.SUCCESS else 0


async def test_a_batch_with_more_index_keys_than_one_send_may_hold_is_refused_before_its_entry_is_built(
        nursery, tmp_path, monkeypatch):
    (config,) = broker_configs(tmp_path, None)
    node, addr = await _serve(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        builds = _count_builds(node, monkeypatch)
        # Seven full messages: 114,667 keys, a 1.6 MB entry that fits max_entry_bytes (8 MiB) but would hold the
        # leader's Raft thread ~75 ms.
        body = _batch("KeysT", MOST_KEYS, 7)
        assert len(body) < node.max_message_size
        r = await _send_batch(client, addr, "KeysT", body)
        assert r.code == ResponseCode.MESSAGE_ILLEGAL, (r.code, r.remark)
        # The batch's as a whole: a client that packed single sends into it sends them again in smaller batches.
        assert r.ext.get("field") == "batch", r.ext
        assert r.remark == (f"the batch of 7 messages ({len(body)} bytes) holds 114667 index keys (one per UNIQ_KEY "
                            f"and per key of KEYS), more than the {MAX_BATCH_INDEX_KEYS} one send may hold (the "
                            f"leader builds each into the DLedger entry on the thread that keeps its Raft group); "
                            f"send fewer messages at once, or fewer keys")
        assert builds[0] == 0 and await _stored(client, addr, "KeysT") == 0
        # Any message alone is taken, and six of them together (98,286 keys) too.
        for count in (1, 6):
            r = await _send_batch(client, addr, "KeysT", _batch("KeysT", MOST_KEYS, count))
            assert r.code == ResponseCode.SUCCESS, r.remark
        assert await _stored(client, addr, "KeysT") == 7


async def test_a_batch_of_as_many_plain_messages_as_max_batch_messages_allows_is_taken(nursery, tmp_path):
    # Each message's UNIQ_KEY is an index key: a cap of 32,768 refused 40,000 plain messages that the largest
    # max_batch_messages (65,536) allowed (found by review).
    (config,) = broker_configs(tmp_path, None, max_batch_messages=65_536)
    node, addr = await _serve(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        body = encode_batch([MessageInput("ManyT", 0, b"x", {"UNIQ_KEY": "%032X" % i}) for i in range(40_000)],
                            ("127.0.0.1", 1))
        assert len(body) < node.max_message_size
        r = await _send_batch(client, addr, "ManyT", body)
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert await _stored(client, addr, "ManyT") == 40_000


async def test_a_batch_whose_entry_cannot_fit_is_refused_before_it_is_built_naming_the_counts(
        nursery, tmp_path, monkeypatch):
    (config,) = broker_configs(tmp_path, None, **SMALL_ENTRIES)
    node, addr = await _serve(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        builds = _count_builds(node, monkeypatch)
        # 10 messages of 2,000 keys: ~40 KB of batch within max_message_size, ~280 KB of entry.
        body = _batch("EntryT", "k " * 2000, 10)
        assert len(body) < node.max_message_size
        r = await _send_batch(client, addr, "EntryT", body)
        assert r.code == ResponseCode.MESSAGE_ILLEGAL, (r.code, r.remark)
        # The batch's as a whole: a client that packed single sends into it sends them again in smaller batches.
        assert r.ext.get("field") == "batch", r.ext
        assert builds[0] == 0
        least = len(body) - 16 + 10 * (40 + 20 + 12 * 2000) + 21 + 23 + 16 + 1 + len("EntryT") + 16
        assert r.remark.startswith(f"the batch of 10 messages ({len(body)} bytes) makes a DLedger entry of at least "
                                   f"{least} bytes, more than the {config.dledger.max_entry_bytes} one entry holds "
                                   f"(dledger.append_entries_batch_size_bytes): besides the records, its 20000 index "
                                   f"entries"), r.remark
        assert await _stored(client, addr, "EntryT") == 0


async def test_a_single_send_past_the_entry_is_refused_after_one_build_naming_the_group_s_sizes(
        nursery, tmp_path, monkeypatch):
    (config,) = broker_configs(tmp_path, None, **SMALL_ENTRIES)
    node, addr = await _serve(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        builds = _count_builds(node, monkeypatch)
        # 16,000 keys: 32 KB of properties, ~224 KB of entry. A single send's keys are not counted before the
        # group builds its entry (one message builds in ~10 ms); the refusal must not build it again.
        r = await call(client, addr, RequestCode.SEND_MESSAGE,
                       {"producer_group": "pg", "topic": "SingleT", "queue_id": 0,
                        "properties": {"KEYS": "k " * 16_000}}, b"x")
        assert r.code == ResponseCode.MESSAGE_ILLEGAL, (r.code, r.remark)
        # The batch's as a whole: a client that packed single sends into it sends them again in smaller batches.
        assert r.ext.get("field") == "batch", r.ext
        assert r.remark.startswith("the message (") and "makes a DLedger entry of " in r.remark, r.remark
        assert f"more than the {config.dledger.max_entry_bytes} one entry holds" in r.remark, r.remark
        assert "its 16000 index entries" in r.remark, r.remark
        assert builds[0] == 1
        assert await _stored(client, addr, "SingleT") == 0
