"""Reads: get_messages with every status, min/max offsets, offset by time, by id, by key."""

from __future__ import annotations

import pytest

from broker.store import (GetMessageStatus, MessageFormatError, MessageInput, MessageStore, decode_record,
                          encode_batch, tags_code)
from broker.store.commit_log import SIZE_MAGIC
from remoting.message import MESSAGE_MAGIC

from .helpers import fill, make_batch, small_config


@pytest.fixture
def store(tmp_path):
    with MessageStore.open(small_config(tmp_path / "s")) as s:
        fill(s, 40)  # 320 messages, 80 per queue, 4 queues; timestamps 1_700_000_000_000 + seq * 1000
        s.dispatch_pending()
        yield s


def test_found_returns_raw_records_in_queue_order(store):
    result = store.get_messages("TopicTest", 1, 10, 5, 1 << 20)
    assert result.status is GetMessageStatus.FOUND
    assert result.next_begin_offset == 15 and (result.min_offset, result.max_offset) == (0, 80)
    views = [decode_record(m) for m in result.messages]
    assert [v.queue_offset for v in views] == result.queue_offsets == [10, 11, 12, 13, 14]
    assert all(v.queue_id == 1 and v.topic == "TopicTest" for v in views)
    assert result.buffer_total_size == sum(len(m) for m in result.messages)


def test_max_bytes_limits_but_always_returns_one(store):
    one = store.get_messages("TopicTest", 0, 0, 32, 1)
    assert one.status is GetMessageStatus.FOUND and one.message_count == 1 and one.next_begin_offset == 1
    size = len(one.messages[0])
    three = store.get_messages("TopicTest", 0, 0, 32, 3 * size + 1)
    assert three.message_count == 3 and three.next_begin_offset == 3


def test_sequential_read_covers_every_message_once(store):
    seen = []
    offset = 0
    while True:
        result = store.get_messages("TopicTest", 2, offset, 7, 1 << 20)
        if result.status is not GetMessageStatus.FOUND:
            assert result.status is GetMessageStatus.OFFSET_OVERFLOW_ONE
            break
        seen += result.queue_offsets
        offset = result.next_begin_offset
    assert seen == list(range(80))


def test_tag_filter_and_no_matched_message(store):
    result = store.get_messages("TopicTest", 0, 0, 100, 1 << 20, tag_filter={tags_code("TagB")})
    tags = [decode_record(m).tags for m in result.messages]
    assert tags and set(tags) == {"TagB"}
    none = store.get_messages("TopicTest", 0, 0, 100, 1 << 20, tag_filter={tags_code("Nope")})
    # one pull reads one ConsumeQueue file at most (64 units here), as RocketMQ does
    assert none.status is GetMessageStatus.NO_MATCHED_MESSAGE and none.next_begin_offset == 64


def test_overflow_and_unknown_queue_statuses(store):
    one = store.get_messages("TopicTest", 0, 80, 10, 1 << 20)
    assert (one.status, one.next_begin_offset) == (GetMessageStatus.OFFSET_OVERFLOW_ONE, 80)
    badly = store.get_messages("TopicTest", 0, 500, 10, 1 << 20)
    assert (badly.status, badly.next_begin_offset) == (GetMessageStatus.OFFSET_OVERFLOW_BADLY, 0)
    assert store.get_messages("Nope", 0, 0, 1, 100).status is GetMessageStatus.NO_MATCHED_LOGIC_QUEUE
    assert store.get_messages("TopicTest", 9, 0, 1, 100).status is GetMessageStatus.NO_MATCHED_LOGIC_QUEUE


def test_offset_found_null_when_a_consume_queue_file_is_gone(store):
    cq = store.dispatcher.queue("TopicTest", 3)
    cq._files.pop(0).destroy()  # units 0..63 (64 units per file in the small config)
    result = store.get_messages("TopicTest", 3, 5, 10, 1 << 20)
    assert (result.status, result.next_begin_offset) == (GetMessageStatus.OFFSET_FOUND_NULL, 64)


