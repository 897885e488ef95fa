"""A store rebuilt empty that begins its commit log at a peer's min offset, given the peer's start state there
(``MessageStore.start_state`` / ``start_at``): it knows every queue whose records the peer's retention removed,
so as the group's leader it continues their offsets instead of giving the next message offset 0."""

from __future__ import annotations

import logging
import re

import pytest

from broker.store import MessageInput, MessageStore, decode_record, encode_batch
from broker.store.dispatch import TOPIC_DELETE_LOG, decode_start_state, encode_start_state
from remoting.message import validate_batch

from .helpers import STORE_HOST, fill, make_batch, small_config

QUEUES = range(4)


def _config(store_dir):
    """Segments of 64 KiB that retention deletes at once (expired at 0 hours, usage past the early ratio)."""
    return small_config(store_dir, segment_size_bytes=64 * 1024, file_reserved_hours=0.0, delete_segments_per_pass=100,
                        disk_clean_early_ratio=0.0, disk_clean_forcibly_ratio=0.5, disk_reject_ratio=0.9)


def _open(config) -> MessageStore:
    return MessageStore.open(config, disk_usage_fn=lambda path: 0.1)


def _append(store: MessageStore, batch: bytes) -> None:
    result = store.append_batch(batch, 1_700_000_100_000, store.max_phy_offset)
    assert result.ok, result


def _bounds(store: MessageStore, topic: str, queues=QUEUES) -> list[tuple[int, int]]:
    return [(store.get_min_offset_in_queue(topic, q), store.get_max_offset_in_queue(topic, q)) for q in queues]


@pytest.fixture
def peer(tmp_path):
    """A replica whose retention deleted the segments holding all of ``Old:0`` (offsets 0..39: an idle queue) and
    of the deleted topic ``Gone`` (its queues dropped into deleted_queues at offset 3), and the first records of
    ``TopicTest``, whose queues go on past its min offset."""
    with _open(_config(tmp_path / "peer")) as store:
        fill(store, 5, topic="Old", queues=1)
        _append(store, encode_batch([MessageInput("Gone", q, b"x", {}) for q in QUEUES for _ in range(3)],
                                    STORE_HOST))
        _append(store, encode_batch([MessageInput(TOPIC_DELETE_LOG, 0, b"Gone", {"KEYS": "Gone"})], STORE_HOST))
        seq = 0
        while store.max_phy_offset < 5.5 * store.config.segment_size_bytes:
            fill(store, 1, start_seq=seq)
            seq += 1
        store.dispatch_pending()
        assert store.retention.clean_once() > 0
        assert _bounds(store, "Old", [0]) == [(40, 40)] and _bounds(store, "Gone") == [(3, 3)] * 4
        assert store.queue_ids("Gone") == []  # only in deleted_queues now
        assert all(0 < lo < hi for lo, hi in _bounds(store, "TopicTest"))  # queues that go on past the min offset
        yield store


def _copy_all(peer: MessageStore, copy: MessageStore) -> None:
    while copy.max_phy_offset < peer.max_phy_offset:
        result = copy.append_commit_log_raw(copy.max_phy_offset, peer.read_commit_log(copy.max_phy_offset, 1 << 20))
        assert result.ok, result
    copy.dispatch_pending()


def _lead_and_apply(leader: MessageStore, follower: MessageStore, batch: bytes) -> list[int]:
    """``leader`` builds an entry as the group's leader does; both apply it. Returns its queue offsets."""
    built = leader.prepare_append([(batch, validate_batch(batch))], leader.max_phy_offset, 1_700_000_200_000, {})
    start = leader.max_phy_offset
    for store in (leader, follower):
        assert store.apply_built(built.pieces, built.data, built.touched, start, built.hint).name == "PUT_OK"
        store.dispatch_pending()
    return built.queue_offsets


def test_a_store_started_with_the_peers_start_state_continues_queues_whose_records_are_gone(peer, tmp_path):
    # Begun without it, the rebuilt member knew nothing of Old:0: as leader it gave the next message offset 0,
    # which the peers applied below their max offset 40, where no consumer (committed at 40) ever read it.
    config = _config(tmp_path / "copy")
    start = peer.min_phy_offset
    with _open(config) as copy:
        copy.start_at(start, peer.start_state(start))
        assert _bounds(copy, "Old", [0]) == [(40, 40)] and _bounds(copy, "Gone") == [(3, 3)] * 4
        _copy_all(peer, copy)
        for topic, queues in (("Old", [0]), ("Gone", QUEUES), ("TopicTest", QUEUES)):
            assert _bounds(copy, topic, queues) == _bounds(peer, topic, queues), topic
        assert _lead_and_apply(copy, peer, make_batch(500, count=1, topic="Old", queues=1)) == [40]
        assert _lead_and_apply(copy, peer, make_batch(501, count=4, topic="Gone")) == [3, 3, 3, 3]
        for store in (peer, copy):
            assert _bounds(store, "Old", [0]) == [(40, 41)] and _bounds(store, "Gone") == [(3, 4)] * 4
            found = store.get_messages("Old", 0, 40, 8, 1 << 20)
            assert [decode_record(m).body.split(b" ")[1] for m in found.messages] == [b"500"]
        peer_segments = [c for c in peer.segment_checksums(peer.max_phy_offset) if c[0] >= start]
        assert copy.segment_checksums(copy.max_phy_offset) == peer_segments  # byte-identical logs
    with _open(config) as copy:  # and after a restart
        assert _bounds(copy, "Old", [0]) == [(40, 41)] and _bounds(copy, "TopicTest") == _bounds(peer, "TopicTest")


