"""An empty store that begins its commit log past 0: a member rebuilt after its peers' retention deleted their
oldest segments copies the log from a peer's min offset, and ends serving exactly what the peer serves."""

from __future__ import annotations

import pytest

from broker.store import GetMessageStatus, MessageStore

from .helpers import fill, small_config


def _served(store: MessageStore, queues: int = 4) -> dict[int, tuple[int, int, list[bytes]]]:
    out = {}
    for q in range(queues):
        lo, hi = store.get_min_offset_in_queue("TopicTest", q), store.get_max_offset_in_queue("TopicTest", q)
        result = store.get_messages("TopicTest", q, lo, 10_000, 1 << 30)
        assert result.status in (GetMessageStatus.FOUND, GetMessageStatus.OFFSET_OVERFLOW_ONE), result.status
        out[q] = (lo, hi, [bytes(m) for m in result.messages])
    return out


@pytest.fixture
def peer(tmp_path):
    """A store whose first two segments are gone, as retention leaves it."""
    with MessageStore.open(small_config(tmp_path / "peer", consume_queue_units_per_file=4096)) as store:
        fill(store, 120, body_size=900)  # about 4 segments of 256 KiB
        store.dispatch_pending()
        for seg in store.commit_log.segments()[:2]:
            store.commit_log.delete_segment(seg.start)
        for cq in store.dispatcher.queues.values():
            cq.correct_min_offset(store.min_phy_offset)
        assert store.min_phy_offset == 2 * store.commit_log.segment_size
        yield store


def test_an_empty_store_copies_a_log_that_begins_past_zero(peer, tmp_path):
    config = small_config(tmp_path / "copy", consume_queue_units_per_file=4096)
    with MessageStore.open(config) as copy:
        copy.start_at(peer.min_phy_offset)
        assert (copy.min_phy_offset, copy.max_phy_offset) == (peer.min_phy_offset,) * 2
        pos = peer.min_phy_offset
        while pos < peer.max_phy_offset:
            result = copy.append_commit_log_raw(pos, peer.read_commit_log(pos, 100_000))
            assert result.ok, result
            pos = copy.max_phy_offset
        copy.dispatch_pending()
        expected = _served(peer)
        assert all(lo > 0 for lo, _, _ in expected.values())  # each queue begins mid-way
        assert _served(copy) == expected
    with MessageStore.open(config) as copy:  # and after a restart
        assert copy.min_phy_offset == peer.min_phy_offset and _served(copy) == expected


def test_start_at_survives_a_restart_before_any_byte_is_copied(peer, tmp_path):
    config = small_config(tmp_path / "copy")
    with MessageStore.open(config) as copy:
        copy.start_at(peer.min_phy_offset)
    with MessageStore.open(config) as copy:
        assert (copy.min_phy_offset, copy.max_phy_offset) == (peer.min_phy_offset,) * 2
        copy.start_at(peer.min_phy_offset + config.segment_size_bytes)  # still empty: may move on
        assert copy.max_phy_offset == peer.min_phy_offset + config.segment_size_bytes


def test_start_at_refuses_a_store_with_data_and_an_offset_inside_a_segment(peer, tmp_path):
    with pytest.raises(ValueError, match="needs an empty store"):
        peer.start_at(peer.max_phy_offset - peer.max_phy_offset % peer.commit_log.segment_size)
    with MessageStore.open(small_config(tmp_path / "copy")) as copy:
        with pytest.raises(ValueError, match="not a segment start"):
            copy.start_at(1000)
        assert copy.max_phy_offset == 0
