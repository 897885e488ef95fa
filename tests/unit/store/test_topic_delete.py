"""Deleting a topic: a record in ``TOPIC_DELETE_LOG`` cuts the topic's queues at its own commit-log offset.

Every path that dispatches must apply the cut at the same place: the leader's build hint (one group commit may
hold records before and after it), parsing records (a raw copy from a peer, a rebuild), and a restart.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from broker.store import GetMessageStatus, MessageInput, MessageStore, StoreCorruptedError, decode_record, encode_batch
from broker.store.dispatch import TOPIC_DELETE_LOG

from .helpers import STORE_HOST, fill, make_batch, small_config

QUEUES = range(4)
DELETE_LOG = TOPIC_DELETE_LOG.encode("ascii")


def deletion(topic: str) -> bytes:
    return encode_batch([MessageInput(TOPIC_DELETE_LOG, 0, topic.encode(), {"KEYS": topic})], STORE_HOST)


def append(store: MessageStore, batch: bytes, ts: int = 1_700_000_100_000) -> int:
    result = store.append_batch(batch, ts, store.max_phy_offset)
    assert result.ok, result
    return result.phy_offsets[0]


def bounds(store: MessageStore, topic: str = "TopicTest") -> list[tuple[int, int]]:
    return [(store.get_min_offset_in_queue(topic, q), store.get_max_offset_in_queue(topic, q)) for q in QUEUES]


def readable(store: MessageStore, topic: str = "TopicTest") -> list[str]:
    """Every body a consumer starting at the min offset of each queue reads."""
    bodies = []
    for q in QUEUES:
        offset = store.get_min_offset_in_queue(topic, q)
        while True:
            result = store.get_messages(topic, q, offset, 64, 1 << 20)
            if result.status is not GetMessageStatus.FOUND:
                break
            bodies += [decode_record(m).body.split(b" ")[1].decode() for m in result.messages]
            offset = result.next_begin_offset
    return sorted(bodies, key=int)


def test_a_deleted_topic_reads_empty_and_a_new_one_of_its_name_starts_after_the_cut(tmp_path):
    with MessageStore.open(small_config(tmp_path / "s")) as store:
        fill(store, 5)  # messages 0..39, 10 per queue
        fill(store, 2, topic="Other")
        cut = append(store, deletion("TopicTest"))
        store.dispatch_pending()
        # Queue offsets go on (never reused); nothing before the cut is served, even below the min offset.
        assert bounds(store) == [(10, 10)] * 4
        old = store.get_messages("TopicTest", 1, 0, 8, 1 << 20)
        assert old.status is GetMessageStatus.OFFSET_TOO_SMALL and old.next_begin_offset == 10
        assert store.query_message("TopicTest", "common", 100).messages == []
        assert store.dispatcher.cut_of("TopicTest") == cut
        fill(store, 1, start_seq=5)  # messages 40..47: the topic again, after the cut
        store.dispatch_pending()
        assert bounds(store) == [(10, 12)] * 4
        assert readable(store) == [str(n) for n in range(40, 48)]
        assert len(store.query_message("TopicTest", "common", 100).messages) == 8
        # Other topics are untouched, and the deletion itself can be looked up by the topic's name.
        assert bounds(store, "Other") == [(0, 4)] * 4
        (record,) = store.query_message(TOPIC_DELETE_LOG, "TopicTest", 10).messages
        assert record.body == b"TopicTest" and record.phy_offset == cut


def test_a_cut_inside_one_group_commit_hides_exactly_the_records_before_it(tmp_path):
    with MessageStore.open(small_config(tmp_path / "s")) as store:
        fill(store, 2)  # messages 0..15, dispatched below
        store.dispatch_pending()
        # One build holding the topic, its deletion and the topic again, as the leader's batcher makes it: the
        # dispatcher gets it as one hint whose units are grouped by queue, not in record order.
        batches = [make_batch(2), deletion("TopicTest"), make_batch(3)]
        built = store.prepare_append([(b, 8 if i != 1 else 1) for i, b in enumerate(batches)],
                                     store.max_phy_offset, 1_700_000_200_000, {})
        store.apply_built(built.pieces, built.data, built.touched, built.pieces[0][0], built.hint)
        store.dispatch_pending()
        assert bounds(store) == [(6, 8)] * 4
        assert readable(store) == [str(n) for n in range(24, 32)]


def test_the_cut_survives_a_restart_a_rebuild_and_a_raw_copy(tmp_path):
    config = small_config(tmp_path / "s")
    with MessageStore.open(config) as store:
        fill(store, 5)
        append(store, deletion("TopicTest"))
        fill(store, 1, start_seq=5)
        store.dispatch_pending()
        expected = bounds(store)
        assert expected == [(10, 12)] * 4
        raw = store.read_commit_log(store.min_phy_offset, 1 << 30)
    with MessageStore.open(config) as store:  # restart: the cut comes back from TOPIC_DELETE_LOG's queue
        assert bounds(store) == expected and readable(store) == [str(n) for n in range(40, 48)]
    for derived in ("consumequeue", "index"):
        shutil.rmtree(config.store_dir / derived)
    (config.store_dir / "checkpoint").unlink()
    with MessageStore.open(config) as store:  # rebuilt by parsing the whole commit log
        assert bounds(store) == expected and readable(store) == [str(n) for n in range(40, 48)]
        assert store.query_message("TopicTest", "key-3", 10).messages == []
    # A member catching up copies raw commit-log bytes and dispatches them by parsing, while it runs.
    with MessageStore.open(small_config(tmp_path / "copy")) as copy:
        assert copy.append_commit_log_raw(0, raw).ok
        copy.dispatch_pending()
        assert bounds(copy) == expected and readable(copy) == [str(n) for n in range(40, 48)]


def test_a_deletion_applies_only_to_its_own_topic_and_keeps_the_latest_cut(tmp_path):
    with MessageStore.open(small_config(tmp_path / "s")) as store:
        fill(store, 1)
        first = append(store, deletion("TopicTest"))
        fill(store, 1, start_seq=1)
        second = append(store, deletion("TopicTest"))
        fill(store, 1, start_seq=2, topic="Other")
        append(store, deletion("NeverExisted"))
        store.dispatch_pending()
        assert first < second and store.dispatcher.cut_of("TopicTest") == second
        assert bounds(store) == [(4, 4)] * 4
        assert bounds(store, "Other") == [(0, 2)] * 4


def _retention_config(store_dir):
    """Segments of 64 KiB that retention deletes at once (expired at 0 hours, usage past the early ratio)."""
    return small_config(store_dir, segment_size_bytes=64 * 1024, file_reserved_hours=0.0, delete_segments_per_pass=100,
                        disk_clean_early_ratio=0.0, disk_clean_forcibly_ratio=0.5, disk_reject_ratio=0.9)


def _open(config) -> MessageStore:
    return MessageStore.open(config, disk_usage_fn=lambda path: 0.1)


def _descriptors_under(path) -> list[str]:
    """What this process holds open under ``path`` (descriptors, a mapping's own included)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path) + "/"):
            held.append(target)
    return held


def _expire_all_but_the_tail(store: MessageStore) -> None:
    """Push the records so far out of the commit log: fill new segments, then one retention pass."""
    start = store.max_phy_offset
    while store.max_phy_offset < start + 4 * store.config.segment_size_bytes:
        append(store, encode_batch([MessageInput("Live", 0, b"y" * 2000, {})], STORE_HOST))
    store.dispatch_pending()
    assert store.retention.clean_once() > 0 and store.min_phy_offset > start


def test_retention_deletes_the_queues_of_deleted_topics_and_a_topic_created_again_continues_their_offsets(
        tmp_path, caplog):
    # Every queue of every topic ever deleted stayed open (two descriptors: the file and its mapping) and on disk
    # for good, after a restart too: 200 topics of 4 queues left 802 queues open, 1,608 descriptors more.
    config = _retention_config(tmp_path / "s")
    cq_root = config.store_dir / "consumequeue"
    with _open(config) as store:
        for i in range(20):
            append(store, encode_batch([MessageInput(f"Gone{i}", q, b"x", {}) for q in QUEUES for _ in range(3)],
                                       STORE_HOST))
            append(store, deletion(f"Gone{i}"))
        fill(store, 1, topic="Again")
        append(store, deletion("Again"))
        fill(store, 1, start_seq=1, topic="Again")  # created again: units past the cut, its queues stay
        store.dispatch_pending()
        assert len(_descriptors_under(cq_root / "Gone7")) == 8
        _expire_all_but_the_tail(store)
        assert not [name for name in os.listdir(cq_root) if name.startswith("Gone")]
        assert _descriptors_under(cq_root / "Gone7") == [] and store.queue_ids("Gone7") == []
        assert sorted(store.dispatcher.queues) == [(b"Again", q) for q in QUEUES] + [(b"Live", 0), (DELETE_LOG, 0)]
        # Read as before the files went: empty at the offset they had reached.
        assert bounds(store, "Gone7") == [(3, 3)] * 4
        assert store.get_messages("Gone7", 1, 0, 8, 1 << 20).status is GetMessageStatus.OFFSET_TOO_SMALL
        assert store.get_messages("Gone7", 1, 3, 8, 1 << 20).status is GetMessageStatus.OFFSET_OVERFLOW_ONE
        assert bounds(store, "Again") == [(4, 4)] * 4 and store.queue_ids("Again") == list(QUEUES)
        fill(store, 1, topic="Gone0")  # the name created again: offsets continue, never given twice
        store.dispatch_pending()
        assert bounds(store, "Gone0") == [(3, 5)] * 4 and readable(store, "Gone0") == [str(n) for n in range(8)]
    with caplog.at_level(logging.WARNING), _open(config) as store:
        assert "consume queues do not match" not in caplog.text  # the count of units still agrees
        assert _descriptors_under(cq_root / "Gone7") == [] and not (cq_root / "Gone7").exists()
        assert bounds(store, "Gone7") == [(3, 3)] * 4 and bounds(store, "Gone0") == [(3, 5)] * 4
        result = store.append_batch(make_batch(0, topic="Gone9"), 1_700_000_300_000, store.max_phy_offset)
        assert sorted(result.queue_offsets) == [3] * 4 + [4] * 4
        store.dispatch_pending()
        assert readable(store, "Gone9") == [str(n) for n in range(8)]
    # Rebuilt from the commit log alone, the offsets of a deleted queue whose records are gone still hold.
    shutil.rmtree(cq_root)
    (config.store_dir / "checkpoint").unlink()
    with _open(config) as store:
        assert bounds(store, "Gone7") == [(3, 3)] * 4 and bounds(store, "Gone9") == [(3, 5)] * 4
        result = store.append_batch(make_batch(0, topic="Gone7"), 1_700_000_400_000, store.max_phy_offset)
        assert sorted(result.queue_offsets) == [3] * 4 + [4] * 4


def test_a_deleted_queue_left_on_disk_by_a_crash_is_deleted_at_the_next_start(tmp_path):
    config = _retention_config(tmp_path / "s")
    cq_root = config.store_dir / "consumequeue"
    with _open(config) as store:
        append(store, encode_batch([MessageInput("Gone", q, b"x", {}) for q in QUEUES for _ in range(3)],
                                   STORE_HOST))
        append(store, deletion("Gone"))
        store.dispatch_pending()
        (name,) = os.listdir(cq_root / "Gone" / "0")
        saved = (cq_root / "Gone" / "0" / name).read_bytes()
        _expire_all_but_the_tail(store)
        assert not (cq_root / "Gone").exists()
    # A crash after the offsets were written, before the files went (their deletion record already expired):
    # a queue's files left whole, another's directory left empty. Loading finishes the deletion.
    (cq_root / "Gone" / "0").mkdir(parents=True)
    (cq_root / "Gone" / "0" / name).write_bytes(saved)
    (cq_root / "Gone" / "1").mkdir()
    with _open(config) as store:
        assert bounds(store, "Gone") == [(3, 3)] * 4
        assert store.queue_ids("Gone") == [] and not (cq_root / "Gone").exists()


def test_deleted_queues_golden_bytes_and_a_damaged_file_is_refused_naming_it(tmp_path):
    from broker.store.dispatch import decode_deleted_queues, encode_deleted_queues

    deleted = {(b"TopicTest", 3): 40, (b"Old", 0): 7}
    data = encode_deleted_queues(deleted)
    assert data.hex() == ("524d4451" "00000001" "00000002"
                          "00000000" "0000000000000007" "03" + b"Old".hex() +
                          "00000003" "0000000000000028" "09" + b"TopicTest".hex() +
                          "19b806b4")
    assert decode_deleted_queues(data, tmp_path / "x") == deleted
    config = _retention_config(tmp_path / "s")
    with _open(config) as store:
        append(store, encode_batch([MessageInput("Gone", 0, b"x", {})], STORE_HOST))
        append(store, deletion("Gone"))
        store.dispatch_pending()
        _expire_all_but_the_tail(store)
    path = config.store_dir / "deleted_queues"
    assert decode_deleted_queues(path.read_bytes(), path) == {(b"Gone", 0): 1}
    damaged = bytearray(path.read_bytes())
    damaged[-6] ^= 1
    path.write_bytes(damaged)
    with pytest.raises(StoreCorruptedError, match=f"{path} is damaged .*start its queues at offset 0"):
        _open(config)