def test_the_start_state_survives_a_restart_before_any_record_is_copied_and_a_later_start_replaces_it(
        peer, tmp_path, caplog):
    config = _config(tmp_path / "copy")
    start = peer.min_phy_offset
    with _open(config) as copy:
        copy.start_at(start, peer.start_state(start))
    with caplog.at_level(logging.WARNING), _open(config) as copy:
        assert "do not match" not in caplog.text  # its queues agree with the checkpoint's count
        assert (copy.min_phy_offset, copy.max_phy_offset) == (start, start)
        assert _bounds(copy, "Old", [0]) == [(40, 40)] and _bounds(copy, "Gone") == [(3, 3)] * 4
        # Still empty: the peers' retention moved on meanwhile, and the state at their new min offset replaces this.
        later = start + config.segment_size_bytes
        moved = encode_start_state(later, {(b"Old", 0): (45, (start - 100, 100, 0))}, {})
        copy.start_at(later, moved)
        assert _bounds(copy, "Old", [0]) == [(45, 45)] and _bounds(copy, "Gone") == [(0, 0)] * 4
        assert _bounds(copy, "TopicTest") == [(0, 0)] * 4 and copy.queue_ids("TopicTest") == []
    with _open(config) as copy:
        assert _bounds(copy, "Old", [0]) == [(45, 45)] and _bounds(copy, "Gone") == [(0, 0)] * 4
        copy.start_at(later + config.segment_size_bytes, None)  # a peer of an older version: none known
        assert _bounds(copy, "Old", [0]) == [(0, 0)] and copy.dispatcher.queues == {}


def test_a_copied_record_must_continue_a_queue_the_state_names(peer, tmp_path):
    start = peer.min_phy_offset
    queues, deleted = decode_start_state(peer.start_state(start), start)
    max_offset, unit = queues[(b"TopicTest", 2)]
    queues[(b"TopicTest", 2)] = (max_offset + 1, unit)
    with _open(_config(tmp_path / "copy")) as copy:
        copy.start_at(start, encode_start_state(start, queues, deleted))
        result = copy.append_commit_log_raw(start, peer.read_commit_log(start, 1 << 20))
        assert result.status.name == "CORRUPTED" and f"TopicTest:2 expects {max_offset + 1}" in result.remark
        assert copy.max_phy_offset == start


def test_without_a_start_state_the_store_begins_as_before_and_says_what_it_does_not_know(peer, tmp_path, caplog):
    start = peer.min_phy_offset
    with caplog.at_level(logging.WARNING), _open(_config(tmp_path / "copy")) as copy:
        copy.start_at(start, None)
        assert "without the peer's queue offsets there (a peer of an older version)" in caplog.text
        _copy_all(peer, copy)
        assert _bounds(copy, "Old", [0]) == [(0, 0)] and _bounds(copy, "TopicTest") == _bounds(peer, "TopicTest")


def test_start_state_golden_bytes_and_a_malformed_state_is_refused_before_anything_is_written(tmp_path):
    queues = {(b"Old", 0): (40, (1000, 200, 7))}
    deleted = {(b"Gone", 1): 3}
    data = encode_start_state(65536, queues, deleted)
    assert data.hex() == ("524d5353" "00000001" "0000000000010000" "00000001" "00000001"
                          "00000000" "0000000000000028" "00000000000003e8" "000000c8" "0000000000000007" "03"
                          + b"Old".hex() +
                          "00000001" "0000000000000003" "04" + b"Gone".hex() +
                          data[-4:].hex())
    assert decode_start_state(data, 65536) == (queues, deleted)
    bad = [
        (data[:-1] + bytes([data[-1] ^ 1]), "its CRC does not match"),
        (encode_start_state(65536, queues, deleted), "the state at phy_offset 65536, not at 131072"),
        (encode_start_state(131072, {(b"Old", 0): (0, (1000, 200, 7))}, {}), "max offset 0"),
        (encode_start_state(131072, {(b"Old", 0): (4, (131000, 200, 7))}, {}), "no record before phy_offset"),
        (encode_start_state(131072, {(b"Old", 0): (4, (1000, 0, 7))}, {}), "no record before"),
        (encode_start_state(131072, {}, {(b"bad topic", 0): 3}), "illegal topic b'bad topic'"),
        (encode_start_state(131072, {(b"Old", 0): (4, (1000, 200, 7))}, {(b"Old", 0): 3}), "Old:0 again"),
        (b"RMSS", "4 bytes are fewer than its head"),
    ]
    with _open(_config(tmp_path / "copy")) as copy:
        for state, why in bad:
            with pytest.raises(ValueError, match=r"the peer.s start state \(\d+ bytes\) is malformed: .*" + re.escape(
                    why)):
                copy.start_at(131072, state)
            assert (copy.min_phy_offset, copy.max_phy_offset, copy.dispatcher.queues) == (0, 0, {})
        with pytest.raises(ValueError, match="phy_offset 65536 is outside the dispatched commit log"):
            copy.start_state(65536)
