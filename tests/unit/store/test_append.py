"""Deterministic batch append: statuses, segment blanks, determinism, raw copy between replicas."""

from __future__ import annotations

import pytest

from broker.store import AppendStatus, MessageInput, MessageStore, StoreConfig, encode_batch, iter_records
from remoting.config import ConfigError, config_from_mapping
from remoting.message import BLANK_MAGIC, MESSAGE_MAGIC

from .helpers import STORE_HOST, fill, make_batch, small_config, tree_bytes


@pytest.fixture
def store(tmp_path):
    with MessageStore.open(small_config(tmp_path / "s")) as s:
        yield s


def test_append_assigns_offsets_and_msg_ids(store):
    result = store.append_batch(make_batch(0), 1_000, 0)
    assert result.status is AppendStatus.PUT_OK
    assert result.start_phy_offset == 0 and result.end_phy_offset == store.max_phy_offset
    assert [m.queue_offset for m in result.messages] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [m.queue_id for m in result.messages] == [0, 1, 2, 3, 0, 1, 2, 3]
    phys = [m.phy_offset for m in result.messages]
    assert phys == sorted(phys) and phys[0] == 0
    assert all(b - a == s for a, b, s in zip(phys, phys[1:], [m.size for m in result.messages]))
    view = store.look_message_by_id(result.messages[3].msg_id)
    assert view.phy_offset == phys[3] and view.store_timestamp == 1_000 and view.store_host == STORE_HOST
    second = store.append_batch(make_batch(1), 2_000, store.max_phy_offset)
    assert [m.queue_offset for m in second.messages] == [2, 2, 2, 2, 3, 3, 3, 3]


def test_duplicate_and_mismatch_write_nothing(store):
    batch = make_batch(0)
    assert store.append_batch(batch, 1, 0).ok
    end = store.max_phy_offset
    dup = store.append_batch(batch, 1, 0)
    assert dup.status is AppendStatus.DUPLICATE and store.max_phy_offset == end
    ahead = store.append_batch(batch, 1, end + 1)
    assert ahead.status is AppendStatus.OFFSET_MISMATCH and "ends at" in ahead.remark
    assert store.max_phy_offset == end


@pytest.mark.parametrize("mutate, status, field", [
    (lambda b: b[:-3], AppendStatus.MESSAGE_ILLEGAL, "batch"),
    (lambda b: b"XXXX" + b[4:], AppendStatus.MESSAGE_ILLEGAL, "batch"),
    (lambda b: b"", AppendStatus.MESSAGE_ILLEGAL, "batch"),
])
def test_malformed_batches_get_a_status_and_no_write(store, mutate, status, field):
    result = store.append_batch(mutate(make_batch(0)), 1, 0)
    assert (result.status, result.field) == (status, field)
    assert store.max_phy_offset == 0 and result.remark


def test_oversize_and_bad_topic_and_big_properties_are_refused_whole(store):
    good = MessageInput("TopicTest", 0, b"ok")
    # encode_batch refuses too; build the bad batches with a permissive limit as a remote producer could.
    oversize = encode_batch([good, MessageInput("TopicTest", 0, b"x" * 20_000)], STORE_HOST,
                            max_message_size=1 << 20)
    result = store.append_batch(oversize, 1, 0)
    assert result.status is AppendStatus.MESSAGE_ILLEGAL and result.field == "body"
    bad_topic = bytearray(encode_batch([good, MessageInput("TopicTest", 0, b"y")], STORE_HOST))
    bad_topic[bad_topic.rindex(b"TopicTest")] = ord(" ")
    result = store.append_batch(bytes(bad_topic), 1, 0)
    assert result.status is AppendStatus.MESSAGE_ILLEGAL and result.field == "topic"
    big_props = bytearray(encode_batch([good, MessageInput("TopicTest", 0, b"z", {"k": "v"})], STORE_HOST))
    big_props[-6:-4] = (40_000).to_bytes(2, "big")  # the properties length field of the last message
    result = store.append_batch(bytes(big_props), 1, 0)
    assert result.status is AppendStatus.PROPERTIES_SIZE_EXCEEDED and result.field == "properties"
    assert store.max_phy_offset == 0 and store.get_max_offset_in_queue("TopicTest", 0) == 0


