"""Reads by an offset from outside (a message id, a request's commit-log offset) find only records the commit log
wrote: never a record head a producer planted in a message body."""

from __future__ import annotations

import shutil
import struct

import pytest

from broker.store import MessageInput, MessageStore, encode_batch
from remoting.message import MESSAGE_MAGIC, RECORD_HEAD, decode_record, record_size

from .helpers import STORE_HOST, small_config

TS = 1_700_000_000_000
PAD = 16


def _forged_body(at: int, topic: bytes, span: int) -> bytes:
    """A body whose bytes from ``PAD`` on read as the head of a record of ``topic`` starting at ``at`` (the phy
    offset the body's byte ``PAD`` will have), ``span`` bytes long: its own body reaches past the planted bytes
    into whatever follows, and ends with the planted topic."""
    tail = bytes([len(topic)]) + topic + b"\x00\x00"
    body_len = span - RECORD_HEAD.size - 4 - len(tail)
    head = RECORD_HEAD.pack(span, MESSAGE_MAGIC, 0, 0, 0, 0, at, 0, 0, bytes(4), 0, 0, bytes(4), 0, 0, 0)
    return b"p" * PAD + head + struct.pack(">i", body_len) + b"q" * 16


def _append(store: MessageStore, msgs: list[MessageInput]) -> list[tuple[int, int]]:
    result = store.append_batch(encode_batch(msgs, STORE_HOST), TS, store.max_phy_offset)
    assert result.ok, result
    return list(zip(result.phy_offsets, result.sizes))


def _written(store: MessageStore, phy_offset: int):
    d = store.dispatcher
    return store.commit_log.record_written_at(phy_offset, d.dispatched, d.queues)


def _plant(store: MessageStore) -> tuple[int, list[tuple[int, int]]]:
    """Topic A's message with a planted head of topic B, then a message of B: the planted record spans it, and
    ends 4 bytes before the log does (its topic is the end of the body of A's last message). Returns the planted
    offset and the real records."""
    base = store.max_phy_offset
    at = base + RECORD_HEAD.size + 4 + PAD
    first_size = record_size(PAD + RECORD_HEAD.size + 4 + 16, 1, 0)
    secret = MessageInput("B", 0, b"SECRET-PAYROLL-DATA " * 5, {"KEYS": "salary"})
    secret_size = record_size(len(secret.body), 1, len("KEYS\x01salary\x02"))
    last_body = b"z" * 40 + b"\x01B\x00\x00"
    end = base + first_size + secret_size + record_size(len(last_body), 1, 0)
    real = _append(store, [MessageInput("A", 0, _forged_body(at, b"B", end - 4 - at), {})])
    real += _append(store, [secret])
    real += _append(store, [MessageInput("A", 0, last_body, {})])
    assert store.max_phy_offset == end
    # What a read by offset took for a record of topic B before, holding B's message.
    view = decode_record(store.commit_log.record_at(at), check_crc=False)
    assert view.topic == "B" and secret.body in view.body
    return at, real


@pytest.fixture
def store(tmp_path):
    st = MessageStore.open(small_config(tmp_path / "s"))
    yield st
    st.close()


def test_a_record_head_planted_in_a_body_is_refused_dispatched_or_not(store):
    at, real = _plant(store)
    assert _written(store, at) is None  # not dispatched yet: the walk from the dispatched offset skips it
    for phy, size in real:
        assert len(_written(store, phy)) == size
    store.dispatch_pending()
    assert _written(store, at) is None  # dispatched: no ConsumeQueue unit names it
    for phy, size in real:
        assert len(_written(store, phy)) == size


def test_look_message_by_offset_refuses_a_planted_head(store):
    at, real = _plant(store)
    assert store.look_message_by_offset(at) is None
    store.dispatch_pending()
    assert store.look_message_by_offset(at) is None
    assert [store.look_message_by_offset(phy).topic for phy, _ in real] == ["A", "B", "A"]


def test_a_planted_head_naming_the_queue_offset_of_a_real_record_is_refused(store):
    # The planted head names queue A/0, queue offset 0: the unit there is the real record's (its carrier's).
    real = _append(store, [MessageInput("A", 0, b"first", {})])
    at = store.max_phy_offset + RECORD_HEAD.size + 4 + PAD
    span = RECORD_HEAD.size + 4 + 16 + 1 + 1 + 2
    body = _forged_body(at, b"A", span)
    real += _append(store, [MessageInput("A", 0, body[:PAD + span - 4] + b"\x01A\x00\x00", {})])
    assert store.commit_log.record_at(at) is not None
    store.dispatch_pending()
    assert _written(store, at) is None
    assert [len(_written(store, phy)) for phy, _ in real] == [size for _, size in real]


