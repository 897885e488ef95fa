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


def _entries(machine: CommitLogMachine, count: int, tag: bytes = b"body") -> list[tuple[int, int, bytes]]:
    """``count`` entries of 8 records each, planned one after another: ``(start, store_timestamp, payload)``."""
    out, start = [], machine.end_offset
    for n in range(count):
        recs = [encode_batch([MessageInput(topic="TopicA", queue_id=i % 4, body=tag + b"-%d-%d|" % (n, i) +
                                           bytes(300), properties={"KEYS": f"k{n}-{i}"},
                                           born_host=("127.0.0.1", 5000))], HOST) for i in range(8)]
        p = machine.prepare_batch(recs, start, 1_700_000_000_000 + n, fresh=n == 0)
        out.append((start, 1_700_000_000_000 + n, p.payload))
        start = p.end_offset
    return out


def _cut(path, at: int) -> None:
    """Zero the commit log from ``at`` on and drop the checkpoint: a tail lost after the last fdatasync."""
    seg = path / "commitlog" / "00000000000000000000"
    data = seg.read_bytes()
    seg.write_bytes(data[:at] + bytes(len(data) - at))
    (path / "checkpoint").unlink()


def test_an_entry_the_commit_log_holds_only_in_part_is_written_again_from_its_missing_part(tmp_path):
    # A member whose commit log lost a tail (a power loss, its Raft journal surviving further) replays entries
    # from the journal. The entry whose records were cut in the middle was DUPLICATE (it starts before the end),
    # so its last records were never written, and every later entry started past the end: REJECTED, all of them,
    # for ever. The member went on as a follower that applied nothing, or as a leader building on its short log.
    with _open(tmp_path / "source") as source:  # the group's log
        planner = CommitLogMachine(source)
        entries = _entries(planner, 6)
        for start, ts, payload in entries:
            assert planner.apply_batch(payload, ts, start).status is ApplyStatus.APPLIED
    with _open(tmp_path / "member") as member:
        machine = CommitLogMachine(member)
        for start, ts, payload in entries:
            assert machine.apply_batch(payload, ts, start).status is ApplyStatus.APPLIED
        mid_entry = member.look_message_by_offset(entries[4][0]).size * 3 + entries[4][0]  # after 3 of its 8
    _cut(tmp_path / "member", mid_entry + 100)
    with _open(tmp_path / "member") as member:
        assert member.max_phy_offset == mid_entry
        machine = CommitLogMachine(member)
        statuses = [machine.apply_batch(payload, ts, start).status for start, ts, payload in entries]
        assert statuses == [ApplyStatus.DUPLICATE] * 4 + [ApplyStatus.APPLIED] * 2
        member.dispatch_pending()
        assert [member.get_max_offset_in_queue("TopicA", q) for q in range(4)] == [12] * 4
        assert member.query_message("TopicA", "k4-7", 2).messages[0].body.startswith(b"body-4-7|")
    with _open(tmp_path / "source") as source, _open(tmp_path / "member") as member:
        assert member.segment_checksums(1 << 40) == source.segment_checksums(1 << 40)
        for sub in ("consumequeue", "index"):
            assert tree_bytes(tmp_path / "member", sub) == tree_bytes(tmp_path / "source", sub)


@pytest.mark.parametrize("held", ["whole", "in_part"])
def test_an_entry_replayed_over_other_bytes_stops_the_member(tmp_path, held):
    # The commit log holds other bytes than a replayed entry where it goes: bytes its group never committed
    # (damaged on disk, or kept by recovery from a torn write). Before, the entry was skipped as a duplicate, and
    # with the log ending inside it every later entry was rejected: the member served those bytes as the log.
    from dledger import LogMismatchError
    with _open(tmp_path / "source") as source:
        entries = _entries(CommitLogMachine(source), 2)
    with _open(tmp_path / "member") as member:
        machine = CommitLogMachine(member)
        with _open(tmp_path / "other") as elsewhere:
            other = _entries(CommitLogMachine(elsewhere), 2, tag=b"BODY")  # the same sizes, other bytes
        assert other[1][0] == entries[1][0]
        for start, ts, payload in (entries[0], other[1]):
            assert machine.apply_batch(payload, ts, start).status is ApplyStatus.APPLIED
        end = member.max_phy_offset
        if held == "in_part":
            end = member.look_message_by_offset(entries[1][0]).size * 3 + entries[1][0]
    if held == "in_part":
        _cut(tmp_path / "member", end + 100)
    with _open(tmp_path / "member") as member:
        machine = CommitLogMachine(member)
        assert machine.apply_batch(entries[0][2], entries[0][1], entries[0][0]).status is ApplyStatus.DUPLICATE
        with pytest.raises(LogMismatchError, match=rf"offset {entries[1][0]} to") as info:
            machine.apply_batch(entries[1][2], entries[1][1], entries[1][0])
        assert info.value.offset == entries[1][0]
        assert member.max_phy_offset == end