def test_message_was_removing_and_offset_too_small(store):
    fill(store, 120, start_seq=40)
    store.dispatch_pending()
    assert len(store.commit_log.segments()) >= 3
    first_segment = store.commit_log.segments()[0].start
    store.commit_log.delete_segment(first_segment)  # units still point into it until the queues are corrected
    result = store.get_messages("TopicTest", 0, 0, 5, 1 << 20)
    assert result.status in (GetMessageStatus.MESSAGE_WAS_REMOVING, GetMessageStatus.FOUND)
    assert result.status is GetMessageStatus.MESSAGE_WAS_REMOVING or result.queue_offsets[0] > 0
    store.retention.delete_derived_files()
    mn = store.get_min_offset_in_queue("TopicTest", 0)
    assert mn > 0
    small = store.get_messages("TopicTest", 0, 0, 5, 1 << 20)
    assert (small.status, small.next_begin_offset) == (GetMessageStatus.OFFSET_TOO_SMALL, mn)
    assert store.get_messages("TopicTest", 0, mn, 1, 1 << 20).status is GetMessageStatus.FOUND


def test_no_message_in_queue_after_recovery_cut_every_unit(tmp_path):
    cfg = small_config(tmp_path / "s")
    with MessageStore.open(cfg) as s:
        fill(s, 1)
        s.append_batch(make_batch(1, topic="Lonely", queues=1, count=1), 5, s.max_phy_offset)
        s.dispatch_pending()
        lonely_phy = s.get_messages("Lonely", 0, 0, 1, 1 << 20).messages[0]
        phy = decode_record(lonely_phy).phy_offset
    seg = (tmp_path / "s" / "commitlog" / "00000000000000000000")
    with open(seg, "r+b") as f:
        f.seek(phy + 100)
        f.write(b"garbage")
    (tmp_path / "s" / "checkpoint").unlink()  # no checkpoint: recovery verifies the segment itself
    with MessageStore.open(cfg) as s:
        assert s.max_phy_offset == phy
        result = s.get_messages("Lonely", 0, 0, 1, 1 << 20)
        assert (result.status, result.next_begin_offset) == (GetMessageStatus.NO_MESSAGE_IN_QUEUE, 0)


def test_min_max_and_offset_by_time(store):
    assert store.get_min_offset_in_queue("TopicTest", 0) == 0
    assert store.get_max_offset_in_queue("TopicTest", 0) == 80
    assert store.get_max_offset_in_queue("Nope", 0) == 0
    # batch seq has 2 messages per queue, stored at 1_700_000_000_000 + seq * 1000
    assert store.get_offset_by_time("TopicTest", 0, 0) == 0
    assert store.get_offset_by_time("TopicTest", 0, 1_700_000_000_000 + 10_000) == 20
    assert store.get_offset_by_time("TopicTest", 0, 1_700_000_000_000 + 10_001) == 22
    assert store.get_offset_by_time("TopicTest", 0, 2_000_000_000_000) == 80


def test_look_message_by_offset_and_id(store):
    result = store.get_messages("TopicTest", 1, 3, 1, 1 << 20)
    view = decode_record(result.messages[0])
    assert store.look_message_by_offset(view.phy_offset) == view
    assert store.look_message_by_id(view.msg_id) == view
    assert store.look_message_by_offset(store.max_phy_offset) is None
    assert store.look_message_by_offset(view.phy_offset + 1) is None
    with pytest.raises(MessageFormatError):
        store.look_message_by_id("not-hex")


def test_query_message_by_key_unique_key_and_time(store):
    found = store.query_message("TopicTest", "key-17", 10)
    assert [v.keys[0] for v in found.messages] == ["key-17"]
    assert store.query_message("TopicTest", "uniq-00000033", 10).messages[0].uniq_key == "uniq-00000033"
    common = store.query_message("TopicTest", "common", 500)
    assert len(common.messages) == 320
    assert [v.phy_offset for v in common.messages] == sorted((v.phy_offset for v in common.messages),
                                                             reverse=True)
    window = store.query_message("TopicTest", "common", 500, 1_700_000_000_000 + 5_000,
                                 1_700_000_000_000 + 6_000)
    assert {v.store_timestamp for v in window.messages} == {1_700_000_000_000 + 5_000, 1_700_000_000_000 + 6_000}
    assert store.query_message("OtherTopic", "key-17", 10).messages == []
    assert len(store.dispatcher.index.files) > 1  # 300 entries per file: the chain spans several files


