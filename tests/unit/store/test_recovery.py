"""Recovery: torn tails cut, derived files brought back in line, rebuilt byte-identical."""

from __future__ import annotations

import errno
import logging
import os
import shutil

import pytest

from broker.store import GetMessageStatus, MessageInput, MessageStore, decode_record, encode_batch
from broker.store.consume_queue import ConsumeQueue
from broker.store.index_file import INDEX_HEADER

from .helpers import STORE_HOST, fill, make_batch, small_config, tree_bytes


def _assert_derived_agree(store: MessageStore) -> None:
    """Every record of the commit log has its ConsumeQueue unit and is found by its unique key."""
    store.dispatch_pending()
    count = 0
    for topic, queues in store.dispatcher.by_topic.items():
        for queue_id, cq in queues.items():
            for q in range(cq.min_offset, cq.max_offset):
                phy, size, _ = cq.unit(q)
                view = store.look_message_by_offset(phy)
                assert view is not None and view.size == size
                assert (view.topic, view.queue_id, view.queue_offset) == (topic, queue_id, q)
                assert any(m.phy_offset == phy for m in store.query_message(topic, view.uniq_key, 4).messages)
                count += 1
    pos, records = store.min_phy_offset, 0
    while pos < store.max_phy_offset:
        raw = store.commit_log.read_raw(pos, 1)
        if len(raw) > 8 and int.from_bytes(raw[4:8], "big") != 0xCBD43194:
            decode_record(raw)
            records += 1
        pos += len(raw)
    assert records == count



def _die(s: MessageStore) -> None:
    """Leave ``s`` as a killed process does: files closed without the clean close's flush and checkpoint, and the
    directory lock released, as the kernel does."""
    s._closed = True
    s._checkpoint.close()
    s.dispatcher.close()
    s.commit_log.close()
    s._dir_lock.release()

def test_rebuild_after_deleting_every_derived_file_is_byte_identical(tmp_path):
    cfg = small_config(tmp_path / "s")
    with MessageStore.open(cfg) as s:
        for seq in range(120):
            s.append_batch(make_batch(seq, topic=f"Topic{seq % 3}", queues=3), 1_700_000_000_000 + seq * 10,
                           s.max_phy_offset)
            if seq % 7 == 0:
                s.dispatch_pending(max_bytes=3000)  # dispatch in odd chunks, as the reput task would
        s.dispatch_pending()
    before = {sub: tree_bytes(tmp_path / "s", sub) for sub in ("consumequeue", "index")}
    assert len(before["index"]) > 1 and len(before["consumequeue"]) >= 9
    shutil.rmtree(tmp_path / "s" / "consumequeue")
    shutil.rmtree(tmp_path / "s" / "index")
    with MessageStore.open(cfg) as s:
        _assert_derived_agree(s)
    after = {sub: tree_bytes(tmp_path / "s", sub) for sub in ("consumequeue", "index")}
    assert after == before


