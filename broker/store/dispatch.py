"""``Dispatcher``: the one path that derives ConsumeQueue units and IndexFile entries from the commit log.

It tails committed commit-log bytes (never past the published end) and, per record, writes the ConsumeQueue
unit at the record's own queue offset and, unless the index already covers the record, the index entries for
its UNIQ_KEY and each of its KEYS. Both writes are idempotent, so recovery may re-dispatch from any point at or
before the checkpoint; deleting every derived file and dispatching from the start of the commit log rebuilds
them byte-identical.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable
from pathlib import Path

from remoting.message import BLANK_MAGIC, BODY_LEN, PROPS_LEN, RECORD_HEAD

from .commit_log import SIZE_MAGIC, CommitLog
from .consume_queue import ConsumeQueue
from .dispatch_info import DispatchHint, index_hashes, scan_properties, tags_code_of
from .index_file import IndexService

log = logging.getLogger(__name__)

__all__ = ["Dispatcher", "DispatchListener"]

DispatchListener = Callable[[str, int, int], None]


class Dispatcher:
    def __init__(self, commit_log: CommitLog, cq_root: Path, units_per_file: int, index: IndexService) -> None:
        self.commit_log = commit_log
        self.cq_root = cq_root
        self.units_per_file = units_per_file
        self.index = index
        self.queues: dict[tuple[bytes, int], ConsumeQueue] = {}
        self.by_topic: dict[str, dict[int, ConsumeQueue]] = {}
        self.dispatched = 0  # every record before this offset is dispatched
        self._hints: collections.deque[DispatchHint] = collections.deque()

    def load_queues(self, commit_log_min: int, commit_log_end: int) -> None:
        self.cq_root.mkdir(parents=True, exist_ok=True)
        for topic in sorted(os.listdir(self.cq_root)):
            topic_dir = self.cq_root / topic
            if not topic_dir.is_dir():
                continue
            for qdir in sorted(os.listdir(topic_dir)):
                if qdir.isdigit():
                    cq = self._queue(topic.encode(), int(qdir))
                    cq.load(commit_log_min, commit_log_end)

    def has_queue_files(self) -> bool:
        return any(cq.max_offset for cq in self.queues.values())

    def _queue(self, topic: bytes, queue_id: int) -> ConsumeQueue:
        cq = self.queues.get((topic, queue_id))
        if cq is None:
            name = topic.decode("ascii")
            cq = ConsumeQueue(self.cq_root, name, queue_id, self.units_per_file)
            self.queues[(topic, queue_id)] = cq
            self.by_topic.setdefault(name, {})[queue_id] = cq
        return cq

    def queue(self, topic: str, queue_id: int) -> ConsumeQueue | None:
        return self.by_topic.get(topic, {}).get(queue_id)

    def queue_offsets(self) -> dict[tuple[bytes, int], int]:
        """The next queue offset of every queue, the state appends continue from."""
        return {key: cq.max_offset for key, cq in self.queues.items() if cq.max_offset}

    def add_hint(self, hint: DispatchHint) -> None:
        """What an append built for ``[hint.start, hint.end)`` (any thread; called in log order)."""
        self._hints.append(hint)

    def dispatch(self, upto: int, max_bytes: int, touched: dict[tuple[bytes, int], ConsumeQueue]) -> int:
        """Dispatch records in ``[dispatched, min(upto, dispatched + max_bytes))`` (whole records; a hinted
        batch whole even past ``max_bytes``); returns how many. Touched queues are collected into ``touched``
        for listeners."""
        pos = self.dispatched
        stop = min(upto, pos + max_bytes)
        hints = self._hints
        count = 0
        while pos < stop:
            while hints and hints[0].start < pos:  # already dispatched (re-dispatch, raw copy, replay)
                hints.popleft()
            if hints and hints[0].start == pos and hints[0].end <= upto:
                count += self._dispatch_hint(hints.popleft(), touched)
                pos = self.dispatched
                continue
            count += self._dispatch_records(min(stop, hints[0].start) if hints else stop, touched)
            if self.dispatched == pos:
                break  # nothing published past here yet
            pos = self.dispatched
        self.index.write_headers()
        return count

    def _dispatch_hint(self, hint: DispatchHint, touched: dict[tuple[bytes, int], ConsumeQueue]) -> int:
        queues = self.queues
        for key, first, units in hint.queues:
            cq = queues.get(key) or self._queue(*key)
            cq.put_units(first, units)
            touched[key] = cq
        index = self.index
        if hint.last_phy > index.indexed_up_to:
            indexed_up_to = index.indexed_up_to
            ts = hint.store_timestamp
            index_file = index.current(hint.start)
            entries = hint.index
            n = len(entries)
            i = 0
            while i < n and entries[i][1] <= indexed_up_to:  # put in order: the indexed ones come first
                i += 1
            while i < n:
                i = index_file.put_many(entries, i, ts)
                if i == n:
                    break
                # The file is full. It ends at the record before this one, as if dispatched record by record.
                h, phy = entries[i]
                before = self._record_before(hint.start, phy)
                if before is not None:
                    index_file.end_phy_offset = before
                    index_file.end_timestamp = ts
                index_file = index.current(phy)
                index_file.put(h, phy, ts)
                i += 1
            index_file.end_phy_offset = hint.last_phy
            index_file.end_timestamp = ts
        self.dispatched = hint.end
        return hint.count

    def _record_before(self, start: int, phy: int) -> int | None:
        """The offset of the record before ``phy`` in ``[start, phy)`` (None if there is none); rare: only when
        an index file fills up."""
        cl = self.commit_log
        pos, before = start, None
        while pos < phy:
            seg = cl.segment_at(pos)
            if seg is None:
                return before
            size, magic = SIZE_MAGIC.unpack_from(seg.mm, pos - seg.start)
            if magic != BLANK_MAGIC:
                before = pos
            pos += size
        return before

    def _dispatch_records(self, stop: int, touched: dict[tuple[bytes, int], ConsumeQueue]) -> int:
        """Dispatch by parsing each record in ``[dispatched, stop)``."""
        cl = self.commit_log
        pos = self.dispatched
        index = self.index
        indexed_up_to = index.indexed_up_to
        index_file = None
        queues = self.queues
        unpack8 = SIZE_MAGIC.unpack_from
        unpack_head = RECORD_HEAD.unpack_from
        unpack_i = BODY_LEN.unpack_from
        unpack_h = PROPS_LEN.unpack_from
        head_size = RECORD_HEAD.size
        seg_size = cl.segment_size
        count = 0
        seg = None
        while pos < stop:
            if seg is None or not seg.start <= pos < seg.start + seg_size:
                seg = cl.segment_at(pos)
                if seg is not None:
                    cl._touched_segments.add(seg.start)
                if seg is None:  # removed by retention under us: skip to the oldest segment left
                    pos = max(pos + 1, cl.min_phy_offset)
                    continue
                mm = seg.mm
            off = pos - seg.start
            size, magic = unpack8(mm, off)
            if magic == BLANK_MAGIC:
                pos += size
                continue
            head = unpack_head(mm, off)
            queue_id = head[3]
            queue_offset = head[5]
            store_ts = head[11]
            t = off + head_size + 4 + unpack_i(mm, off + head_size)[0]
            tl = mm[t]
            topic = mm[t + 1:t + 1 + tl]
            p = t + 1 + tl
            pl = unpack_h(mm, p)[0]
            props = mm[p + 2:p + 2 + pl] if pl else b""
            key = (topic, queue_id)
            cq = queues.get(key) or self._queue(topic, queue_id)
            code = 0
            tags = raw_keys = uniq = None
            if props:
                tags, raw_keys, uniq = scan_properties(bytes(props))
                if tags:
                    code = tags_code_of(tags)
            cq.put(queue_offset, pos, size, code)
            touched[key] = cq
            if pos > indexed_up_to:
                if index_file is None:
                    index_file = index.current(pos)
                if uniq or raw_keys:
                    for h in index_hashes(bytes(topic), uniq, raw_keys):
                        if not index_file.put(h, pos, store_ts):
                            index_file = index.current(pos)
                            index_file.put(h, pos, store_ts)
                index_file.end_phy_offset = pos
                index_file.end_timestamp = store_ts
            pos += size
            count += 1
        if count:
            cl.note_touched(seg.start, pos - self.dispatched)
        self.dispatched = pos
        return count

    def flush(self) -> None:
        for cq in list(self.queues.values()):
            cq.flush()
        self.index.flush()

    def release_cold_pages(self) -> None:
        for cq in list(self.queues.values()):
            cq.release_cold_pages()
        self.index.release_cold_pages()

    def close(self) -> None:
        for cq in self.queues.values():
            cq.close()
        self.queues.clear()
        self.by_topic.clear()
        self.index.close()
