"""Retention and the disk guard, on a small fake disk (injected usage and clock)."""

from __future__ import annotations

import os
import time

import pytest

from broker.store import AppendStatus, GetMessageStatus, MessageStore

from .helpers import fill, make_batch, small_config

HOUR = 3600.0


def _at_hour(hour: int) -> float:
    now = time.localtime()
    return time.mktime((now.tm_year, now.tm_mon, now.tm_mday, hour, 30, 0, 0, 0, -1))


class FakeDisk:
    """Usage grows with the commit-log segments on disk: ``base + per_segment * segments``."""

    def __init__(self, root, base: float, per_segment: float) -> None:
        self.root, self.base, self.per_segment = root, base, per_segment

    def __call__(self, path) -> float:
        return self.base + self.per_segment * len(os.listdir(self.root / "commitlog"))


@pytest.fixture
def setup(tmp_path):
    def _make(base: float, per_segment: float = 0.0, hour: int = 4, **overrides):
        clock = {"now": _at_hour(hour)}
        disk = FakeDisk(tmp_path / "s", base, per_segment)
        cfg = small_config(tmp_path / "s", file_reserved_hours=72, delete_segments_per_pass=3, **overrides)
        store = MessageStore.open(cfg, disk_usage_fn=disk, now_fn=lambda: clock["now"])
        fill(store, 160, body_size=900)  # 6 segments of 256 KiB
        store.dispatch_pending()
        return store, disk, clock
    stores = []

    def make(*a, **kw):
        stores.append(_make(*a, **kw))
        return stores[-1]
    yield make
    for store, _, _ in stores:
        store.close()


def _age_segments(store: MessageStore, now: float, hours: float, count: int) -> None:
    for seg in store.commit_log.segments()[:count]:
        os.utime(seg.path, (now - hours * HOUR, now - hours * HOUR))


def test_expired_segments_go_only_in_the_delete_window(setup):
    store, _, clock = setup(0.10, hour=13)
    segments = store.commit_log.segments()
    assert len(segments) >= 5
    _age_segments(store, clock["now"], 100, len(segments))
    assert store.retention.clean_once() == 0  # 13:30 is not in delete_when_hours (4)
    clock["now"] = _at_hour(4)
    _age_segments(store, clock["now"], 100, len(segments))
    assert store.retention.clean_once() == 3  # delete_segments_per_pass
    while store.retention.clean_once():
        pass
    assert len(store.commit_log.segments()) == 1  # min_retained_segments
    assert store.min_phy_offset == store.commit_log.segments()[0].start


def test_young_segments_stay_and_derived_files_follow_the_commit_log(setup):
    store, _, clock = setup(0.10)
    _age_segments(store, clock["now"], 100, 4)
    _age_segments(store, clock["now"], -1, 0)
    deleted = 0
    while n := store.retention.clean_once():
        deleted += n
    assert deleted == 4
    cl_min = store.min_phy_offset
    mn = store.get_min_offset_in_queue("TopicTest", 0)
    assert mn > 0
    first = store.get_messages("TopicTest", 0, mn, 1, 1 << 20)
    assert first.status is GetMessageStatus.FOUND
    assert store.dispatcher.queue("TopicTest", 0).unit(mn)[0] >= cl_min
    assert store.get_messages("TopicTest", 0, 0, 1, 1 << 20).status is GetMessageStatus.OFFSET_TOO_SMALL
    # consume queue files wholly before the new start are gone (64 units per file in the small config)
    assert min(store.dispatcher.queue("TopicTest", 0)._files) == mn // 64
    assert all(f.end_phy_offset >= cl_min for f in store.dispatcher.index.files)


def test_clean_early_ignores_the_delete_window(setup):
    store, _, clock = setup(0.80, hour=13)
    _age_segments(store, clock["now"], 100, 2)
    assert store.retention.clean_once() == 2


def test_force_clean_deletes_unexpired_segments_until_below_the_ratio(setup):
    store, disk, clock = setup(0.80, per_segment=0.01, hour=13)
    count = len(store.commit_log.segments())
    assert disk(None) >= 0.85
    deleted = store.retention.clean_once()
    assert 0 < deleted <= 3
    assert len(store.commit_log.segments()) == count - deleted
    while disk(None) >= 0.85 and store.retention.clean_once():
        pass
    assert disk(None) < 0.85


def test_disk_full_refuses_appends_with_a_clear_status(setup):
    store, disk, _ = setup(0.10)
    disk.base = 0.95
    store.retention.refresh_disk_state()
    end = store.max_phy_offset
    result = store.append_batch(make_batch(500), 1, end)
    assert result.status is AppendStatus.DISK_FULL and "disk_reject_ratio" in result.remark
    assert store.max_phy_offset == end
    assert store.append_batch(make_batch(500), 1, end, check_disk=False).ok  # a follower applying a commit
    disk.base = 0.10
    store.retention.clean_once()
    assert store.append_batch(make_batch(501), 1, store.max_phy_offset).ok
    assert store.statistics().disk_full is False


def test_segments_not_dispatched_yet_stay_until_they_are(tmp_path):
    # A follower applying a backlog writes segments faster than it dispatches them. Deleted before their units
    # were written, they left every queue at min offset 0 with units pointing at nothing: GET_MIN_OFFSET said 0
    # where the leader said 126, and a pull from 0 was "removed by retention" instead of moved to the min.
    clock = {"now": _at_hour(4)}
    cfg = small_config(tmp_path / "s", file_reserved_hours=72)
    with MessageStore.open(cfg, disk_usage_fn=lambda _path: 0.1, now_fn=lambda: clock["now"]) as store:
        fill(store, 160, body_size=900)  # 6 segments of 256 KiB, not dispatched
        _age_segments(store, clock["now"], 100, len(store.commit_log.segments()))
        store.retention.clean_once()  # the clean service's pass before the reput task's
        store.dispatch_pending()
        while store.retention.clean_once():
            pass
        assert len(store.commit_log.segments()) == 1
        for queue_id in range(4):
            mn = store.get_min_offset_in_queue("TopicTest", queue_id)
            assert store.dispatcher.queue("TopicTest", queue_id).unit(mn)[0] >= store.min_phy_offset > 0
            assert store.get_messages("TopicTest", queue_id, mn, 1, 1 << 20).status is GetMessageStatus.FOUND
            too_small = store.get_messages("TopicTest", queue_id, 0, 1, 1 << 20)
            assert too_small.status is GetMessageStatus.OFFSET_TOO_SMALL and too_small.next_begin_offset == mn
