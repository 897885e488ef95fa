"""A member that missed several compactions gets a snapshot ahead of its commit log and copies the missing
bytes from a peer before it applies anything else; it ends byte-identical."""

from __future__ import annotations

import pytest
import trio

from dledger import MemberDivergedError
from raftmq.runner import leaf_exceptions
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
        # One record per entry, until several compactions of 20 entries are in place. Counted, not assumed from the
        # number of appends: a snapshot is written and synced off the tick, and under load 150 appends could end
        # before the first one was in place (snapshots_written read 0 in a full suite run).
        with trio.fail_after(60):
            for i in range(2000):
                await leader.append(b"while-down-%04d" % i)
                if i >= 150 and leader.statistics().snapshots_written >= 3:
                    break
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


async def test_a_member_whose_log_diverged_stops_with_a_clear_error(tmp_path):
    """Bytes from a peer that do not continue this member's log mean its log holds something the group never
    committed (peers' logs are identical): the member must stop, saying where and what to do, not serve on."""
    configs = {c.self_id: c for c in make_configs(tmp_path, log_compaction_min_entries=20)}
    logs = {k: open_log(tmp_path, k) for k in configs}

    async def fetch_range(peer, offset, max_bytes):
        return logs[peer.id].read_raw(offset, max_bytes)[1:]  # a peer's bytes shifted: not a record boundary

    with pytest.raises(BaseExceptionGroup) as info:
        async with trio.open_nursery() as nursery:
            runners = {k: MemberRunner(nursery, cfg, logs[k], fetch_range=fetch_range) for k, cfg in configs.items()}
            groups = {k: await r.start() for k, r in runners.items()}
            leader = await ready_leader(list(groups.values()))
            lagging = next(k for k in configs if k != leader.config.self_id)
            await runners[lagging].stop()
            for i in range(100):
                await leader.append(b"while-down-%04d" % i)
            end_before = logs[lagging].end_offset
            await runners[lagging].start()
            with trio.fail_after(20):
                await trio.sleep_forever()  # ended by the member's error
    diverged, rest = info.value.split(MemberDivergedError)
    assert rest is None and diverged is not None
    (error,) = leaf_exceptions(diverged)
    assert error.member_id == lagging and error.offset == end_before
    assert f"diverged from the group at commit-log offset {end_before}" in str(error)
    assert "start it empty" in str(error)
    assert logs[lagging].end_offset == end_before  # nothing of the bad copy was written
    for log in logs.values():
        log.close()
