"""A member that missed several compactions gets a snapshot ahead of its commit log and copies the missing
bytes from a peer before it applies anything else; it ends byte-identical."""

from __future__ import annotations

import pytest
import trio

from tests.integration.dledger.helpers import MemberRunner, make_configs, open_log, ready_leader, wait_ends

pytestmark = pytest.mark.timeout(90)


async def test_lagging_member_catches_up_from_snapshot_and_byte_copy(tmp_path):
    configs = {c.self_id: c for c in make_configs(tmp_path, log_compaction_min_entries=20)}
    logs = {k: open_log(tmp_path, k) for k in configs}
    fetches = []

    async def fetch_range(peer, offset, max_bytes):
        fetches.append((peer.id, offset))
        return logs[peer.id].read_raw(offset, max_bytes)

    async with trio.open_nursery() as nursery:
        runners = {k: MemberRunner(nursery, cfg, logs[k], fetch_range=fetch_range) for k, cfg in configs.items()}
        groups = {k: await r.start() for k, r in runners.items()}
        leader = await ready_leader(list(groups.values()))
        lagging = next(k for k in configs if k != leader.config.self_id)
        await leader.append(b"before-stop")
        with trio.fail_after(5):
            while logs[lagging].end_offset != leader.statistics().end_offset:
                await trio.sleep(0.02)
        await runners[lagging].stop()
        for i in range(150):  # one record per entry: several compactions of 20 entries
            await leader.append(b"while-down-%04d" % i)
        assert leader.statistics().snapshots_written >= 3
        g3 = await runners[lagging].start()
        target_end = leader.statistics().end_offset
        with trio.fail_after(20):
            while logs[lagging].end_offset < target_end or not g3.serving_reads:
                await trio.sleep(0.05)
        stats = g3.statistics()
        assert stats.snapshots_loaded >= 1 and stats.catch_up_bytes > 0
        await leader.append(b"after-catch-up")
        await wait_ends(logs.values(), leader.statistics().end_offset, timeout_s=5)
        nursery.cancel_scope.cancel()
    assert fetches
    contents = {k: log.path.read_bytes() for k, log in logs.items()}
    assert len(set(contents.values())) == 1
    for log in logs.values():
        log.close()
