"""``CommitLog``: every message of the node, appended sequentially to fixed-size segments.

Rules this module keeps:

* Segments are named by their start offset and all have ``segment_size_bytes``; segment *k* starts at
  ``min_start + k * segment_size_bytes``, so finding the segment of an offset is one division.
* A record never straddles two segments. If the next record and an 8-byte blank header do not fit in what is
  left of a segment, the rest is closed with a blank (``total_size = rest``, ``BLANK_MAGIC``) and the record
  goes to the next segment, exactly as RocketMQ does. Every byte of a segment up to the end is therefore either
  a record or a blank, and replicas fed the same batches are byte-identical.
* One writer at a time (the Raft apply thread or the trio thread). Bytes are written first; only then is the
  new end published, under a lock that guards nothing but that swap. Readers never look past the published
  end, so they never see a half-written record and never take the lock on the read path.
* A batch is atomic on disk: the magic of its first header (record or blank) is written last, so recovery
  after a crash in the middle of an append stops at the batch start and the whole batch is cut. Raft replays
  the batch and it is applied again, never half.
* Recovery trusts what a checkpoint says was made durable and verifies (size, magic, offset, CRC) every record
  after it; the first record that fails ends the log, and the torn tail behind it is zeroed so a later crash
  can never resurrect stale bytes.
* A message body may hold any bytes, a whole record head among them, so bytes that read as a record at an offset
  do not make one. ``record_at`` serves offsets the store derived itself (ConsumeQueue units, index entries,
  dispatch); an offset from outside (a message id, a request) is read with ``record_written_at``, which also
  checks that the log wrote a record starting there.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from crc32c import crc32c

from remoting.message import (BATCH_HEAD, BLANK_MAGIC, BODY_LEN, ENTRY_HEAD, MAX_PROPERTIES_SIZE, MAX_TOPIC_LENGTH,
                              MESSAGE_MAGIC, PROPS_LEN, RECORD_HEAD, record_size)

from .config import END_FILE_MIN_BLANK_LENGTH, StoreConfig
from .consume_queue import CQ_UNIT, ConsumeQueue
from .dispatch_info import DispatchHint, index_hashes, scan_properties, tags_code_of
from .errors import StoreCorruptedError
from .mapped_file import MappedFile, file_name, parse_file_name, pwrite_all

log = logging.getLogger(__name__)

__all__ = ["CommitLog", "BuiltBatch", "SIZE_MAGIC", "MIN_RECORD_SIZE"]

SIZE_MAGIC = struct.Struct(">iI")
PHY_OFFSET_AT = 28  # byte position of phy_offset inside a record (see RECORD_HEAD)
_MAGIC = struct.Struct(">I")
_PHY_OFFSET = struct.Struct(">q")
_NO_MAGIC = bytes(4)
_TAIL_DELTA = RECORD_HEAD.size - ENTRY_HEAD.size  # a record is this much longer than its batch entry
MIN_RECORD_SIZE = record_size(0, 1, 0)


class BuiltBatch(NamedTuple):
    """Commit-log bytes made by ``CommitLog.build`` and not yet written. ``pieces`` are ``(phy_offset,
    data_offset, length)`` runs of ``data``; a run ends where a segment is closed by a blank header."""

    pieces: tuple[tuple[int, int, int], ...]
    data: bytes
    end: int
    phy_offsets: list[int]
    queue_offsets: list[int]
    sizes: list[int]
    queue_ids: list[int]
    touched: dict[tuple[bytes, int], int]  # next queue offset of every queue this batch writes to
    hint: DispatchHint  # its ConsumeQueue units and index entries, for the dispatcher


class CommitLog:
    def __init__(self, config: StoreConfig) -> None:
        self.dir: Path = config.store_dir / "commitlog"
        self.segment_size = config.segment_size_bytes
        self.max_record_size = record_size(config.max_message_size, MAX_TOPIC_LENGTH, MAX_PROPERTIES_SIZE)
        self._segments: dict[int, MappedFile] = {}
        self._state_lock = threading.Lock()
        self.end = 0  # published: readers may read [min_phy_offset, end)
        self.hot_window = config.hot_window_bytes
        self._cache_dropped_upto = 0
        self.release_every_bytes = max(config.hot_window_bytes, 16 * 1024 * 1024)
        self._touched_segments: set[int] = set()
        self._touched_bytes = 0
        self.min_phy_offset = 0

    # -- segments --------------------------------------------------------------------------------------------
    def segments(self) -> list[MappedFile]:
        return sorted(self._segments.values(), key=lambda s: s.start)

    def segment_at(self, phy_offset: int) -> MappedFile | None:
        return self._segments.get(phy_offset - phy_offset % self.segment_size)

    def _create_segment(self, start: int) -> MappedFile:
        seg = MappedFile.create(self.dir / file_name(start), start, self.segment_size)
        self._segments[start] = seg
        self._touched_segments.add(start)
        log.info("commit log segment created start=%d", start)
        return seg

    # -- recovery --------------------------------------------------------------------------------------------
    def recover(self, trusted_offset: int | None) -> int:
        """Open the segments, find the end of valid data and cut whatever follows; returns the end."""
        self.dir.mkdir(parents=True, exist_ok=True)
        starts = []
        for entry in os.listdir(self.dir):
            start = parse_file_name(entry)
            if start is not None:
                starts.append(start)
        starts.sort()
        for i, start in enumerate(starts):
            if start % self.segment_size:
                raise StoreCorruptedError(f"commit log segment {file_name(start)} does not start at a multiple of "
                                          f"segment_size_bytes {self.segment_size}; was the size changed?")
            if i and start != starts[i - 1] + self.segment_size:
                raise StoreCorruptedError(f"commit log segments are not contiguous: {file_name(starts[i - 1])} "
                                          f"is followed by {file_name(start)}")
        # Segments are created at their full size: a shorter one lost its end (a file truncated by a tool or a
        # repair; the last one may also be a file being created when the process died). Opening extends it with
        # zeros, which must not be taken for the records the checkpoint vouched for.
        held = {start: os.path.getsize(self.dir / file_name(start)) for start in starts}
        for start in starts[:-1]:
            if held[start] < self.segment_size:
                raise StoreCorruptedError(f"commit log segment {file_name(start)} is {held[start]} bytes, shorter "
                                          f"than segment_size_bytes {self.segment_size}: it lost its end, and the "
                                          f"segments after it continue the log from there")
        for start in starts:
            self._segments[start] = MappedFile.open(self.dir / file_name(start), start, self.segment_size)
            self._touched_segments.add(start)
        if not starts:
            self.end = self.min_phy_offset = trusted_offset - trusted_offset % self.segment_size \
                if trusted_offset else 0
            return self.end
        self.min_phy_offset = starts[0]
        last_end = starts[-1] + self.segment_size
        if trusted_offset is not None and trusted_offset > starts[-1] + held[starts[-1]]:
            log.warning("commit log segment shorter than the checkpoint says it was written, verifying it from "
                        "its start start=%d bytes=%d commit_log_flushed=%d", starts[-1], held[starts[-1]],
                        trusted_offset)
            trusted_offset = starts[-1]
        if trusted_offset is not None and starts[0] <= trusted_offset <= last_end:
            scan_from = trusted_offset
        else:
            # Only the last segment is being written; the one before may end with the blank of a batch that
            # rolled over, whose magic is written last, so both are verified.
            scan_from = starts[max(0, len(starts) - 2)]
            log.warning("commit log recovery without a usable checkpoint scan_from=%d", scan_from)
        end = self._scan(scan_from)
        self._truncate_after(end)
        self.end = end
        log.info("commit log recovered min_phy_offset=%d end=%d verified_bytes=%d", self.min_phy_offset, end,
                 end - scan_from)
        return end

    def _scan(self, pos: int) -> int:
        size_limit = self.max_record_size
        seg_size = self.segment_size
        unpack8 = SIZE_MAGIC.unpack_from
        unpack_head = RECORD_HEAD.unpack_from
        unpack_i = BODY_LEN.unpack_from
        unpack_h = PROPS_LEN.unpack_from
        while True:
            seg = self._segments.get(pos - pos % seg_size)
            if seg is None:
                return pos
            off = pos - seg.start
            if off + END_FILE_MIN_BLANK_LENGTH > seg_size:
                return pos
            size, magic = unpack8(seg.mm, off)
            if magic == BLANK_MAGIC and size == seg_size - off:
                pos += size
                continue
            if magic != MESSAGE_MAGIC or size < MIN_RECORD_SIZE or size > size_limit \
                    or off + size + END_FILE_MIN_BLANK_LENGTH > seg_size:
                return pos
            head = unpack_head(seg.mm, off)
            if head[6] != pos:
                return pos
            body_len = unpack_i(seg.mm, off + RECORD_HEAD.size)[0]
            if body_len < 0 or record_size(body_len, 0, 0) > size:
                return pos
            body_at = off + RECORD_HEAD.size + 4
            if crc32c(seg.mv[body_at:body_at + body_len]) != head[2]:
                return pos
            # The CRC covers the body only. The last page written before a power loss may read as zeros while
            # the page before it holds the head and body of the record it ends: its topic and properties then no
            # longer add up to its size, or hold zeros where a stored record cannot: in its topic, and as the
            # last byte of its properties (RocketMQ's encoding ends each pair with \x02) with nothing after it.
            t = body_at + body_len
            record_end = off + size
            p = t + 1 + seg.mm[t]
            if p == t + 1 or p + 2 > record_end or p + 2 + unpack_h(seg.mm, p)[0] != record_end \
                    or 0 in seg.mm[t + 1:p]:
                return pos
            if p + 2 < record_end and not seg.mm[record_end - 1] and unpack8(seg.mm, record_end)[1] not in (
                    MESSAGE_MAGIC, BLANK_MAGIC):
                return pos
            pos += size

    def _truncate_after(self, end: int) -> None:
        seg_start = end - end % self.segment_size
        for start in sorted(self._segments):
            if start > seg_start:
                log.warning("commit log recovery deletes segment past the end start=%d end=%d", start, end)
                self._segments.pop(start).destroy()
        seg = self._segments.get(seg_start)
        if seg is not None:
            self._zero_torn_tail(seg, end - seg_start)

    def _zero_torn_tail(self, seg: MappedFile, off: int) -> None:
        # Records are contiguous, so a run of zeros longer than the largest record means nothing was ever
        # written past it: stop there instead of reading a whole sparse segment.
        chunk = 1 << 20
        zeros = bytes(chunk)
        run = 0
        pos = off
        cut = 0
        while pos < seg.size and run <= self.max_record_size:
            n = min(chunk, seg.size - pos)
            if seg.mv[pos:pos + n] == zeros[:n]:
                run += n
            else:
                seg.mm[pos:pos + n] = zeros[:n]
                cut += n
                run = 0
            pos += n
        if cut:
            log.warning("commit log torn tail zeroed offset=%d bytes<=%d", seg.start + off, cut)
        seg.release_all()

    # -- append ----------------------------------------------------------------------------------------------
    def build(self, batches: Sequence[tuple[bytes, int]], start: int, store_timestamp: int,
              queue_offsets: Mapping[tuple[bytes, int], int],
              planned: Mapping[tuple[bytes, int], int] | None = None) -> BuiltBatch:
        """The bytes ``write_built`` would put at ``start`` for validated ``(batch, count)`` pairs, in order,
        without touching the log. A queue's next offset is looked up in this build, then ``planned`` (batches
        built before this one and not yet written), then ``queue_offsets``. Building once and writing the same
        bytes on every replica is what keeps replicas byte-identical at a fraction of the per-message cost."""
        seg_size = self.segment_size
        limit = seg_size - END_FILE_MIN_BLANK_LENGTH
        payload = sum(len(b) - BATCH_HEAD.size + n * _TAIL_DELTA for b, n in batches)
        out = bytearray(payload + SIZE_MAGIC.size * (payload // seg_size + 2))
        unpack_entry = ENTRY_HEAD.unpack_from
        unpack_i = BODY_LEN.unpack_from
        pack_head = RECORD_HEAD.pack_into
        pack_blank = SIZE_MAGIC.pack_into
        head_size = ENTRY_HEAD.size
        rec_head = RECORD_HEAD.size
        planned = planned if planned is not None else {}
        touched: dict[tuple[bytes, int], int] = {}
        units: dict[tuple[bytes, int], tuple[int, bytearray]] = {}
        index: list[tuple[int, int]] = []
        pack_unit = CQ_UNIT.pack
        unpack_h = PROPS_LEN.unpack_from
        phys: list[int] = []
        qoffs: list[int] = []
        sizes: list[int] = []
        qids: list[int] = []
        pieces: list[tuple[int, int, int]] = []
        piece_phy = end = start
        piece_o = o = 0
        wpos = start % seg_size
        cur_key: tuple[bytes, int] | None = None
        cur_topic: bytes | None = None
        cur_qid = q = 0
        unit_buf = bytearray()
        index_prefix = b""
        for batch, count in batches:
            _, _, store_ip, store_port = BATCH_HEAD.unpack_from(batch, 0)
            mv = memoryview(batch)
            pos = BATCH_HEAD.size
            for _ in range(count):
                (entry_size, queue_id, flag, sys_flag, born_ts, born_ip, born_port, reconsume,
                 prepared) = unpack_entry(batch, pos)
                tail = pos + head_size
                body_end = tail + 4 + unpack_i(batch, tail)[0]
                tl = batch[body_end]
                topic = batch[body_end + 1:body_end + 1 + tl]
                if queue_id != cur_qid or topic != cur_topic:
                    # Consecutive messages almost always share a queue (a producer's batch does): the offset,
                    # units and index prefix of the current queue stay in locals until it changes.
                    if cur_key is not None:
                        touched[cur_key] = q
                    cur_key = key = (topic, queue_id)
                    cur_topic, cur_qid = topic, queue_id
                    q = touched.get(key)
                    if q is None:
                        q = planned.get(key)
                        if q is None:
                            q = queue_offsets.get(key, 0)
                        units[key] = (q, bytearray())
                    unit_buf = units[key][1]
                    index_prefix = topic + b"#"
                p = body_end + 1 + tl
                pl = unpack_h(batch, p)[0]
                code = 0
                tags = raw_keys = uniq = None
                if pl:
                    tags, raw_keys, uniq = scan_properties(batch[p + 2:p + 2 + pl])
                    if tags:
                        code = tags_code_of(tags)
                size = entry_size + _TAIL_DELTA
                if wpos + size > limit:
                    # Close the segment with a blank header (the rest of a segment is zeros already) and go on
                    # at the next segment: a new piece, since the log jumps there.
                    pack_blank(out, o, seg_size - wpos, BLANK_MAGIC)
                    o += SIZE_MAGIC.size
                    pieces.append((piece_phy, piece_o, o - piece_o))
                    end += seg_size - wpos
                    wpos = 0
                    piece_phy, piece_o = end, o
                if raw_keys:
                    index += [(h, end) for h in index_hashes(topic, uniq, raw_keys)]
                elif uniq:  # index_hashes' answer for a lone UNIQ_KEY, without the call and the list
                    index.append((crc32c(index_prefix + uniq) & 0x7FFFFFFF, end))
                pack_head(out, o, size, MESSAGE_MAGIC, crc32c(mv[tail + 4:body_end]), queue_id, flag, q, end,
                          sys_flag, born_ts, born_ip, born_port, store_timestamp, store_ip, store_port, reconsume,
                          prepared)
                unit_buf += pack_unit(end, size, code)
                out[o + rec_head:o + size] = mv[tail:pos + entry_size]
                phys.append(end)
                qoffs.append(q)
                sizes.append(size)
                qids.append(queue_id)
                q += 1
                o += size
                end += size
                wpos += size
                pos += entry_size
        if cur_key is not None:
            touched[cur_key] = q
        if o > piece_o:
            pieces.append((piece_phy, piece_o, o - piece_o))
        del out[o:]
        hint = DispatchHint(start, end, store_timestamp, phys[-1] if phys else start, len(phys),
                            [(k, first, bytes(u)) for k, (first, u) in units.items()], index)
        return BuiltBatch(tuple(pieces), bytes(out), end, phys, qoffs, sizes, qids, touched, hint)

    def write_built(self, pieces: Sequence[tuple[int, int, int]], data: bytes | memoryview,
                    queue_offsets: dict[tuple[bytes, int], int], touched: Mapping[tuple[bytes, int], int]) -> int:
        """Write what ``build`` made (here or on another replica) at the end; returns the new end. The magic of
        the first header is written last, so a crash part-way leaves no visible part of the batch; the queue
        offsets and the end are published together once every byte is in place."""
        if not pieces:
            return self.end
        seg_size = self.segment_size
        mv = memoryview(data)
        first: tuple[Any, int, bytes] | None = None
        if pieces[0][0] != self.end:
            raise ValueError(f"built batch starts at {pieces[0][0]}, the commit log ends at {self.end}")
        for phy, o, n in pieces:
            seg_start = phy - phy % seg_size
            off = phy - seg_start
            if off + n > seg_size or o + n > len(mv):
                raise ValueError(f"built piece at {phy} of {n} bytes does not fit its segment or the data")
            seg = self._segments.get(seg_start) or self._create_segment(seg_start)
            # pwrite, not a copy into the mapping: the same page cache (readers' mappings see the bytes at
            # once) at about twice the speed, as fresh pages need no fault each.
            if first is None:
                first = (seg.fd, off + 4, bytes(mv[o + 4:o + 8]))
                pwrite_all(seg.fd, bytes(mv[o:o + 4]) + _NO_MAGIC, off)
                pwrite_all(seg.fd, mv[o + 8:o + n], off + 8)
            else:
                pwrite_all(seg.fd, mv[o:o + n], off)
            self.note_touched(seg_start, n)
        assert first is not None
        first_fd, magic_at, magic = first
        pwrite_all(first_fd, magic, magic_at)  # the batch becomes visible to recovery only now, as a whole
        last_phy, _, last_n = pieces[-1]
        with self._state_lock:
            queue_offsets.update(touched)
            self.end = last_phy + last_n
        return self.end

    def append(self, batch: bytes, count: int, store_timestamp: int,
               queue_offsets: dict[tuple[bytes, int], int]) -> BuiltBatch:
        """Write a validated batch at the end; returns what was built (per-message columns, dispatch hint).
        ``queue_offsets`` (the next queue offset per ``(topic, queue_id)``) and the end are only
        updated once every byte is written."""
        built = self.build(((batch, count),), self.end, store_timestamp, queue_offsets)
        self.write_built(built.pieces, built.data, queue_offsets, built.touched)
        return built

    def append_raw(self, data: memoryview) -> int:
        """Copy already-validated raw records (and blanks) at the end; returns the new end. The caller updated
        nothing yet; it publishes its own derived state after this returns."""
        seg_size = self.segment_size
        pos = self.end
        src = 0
        n = len(data)
        while src < n:
            seg = self._segments.get(pos - pos % seg_size) or self._create_segment(pos - pos % seg_size)
            off = pos - seg.start
            take = min(n - src, seg_size - off)
            pwrite_all(seg.fd, data[src:src + take], off)
            pos += take
            src += take
        with self._state_lock:
            self.end = pos
        return pos

    # -- reads -----------------------------------------------------------------------------------------------
    def read(self, phy_offset: int, size: int) -> memoryview | None:
        """A zero-copy view of ``[phy_offset, phy_offset + size)`` if it is inside one segment and published."""
        if phy_offset < self.min_phy_offset or phy_offset + size > self.end:
            return None
        seg = self._segments.get(phy_offset - phy_offset % self.segment_size)
        if seg is None:
            return None
        off = phy_offset - seg.start
        if off + size > self.segment_size:
            return None
        return seg.mv[off:off + size]

    def record_at(self, phy_offset: int) -> memoryview | None:
        """The whole record starting at ``phy_offset`` (None for a blank, an unpublished or a removed offset, or
        an offset inside a record's head), for an offset the store derived itself: bytes inside a body that read as
        a record head pass, so an offset from outside goes through ``record_written_at``."""
        if phy_offset < self.min_phy_offset:
            return None
        seg = self._segments.get(phy_offset - phy_offset % self.segment_size)
        if seg is None:
            return None
        size = self._unit_size(seg, phy_offset, self.end, blank=False)
        if size is None:
            return None
        off = phy_offset - seg.start
        return seg.mv[off:off + size]

    def record_written_at(self, phy_offset: int, dispatched: int,
                          queues: Mapping[tuple[bytes, int], ConsumeQueue]) -> memoryview | None:
        """``record_at`` for an offset from outside (a message id, a request's commit-log offset): the record only if
        the log itself wrote one starting there, None otherwise. ``dispatched`` and ``queues`` are the dispatcher's.

        ``record_at`` alone takes any offset whose bytes read as a record head naming that offset, and a producer
        writes whatever it likes in a body: a head planted there passed for a record of any topic, spanning the
        records after it (a lookup by id served them under the planted topic, the ACL judged a request naming it
        on that topic, a send-back re-stored it as a message of that topic). Dispatch reaches every record the log
        wrote, record after record, and writes its ConsumeQueue unit at the queue and queue offset its own head
        names: below ``dispatched``, that unit must name this offset and size (one unit read, whatever the topic:
        system, retry, schedule and half topics are dispatched alike), and a planted head names a unit that is
        another record's, or none. At or past ``dispatched`` (appended a moment ago), the record must be reached by
        walking record heads from ``dispatched``, a record start: as many as dispatch is behind."""
        raw = self.record_at(phy_offset)
        if raw is None:
            return None
        if phy_offset < dispatched:
            head = RECORD_HEAD.unpack_from(raw, 0)
            t = RECORD_HEAD.size + 4 + BODY_LEN.unpack_from(raw, RECORD_HEAD.size)[0]
            if not RECORD_HEAD.size + 4 <= t < len(raw):
                return None
            cq = queues.get((bytes(raw[t + 1:t + 1 + raw[t]]), head[3]))
            unit = cq.unit(head[5]) if cq is not None else None
            return raw if unit is not None and unit[0] == phy_offset and unit[1] == len(raw) else None
        pos, end = dispatched, self.end
        while pos < phy_offset:
            seg = self._segments.get(pos - pos % self.segment_size)
            size = self._unit_size(seg, pos, end) if seg is not None else None
            if size is None:
                return None
            pos += size
        return raw if pos == phy_offset else None

    def _unit_size(self, seg: Any, pos: int, end: int, *, blank: bool = True) -> int | None:
        """The size of the record or (with ``blank``) blank that starts at ``pos`` (inside ``seg``, below
        ``end``), or None when ``pos`` is not where one starts: the one rule of "a record starts here" for the
        reads at an offset from outside (a peer's fetch, a message id). The bytes inside a record read as a size
        of 0, a negative one or one past the log end, so nothing may be taken from a header before it is known to
        be one."""
        off = pos - seg.start
        if off + 8 > self.segment_size or pos + 8 > end:
            return None
        size, magic = SIZE_MAGIC.unpack_from(seg.mm, off)
        if magic == BLANK_MAGIC:
            return size if blank and size == self.segment_size - off and pos + size <= end else None
        if magic != MESSAGE_MAGIC or size < MIN_RECORD_SIZE or off + size > self.segment_size or pos + size > end:
            return None
        return size if _PHY_OFFSET.unpack_from(seg.mm, off + PHY_OFFSET_AT)[0] == pos else None

    def read_raw(self, phy_offset: int, max_bytes: int) -> bytes:
        """Whole records (and blanks) from ``phy_offset``, at most ``max_bytes`` unless the first record alone is
        longer (it is returned whole so a copier always advances)."""
        out = bytearray()
        pos = phy_offset
        end = self.end
        while pos < end:
            seg = self._segments.get(pos - pos % self.segment_size)
            if seg is None:
                break
            size = self._unit_size(seg, pos, end)
            if size is None:
                if pos == phy_offset:
                    raise ValueError(f"phy_offset {phy_offset} is not the start of a record in the commit log")
                log.warning("commit log holds no record at phy_offset=%d; raw read stopped there", pos)
                break
            if out and len(out) + size > max_bytes:
                break
            off = pos - seg.start
            out += seg.mv[off:off + size]
            pos += size
        return bytes(out)

    # -- durability and retention ----------------------------------------------------------------------------
    def sync_range(self, begin: int, end: int) -> None:
        """fdatasync every segment touched by ``[begin, end)``."""
        if end <= begin:
            return
        start = begin - begin % self.segment_size
        while start < end:
            seg = self._segments.get(start)
            if seg is not None and seg.fd >= 0:
                seg.sync()
            start += self.segment_size

    def note_touched(self, seg_start: int, nbytes: int) -> None:
        """Account bytes mapped in by appends, reads and dispatch; past ``release_every_bytes`` the cold pages
        are dropped right away, so RSS stays bounded even when a slow fdatasync delays the flush service."""
        self._touched_segments.add(seg_start)
        self._touched_bytes += nbytes
        if self._touched_bytes >= self.release_every_bytes:
            self.release_cold_pages(self.end, self.hot_window)

    def release_cold_pages(self, upto: int, hot_window: int) -> None:
        """Drop resident pages of touched segments except the ``hot_window`` bytes below ``upto``."""
        self._touched_bytes = 0
        touched, self._touched_segments = self._touched_segments, set()
        for start in touched:
            seg = self._segments.get(start)
            if seg is None or seg.fd < 0:
                continue
            keep_from = min(max(upto - hot_window - start, 0), seg.size)
            try:
                seg.release(keep_from)
            except ValueError:  # retention closed it meanwhile (another thread)
                continue
            if keep_from < seg.size and start + seg.size > upto - hot_window:
                self._touched_segments.add(start)  # partly hot: look at it again next time

    def drop_cached(self, upto: int) -> None:
        """Drop page-cache pages of flushed bytes below ``upto`` not dropped before (``page_cache_window_bytes``:
        new writes then reuse the pages just freed; see docs/architecture.md, "Store")."""
        begin = max(self._cache_dropped_upto, self.min_phy_offset)
        while begin < upto:
            seg_start = begin - begin % self.segment_size
            seg_end = min(seg_start + self.segment_size, upto)
            seg = self._segments.get(seg_start)
            if seg is not None and seg.fd >= 0:
                try:
                    seg.drop_cached(begin - seg_start, seg_end - seg_start)
                except (OSError, ValueError):  # retention closed it meanwhile (another thread)
                    pass
            begin = seg_end
        self._cache_dropped_upto = max(self._cache_dropped_upto, upto)

    def delete_segment(self, start: int) -> None:
        seg = self._segments.get(start)
        if seg is None:
            return
        with self._state_lock:
            del self._segments[start]
            remaining = [s for s in self._segments if s > start]
            self.min_phy_offset = min(remaining) if remaining else max(self.end, start + self.segment_size)
        seg.destroy()
        log.info("commit log segment deleted start=%d min_phy_offset=%d", start, self.min_phy_offset)

    def close(self) -> None:
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
