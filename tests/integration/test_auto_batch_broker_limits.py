"""Auto-batching producers against an in-process broker whose limits are lower than the client's, and closing with
sends in flight (client/accumulator.py, client/producer.py).

Found by review against a dev cluster: with the broker's max_batch_messages at 16, 192 of 200 concurrent single
sends failed, each caller of one message told "request field 'body' holds 64 messages"; the same for a broker
store.max_message_size below the client's and for a batch whose DLedger entry (records plus index keys) did not fit.
Closing a producer 20 ms after 300 sends began told ClientClosedError to 44 (296 with auto-batching) of callers whose
messages were stored."""

from __future__ import annotations

import collections

import trio

from client import Message, SendStatus, open_producer, open_pull_consumer
from tests.integration.broker.helpers import start_leading_node

# Entries of at most 128 KiB (as tests/integration/broker/test_entry_limit.py): a message with 500 keys takes 6 KB
# of index entries in its entry, so 64 of them (1 KB of KEYS each, 70 KB of batch) make an entry of 400 KB.
SMALL_ENTRIES = {"dledger.append_entries_batch_size_bytes": 256 * 1024, "dledger.max_batch_bytes": 16 * 1024}


async def _stored(namesrv: str, topic: str) -> list[bytes]:
    bodies = []
    async with open_pull_consumer(namesrv, consumer_group="auto-batch-check") as consumer:
        for mq in await consumer.fetch_queues(topic):
            offset = 0
            while True:
                result = await consumer.pull(mq, offset, 32)
                if not result.messages:
                    break
                bodies.extend(m.body for m in result.messages)
                offset = result.next_begin_offset
    return bodies


async def _burst(producer, topic: str, n: int, **fields) -> dict[int, object]:
    outcomes: dict[int, object] = {}

    async def one(i: int) -> None:
        try:
            outcomes[i] = (await producer.send(Message(topic, b"m%03d" % i + b"." * 900, **fields))).send_status
        except Exception as e:  # noqa: BLE001 - every failure is the finding
            outcomes[i] = e

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return outcomes


async def _check_burst(namesrv: str, producer, topic: str, n: int = 200, **fields) -> None:
    await producer.send(Message(topic, b"warm"))  # the topic exists, its route cached: the burst batches at once
    outcomes = await _burst(producer, topic, n, **fields)
    failed = {i: o for i, o in outcomes.items() if o is not SendStatus.SEND_OK}
    assert not failed, f"{len(failed)} of {n} failed, e.g. {next(iter(failed.values()))!r}"
    stored = await _stored(namesrv, topic)
    assert sorted(stored) == sorted([b"warm"] + [b"m%03d" % i + b"." * 900 for i in range(n)])
    assert producer.statistics().auto_batches < n  # still batched


async def test_auto_batches_past_the_brokers_max_batch_messages_are_sent_again_smaller(nursery, tmp_path):
    namesrv, _ = await start_leading_node(nursery, tmp_path, max_batch_messages=16)
    async with open_producer(namesrv, auto_batch=True) as producer:
        await _check_burst(namesrv, producer, "Counted")


async def test_auto_batches_past_the_brokers_max_message_size_are_sent_again_smaller(nursery, tmp_path):
    # The broker takes 16 KiB a batch body; the client thinks 4 MiB, and batches up to 64 KiB.
    namesrv, _ = await start_leading_node(nursery, tmp_path, **{"store.max_message_size": 16 * 1024})
    async with open_producer(namesrv, auto_batch=True) as producer:
        await _check_burst(namesrv, producer, "Sized")


async def test_auto_batches_past_the_brokers_entry_size_are_sent_again_smaller(nursery, tmp_path):
    namesrv, _ = await start_leading_node(nursery, tmp_path, **SMALL_ENTRIES)
    keys = " ".join(f"k{i}" for i in range(500))
    # No key limit of the client's: the broker's refusal of the entry is what keeps the batches small.
    async with open_producer(namesrv, auto_batch=True, auto_batch_max_keys=1 << 20) as producer:
        await _check_burst(namesrv, producer, "Keyed", n=100, keys=keys)


async def test_closing_answers_the_sends_in_flight_with_their_outcome_not_closed(nursery, tmp_path):
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    for auto_batch in (False, True):
        topic = f"Closing{int(auto_batch)}"
        outcomes: collections.Counter[str] = collections.Counter()
        async with trio.open_nursery() as outer:
            async with open_producer(namesrv, auto_batch=auto_batch, auto_batch_max_messages=8,
                                     auto_batch_max_delay_ms=2000) as producer:
                await producer.send(Message(topic, b"warm"))

                async def one(i: int) -> None:
                    try:
                        await producer.send(Message(topic, b"c%03d" % i))
                        outcomes["ok"] += 1
                    except Exception as e:  # noqa: BLE001 - every failure is the finding
                        outcomes[f"{type(e).__name__}: {e}"] += 1

                for i in range(300):
                    outer.start_soon(one, i)
                await trio.sleep(0.02)
        stored = await _stored(namesrv, topic)
        assert outcomes == {"ok": 300}, (auto_batch, outcomes)
        assert sorted(stored) == sorted([b"warm"] + [b"c%03d" % i for i in range(300)])