def test_query_message_finds_every_record_of_a_window_between_whole_seconds(tmp_path):
    # An index entry keeps its time to the second since the file's first entry, rounded down. Compared with the
    # window as if exact, a record stored later within its second was left out whenever the window began after
    # that second began: with batches 250 ms apart, the window 1.25 s .. 1.75 s found none of its 24 records.
    ts0 = 1_700_000_000_000
    with MessageStore.open(small_config(tmp_path / "s")) as store:
        for seq in range(40):
            assert store.append_batch(make_batch(seq), ts0 + seq * 250, store.max_phy_offset).ok
        store.dispatch_pending()
        for begin, end in ((1250, 1750), (1001, 1001), (0, 0), (9_750, 9_999), (1, 249)):
            window = store.query_message("TopicTest", "common", 64, ts0 + begin, ts0 + end).messages
            want = {ts0 + seq * 250 for seq in range(40) if begin <= seq * 250 <= end}
            assert {v.store_timestamp for v in window} == want, (begin, end)
            assert len(window) == 8 * len(want)


def test_query_message_looks_past_newer_records_of_the_key_outside_the_window(tmp_path):
    # 320 records of the key "common" within one second, 8 per millisecond. The index walk stopped after
    # max_num * 2 + 8 hits: the newest 16 for max_num 4, all outside a window on the first two milliseconds, so
    # the query found none of the 16 records there.
    ts0 = 1_700_000_000_000
    with MessageStore.open(small_config(tmp_path / "s", index_max_entries=100_000)) as store:
        for seq in range(40):
            assert store.append_batch(make_batch(seq), ts0 + seq, store.max_phy_offset).ok
        store.dispatch_pending()
        window = store.query_message("TopicTest", "common", 4, ts0, ts0 + 1).messages
        assert len(window) == 4 and {v.store_timestamp for v in window} == {ts0 + 1}
        assert len(store.query_message("TopicTest", "common", 64, ts0, ts0 + 1).messages) == 16
        assert len(store.query_message("TopicTest", "common", 64, ts0 + 39, ts0 + 39).messages) == 8


def test_a_record_naming_a_key_twice_is_found_once(tmp_path):
    # Each key of KEYS is indexed, and the UNIQ_KEY too: a record whose KEYS repeat a key, or hold its own unique
    # id, has two entries under it and was found twice, each copy counting against max_num.
    with MessageStore.open(small_config(tmp_path / "s")) as store:
        batch = encode_batch([MessageInput("TopicTest", 0, b"twice", {"KEYS": "dup dup other", "UNIQ_KEY": "u1"}),
                              MessageInput("TopicTest", 0, b"own id", {"KEYS": "u2", "UNIQ_KEY": "u2"}),
                              MessageInput("TopicTest", 0, b"plain", {"KEYS": "dup", "UNIQ_KEY": "u3"})],
                             ("10.0.0.7", 10911))
        assert store.append_batch(batch, 1_700_000_000_000, 0).ok
        store.dispatch_pending()
        assert [v.body for v in store.query_message("TopicTest", "dup", 10).messages] == [b"plain", b"twice"]
        assert [v.body for v in store.query_message("TopicTest", "dup", 2).messages] == [b"plain", b"twice"]
        assert [v.body for v in store.query_message("TopicTest", "u2", 10).messages] == [b"own id"]


def test_record_at_answers_exactly_where_a_record_starts(tmp_path):
    # record_at (lookups by offset) and read_commit_log (a peer's fetch) share one rule for "a record starts
    # here"; the blank that closes a segment is a unit a fetch copies but no record.
    with MessageStore.open(small_config(tmp_path / "s", segment_size_bytes=64 * 1024)) as store:
        fill(store, 40)
        data = store.read_commit_log(0, 1 << 30)
        records, blanks, pos = set(), set(), 0
        while pos < len(data):
            size, magic = SIZE_MAGIC.unpack_from(data, pos)
            (records if magic == MESSAGE_MAGIC else blanks).add(pos)
            pos += size
        assert pos == store.max_phy_offset and blanks and len(records) == 320
        assert {o for o in range(pos + 64) if store.commit_log.record_at(o) is not None} == records
        for b in blanks:
            assert store.read_commit_log(b, 1) == data[b:b + 64 * 1024 - b % (64 * 1024)]