@pytest.mark.parametrize("tail", ["partial_record", "garbage", "half_header"])
def test_recovery_cuts_a_torn_tail(tmp_path, tail):
    cfg = small_config(tmp_path / "s")
    with MessageStore.open(cfg) as s:
        fill(s, 10)
        end = s.max_phy_offset
        s.dispatch_pending()
        next_batch = make_batch(10)
        # what the next append would have written, to tear it
        probe = MessageStore.open(small_config(tmp_path / "probe"))
        fill(probe, 10)
        probe.append_batch(next_batch, 99, probe.max_phy_offset)
        full = probe.commit_log.read_raw(end, 1 << 20)
        probe.close()
    first_size = int.from_bytes(full[:4], "big")
    torn = {"partial_record": full[:first_size // 2 + 3], "garbage": os.urandom(5000),
            "half_header": full[:6]}[tail]
    with open(tmp_path / "s" / "commitlog" / "00000000000000000000", "r+b") as f:
        f.seek(end)
        f.write(torn)
    with MessageStore.open(cfg) as s:
        assert s.max_phy_offset == end
        with open(tmp_path / "s" / "commitlog" / "00000000000000000000", "rb") as f:
            f.seek(end)
            assert f.read(len(torn) + 100) == bytes(len(torn) + 100)  # the torn bytes are zeroed
        assert s.append_batch(next_batch, 99, end).ok
        _assert_derived_agree(s)
    with MessageStore.open(cfg) as s:
        assert s.max_phy_offset == end + len(full)


@pytest.mark.parametrize("zeroed", ["last_property_byte", "half_the_properties", "properties_length", "topic_end"])
def test_recovery_cuts_a_last_record_whose_tail_was_zeroed(tmp_path, zeroed):
    # After a power loss the last page written may read as zeros while the one before holds the record's head and
    # body: its size, magic, offset and body CRC (the only CRC) pass. Recovery kept such a record, its keys or
    # topic zeroed: the replica then differed from its group there, and consumers got broken properties.
    cfg = small_config(tmp_path / "s")
    with MessageStore.open(cfg) as s:
        fill(s, 10)
        s.dispatch_pending()
        raw = bytes(s.get_messages("TopicTest", 3, 19, 1, 1 << 20).messages[0])  # the last of 80 records
        last = decode_record(raw)
        end = s.max_phy_offset
    assert last.phy_offset + last.size == end
    t = 88 + int.from_bytes(raw[84:88], "big")
    props_len = int.from_bytes(raw[t + 1 + raw[t]:t + 3 + raw[t]], "big")
    tail = {"last_property_byte": 1, "half_the_properties": props_len // 2, "properties_length": props_len + 1,
            "topic_end": props_len + 4}[zeroed]
    with open(tmp_path / "s" / "commitlog" / "00000000000000000000", "r+b") as f:
        f.seek(end - tail)
        f.write(bytes(tail))
    (tmp_path / "s" / "checkpoint").unlink()  # the bytes past the last checkpoint are verified
    with MessageStore.open(cfg) as s:
        assert s.max_phy_offset == last.phy_offset
        assert s.get_max_offset_in_queue("TopicTest", 3) == 19
        _assert_derived_agree(s)


def test_recovery_without_checkpoint_cuts_records_and_their_units_and_index_entries(tmp_path):
    cfg = small_config(tmp_path / "s")
    with MessageStore.open(cfg) as s:
        fill(s, 30)
        s.dispatch_pending()
        last = s.get_messages("TopicTest", 3, 59, 1, 1 << 20).messages[0]
        victim = decode_record(last)
    path = tmp_path / "s" / "commitlog" / "00000000000000000000"
    with open(path, "r+b") as f:  # tear the body of the very last record
        f.seek(victim.phy_offset + 120)
        f.write(b"\xff" * 8)
    (tmp_path / "s" / "checkpoint").write_bytes(b"\x13" * 32)  # a torn checkpoint is ignored
    with MessageStore.open(cfg) as s:
        assert s.max_phy_offset == victim.phy_offset
        assert s.get_max_offset_in_queue("TopicTest", 3) == 59
        assert s.query_message("TopicTest", victim.uniq_key, 5).messages == []
        _assert_derived_agree(s)
        result = s.append_batch(make_batch(30), 5, s.max_phy_offset)
        assert [m.queue_offset for m in result.messages if m.queue_id == 3] == [59, 60]


def test_unpublished_index_entries_are_undone_then_redispatched(tmp_path):
    cfg = small_config(tmp_path / "s", index_max_entries=5000)
    with MessageStore.open(cfg) as s:
        fill(s, 10)
        s.dispatch_pending()
        s.flush_all()
        f = s.dispatcher.index.files[-1]
        header = bytes(f.file.mm[:INDEX_HEADER.size])
        fill(s, 5, start_seq=10)
        s.dispatch_pending()
        s._checkpoint.write(s.flush(), 0, 0)  # checkpoint behind the dispatch
        f.file.mm[:INDEX_HEADER.size] = header  # as if the process died before the header write
        _die(s)
    with MessageStore.open(cfg) as s:
        _assert_derived_agree(s)
        assert len(s.query_message("TopicTest", "common", 1000).messages) == 120
    shutil.copytree(tmp_path / "s", tmp_path / "r")
    shutil.rmtree(tmp_path / "r" / "index")
    with MessageStore.open(small_config(tmp_path / "r", index_max_entries=5000)):
        pass
    assert tree_bytes(tmp_path / "r", "index") == tree_bytes(tmp_path / "s", "index")


def test_reopen_continues_queue_offsets_and_reads(tmp_path):
    cfg = small_config(tmp_path / "s")
    with MessageStore.open(cfg) as s:
        fill(s, 50, body_size=900)
        end = s.max_phy_offset
    with MessageStore.open(cfg) as s:
        assert s.max_phy_offset == end and s.get_max_offset_in_queue("TopicTest", 0) == 100
        result = s.get_messages("TopicTest", 0, 98, 10, 1 << 20)
        assert result.status is GetMessageStatus.FOUND and result.queue_offsets == [98, 99]
        assert s.append_batch(make_batch(50), 1, end).messages[0].queue_offset == 100


def test_missing_middle_segment_is_refused(tmp_path):
    cfg = small_config(tmp_path / "s")
    with MessageStore.open(cfg) as s:
        fill(s, 100, body_size=900)
        starts = [seg.start for seg in s.commit_log.segments()]
    os.unlink(tmp_path / "s" / "commitlog" / f"{starts[1]:020d}")
    from broker.store import StoreCorruptedError
    with pytest.raises(StoreCorruptedError, match="not contiguous"):
        MessageStore.open(cfg)


@pytest.mark.timeout(30)
def test_a_truncated_last_segment_is_verified_from_its_start_and_cut_where_its_records_end(tmp_path):
    # The checkpoint vouched for bytes the file no longer had: recovery extended the file with zeros and trusted
    # them, so the log ended at the checkpoint with zeros served as records, and a re-dispatch across them never
    # ended (a zero-sized record does not advance).
    cfg = small_config(tmp_path / "s")
    with MessageStore.open(cfg) as s:
        fill(s, 100, body_size=900)
        starts = [seg.start for seg in s.commit_log.segments()]
        end = s.max_phy_offset
    assert len(starts) > 2 and end - starts[-1] > 5000
    os.truncate(tmp_path / "s" / "commitlog" / f"{starts[-1]:020d}", end - starts[-1] - 3000)
    with MessageStore.open(cfg) as s:
        assert starts[-1] < s.max_phy_offset <= end - 3000
        _assert_derived_agree(s)


@pytest.mark.timeout(30)
def test_zeros_where_the_checkpoint_vouched_for_records_are_refused_naming_the_offset_and_the_remedy(tmp_path):
    # Bytes before the checkpoint's commit_log_flushed are trusted; zeros there (a disk that lost what it said
    # was written, a damaged file) made re-dispatch spin for ever on a zero-sized "record": the broker never
    # started, saying nothing.
    from broker.store import StoreCorruptedError
    cfg = small_config(tmp_path / "s")
    with MessageStore.open(cfg) as s:
        fill(s, 100)
        s.dispatch_pending()
        end = s.max_phy_offset
        last = s.dispatcher.index.files[-1].end_phy_offset  # the record re-dispatch starts at
    path = tmp_path / "s" / "commitlog" / f"{end - end % cfg.segment_size_bytes:020d}"
    with open(path, "r+b") as f:
        f.seek(last % cfg.segment_size_bytes)
        f.write(bytes(end - last))
    with pytest.raises(StoreCorruptedError, match=rf"no record at phy_offset {last}.*remove .*checkpoint"):
        MessageStore.open(cfg)
    os.unlink(tmp_path / "s" / "checkpoint")  # as the error says
    with MessageStore.open(cfg) as s:
        assert s.max_phy_offset == last
        _assert_derived_agree(s)


def test_a_truncated_middle_segment_is_refused(tmp_path):
    from broker.store import StoreCorruptedError
    cfg = small_config(tmp_path / "s")
    with MessageStore.open(cfg) as s:
        fill(s, 100, body_size=900)
        starts = [seg.start for seg in s.commit_log.segments()]
    os.truncate(tmp_path / "s" / "commitlog" / f"{starts[1]:020d}", 1000)
    with pytest.raises(StoreCorruptedError, match=rf"commit log segment {starts[1]:020d} is 1000 bytes"):
        MessageStore.open(cfg)
    assert os.path.getsize(tmp_path / "s" / "commitlog" / f"{starts[1]:020d}") == 1000  # nothing written


def test_a_batch_cut_short_by_a_crash_is_cut_whole(tmp_path):
    cfg = small_config(tmp_path / "s")
    with MessageStore.open(cfg) as s:
        fill(s, 5)
        end = s.max_phy_offset
        s.flush_all()
        # a crash after every record of the batch was written but before its first magic was set
        result = s.append_batch(make_batch(5), 1, end)
        s.commit_log.segment_at(end).mm[end + 4:end + 8] = bytes(4)
        assert result.ok and s.max_phy_offset > end
    (tmp_path / "s" / "checkpoint").unlink()
    with MessageStore.open(cfg) as s:
        assert s.max_phy_offset == end
        assert sum(s.get_max_offset_in_queue("TopicTest", q) for q in range(4)) == 40


@pytest.mark.parametrize("units", [100, 128, 32])
def test_consume_queue_files_of_another_units_per_file_are_refused(tmp_path, units):
    # store.consume_queue_units_per_file changed on a kept store: files not at a multiple were skipped and the
    # others extended and read at the wrong units (100: queue 0 ended at offset 64 instead of 200), silently.
    from broker.store import StoreCorruptedError
    with MessageStore.open(small_config(tmp_path / "s")) as s:
        fill(s, 100)
        s.dispatch_pending()
        assert s.dispatcher.queue("TopicTest", 0).max_offset == 200
    before = tree_bytes(tmp_path / "s", "consumequeue")
    changed = small_config(tmp_path / "s", consume_queue_units_per_file=units)
    with pytest.raises(StoreCorruptedError, match=r"does not fit store\.consume_queue_units_per_file "
                                                  rf"{units} \({units * 20}-byte files\); was it changed\?"):
        MessageStore.open(changed)
    assert tree_bytes(tmp_path / "s", "consumequeue") == before  # nothing extended
    shutil.rmtree(tmp_path / "s" / "consumequeue")  # as the error says: rebuilt from the commit log
    with MessageStore.open(changed) as s:
        assert s.dispatcher.queue("TopicTest", 0).max_offset == 200


@pytest.mark.parametrize("changes", [{"index_hash_slots": 53}, {"index_max_entries": 600}, {"index_max_entries": 200}])
def test_index_files_of_other_sizes_are_refused(tmp_path, changes):
    # store.index_hash_slots / index_max_entries changed on a kept store: smaller files were extended and read with
    # the wrong slot table (lookups silently missed), bigger ones refused as a bare OSError.
    from broker.store import StoreCorruptedError
    with MessageStore.open(small_config(tmp_path / "s")) as s:
        fill(s, 100)
        s.dispatch_pending()
    before = tree_bytes(tmp_path / "s", "index")
    changed = small_config(tmp_path / "s", **changes)
    with pytest.raises(StoreCorruptedError, match=r"does not fit store\.index_hash_slots .* was one changed\?"):
        MessageStore.open(changed)
    assert tree_bytes(tmp_path / "s", "index") == before
    shutil.rmtree(tmp_path / "s" / "index")  # as the error says: rebuilt from the commit log
    with MessageStore.open(changed) as s:
        assert s.dispatcher.index.files


@pytest.mark.parametrize("lost", ["last_file", "middle_file", "queue_directory", "every_queue_but_one"])
def test_lost_consume_queue_files_are_rebuilt_from_the_commit_log(tmp_path, lost):
    # Recovery took the files for the queues: a queue that lost its newest file ended early and the next append
    # gave its queue offsets again (two records at TopicTest:0 offset 192, a consumer past 192 skipped the new
    # one); a lost middle file was skipped by every pull, a lost queue directory started the queue again at 0.
    cfg = small_config(tmp_path / "s")
    with MessageStore.open(cfg) as s:
        fill(s, 100)  # 200 units a queue, 64 a file: 4 files each
    queue_dir = tmp_path / "s" / "consumequeue" / "TopicTest"
    files = sorted(os.listdir(queue_dir / "0"))
    if lost == "last_file":
        os.unlink(queue_dir / "0" / files[-1])
    elif lost == "middle_file":
        os.unlink(queue_dir / "0" / files[1])
    elif lost == "queue_directory":
        shutil.rmtree(queue_dir / "2")
    else:
        for q in (0, 1, 3):
            shutil.rmtree(queue_dir / str(q))
    with MessageStore.open(cfg) as s:
        _assert_derived_agree(s)
        assert [s.get_max_offset_in_queue("TopicTest", q) for q in range(4)] == [200] * 4
        result = s.append_batch(make_batch(100), 1_800_000_000_000, s.max_phy_offset)
        assert sorted(m.queue_offset for m in result.messages) == [200, 200, 200, 200, 201, 201, 201, 201]
    with MessageStore.open(cfg) as s:
        _assert_derived_agree(s)


def test_a_rebuild_keeps_the_offsets_of_a_queue_whose_records_retention_removed(tmp_path, caplog):
    # The rebuild re-dispatched only the records still in the commit log: Old:0, whose 40 records retention had
    # removed (min = max = 40), was gone, and its next message took queue offset 0, below the 40 its consumers
    # had committed, which never saw offsets 0..39.
    cfg = small_config(tmp_path / "s", file_reserved_hours=0.0, disk_clean_early_ratio=0.0,
                       disk_clean_forcibly_ratio=0.5, disk_reject_ratio=0.9)
    with MessageStore.open(cfg, disk_usage_fn=lambda path: 0.1) as s:
        fill(s, 5, topic="Old", queues=1)  # Old:0 offsets 0..39, in the first segment
        seq = 0
        while s.max_phy_offset < 3 * cfg.segment_size_bytes:
            fill(s, 1, start_seq=seq, topic="New")
            seq += 1
        s.dispatch_pending()
        assert s.retention.clean_once() > 0
        assert (s.get_min_offset_in_queue("Old", 0), s.get_max_offset_in_queue("Old", 0)) == (40, 40)
    shutil.rmtree(tmp_path / "s" / "consumequeue" / "New" / "3")  # any queue's loss rebuilds them all
    with caplog.at_level(logging.WARNING), MessageStore.open(cfg, disk_usage_fn=lambda path: 0.1) as s:
        assert "consume queues do not match" in caplog.text
        assert (s.get_min_offset_in_queue("Old", 0), s.get_max_offset_in_queue("Old", 0)) == (40, 40)
        assert s.queue_ids("Old") == [0]
        result = s.append_batch(make_batch(99, count=1, topic="Old", queues=1), 1_800_000_000_000, s.max_phy_offset)
        assert result.queue_offsets == [40]
        s.dispatch_pending()
        pulled = s.get_messages("Old", 0, 40, 32, 1 << 20)
        assert pulled.status is GetMessageStatus.FOUND and pulled.queue_offsets == [40]
        _assert_derived_agree(s)
    caplog.clear()
    with caplog.at_level(logging.WARNING), MessageStore.open(cfg, disk_usage_fn=lambda path: 0.1) as s:
        assert "consume queues do not match" not in caplog.text
        assert (s.get_min_offset_in_queue("Old", 0), s.get_max_offset_in_queue("Old", 0)) == (40, 41)


def test_a_dispatch_round_retried_after_a_failure_counts_its_units_once(tmp_path, monkeypatch, caplog):
    # queue_units took a round's growth only at its end: a round that failed after writing units (out of
    # descriptors creating the next queue's file) and was retried, as the reput task does, found those units
    # already in (put says 0 for them), the count stayed short, and the next start rebuilt every queue.
    cfg = small_config(tmp_path / "s")
    with MessageStore.open(cfg) as s:
        fill(s, 4)
        s.dispatch_pending()
        mixed = encode_batch([MessageInput("TopicTest", 0, b"x" * 50, {}), MessageInput("Other", 0, b"y" * 50, {})],
                             STORE_HOST)
        assert s.append_batch(mixed, 1_700_000_010_000, s.max_phy_offset).ok
        create = ConsumeQueue._create
        failures = [OSError(errno.EMFILE, "Too many open files")]

        def create_or_fail(cq, idx):
            if cq.topic == "Other" and failures:
                raise failures.pop()
            return create(cq, idx)

        monkeypatch.setattr(ConsumeQueue, "_create", create_or_fail)
        with pytest.raises(OSError):
            s.dispatch_pending()
        s.dispatch_pending()
        assert s.dispatcher.queue_units == sum(cq.max_offset for cq in s.dispatcher.queues.values()) == 34
    with caplog.at_level(logging.WARNING), MessageStore.open(cfg) as s:
        assert "consume queues do not match" not in caplog.text
        assert s.get_max_offset_in_queue("TopicTest", 0) == 9 and s.get_max_offset_in_queue("Other", 0) == 1


def test_a_queue_deleted_with_its_topic_and_created_again_before_a_crash_is_counted_without_a_rebuild(
        tmp_path, caplog):
    # The checkpoint counted the deleted queue at its kept offset (3); the files of the queue created again
    # hold holes below its first new unit, which the count before that unit took for a queue begun there (0).
    cfg = small_config(tmp_path / "s", segment_size_bytes=64 * 1024, file_reserved_hours=0.0,
                       disk_clean_early_ratio=0.0, disk_clean_forcibly_ratio=0.5, disk_reject_ratio=0.9)
    delete_log = "rmq_sys_TOPIC_DELETE_LOG"
    with MessageStore.open(cfg, disk_usage_fn=lambda path: 0.1) as s:
        for batch in ([MessageInput("Gone", 0, b"x", {})] * 3, [MessageInput(delete_log, 0, b"Gone", {})]):
            assert s.append_batch(encode_batch(batch, STORE_HOST), 1_700_000_000_000, s.max_phy_offset).ok
        while s.max_phy_offset < 4 * cfg.segment_size_bytes:
            fill(s, 1, topic="Live", queues=1)
        s.dispatch_pending()
        assert s.retention.clean_once() > 0 and s.queue_ids("Gone") == []
    s = MessageStore.open(cfg, disk_usage_fn=lambda path: 0.1)
    result = s.append_batch(encode_batch([MessageInput("Gone", 0, b"again", {})], STORE_HOST), 1_800_000_000_000,
                            s.max_phy_offset)
    assert result.queue_offsets == [3]
    s.dispatch_pending()
    _die(s)  # the unit is in the file, the checkpoint still from before it
    with caplog.at_level(logging.WARNING), MessageStore.open(cfg, disk_usage_fn=lambda path: 0.1) as s:
        assert "consume queues do not match" not in caplog.text
        assert (s.get_min_offset_in_queue("Gone", 0), s.get_max_offset_in_queue("Gone", 0)) == (3, 4)


def test_checkpoint_golden_bytes_and_a_version_1_checkpoint_is_still_read(tmp_path):
    from crc32c import crc32c

    from broker.store.checkpoint import StoreCheckpoint
    path = tmp_path / "checkpoint"
    cp = StoreCheckpoint(path)
    cp.write(0x0102, 0x0304, 0x0506)
    cp.close()
    head = bytes.fromhex("524d434b 00000002 0000000000000102 0000000000000304 0000000000000506")
    assert path.read_bytes() == head + crc32c(head).to_bytes(4, "big") + bytes(4)
    old = bytes.fromhex("524d434b 00000001 0000000000000102 0000000000000304")
    path.write_bytes(old + crc32c(old).to_bytes(4, "big") + bytes(4))
    cp = StoreCheckpoint(path)
    assert (cp.commit_log_flushed, cp.dispatched, cp.queue_units) == (0x0102, 0x0304, None)
    cp.close()


@pytest.mark.parametrize("checkpoint", ["before_the_roll", "at_the_end"])
def test_a_crash_before_a_new_index_files_first_header_write_loses_no_key_and_doubles_none(tmp_path, checkpoint):
    # An index file fills in the middle of a record's keys: its first keys stay in the full file and the next
    # file begins with the rest. A crash before the next file's header was written left it reading as fresh; its
    # entries were undone and the record was dispatched again from the checkpoint, all its keys into the new
    # file, so query_message found it twice (with a checkpoint at the end: not at all, nor the records after it).
    cfg = small_config(tmp_path / "s")
    with MessageStore.open(cfg) as s:
        fill(s, 12)  # 96 records of 3 keys: 288 of the first file's 299 entries
        s.dispatch_pending()
        s.flush_all()
        fill(s, 2, start_seq=12)  # the first file fills at record 99, after two of its three keys
        s.dispatch_pending()
        if checkpoint == "at_the_end":
            s.flush_all()
        first, second = s.dispatcher.index.files
        assert first.end_phy_offset < second.begin_phy_offset == s.look_message_by_offset(
            second.begin_phy_offset).phy_offset
        second.file.mm[:INDEX_HEADER.size] = bytes(INDEX_HEADER.size)  # as if the process died before writing it
        _die(s)
    with MessageStore.open(cfg) as s:
        _assert_derived_agree(s)
        for n in range(112):
            assert len(s.query_message("TopicTest", f"uniq-{n:08d}", 4).messages) == 1, n
        assert len(s.query_message("TopicTest", "common", 1000).messages) == 112
    shutil.copytree(tmp_path / "s", tmp_path / "r")
    shutil.rmtree(tmp_path / "r" / "index")
    with MessageStore.open(small_config(tmp_path / "r")):
        pass
    assert tree_bytes(tmp_path / "r", "index") == tree_bytes(tmp_path / "s", "index")


@pytest.mark.parametrize("lost", ["first", "middle", "last", "two_last"])
def test_lost_index_files_are_rebuilt_from_the_commit_log(tmp_path, lost):
    # Recovery dispatched on from the checkpoint: the keys of the records a lost first or middle file held were
    # never found again by query_message (of a lost newest file: see the test above).
    cfg = small_config(tmp_path / "s")
    with MessageStore.open(cfg) as s:
        fill(s, 100)  # 300 entries a file, 3 a message: 9 files
    names = sorted(os.listdir(tmp_path / "s" / "index"))
    assert len(names) == 9
    victims = {"first": names[:1], "middle": names[4:5], "last": names[-1:], "two_last": names[-2:]}[lost]
    for name in victims:
        os.unlink(tmp_path / "s" / "index" / name)
    with MessageStore.open(cfg) as s:
        _assert_derived_agree(s)
        assert len(s.query_message("TopicTest", "common", 1000).messages) == 800
    assert sorted(os.listdir(tmp_path / "s" / "index")) == names
    shutil.copytree(tmp_path / "s", tmp_path / "r")
    shutil.rmtree(tmp_path / "r" / "index")
    with MessageStore.open(small_config(tmp_path / "r")):
        pass
    assert tree_bytes(tmp_path / "r", "index") == tree_bytes(tmp_path / "s", "index")
