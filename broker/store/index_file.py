"""``IndexFile`` and ``IndexService``: lookup of messages by key, unique key and time, RocketMQ's hash index.

File layout (big-endian), ``40 + slots * 4 + max_entries * 20`` bytes, created sparse::

    header  | begin_timestamp 8 | end_timestamp 8 | begin_phy_offset 8 | end_phy_offset 8 |
            | hash_slot_count 4 | index_count 4 |
    slots   | newest entry index 4 | * hash_slot_count          (0 = empty)
    entries | key_hash 4 | phy_offset 8 | time_diff_s 4 | prev_index 4 | * max_entries   (entry 0 unused)

``key_hash`` is ``crc32c("topic#key") & 0x7fffffff`` (RocketMQ hashes with Java's ``String.hashCode``; any
deterministic hash will do since a lookup re-checks the record). ``time_diff_s`` is seconds since
``begin_timestamp``.

``end_phy_offset``/``end_timestamp`` are the last record dispatched while the file was the current one, written
after its entries: every record at or before ``end_phy_offset`` is indexed, which makes re-dispatch after a crash
skip what is already there instead of chaining duplicates. A file may fill up in the middle of a record's keys:
the first ones stay in it, past its ``end_phy_offset``, and the record begins the next file. So retention deletes
a file only once its newest entry too is before the commit log's start, and a lookup by time skips a file only
when its newest entry too is older than the window.

A file is named by its ``begin_phy_offset``, where dispatch began it once the one before was full, and that
depends on how the records were dispatched: a batch's ``DispatchHint`` begins it at the batch's start (a record
without keys, or the blank before a record that did not fit its segment), parsing at the first record of a
dispatch round or at the record whose key did not fit. Names, boundaries, header times and bytes may therefore
differ between the members of a group and after a rebuild from the commit log. Every record is indexed once
under each of its keys, in commit-log order, either way, and a lookup re-checks each record (topic, key, store
timestamp), so lookups find the same records on every member and after a rebuild.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

from crc32c import crc32c

from .errors import StoreCorruptedError
from .mapped_file import MappedFile, file_name, parse_file_name

log = logging.getLogger(__name__)

__all__ = ["IndexFile", "IndexService", "INDEX_HEADER", "INDEX_ENTRY", "key_hash"]

INDEX_HEADER = struct.Struct(">qqqqii")
INDEX_SLOT = struct.Struct(">i")
INDEX_ENTRY = struct.Struct(">iqii")
# How far back in time an older index entry may lie from a newer one (a store clock set back, a new leader whose
# clock is behind the last one's) and a lookup still walk past it (IndexFile.lookup).
CLOCK_BACK_SLACK_MS = 60_000


_pack_entry = INDEX_ENTRY.pack_into
_pack_slot = INDEX_SLOT.pack_into
_unpack_slot = INDEX_SLOT.unpack_from


def key_hash(topic: str, key: str) -> int:
    return crc32c(f"{topic}#{key}".encode()) & 0x7FFFFFFF


class IndexFile:
    _header_size = INDEX_HEADER.size

    def __init__(self, mapped: MappedFile, slots: int, max_entries: int) -> None:
        self.file = mapped
        self.slots = slots
        self.max_entries = max_entries
        self.entries_at = INDEX_HEADER.size + slots * INDEX_SLOT.size
        (self.begin_timestamp, self.end_timestamp, self.begin_phy_offset, self.end_phy_offset, stored_slots,
         self.index_count) = INDEX_HEADER.unpack_from(mapped.mm, 0)
        if self.index_count == 0:  # a new file: entry 0 stays unused so a 0 slot means "empty"
            self.index_count = 1
            self.begin_timestamp = self.end_timestamp = 0
            self.begin_phy_offset = mapped.start
            # The file is created for the record at its start: everything before is in older files.
            self.end_phy_offset = mapped.start - 1
        elif stored_slots != slots:
            raise ValueError(f"index file {mapped.path} has {stored_slots} slots, config says {slots}")

    @staticmethod
    def file_bytes(slots: int, max_entries: int) -> int:
        return INDEX_HEADER.size + slots * INDEX_SLOT.size + max_entries * INDEX_ENTRY.size

    def _newest_entry(self) -> tuple[int, int, int, int] | None:
        if self.index_count <= 1:
            return None
        return INDEX_ENTRY.unpack_from(self.file.mm, self.entries_at + (self.index_count - 1) * INDEX_ENTRY.size)

    @property
    def last_phy_offset(self) -> int:
        """The highest phy offset the file names: its newest entry's (entries go in commit-log order) or its
        ``end_phy_offset``, whichever is higher (a file split in a record's keys holds some past its end)."""
        newest = self._newest_entry()
        return self.end_phy_offset if newest is None else max(newest[1], self.end_phy_offset)

    def may_hold_from(self, begin_ts: int) -> bool:
        """Whether the file may hold an entry of a record stored at or after ``begin_ts``: by its ``end_timestamp``,
        or by its newest entry's second. The first keys of a record split over two files stay here, past
        ``end_phy_offset``, and the record may be later than ``end_timestamp``: by the header alone, a lookup of
        those keys within a window after it skipped the file and missed the record."""
        if self.end_timestamp >= begin_ts:
            return True
        newest = self._newest_entry()
        if newest is None:
            return False
        diff = newest[2]
        return diff == 0x7FFFFFFF or self.begin_timestamp + diff * 1000 + 999 >= begin_ts

    @property
    def full(self) -> bool:
        return self.index_count >= self.max_entries

    def put(self, h: int, phy_offset: int, store_timestamp: int) -> bool:
        """Add an entry; False (nothing written) when the file is full."""
        return self.put_many(((h, phy_offset),), 0, store_timestamp) == 1

    def put_many(self, entries: Sequence[tuple[int, int]], start: int, store_timestamp: int) -> int:
        """``put`` of each ``(hash, phy_offset)`` of ``entries[start:]``, all with one store timestamp (a
        dispatched batch), until the file is full; returns the position of the first entry not put."""
        count = self.index_count
        stop = min(len(entries), start + self.max_entries - count)
        if stop <= start:
            return start
        if count == 1:
            self.begin_timestamp = store_timestamp
        diff = (store_timestamp - self.begin_timestamp) // 1000
        diff = 0 if diff < 0 else (diff if diff < 0x7FFFFFFF else 0x7FFFFFFF)
        mm = self.file.mm
        header, slots, at = self._header_size, self.slots, self.entries_at + count * 20
        self.file.reserve(at + (stop - start) * 20)  # the header and every slot lie before the entries
        pack_entry, pack_slot, unpack_slot = _pack_entry, _pack_slot, _unpack_slot
        for i in range(start, stop):
            h, phy = entries[i]
            slot_at = header + (h % slots) * 4
            pack_entry(mm, at, h, phy, diff, unpack_slot(mm, slot_at)[0])
            pack_slot(mm, slot_at, count)
            count += 1
            at += 20
        self.index_count = count
        return stop

    def write_header(self) -> None:
        INDEX_HEADER.pack_into(self.file.mm, 0, self.begin_timestamp, self.end_timestamp, self.begin_phy_offset,
                               self.end_phy_offset, self.slots, self.index_count)

    def lookup(self, h: int, begin_ts: int, end_ts: int) -> Iterator[int]:
        """The offsets of entries with hash ``h`` that may have been stored within ``[begin_ts, end_ts]``, newest
        (highest offset) first. An entry knows its time only to the second: ``time_diff_s`` is rounded down, so the
        record was stored within the 999 ms after the entry's time (before the file's begin at ``time_diff_s`` 0,
        which also holds a clock that went back; at the cap, any time later). The caller reads the record and
        checks its exact time.

        The walk stops at the first entry older than ``begin_ts`` by more than ``CLOCK_BACK_SLACK_MS``: entries go
        newest to oldest, and their times go back only where a store clock did (a new leader's behind the last
        one's), by less than that between NTP-synced brokers. RocketMQ's stops at the first entry before the window;
        without a stop, a key many records carry (an order id) walked its whole chain, on the event loop, for an
        old window (400,000 entries: 0.13 s)."""
        mm = self.file.mm
        pos = INDEX_SLOT.unpack_from(mm, INDEX_HEADER.size + (h % self.slots) * 4)[0]
        seen = 0
        while 0 < pos < self.index_count and seen < self.max_entries:
            eh, phy, diff, prev = INDEX_ENTRY.unpack_from(mm, self.entries_at + pos * INDEX_ENTRY.size)
            ts = self.begin_timestamp + diff * 1000
            if eh == h and (diff == 0 or ts <= end_ts) and (diff == 0x7FFFFFFF or ts + 999 >= begin_ts):
                yield phy
            elif diff != 0x7FFFFFFF and ts + 999 + CLOCK_BACK_SLACK_MS < begin_ts:
                break
            if prev >= pos:
                break
            pos = prev
            seen += 1

    def undo_unpublished(self) -> int:
        """Remove entries written after the last header write (a crash mid-dispatch): they are beyond
        ``index_count`` but their slots already point at them."""
        mm = self.file.mm
        n = self.index_count
        zero = bytes(INDEX_ENTRY.size)
        while n < self.max_entries:
            at = self.entries_at + n * INDEX_ENTRY.size
            if mm[at:at + INDEX_ENTRY.size] == zero:
                break
            n += 1
        for i in range(n - 1, self.index_count - 1, -1):
            at = self.entries_at + i * INDEX_ENTRY.size
            h, _, _, prev = INDEX_ENTRY.unpack_from(mm, at)
            INDEX_SLOT.pack_into(mm, INDEX_HEADER.size + (h % self.slots) * 4, prev)
            mm[at:at + INDEX_ENTRY.size] = zero
        return n - self.index_count

    def truncate_past(self, commit_log_end: int) -> int:
        """Remove the newest entries pointing at or past ``commit_log_end``; removing in reverse insertion order
        restores each slot to the entry it held before."""
        mm = self.file.mm
        removed = 0
        while self.index_count > 1:
            at = self.entries_at + (self.index_count - 1) * INDEX_ENTRY.size
            h, phy, _, prev = INDEX_ENTRY.unpack_from(mm, at)
            if phy < commit_log_end:
                break
            INDEX_SLOT.pack_into(mm, INDEX_HEADER.size + (h % self.slots) * 4, prev)
            mm[at:at + INDEX_ENTRY.size] = bytes(INDEX_ENTRY.size)
            self.index_count -= 1
            removed += 1
        if self.end_phy_offset >= commit_log_end:
            # The newest entry left is a record start below the end; records between it and the end have no
            # entries, so re-dispatching them from there adds none twice.
            last = self.entries_at + (self.index_count - 1) * INDEX_ENTRY.size
            self.end_phy_offset = (INDEX_ENTRY.unpack_from(mm, last)[1] if self.index_count > 1
                                   else self.begin_phy_offset - 1)
        self.write_header()
        return removed


class IndexService:
    def __init__(self, root: Path, slots: int, max_entries: int) -> None:
        self.dir = root
        self.slots = slots
        self.max_entries = max_entries
        self.file_size = IndexFile.file_bytes(slots, max_entries)
        self.files: list[IndexFile] = []
        self._dirty: set[IndexFile] = set()

    def load(self, commit_log_end: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        starts = sorted(s for s in (parse_file_name(n) for n in os.listdir(self.dir)) if s is not None)
        for start in starts:
            # A file written with other store.index_hash_slots / index_max_entries was extended and read with the
            # wrong slot table, silently (or refused as an OSError when bigger). 0 bytes: being created at a crash.
            size = os.path.getsize(self.dir / file_name(start))
            if size not in (0, self.file_size):
                raise StoreCorruptedError(
                    f"index file {self.dir / file_name(start)} ({size} bytes) does not fit store.index_hash_slots "
                    f"{self.slots} and index_max_entries {self.max_entries} ({self.file_size}-byte files); was one "
                    f"changed? Set them back, or remove {self.dir} to rebuild the index from the commit log")
        for start in starts:
            mf = MappedFile.open(self.dir / file_name(start), start, self.file_size)
            self.files.append(IndexFile(mf, self.slots, self.max_entries))
        while self.files and self.files[-1].begin_phy_offset >= commit_log_end:
            dead = self.files.pop()
            log.warning("index file past the commit-log end deleted begin_phy_offset=%d", dead.begin_phy_offset)
            dead.file.destroy()
        if self.files:
            undone = self.files[-1].undo_unpublished()
            removed = self.files[-1].truncate_past(commit_log_end) + undone
            if removed:
                log.warning("index entries past the commit-log end removed count=%d", removed)
            self._undo_split_record()

    def _undo_split_record(self) -> None:
        """A file is begun when the one before is full, which may happen between the keys of one record: its
        first keys stay in the full file (past that file's ``end_phy_offset``), the others begin the new one.
        When the new file is gone (lost, or never published: a crash before its first header write leaves it
        reading as fresh), re-dispatch from the full file's end would put all the record's keys in a new file,
        and a lookup would find the record twice. So the full file gives those first keys back: re-dispatch
        then fills it and begins the next file exactly as before."""
        last = self.files[-1]
        if len(self.files) > 1 and last.index_count == 1 and last.end_phy_offset < last.begin_phy_offset:
            self.files.pop()
            last.file.destroy()
            last = self.files[-1]
        removed = last.truncate_past(last.end_phy_offset + 1)
        if removed:
            log.warning("index entries of a record split over two files removed count=%d end_phy_offset=%d", removed,
                        last.end_phy_offset)

    @property
    def indexed_up_to(self) -> int:
        """Every record at or before this phy offset is indexed (-1: nothing)."""
        return self.files[-1].end_phy_offset if self.files else -1

    @property
    def restart_offset(self) -> int | None:
        """A record start from which re-dispatch is safe without a checkpoint (None: no index yet)."""
        if not self.files:
            return None
        f = self.files[-1]
        return f.end_phy_offset if f.end_phy_offset >= f.begin_phy_offset else f.begin_phy_offset

    def current(self, phy_offset: int) -> IndexFile:
        if not self.files or self.files[-1].full:
            if self.files:
                self.files[-1].write_header()
            mf = MappedFile.create(self.dir / file_name(phy_offset), phy_offset, self.file_size)
            f = IndexFile(mf, self.slots, self.max_entries)
            self.files.append(f)
            log.info("index file created begin_phy_offset=%d", phy_offset)
        f = self.files[-1]
        self._dirty.add(f)
        return f

    def write_headers(self) -> None:
        if self.files:
            self.files[-1].write_header()

    def query(self, topic: str, key: str, begin_ts: int, end_ts: int) -> Iterator[int]:
        """The offsets of records of ``topic`` that may hold ``key`` and may have been stored within
        ``[begin_ts, end_ts]`` (``IndexFile.lookup``), newest first, as the caller asks for more: how many it
        reads depends on how many the records' own check lets through. Take them before the next dispatch."""
        h = key_hash(topic, key)
        for f in reversed(list(self.files)):
            if f.index_count > 1 and f.begin_timestamp <= end_ts and (f is self.files[-1] or f.may_hold_from(begin_ts)):
                yield from f.lookup(h, begin_ts, end_ts)

    def flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for f in dirty:
            if f.file.fd >= 0:
                f.file.sync()

    def release_cold_pages(self) -> None:
        """Older files entirely; the current one below its write position only, keeping its hash slots
        resident (they are hit at random on every put)."""
        files = list(self.files)
        for f in files:
            if f.file.fd < 0:
                continue
            if f is files[-1]:
                f.file.release_range(f.entries_at, f.entries_at + (f.index_count - 1) * INDEX_ENTRY.size)
            else:
                f.file.release(f.file.size)

    def delete_files_before(self, commit_log_min: int) -> int:
        """Delete the oldest files none of whose entries point at or past ``commit_log_min`` (never the current
        one); returns how many. ``end_phy_offset`` alone does not say: a file that filled up in the middle of a
        record's keys holds that record's first keys past its end (``_undo_split_record``), and deleted with the
        segment before the record, it took them away while the record stayed (found by its later KEYS only)."""
        deleted = 0
        while len(self.files) > 1 and self.files[0].last_phy_offset < commit_log_min:
            dead = self.files.pop(0)
            self._dirty.discard(dead)
            dead.file.destroy()
            deleted += 1
        return deleted

    def drop(self) -> None:
        """Delete every IndexFile, for recovery to rebuild the index from the commit log."""
        self.close()
        self._dirty.clear()
        shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)

    def close(self) -> None:
        for f in self.files:
            f.file.close()
        self.files.clear()
