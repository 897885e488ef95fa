"""Retention of IndexFile files around a record whose keys were split over two files."""

from __future__ import annotations

import pytest

from broker.store import MessageInput, MessageStore, encode_batch
from broker.store.index_file import INDEX_ENTRY
from remoting.message import record_size

from .helpers import STORE_HOST, small_config

SEG = 64 * 1024
BLANK_HEADER = 8


@pytest.fixture
def store(tmp_path):
    cfg = small_config(tmp_path / "s", segment_size_bytes=SEG, index_max_entries=300, file_reserved_hours=0.0,
                       delete_segments_per_pass=1, disk_clean_early_ratio=0.0, disk_clean_forcibly_ratio=0.5,
                       disk_reject_ratio=0.9)
    st = MessageStore.open(cfg, disk_usage_fn=lambda path: 0.1)
    yield st
    st.close()


def _put(st: MessageStore, msg: MessageInput, ts: int) -> int:
    result = st.append_batch(encode_batch([msg], STORE_HOST), ts, st.max_phy_offset)
    assert result.ok, result
    st.dispatch_pending()
    return result.phy_offsets[0]


def test_a_file_holding_the_first_keys_of_a_kept_record_is_not_deleted(store):
    ts = 1_700_000_000_000
    # Index file 0 has 299 usable entries: 298 one-key records leave room for exactly one more key.
    for i in range(298):
        ts += 1
        _put(store, MessageInput("T", 0, b"a", {"UNIQ_KEY": f"u{i}"}), ts)
    assert store.dispatcher.index.files[0].index_count == 299
    # Keyless records up to the end of segment 0, leaving room for M's bytes but not its 8-byte blank after it:
    # M (two keys) is the first record of segment 1, and its UNIQ_KEY is the last entry of file 0.
    props = {"UNIQ_KEY": "M-uniq", "KEYS": "order-42"}
    m_size = record_size(1, 1, len("UNIQ_KEY\x01M-uniq\x02KEYS\x01order-42\x02".encode()))
    while SEG - store.max_phy_offset > 2000:
        ts += 1
        _put(store, MessageInput("T", 0, b"b" * 1000, {}), ts)
    filler = SEG - store.max_phy_offset - m_size - record_size(0, 1, 0)
    ts += 1
    _put(store, MessageInput("T", 0, b"b" * filler, {}), ts)
    assert SEG - store.max_phy_offset == m_size < m_size + BLANK_HEADER
    ts += 1
    m_at = _put(store, MessageInput("T", 0, b"M", props), ts)
    assert m_at == SEG
    first = store.dispatcher.index.files[0]
    assert first.full and first.end_phy_offset < m_at
    while store.max_phy_offset < 3 * SEG:
        ts += 1
        _put(store, MessageInput("T", 1, b"c" * 1000, {}), ts)

    assert store.retention.clean_once() == 1
    assert store.min_phy_offset == m_at
    assert store.look_message_by_offset(m_at) is not None
    assert [v.phy_offset for v in store.query_message("T", "M-uniq", 10).messages] == [m_at]
    assert [v.phy_offset for v in store.query_message("T", "order-42", 10).messages] == [m_at]
    assert store.dispatcher.index.files[0] is first


def test_a_file_goes_once_its_last_entry_is_before_the_commit_log_start(store):
    ts = 1_700_000_000_000
    keyed = []
    # Two full index files of one-key records, then keyless records: the first two files point into segments
    # retention deletes, and go with them.
    while len(store.dispatcher.index.files) < 3:
        ts += 1
        keyed.append(_put(store, MessageInput("T", 0, b"k" * 200, {"UNIQ_KEY": f"k{len(keyed)}"}), ts))
    while store.max_phy_offset < keyed[-1] - keyed[-1] % SEG + 3 * SEG:
        ts += 1
        _put(store, MessageInput("T", 1, b"c" * 1000, {}), ts)
    newest = {f.begin_phy_offset: _newest_entry(f) for f in store.dispatcher.index.files}
    while store.retention.clean_once():
        pass
    cl_min = store.min_phy_offset
    left = store.dispatcher.index.files
    kept = {f.begin_phy_offset for f in left}
    gone = [begin for begin in newest if begin not in kept]
    assert gone and all(newest[begin] < cl_min for begin in gone)
    assert all(_newest_entry(f) >= cl_min for f in left[:-1])


def _newest_entry(f) -> int:
    return INDEX_ENTRY.unpack_from(f.file.mm, f.entries_at + (f.index_count - 1) * INDEX_ENTRY.size)[1]


def test_the_first_keys_of_a_split_record_are_found_in_a_window_after_the_full_file_ends(store):
    ts = 1_700_000_000_000
    for i in range(298):
        ts += 1
        _put(store, MessageInput("T", 0, b"a", {"UNIQ_KEY": f"u{i}"}), ts)
    ts += 5000
    m_at = _put(store, MessageInput("T", 0, b"M", {"UNIQ_KEY": "M-uniq", "KEYS": "order-42"}), ts)
    first, second = store.dispatcher.index.files
    # M's UNIQ_KEY is the full file's last entry, past its end; its KEYS word begins the next file.
    assert first.end_phy_offset < m_at <= second.begin_phy_offset and first.end_timestamp < ts
    for key in ("M-uniq", "order-42"):
        assert [v.phy_offset for v in store.query_message("T", key, 10, ts, ts).messages] == [m_at], key
    assert store.query_message("T", "M-uniq", 10, ts + 1000, ts + 5000).messages == []