def test_offsets_inside_records_blanks_and_outside_the_log_are_refused(store):
    real = _append(store, [MessageInput("T", q, b"x" * 100, {"KEYS": f"k{q}"}) for q in range(3)])
    for phy in (real[0][0] + 1, real[1][0] - 8, store.max_phy_offset, store.max_phy_offset + 100, -1):
        assert _written(store, phy) is None, phy
    store.dispatch_pending()
    for phy in (real[0][0] + 1, real[1][0] - 8, store.max_phy_offset, -1):
        assert _written(store, phy) is None, phy


def _every_record(store: MessageStore, records: list[tuple[int, int]]) -> None:
    for phy, size in records:
        raw = _written(store, phy)
        assert raw is not None and len(raw) == size, (phy, store.dispatcher.dispatched)


SYSTEM_TOPICS = [("SCHEDULE_TOPIC_XXXX", 2), ("RMQ_SYS_TRANS_HALF_TOPIC", 0), ("%RETRY%billing", 0),
                 ("%DLQ%billing", 0), ("RMQ_SYS_TRANS_OP_HALF_TOPIC", 0), ("TopicTest", 3)]


def _fill_across_segments(store: MessageStore, rounds: int) -> list[tuple[int, int]]:
    records = []
    for n in range(rounds):
        msgs = [MessageInput(topic, qid, bytes([65 + n % 26]) * (700 + 37 * i), {"KEYS": f"k{n}-{i}"})
                for i, (topic, qid) in enumerate(SYSTEM_TOPICS)]
        records += _append(store, msgs)
    return records


def test_every_record_is_found_dispatched_or_not_across_segment_ends(store):
    records = _fill_across_segments(store, 100)  # over 2 segments of 256 KiB: batches roll over segment ends
    assert store.max_phy_offset > 2 * store.commit_log.segment_size
    _every_record(store, records)  # not dispatched: each reached by the walk over record heads and blanks
    store.dispatch_pending(max_bytes=100_000)  # part-way: both ways at once
    assert 0 < store.dispatcher.dispatched < store.max_phy_offset
    _every_record(store, records)
    store.dispatch_pending()
    _every_record(store, records)


def test_every_record_is_found_after_a_restart_a_rebuild_and_retention(tmp_path):
    config = small_config(tmp_path / "s", file_reserved_hours=0.0, delete_segments_per_pass=1,
                          disk_clean_early_ratio=0.0, disk_clean_forcibly_ratio=0.5, disk_reject_ratio=0.9)
    with MessageStore.open(config, disk_usage_fn=lambda path: 0.1) as store:
        records = _fill_across_segments(store, 160)
        store.dispatch_pending()
    with MessageStore.open(config, disk_usage_fn=lambda path: 0.1) as store:
        _every_record(store, records)
    shutil.rmtree(tmp_path / "s" / "consumequeue")
    with MessageStore.open(config, disk_usage_fn=lambda path: 0.1) as store:
        _every_record(store, records)
        assert store.retention.clean_once() == 1
        kept = [(phy, size) for phy, size in records if phy >= store.min_phy_offset]
        assert 0 < len(kept) < len(records)
        _every_record(store, kept)
        assert all(_written(store, phy) is None for phy, _ in records if phy < store.min_phy_offset)


def test_every_record_is_found_in_a_raw_copy_that_begins_past_zero(tmp_path):
    with MessageStore.open(small_config(tmp_path / "peer")) as peer:
        records = _fill_across_segments(peer, 160)
        peer.dispatch_pending()
        peer.commit_log.delete_segment(0)
        for cq in peer.dispatcher.queues.values():
            cq.correct_min_offset(peer.min_phy_offset)
        with MessageStore.open(small_config(tmp_path / "copy")) as copy:
            copy.start_at(peer.min_phy_offset)
            pos = peer.min_phy_offset
            while pos < peer.max_phy_offset:
                assert copy.append_commit_log_raw(pos, peer.read_commit_log(pos, 100_000)).ok
                pos = copy.max_phy_offset
            kept = [(phy, size) for phy, size in records if phy >= copy.min_phy_offset]
            _every_record(copy, kept)
            copy.dispatch_pending()
            _every_record(copy, kept)