def test_prepared_end_matches_append_across_segment_rolls(store):
    for seq in range(200):
        batch = make_batch(seq, body_size=900)
        count, refusal = store.check_batch(batch, store.max_phy_offset)
        planned = store.prepare_append([(batch, count)], store.max_phy_offset, seq, {}).end
        assert refusal is None and store.max_phy_offset < planned  # preparing writes nothing
        assert store.append_batch(batch, seq, store.max_phy_offset).end_phy_offset == planned
    assert store.max_phy_offset > 4 * store.config.segment_size_bytes


def test_segments_end_with_a_blank_and_records_never_straddle(store):
    fill(store, 120, body_size=700)
    seg_size = store.config.segment_size_bytes
    segments = store.commit_log.segments()
    assert len(segments) >= 3
    for seg in segments[:-1]:
        data = bytes(seg.mv)
        pos = 0
        while True:
            size = int.from_bytes(data[pos:pos + 4], "big")
            magic = int.from_bytes(data[pos + 4:pos + 8], "big")
            if magic == BLANK_MAGIC:
                assert pos + size == seg_size and size >= 8
                assert data[pos + 8:] == bytes(size - 8)
                break
            assert magic == MESSAGE_MAGIC and pos + size + 8 <= seg_size
            pos += size


def test_two_stores_fed_the_same_batches_are_byte_identical(tmp_path):
    stores = [MessageStore.open(small_config(tmp_path / name)) for name in ("a", "b")]
    try:
        for seq in range(150):
            batch = make_batch(seq, count=1 + seq % 9, queues=1 + seq % 5, body_size=50 + seq * 7 % 900)
            results = [s.append_batch(batch, 1_700_000_000_000 + seq, s.max_phy_offset) for s in stores]
            assert results[0].messages == results[1].messages
        for s in stores:
            s.dispatch_pending()
            s.flush_all()
        assert stores[0].segment_checksums(2 ** 62) == stores[1].segment_checksums(2 ** 62)
        for sub in ("commitlog", "consumequeue", "index"):
            assert tree_bytes(tmp_path / "a", sub) == tree_bytes(tmp_path / "b", sub), sub
    finally:
        for s in stores:
            s.close()


def test_raw_copy_makes_a_byte_identical_replica(tmp_path):
    with MessageStore.open(small_config(tmp_path / "leader")) as leader, \
            MessageStore.open(small_config(tmp_path / "follower")) as follower:
        fill(leader, 90, body_size=800)
        while follower.max_phy_offset < leader.max_phy_offset:
            chunk = leader.read_commit_log(follower.max_phy_offset, 50_000)
            assert chunk
            result = follower.append_commit_log_raw(follower.max_phy_offset, chunk)
            assert result.ok, result.remark
            for m in result.messages:
                assert leader.look_message_by_id(m.msg_id).phy_offset == m.phy_offset
        assert leader.read_commit_log(leader.max_phy_offset, 100) == b""
        assert follower.segment_checksums(2 ** 62) == leader.segment_checksums(2 ** 62)
        follower.dispatch_pending()
        leader.dispatch_pending()
        assert follower.get_max_offset_in_queue("TopicTest", 2) == leader.get_max_offset_in_queue("TopicTest", 2)
        # the follower continues with ordinary appends exactly where the leader would
        batch = make_batch(1000)
        a = leader.append_batch(batch, 5, leader.max_phy_offset)
        b = follower.append_batch(batch, 5, follower.max_phy_offset)
        assert a.messages == b.messages


