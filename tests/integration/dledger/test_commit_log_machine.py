"""The message store as the replicated state machine: per-record results, byte-identical commit logs."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio

from broker.commit_log_machine import CommitLogMachine
from broker.store import AppendStatus, MessageInput, MessageStore, StoreConfig, encode_batch
from dledger import ApplyStatus, open_dledger_group
from tests.integration.dledger.helpers import make_configs, ready_leader
from tests.unit.store.helpers import tree_bytes

pytestmark = pytest.mark.timeout(60)
HOST = ("127.0.0.1", 10911)


def _batch(i: int, n: int = 1) -> bytes:
    return encode_batch([MessageInput(topic="TopicA", queue_id=i % 4, body=b"body-%d-%d" % (i, k),
                                      properties={"KEYS": f"k{i}"}, born_host=("127.0.0.1", 5000))
                         for k in range(n)], HOST)


def _open(path):
    return MessageStore.open(StoreConfig(store_dir=path, segment_size_bytes=64 * 1024, max_message_size=2048))


def _big(i: int, n: int) -> bytes:
    return encode_batch([MessageInput(topic="TopicA", queue_id=i % 4, body=b"body-%d-%d|" % (i, k) + bytes(1500),
                                      properties={"KEYS": f"k{i}"}, born_host=("127.0.0.1", 5000))
                         for k in range(n)], HOST)


def test_prepared_entries_apply_byte_identically_and_plan_ahead(tmp_path):
    """The leader builds two entries before either is applied; every replica writes the same bytes, which are
    exactly what a plain store append of the same messages writes (segment-end blanks included)."""
    leader, follower, plain = (_open(tmp_path / n) for n in ("leader", "follower", "plain"))
    machine, other = CommitLogMachine(leader), CommitLogMachine(follower)
    try:
        records = [[_big(i, 1 + i % 3) for i in range(k, k + 8)] for k in (0, 8, 16, 24)]
        prepared, start = [], 0
        for n, recs in enumerate(records):
            p = machine.prepare_batch(recs, start, 1_700_000_000_000 + n, fresh=n == 0)
            prepared.append((start, 1_700_000_000_000 + n, p))
            start = p.end_offset
        for s0, ts, p in prepared:
            for m in (machine, other):
                assert m.apply_batch(p.payload, ts, s0).status is ApplyStatus.APPLIED
            for rec in records[prepared.index((s0, ts, p))]:
                assert plain.append_batch(rec, ts, plain.max_phy_offset).ok
        end = start
        assert leader.max_phy_offset == follower.max_phy_offset == plain.max_phy_offset == end
        sums = leader.segment_checksums(end)
        assert len(sums) >= 2 and sums == follower.segment_checksums(end) == plain.segment_checksums(end)
        # Results known at prepare time name what was written: queue offsets continue across the entries.
        last = prepared[-1][2].record_results[-1]
        view = follower.look_message_by_offset(last.phy_offsets[-1])
        assert view.body.startswith(b"body-31-%d|" % (31 % 3)) and view.queue_offset == last.queue_offsets[-1]
        follower.dispatch_pending()
        plain.dispatch_pending()
        for q in range(4):
            expected = sum(1 + i % 3 for i in range(32) if i % 4 == q)
            assert follower.get_max_offset_in_queue("TopicA", q) == plain.get_max_offset_in_queue("TopicA", q) \
                == expected
        follower.flush_all()
        plain.flush_all()
        # Units and index entries shipped in the entries are those a plain append derives.
        for sub in ("consumequeue", "index"):
            assert tree_bytes(tmp_path / "follower", sub) == tree_bytes(tmp_path / "plain", sub)
        assert follower.query_message("TopicA", "k31", 4).messages[0].body.startswith(b"body-31-")
        # Replays are skipped and a plan made against a state that never happened writes nothing.
        s0, ts, p = prepared[0]
        assert other.apply_batch(p.payload, ts, s0).status is ApplyStatus.DUPLICATE
        assert other.apply_batch(p.payload, ts, end + 1).status is ApplyStatus.REJECTED
        assert follower.max_phy_offset == end
    finally:
        for s in (leader, follower, plain):
            s.close()


def test_a_bad_record_is_refused_alone(tmp_path):
    store = _open(tmp_path / "s")
    machine = CommitLogMachine(store)
    try:
        bad = bytearray(_batch(1))
        bad[-1:] = b""  # cut short: the batch layout no longer adds up
        p = machine.prepare_batch([_batch(0), bytes(bad), _batch(2)], 0, 1, fresh=True)
        ok0, refused, ok2 = p.record_results
        assert not refused.ok and refused.status is AppendStatus.MESSAGE_ILLEGAL and refused.phy_offsets == []
        assert ok0.ok and ok2.ok and ok2.phy_offsets[0] > ok0.phy_offsets[0]
        assert machine.apply_batch(p.payload, 1, 0).status is ApplyStatus.APPLIED
        assert store.look_message_by_offset(ok2.phy_offsets[0]).body == b"body-2-0"
        only_bad = machine.prepare_batch([bytes(bad)], store.max_phy_offset, 2, fresh=True)
        assert only_bad.payload is None and not only_bad.record_results[0].ok
    finally:
        store.close()


async def test_message_store_replicated_with_per_record_results(tmp_path):
    configs = make_configs(tmp_path)
    stores = [MessageStore.open(StoreConfig(store_dir=tmp_path / c.self_id / "store",
                                            segment_size_bytes=64 * 1024, max_message_size=16 * 1024))
              for c in configs]
    machines = [CommitLogMachine(s) for s in stores]
    try:
        async with AsyncExitStack() as stack:
            groups = [await stack.enter_async_context(open_dledger_group(c, m)) for c, m in zip(configs, machines)]
            leader = await ready_leader(groups)
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


def test_the_leader_refuses_records_while_the_disk_is_full(tmp_path):
    """The disk guard is the leader's (followers apply whatever was committed): prepare refuses every record
    with DISK_FULL and proposes nothing; the broker answers SERVICE_NOT_AVAILABLE, as RocketMQ does."""
    from broker.node import BrokerNode
    from broker.processor.base import RequestRejected
    from remoting.codes import ResponseCode

    usage = [0.5]
    store = MessageStore.open(StoreConfig(store_dir=tmp_path / "s", segment_size_bytes=64 * 1024,
                                          max_message_size=2048), disk_usage_fn=lambda _path: usage[0])
    machine = CommitLogMachine(store)
    try:
        usage[0] = 0.95
        store.retention.refresh_disk_state()
        refused = machine.prepare_batch([_batch(0), _batch(1)], 0, 1, fresh=True)
        assert refused.payload is None and store.max_phy_offset == 0
        assert [r.status for r in refused.record_results] == [AppendStatus.DISK_FULL] * 2
        with pytest.raises(RequestRejected) as info:
            BrokerNode.machine_messages(refused.record_results[0])
        assert info.value.code == ResponseCode.SERVICE_NOT_AVAILABLE and "disk usage 95%" in str(info.value)
        usage[0] = 0.5
        store.retention.refresh_disk_state()
        accepted = machine.prepare_batch([_batch(0)], 0, 2, fresh=True)
        assert accepted.payload is not None and accepted.record_results[0].ok
    finally:
        store.close()
