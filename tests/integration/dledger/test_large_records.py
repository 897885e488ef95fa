"""Records far bigger than a group-commit batch: 1 MiB and ~4 MiB (one RocketMQ message at its 4 MiB default).

A record bigger than ``max_batch_bytes`` is proposed alone as its own entry; every entry stays below half of
``append_entries_batch_size_bytes`` (pysyncobj's broken chunked-send path stays unreachable, also when a
lagging follower is sent several big entries packed into one append_entries message).
"""

from __future__ import annotations

import time

import pytest
import trio

from dledger import RecordTooLargeError
from tests.integration.dledger.helpers import MemberRunner, make_configs, open_log, ready_leader, wait_ends

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20


async def test_one_and_four_mib_records_commit_byte_identical(tmp_path, figure):
    configs = {c.self_id: c for c in make_configs(tmp_path)}
    cfg = configs["n0"]
    assert cfg.max_batch_bytes < 4 * MIB + 64 * 1024 < cfg.max_record_bytes
    logs = {k: open_log(tmp_path, k) for k in configs}
    entry_sizes: list[int] = []
    original = logs["n0"].apply_batch

    def recording_apply(payload, store_timestamp, expected_start_offset):
        entry_sizes.append(len(payload))
        return original(payload, store_timestamp, expected_start_offset)

    logs["n0"].apply_batch = recording_apply
    big = [bytes([i]) * size for i, size in enumerate([MIB, 4 * MIB + 32 * 1024, MIB, 4 * MIB])]
    small = [b"small-%04d" % i * 100 for i in range(200)]
    expected = list(big) + list(small)
    async with trio.open_nursery() as nursery:
        runners = {k: MemberRunner(nursery, c, logs[k]) for k, c in configs.items()}
        groups = {k: await r.start() for k, r in runners.items()}
        leader = await ready_leader(list(groups.values()))

        # Alone, then mixed with concurrent small records (which keep being group-committed).
        started = time.monotonic()
        await leader.append(big[1], timeout_s=10)
        one_4mib_s = time.monotonic() - started
        async with trio.open_nursery() as sends:
            for record in [big[0], *big[2:], *small]:
                sends.start_soon(lambda r=record: leader.append(r, timeout_s=10))
        with pytest.raises(RecordTooLargeError):
            await leader.append(b"x" * (cfg.max_record_bytes + 1))

        # A follower that missed big entries is sent several of them packed into one message on its return.
        lagging_id = next(k for k, g in groups.items() if not g.is_leader)
        await runners[lagging_id].stop()
        late = [bytes([0x80 + i]) * (4 * MIB - i) for i in range(3)]
        for record in late:
            await leader.append(record, timeout_s=10)
        expected += late
        groups[lagging_id] = await runners[lagging_id].start()
        await wait_ends(logs.values(), leader.statistics().end_offset)
        stats = leader.statistics()
        assert stats.rejected_batches == 0 and stats.failed_batches == 0
        assert stats.appended_records == len(expected)
        figure(f"one ~4 MiB record committed in {one_4mib_s * 1000:.0f} ms")
        nursery.cancel_scope.cancel()

    contents = [log.path.read_bytes() for log in logs.values()]
    assert contents[0] == contents[1] == contents[2]
    assert sorted(d for _, d in logs["n0"].read_records()) == sorted(expected)
    # Every big record was an entry of its own; no entry reached the chunked-send threshold.
    # (a member restarted on its journal applies some entries again: sizes are compared as a set)
    framing = 8  # ByteLog's record header
    assert {s for s in entry_sizes if s >= MIB} == {len(r) + framing for r in big + late}
    assert all(s <= cfg.max_batch_bytes + cfg.join_overhead_bytes for s in entry_sizes if s < MIB)
    assert max(entry_sizes) + 21 <= cfg.max_entry_bytes < cfg.append_entries_batch_size_bytes // 2
    for log in logs.values():
        log.close()


async def test_member_behind_a_snapshot_copies_records_bigger_than_a_catch_up_chunk(tmp_path):
    # Compaction every few entries: the stopped member comes back behind a snapshot and must copy 4 MiB records
    # with FETCH_COMMIT_LOG-style reads of catch_up_chunk_bytes (1 MiB): each read returns one whole record.
    configs = {c.self_id: c for c in make_configs(tmp_path, log_compaction_min_entries=3,
                                                  log_compaction_min_time_s=1)}
    assert configs["n0"].catch_up_chunk_bytes < 4 * MIB
    logs = {k: open_log(tmp_path, k) for k in configs}
    fetched: list[int] = []

    async def fetch_range(peer, offset, max_bytes):
        data = logs[peer.id].read_raw(offset, max_bytes)
        fetched.append(len(data))
        return data

    async with trio.open_nursery() as nursery:
        runners = {k: MemberRunner(nursery, c, logs[k], fetch_range=fetch_range) for k, c in configs.items()}
        groups = {k: await r.start() for k, r in runners.items()}
        leader = await ready_leader(list(groups.values()))
        lagging = next(k for k in configs if k != leader.config.self_id)
        await leader.append(b"before-stop")
        await wait_ends(logs.values(), leader.statistics().end_offset)
        await runners[lagging].stop()
        for i in range(10):
            await leader.append(bytes([i]) * (4 * MIB - i), timeout_s=10)
        assert leader.statistics().snapshots_written >= 2
        back = await runners[lagging].start()
        await wait_ends(logs.values(), leader.statistics().end_offset, timeout_s=40)
        with trio.fail_after(10):
            while not back.serving_reads:
                await trio.sleep(0.05)
        assert back.statistics().catch_up_bytes > 0
        nursery.cancel_scope.cancel()
    assert fetched and max(fetched) > 4 * MIB - 16  # whole 4 MiB records, never cut at the chunk size
    contents = {k: log.path.read_bytes() for k, log in logs.items()}
    assert len(set(contents.values())) == 1
    for log in logs.values():
        log.close()
