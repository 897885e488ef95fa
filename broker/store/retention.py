"""``Retention``: deleting old commit-log segments and guarding the disk, as RocketMQ's CleanCommitLogService.

Per pass (every ``clean_interval_ms``), with ``u`` the disk usage of the store directory:

* ``u < disk_clean_early_ratio``: segments older than ``file_reserved_hours`` (file mtime) are deleted, but only
  during the ``delete_when_hours`` (04:00 by default), so deletion I/O stays out of busy hours.
* ``u >= disk_clean_early_ratio``: expired segments are deleted now, whatever the hour.
* ``u >= disk_clean_forcibly_ratio``: the oldest segments are deleted even if not expired.
* ``u >= disk_reject_ratio``: appends are refused with ``DISK_FULL`` until usage falls again.

The newest ``min_retained_segments`` segments are never deleted, nor one not yet dispatched to its end, and one
pass deletes at most ``delete_segments_per_pass``. After the commit log shrinks, ConsumeQueue and IndexFile
files that only point into deleted segments go too, and so does every queue of a deleted topic with nothing
after the deletion once its last record is gone (closed, its directory deleted, its max offset kept:
``Dispatcher.drop_deleted_topic_queues``). ``disk_usage_fn`` and ``now_fn`` are injectable, so tests use a small
fake disk.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .message_store import MessageStore

log = logging.getLogger(__name__)

__all__ = ["Retention"]


class Retention:
    def __init__(self, store: MessageStore, disk_usage_fn: Callable[[Path], float],
                 now_fn: Callable[[], float]) -> None:
        self.store = store
        self.disk_usage_fn = disk_usage_fn
        self.now_fn = now_fn
        self.disk_usage = 0.0
        self.disk_full = False

    def refresh_disk_state(self) -> float:
        cfg = self.store.config
        self.disk_usage = float(self.disk_usage_fn(cfg.store_dir))
        full = self.disk_usage >= cfg.disk_reject_ratio
        if full != self.disk_full:
            log.warning("store disk guard %s disk_usage=%.3f disk_reject_ratio=%.2f",
                        "refuses appends" if full else "accepts appends again", self.disk_usage,
                        cfg.disk_reject_ratio)
        self.disk_full = full
        return self.disk_usage

    def clean_once(self) -> int:
        """One pass; returns the number of commit-log segments deleted."""
        cfg = self.store.config
        cl = self.store.commit_log
        usage = self.refresh_disk_state()
        now = self.now_fn()
        force = usage >= cfg.disk_clean_forcibly_ratio
        in_window = time.localtime(now).tm_hour in cfg.delete_when_hours
        early = usage >= cfg.disk_clean_early_ratio
        segments = cl.segments()
        # The segment holding the end is being written: it is always among the retained ones.
        candidates = segments[:max(0, len(segments) - cfg.min_retained_segments)]
        end_segment = cl.end - cl.end % cl.segment_size
        # Only segments dispatched to their end: the ConsumeQueue and IndexFile files are trimmed and each queue's
        # min offset moved right after a deletion, from the units dispatched by then. A follower applying a
        # backlog (or any node whose dispatch lags) had segments deleted before their units were written; the
        # units came after, pointing into nothing, and its queues kept min offset 0 (the leader said 126):
        # GET_MIN_OFFSET and the first pull disagreed between replicas until a later deletion.
        dispatched = self.store.dispatcher.dispatched
        expiry_s = cfg.file_reserved_hours * 3600.0
        deleted = 0
        for seg in candidates:
            if deleted >= cfg.delete_segments_per_pass or seg.start >= end_segment \
                    or seg.start + cl.segment_size > dispatched:
                break
            try:
                age_s = now - os.stat(seg.path).st_mtime
            except FileNotFoundError:
                age_s = float("inf")
            expired = age_s >= expiry_s
            if not (force or (expired and (in_window or early))):
                break  # segments are in age order: if this one stays, the newer ones stay too
            with self.store._files_lock:
                cl.delete_segment(seg.start)
            deleted += 1
            log.info("retention deleted segment start=%d age_h=%.1f disk_usage=%.3f forced=%s", seg.start,
                     age_s / 3600.0, usage, force and not expired)
            if force and not expired:
                usage = self.refresh_disk_state()
                if usage < cfg.disk_clean_forcibly_ratio:
                    break
        if deleted:
            self.delete_derived_files()
            self.refresh_disk_state()
        return deleted

    def delete_derived_files(self) -> None:
        """ConsumeQueue and IndexFile files that only point before the commit log's new start, and the queues of
        deleted topics left with nothing to serve."""
        cl_min = self.store.commit_log.min_phy_offset
        d = self.store.dispatcher
        with self.store._files_lock:
            cq_files = sum(cq.delete_files_before(cl_min) for cq in list(d.queues.values()))
            index_files = d.index.delete_files_before(cl_min)
            queues = d.drop_deleted_topic_queues(cl_min)
        if cq_files or index_files or queues:
            log.info("retention deleted derived files consume_queue_files=%d index_files=%d "
                     "deleted_topic_queues=%d min_phy_offset=%d", cq_files, index_files, queues, cl_min)