def test_raw_copy_rejects_corruption_before_writing(tmp_path):
    with MessageStore.open(small_config(tmp_path / "leader")) as leader, \
            MessageStore.open(small_config(tmp_path / "follower")) as follower:
        fill(leader, 3)
        data = bytearray(leader.read_commit_log(0, 1 << 20))
        records = list(iter_records(bytes(data)))
        data[records[1].phy_offset + 90] ^= 0xFF  # a body byte of the second record
        result = follower.append_commit_log_raw(0, bytes(data))
        assert result.status is AppendStatus.CORRUPTED and "CRC" in result.remark
        assert follower.max_phy_offset == 0
        assert follower.append_commit_log_raw(5, b"").status is AppendStatus.OFFSET_MISMATCH
        skipped = bytes(leader.read_commit_log(records[1].phy_offset, 1 << 20))
        result = follower.append_commit_log_raw(0, skipped)
        assert result.status is AppendStatus.CORRUPTED and "says it is at" in result.remark


def test_config_rejects_a_segment_smaller_than_a_record(tmp_path):
    with pytest.raises(ConfigError, match="segment_size_bytes"):
        small_config(tmp_path, segment_size_bytes=64 * 1024, max_message_size=1 << 20)


@pytest.mark.parametrize("mapping, message", [
    ({"flush_disk_type": "SOMETIMES"}, "flush_disk_type must be one of"),
    ({"flush_interval_ms": 0}, "flush_interval_ms must be >= 1"),
    ({"delete_when_hours": [4, 25]}, "delete_when_hours must list hours"),
    ({"disk_clean_early_ratio": 0.95}, "disk ratios"),
    ({"segment_size": 1}, "unknown config key 'segment_size'"),
])
def test_store_config_rejects_bad_values_naming_the_key(tmp_path, mapping, message):
    with pytest.raises(ConfigError, match=message):
        config_from_mapping(StoreConfig, {"store_dir": str(tmp_path), **mapping})


def test_store_config_from_toml_values(tmp_path):
    cfg = config_from_mapping(StoreConfig, {"store_dir": str(tmp_path), "delete_when_hours": [3, 4],
                                            "flush_disk_type": "SYNC_FLUSH", "segment_size_bytes": 1 << 24})
    assert cfg.delete_when_hours == (3, 4) and cfg.store_dir == tmp_path and cfg.flush_disk_type == "SYNC_FLUSH"


def test_reads_from_inside_a_record_are_refused_not_misread(tmp_path):
    # FETCH_COMMIT_LOG and VIEW_MESSAGE_BY_ID take a phy_offset from the wire. Inside a record the bytes read as a
    # size of 0 (a zero queue_id: the read looped forever and the node hung), a negative one, or one reaching far
    # past the log end (megabytes of zeros sent as "records").
    import threading

    with MessageStore.open(small_config(tmp_path / "s")) as store:
        fill(store, 2)
        records = list(iter_records(store.read_commit_log(0, 1 << 20)))
        inside = [o for r in records[:2] for o in range(r.phy_offset + 1, r.phy_offset + r.size)]
        outcomes: dict[int, object] = {}

        def probe() -> None:
            for offset in inside:
                try:
                    outcomes[offset] = store.read_commit_log(offset, 100)
                except ValueError as e:
                    outcomes[offset] = e

        worker = threading.Thread(target=probe, daemon=True)
        worker.start()
        worker.join(timeout=30)
        assert not worker.is_alive(), f"read_commit_log hung after offsets {sorted(outcomes)[-1:]}"
        wrong = {o: v for o, v in outcomes.items() if not isinstance(v, ValueError)}
        assert not wrong, f"{len(wrong)} offsets inside a record were read, e.g. {min(wrong)}"
        assert "not the start of a record" in str(outcomes[inside[0]])
        assert all(store.look_message_by_offset(o) is None for o in inside)
        # offsets where records start still read as before
        assert store.read_commit_log(records[1].phy_offset, 1)[:records[1].size] == bytes(
            store.commit_log.record_at(records[1].phy_offset))
        assert store.look_message_by_offset(records[1].phy_offset).phy_offset == records[1].phy_offset
