"""Deleting a topic: a record in ``TOPIC_DELETE_LOG`` cuts the topic's queues at its own commit-log offset.

Every path that dispatches must apply the cut at the same place: the leader's build hint (one group commit may
hold records before and after it), parsing records (a raw copy from a peer, a rebuild), and a restart.
"""

from __future__ import annotations

import shutil

from broker.store import GetMessageStatus, MessageInput, MessageStore, decode_record, encode_batch
from broker.store.dispatch import TOPIC_DELETE_LOG

from .helpers import STORE_HOST, fill, make_batch, small_config

QUEUES = range(4)


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
