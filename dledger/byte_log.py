"""``ByteLog``: the smallest real state machine, a CRC-framed append-only log file.

It is what ``raftmq bench dledger`` and the dledger tests replicate when they measure or check the Raft layer
without the message store, and the reference implementation of ``dledger.state_machine.StateMachine``::

    record = size (uint32 BE, bytes of data) | crc32c(data) (uint32 BE) | data
    batch payload = record | record | ...         (what prepare_batch builds, appended as one unit)
    file  = batch payload | batch payload | ...   (offsets are byte positions in the file)

``prepare_checksums`` cuts the file into fixed logical segments of ``segment_size_bytes`` (crc32c of each, up to the
asked offset), the same shape as the message store's per-segment checksums, so ``raftmq verify`` treats both
alike. On open, a torn tail (a record cut by a crash) is truncated away: only whole, CRC-valid records count.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import crc32c
import trio

from dledger.state_machine import (CHECKSUM_CHUNK_BYTES, ApplyStatus, BatchResult, ChecksumStopped, ChecksumWork,
                                   PreparedBatch)

__all__ = ["ByteLog", "RECORD_HEADER", "frame_record", "iter_records"]

RECORD_HEADER = struct.Struct(">II")


def frame_record(data: bytes) -> bytes:
    return RECORD_HEADER.pack(len(data), crc32c.crc32c(data)) + data


def iter_records(buf: bytes, *, base_offset: int = 0):
    """Yield ``(offset, data)`` for each whole record; raise ValueError at the first bad one."""
    pos = 0
    view = memoryview(buf)
    while pos < len(buf):
        if len(buf) - pos < RECORD_HEADER.size:
            raise ValueError(f"truncated record header at offset {base_offset + pos}")
        size, crc = RECORD_HEADER.unpack_from(buf, pos)
        end = pos + RECORD_HEADER.size + size
        if end > len(buf):
            raise ValueError(f"record at offset {base_offset + pos} claims {size} bytes, only "
                             f"{len(buf) - pos - RECORD_HEADER.size} follow")
        data = view[pos + RECORD_HEADER.size:end]
        if crc32c.crc32c(data) != crc:
            raise ValueError(f"record at offset {base_offset + pos} fails its crc32c check")
        yield base_offset + pos, bytes(data)
        pos = end


class ByteLog:
    def __init__(self, path: str | os.PathLike[str], *, segment_size_bytes: int = 64 << 20,
                 fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.segment_size_bytes = segment_size_bytes
        self._fsync = fsync
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self._end = self._recover()
        # What a power loss would keep: nothing recovered is known to be synced (a killed process's writes may
        # still be in the page cache), so the first wait_durable syncs.
        self._durable = 0

    def _recover(self) -> int:
        size = os.fstat(self._fd).st_size
        good = 0
        chunk = 8 << 20
        pending = b""
        offset = 0
        while offset < size:
            pending += os.pread(self._fd, chunk, offset)
            offset += chunk
            pos = 0
            while len(pending) - pos >= RECORD_HEADER.size:
                rsize, crc = RECORD_HEADER.unpack_from(pending, pos)
                end = pos + RECORD_HEADER.size + rsize
                if end > len(pending):
                    break
                if crc32c.crc32c(memoryview(pending)[pos + RECORD_HEADER.size:end]) != crc:
                    offset = size  # stop: everything from here is a torn or corrupt tail
                    break
                pos = end
            good += pos
            pending = pending[pos:]
        if good != size:
            os.ftruncate(self._fd, good)
        return good

    @property
    def end_offset(self) -> int:
        return self._end

    @property
    def min_offset(self) -> int:
        return 0  # a ByteLog keeps its whole log

    def start_state(self, offset: int) -> bytes:
        return b""  # the records are the whole state

    def start_at(self, offset: int, state: bytes | None) -> None:
        raise ValueError("a ByteLog always starts at offset 0 (it deletes nothing, so a peer never needs to "
                         f"start past it); asked to start at {offset}")

    def close(self) -> None:
        os.close(self._fd)

    def prepare_batch(self, records: Sequence[bytes], start_offset: int, store_timestamp: int, *,
                      fresh: bool) -> PreparedBatch:
        framed = [frame_record(r) for r in records]
        offsets = []
        pos = start_offset
        for f in framed:
            offsets.append(pos)
            pos += len(f)
        return PreparedBatch(b"".join(framed), pos, tuple(offsets))

    def apply_batch(self, payload: bytes, store_timestamp: int, expected_start_offset: int) -> BatchResult:
        with self._lock:
            end = self._end
            if expected_start_offset < end:
                return BatchResult(ApplyStatus.DUPLICATE, end)
            if expected_start_offset > end:
                return BatchResult(ApplyStatus.REJECTED, end)
            os.pwrite(self._fd, payload, end)
            if self._fsync:
                os.fdatasync(self._fd)
            self._end = end + len(payload)
            return BatchResult(ApplyStatus.APPLIED, self._end)

    def read_raw(self, offset: int, max_bytes: int) -> bytes:
        """Whole records from ``offset`` (at least one, even if it is bigger than ``max_bytes``); ``ValueError``
        when ``offset`` is past the end or not the start of a record."""
        end = self._end
        if offset > end:
            raise ValueError(f"phy_offset {offset} is outside the log [0, {end}]")
        if offset == end:
            return b""
        # The log keeps no index: an offset is a record's start when the header read there describes a record
        # that ends within the log and whose crc32c matches. Read from inside a record, data bytes taken for a
        # header answered FETCH_COMMIT_LOG with bytes that are no records, as much as the rest of the log.
        header = os.pread(self._fd, RECORD_HEADER.size, offset)
        size, crc = RECORD_HEADER.unpack(header) if len(header) == RECORD_HEADER.size else (end, 0)
        if offset + RECORD_HEADER.size + size > end or crc32c.crc32c(
                os.pread(self._fd, size, offset + RECORD_HEADER.size)) != crc:
            raise ValueError(f"phy_offset {offset} is not the start of a record in the log")
        buf = os.pread(self._fd, min(max(max_bytes, RECORD_HEADER.size), end - offset), offset)
        pos = 0
        while len(buf) - pos >= RECORD_HEADER.size:
            size, _crc = RECORD_HEADER.unpack_from(buf, pos)
            if pos + RECORD_HEADER.size + size > len(buf):
                if pos == 0:
                    return os.pread(self._fd, RECORD_HEADER.size + size, offset)
                break
            pos += RECORD_HEADER.size + size
        return buf[:pos]

    def write_raw(self, offset: int, data: bytes) -> None:
        with self._lock:
            if offset != self._end:
                raise ValueError(f"write_raw offset {offset} is not the log end {self._end}")
            for _ in iter_records(data, base_offset=offset):
                pass
            os.pwrite(self._fd, data, offset)
            if self._fsync:
                os.fdatasync(self._fd)
            self._end = offset + len(data)

    async def wait_durable(self, offset: int) -> None:
        if self._fsync or self._durable >= min(offset, self._end):
            return  # with fsync every write was synced before its end was published
        end = self._end
        await trio.to_thread.run_sync(os.fdatasync, self._fd)
        self._durable = max(self._durable, end)

    def read_records(self, offset: int = 0, max_bytes: int = 1 << 30) -> list[tuple[int, bytes]]:
        return list(iter_records(self.read_raw(offset, max_bytes), base_offset=offset))

    def prepare_checksums(self, up_to_offset: int) -> ChecksumWork:
        up_to = min(up_to_offset, self._end)
        path, segment_size = self.path, self.segment_size_bytes

        def work(stop: Callable[[], bool]) -> list[tuple[int, int, int]]:
            # A descriptor of its own: the log's may be closed (and its number reused) while this runs elsewhere.
            fd = os.open(path, os.O_RDONLY)
            try:
                out = []
                for start in range(0, up_to, segment_size):
                    length = min(segment_size, up_to - start)
                    crc = 0
                    for pos in range(start, start + length, CHECKSUM_CHUNK_BYTES):
                        if stop():
                            raise ChecksumStopped(f"checksums stopped at offset {pos}")
                        crc = crc32c.crc32c(os.pread(fd, min(CHECKSUM_CHUNK_BYTES, start + length - pos), pos), crc)
                    out.append((start, length, crc))
                return out
            finally:
                os.close(fd)

        return work
