"""``ConsumeQueue``: the per-(topic, queue) index of the commit log, fixed 20-byte units in fixed-size files.

Unit layout (big-endian)::

    | phy_offset 8 | size 4 | tags_code 8 |

Unit *n* of a queue is the message with queue offset *n*; it lives in file ``n // units_per_file`` at byte
``(n % units_per_file) * 20``; files are named by the byte offset of their first unit (20 digits), as in
RocketMQ. A unit is written at the position its record's queue offset names, so dispatching a record twice
writes the same bytes twice: re-dispatch after a crash is idempotent. ``size`` is never 0 in a real unit, so
an all-zero unit is a hole.

Units below ``min_offset`` are kept but never served: they point into commit-log segments retention deleted, or
below the queue's ``cut``, the commit-log offset at which its topic was deleted (``apply_cut``, called by the
dispatcher when it reaches the deletion record). Retention keeps a queue's newest file, so a queue whose records
are all gone still knows its max offset; a queue of a deleted topic left with nothing past its cut is deleted
whole (``destroy``) once its records are gone, the dispatcher keeping its max offset.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

from .errors import StoreCorruptedError
from .mapped_file import MappedFile, file_name, parse_file_name

log = logging.getLogger(__name__)

__all__ = ["ConsumeQueue", "CQ_UNIT", "CQ_UNIT_SIZE"]

CQ_UNIT = struct.Struct(">qiq")
CQ_UNIT_SIZE = CQ_UNIT.size
_SCAN_CHUNK = 64 * 1024 - (64 * 1024) % CQ_UNIT_SIZE


def _last_used_unit(mv: memoryview) -> int:
    """Index of the last non-zero unit of a file, or -1."""
    zeros = bytes(_SCAN_CHUNK)
    hi = len(mv)
    while hi > 0:
        lo = max(0, hi - _SCAN_CHUNK)
        if mv[lo:hi] != zeros[:hi - lo]:
            chunk = bytes(mv[lo:hi]).rstrip(b"\x00")
            return (lo + len(chunk) - 1) // CQ_UNIT_SIZE
        hi = lo
    return -1


def _first_used_unit(mv: memoryview) -> int:
    zeros = bytes(_SCAN_CHUNK)
    lo = 0
    while lo < len(mv):
        hi = min(len(mv), lo + _SCAN_CHUNK)
        if mv[lo:hi] != zeros[:hi - lo]:
            chunk = bytes(mv[lo:hi])
            return (lo + len(chunk) - len(chunk.lstrip(b"\x00"))) // CQ_UNIT_SIZE
        lo = hi
    return -1


class ConsumeQueue:
    def __init__(self, root: Path, topic: str, queue_id: int, units_per_file: int) -> None:
        self.topic = topic
        self.queue_id = queue_id
        self.dir = root / topic / str(queue_id)
        self.units_per_file = units_per_file
        self.file_size = units_per_file * CQ_UNIT_SIZE
        self._files: dict[int, MappedFile] = {}  # file index -> file
        self._dirty: set[int] = set()
        self.max_offset = 0  # next queue offset; units [min_offset, max_offset) are readable
        self.min_offset = 0
        # Commit-log offset of the latest deletion of this queue's topic: records before it are gone for readers.
        # Queue offsets are not reset: an offset a consumer committed before can never name another message.
        self.cut = 0

    # -- loading and recovery --------------------------------------------------------------------------------
    def load(self, commit_log_min: int, commit_log_end: int) -> None:
        for entry in os.listdir(self.dir):
            start = parse_file_name(entry)
            if start is None:
                continue
            # Files written with another store.consume_queue_units_per_file were skipped (start not a multiple) or
            # extended and read at the wrong units: queues silently lost their offsets. 0 bytes: a file being
            # created when the process died.
            size = os.path.getsize(self.dir / entry)
            if start % self.file_size or size not in (0, self.file_size):
                raise StoreCorruptedError(
                    f"consume queue file {self.dir / entry} ({size} bytes) does not fit "
                    f"store.consume_queue_units_per_file {self.units_per_file} ({self.file_size}-byte files); was it "
                    f"changed? Set it back, or remove {self.dir.parent.parent} to rebuild every queue from the "
                    f"commit log")
            idx = start // self.file_size
            self._files[idx] = MappedFile.open(self.dir / entry, start, self.file_size)
        self._find_max()
        self.truncate_past(commit_log_end)
        self.correct_min_offset(commit_log_min)

    def _find_max(self) -> None:
        self.max_offset = 0
        for idx in sorted(self._files, reverse=True):
            last = _last_used_unit(self._files[idx].mv)
            if last >= 0:
                self.max_offset = idx * self.units_per_file + last + 1
                return

    def truncate_past(self, commit_log_end: int) -> None:
        """Zero units that point at or past the commit-log end (their records were cut by recovery)."""
        removed = 0
        while self.max_offset > 0:
            unit = self.unit(self.max_offset - 1)
            if unit is None:
                break
            phy, size, _ = unit
            if size != 0 and phy + size <= commit_log_end:
                break
            idx, r = divmod(self.max_offset - 1, self.units_per_file)
            f = self._files[idx]
            f.mm[r * CQ_UNIT_SIZE:(r + 1) * CQ_UNIT_SIZE] = bytes(CQ_UNIT_SIZE)
            self._dirty.add(idx)
            self.max_offset -= 1
            removed += 1
            if r == 0 and idx != min(self._files):
                self._files.pop(idx).destroy()
                self._dirty.discard(idx)
        if removed:
            log.warning("consume queue truncated topic=%s queue_id=%d units=%d max_offset=%d", self.topic,
                        self.queue_id, removed, self.max_offset)

    def correct_min_offset(self, commit_log_min: int) -> None:
        """The first unit still pointing into the commit log (units before it point at deleted segments) and
        at or past the cut."""
        commit_log_min = max(commit_log_min, self.cut)
        for idx in sorted(self._files):
            f = self._files[idx]
            first = _first_used_unit(f.mv)
            if first < 0:
                continue
            for r in range(first, self.units_per_file):
                phy, size, _ = CQ_UNIT.unpack_from(f.mm, r * CQ_UNIT_SIZE)
                if size == 0:
                    break
                if phy >= commit_log_min:
                    self.min_offset = idx * self.units_per_file + r
                    return
        self.min_offset = self.max_offset

    def missing_file(self) -> int | None:
        """The index of a file missing between this queue's first and last (retention deletes from the front
        only, so any gap was lost), or None."""
        held = sorted(self._files)
        for before, idx in zip(held, held[1:]):
            if idx != before + 1:
                return before + 1
        return None

    def max_offset_at(self, phy_offset: int) -> int:
        """The max offset this queue had when dispatch stood at ``phy_offset``: one past its last unit pointing
        before it (0 if none). Units are in commit-log order, so a binary search finds it; a unit in a file
        retention deleted pointed before it. Recovery compares the sum over the queues with the checkpoint's."""
        lo = self._first_unit_from(phy_offset, min(self._files, default=0) * self.units_per_file)
        if lo:
            # Only holes before: a queue begun past offset 0 (a store that starts past 0) after that point.
            unit = self.unit(lo - 1)
            if unit is not None and unit[1] == 0:
                return 0
        return lo

    def _first_unit_from(self, phy_offset: int, lo: int) -> int:
        """The first queue offset from ``lo`` whose unit points at ``phy_offset`` or after (``max_offset`` if none).
        Units are in commit-log order, so a binary search finds it; a unit whose file is gone (or a hole) counts as
        pointing before: it cannot be served either way."""
        hi = self.max_offset
        while lo < hi:
            mid = (lo + hi) // 2
            unit = self.unit(mid)
            if unit is None or unit[1] == 0 or unit[0] < phy_offset:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def apply_cut(self, phy_offset: int) -> None:
        """Hide every unit pointing before ``phy_offset`` (its topic was deleted there). Units are in commit-log
        order within a queue, so the new min offset is found by binary search; until units past the cut
        arrive, the queue reads as empty at its max offset."""
        if phy_offset <= self.cut:
            return
        self.cut = phy_offset
        lo = self._first_unit_from(phy_offset, self.min_offset)
        if lo > self.min_offset:
            log.info("consume queue cut topic=%s queue_id=%d cut=%d min_offset=%d->%d max_offset=%d", self.topic,
                     self.queue_id, phy_offset, self.min_offset, lo, self.max_offset)
            self.min_offset = lo

    # -- writing ---------------------------------------------------------------------------------------------
    def _create(self, idx: int) -> MappedFile:
        self.dir.mkdir(parents=True, exist_ok=True)
        f = MappedFile.create(self.dir / file_name(idx * self.file_size), idx * self.file_size, self.file_size)
        self._files[idx] = f
        return f

    def put(self, queue_offset: int, phy_offset: int, size: int, tags_code: int) -> int:
        """Write one unit; returns how far the max offset grew."""
        idx, r = divmod(queue_offset, self.units_per_file)
        f = self._files.get(idx) or self._create(idx)
        at = r * CQ_UNIT_SIZE
        if at + CQ_UNIT_SIZE > f.reserved:
            f.reserve(at + CQ_UNIT_SIZE)
        CQ_UNIT.pack_into(f.mm, at, phy_offset, size, tags_code)
        self._dirty.add(idx)
        if queue_offset < self.max_offset:
            return 0
        grown = queue_offset + 1 - self.max_offset
        if self.max_offset == 0:  # the first unit: a queue rebuilt after retention starts past 0
            self.min_offset = queue_offset
        self.max_offset = queue_offset + 1
        return grown

    def put_units(self, first_offset: int, units: bytes | memoryview) -> int:
        """Write consecutive units from ``first_offset`` (one copy per file instead of one pack per unit); returns
        how far the max offset grew."""
        mv = memoryview(units)
        n = len(mv) // CQ_UNIT_SIZE
        done = 0
        while done < n:
            idx, r = divmod(first_offset + done, self.units_per_file)
            take = min(n - done, self.units_per_file - r)
            f = self._files.get(idx) or self._create(idx)
            f.reserve((r + take) * CQ_UNIT_SIZE)
            f.mm[r * CQ_UNIT_SIZE:(r + take) * CQ_UNIT_SIZE] = mv[done * CQ_UNIT_SIZE:(done + take) * CQ_UNIT_SIZE]
            self._dirty.add(idx)
            done += take
        end = first_offset + n
        if not n or end <= self.max_offset:
            return 0
        grown = end - self.max_offset
        if self.max_offset == 0:  # the first unit: a queue rebuilt after retention starts past 0
            self.min_offset = first_offset
        self.max_offset = end
        return grown

    # -- reading ---------------------------------------------------------------------------------------------
    def unit(self, queue_offset: int) -> tuple[int, int, int] | None:
        idx, r = divmod(queue_offset, self.units_per_file)
        f = self._files.get(idx)
        if f is None:
            return None
        return CQ_UNIT.unpack_from(f.mm, r * CQ_UNIT_SIZE)

    def units(self, queue_offset: int, max_units: int) -> memoryview | None:
        """Units from ``queue_offset`` up to ``max_units``, the max offset or the end of its file."""
        idx, r = divmod(queue_offset, self.units_per_file)
        f = self._files.get(idx)
        if f is None:
            return None
        n = min(max_units, self.max_offset - queue_offset, self.units_per_file - r)
        return f.mv[r * CQ_UNIT_SIZE:(r + n) * CQ_UNIT_SIZE]

    def iter_files(self) -> Iterator[MappedFile]:
        return iter([self._files[i] for i in sorted(self._files)])

    # -- durability and retention ----------------------------------------------------------------------------
    def flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for idx in dirty:
            f = self._files.get(idx)
            if f is not None and f.fd >= 0:
                f.sync()

    def release_cold_pages(self) -> None:
        last = max(self._files, default=None)
        for idx, f in list(self._files.items()):
            if idx != last:
                f.release(f.size)

    def delete_files_before(self, commit_log_min: int) -> int:
        """Delete files (never the last) whose every unit points before ``commit_log_min``; returns how many."""
        deleted = 0
        for idx in sorted(self._files)[:-1]:
            f = self._files[idx]
            last = _last_used_unit(f.mv)
            if last >= 0:
                phy, size, _ = CQ_UNIT.unpack_from(f.mm, last * CQ_UNIT_SIZE)
                if phy + size > commit_log_min:
                    break
            self._files.pop(idx).destroy()
            self._dirty.discard(idx)
            deleted += 1
        self.correct_min_offset(commit_log_min)
        return deleted

    def destroy(self) -> None:
        """Close and delete every file of the queue and its directory, and its topic's directory once no queue is
        left in it (a queue deleted with its topic)."""
        for f in self._files.values():
            f.destroy()
        self._files.clear()
        self._dirty.clear()
        try:
            shutil.rmtree(self.dir)
        except FileNotFoundError:
            pass
        try:
            self.dir.parent.rmdir()
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                raise

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
