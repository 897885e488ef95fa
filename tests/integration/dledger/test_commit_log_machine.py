"""The message store as the replicated state machine: per-record results, byte-identical commit logs."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio

from broker.commit_log_machine import CommitLogMachine, decode_payload, encode_payload
from broker.store import MessageInput, MessageStore, StoreConfig, encode_batch
from dledger import open_dledger_group
from tests.integration.dledger.helpers import make_configs
from tests.integration.dledger.test_group import _leader

pytestmark = pytest.mark.timeout(60)
HOST = ("127.0.0.1", 10911)


def _batch(i: int, n: int = 1) -> bytes:
    return encode_batch([MessageInput(topic="TopicA", queue_id=i % 4, body=b"body-%d-%d" % (i, k),
                                      properties={"KEYS": f"k{i}"}, born_host=("127.0.0.1", 5000))
                         for k in range(n)], HOST)


def test_payload_keeps_record_boundaries():
    counts, batch = decode_payload(encode_payload([_batch(1, 2), _batch(2, 3)]))
    assert counts == [2, 3]
    assert batch[:4] == _batch(1)[:4]


async def test_message_store_replicated_with_per_record_results(tmp_path):
    configs = make_configs(tmp_path)
    stores = [MessageStore.open(StoreConfig(store_dir=tmp_path / c.self_id / "store",
                                            segment_size_bytes=64 * 1024, max_message_size=16 * 1024))
              for c in configs]
    machines = [CommitLogMachine(s) for s in stores]
    try:
        async with AsyncExitStack() as stack:
            groups = [await stack.enter_async_context(open_dledger_group(c, m)) for c, m in zip(configs, machines)]
            leader = await _leader(groups)
            results = {}

            async def one(i):
                results[i] = (await leader.append(_batch(i, 1 + i % 3))).result

            async with trio.open_nursery() as nursery:
                for i in range(300):
                    nursery.start_soon(one, i)
            for i, result in results.items():
                assert result.ok and len(result.phy_offsets) == 1 + i % 3
            phys = sorted(p for r in results.values() for p in r.phy_offsets)
            assert len(set(phys)) == len(phys)
            end = stores[0].max_phy_offset if leader is groups[0] else leader.statistics().end_offset
            with trio.fail_after(5):
                while any(s.max_phy_offset != end for s in stores):
                    await trio.sleep(0.02)
            sums = [s.segment_checksums(end) for s in stores]
            assert sums[0] == sums[1] == sums[2] and len(sums[0]) > 1  # several segments, identical
            view = stores[1].look_message_by_offset(results[7].phy_offsets[0])
            assert view.body == b"body-7-0"
    finally:
        for s in stores:
            s.close()
