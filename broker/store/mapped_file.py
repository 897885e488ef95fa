"""``MappedFile``: one fixed-size file mapped shared into memory, the building block of every store file.

Files are created sparse (``ftruncate``): unwritten bytes read as zeros, which is what recovery relies on to
find where data ends. Writes go through the mapping; durability comes from ``fdatasync`` on the descriptor
(Linux writes back dirty shared-mapping pages on it, and it releases the GIL, unlike ``mmap.flush``).

A write through the mapping into a hole of a sparse file makes the kernel allocate the block at the page
fault; on a full disk that fault is a SIGBUS, which kills the process with no error to handle or log. So a
writer through the mapping first ``reserve``s the range (``posix_fallocate``, ``RESERVE_CHUNK_BYTES`` ahead at a
time): a full disk then raises ``OSError(ENOSPC)`` where the store can stop cleanly. Files are still created
sparse, so an unused file costs no disk. The commit log needs no reservation: it writes with ``pwrite``, which
returns the error itself.

Pages of a shared mapping count in the process RSS once touched. ``release`` drops them from our page tables
(``MADV_DONTNEED``): dirty pages stay in the page cache and are written back as usual, and a later access
faults them in again, so views handed out earlier stay valid.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["MappedFile", "PAGE_SIZE", "RESERVE_CHUNK_BYTES", "file_name", "parse_file_name", "pwrite_all"]

PAGE_SIZE = mmap.PAGESIZE
# Blocks allocated ahead of a writer through the mapping: one posix_fallocate per MiB written.
RESERVE_CHUNK_BYTES = 1 << 20


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """``os.pwrite`` every byte. A write the disk can take only part of returns a short count (the next one
    raises ENOSPC); ignoring it would leave a hole of zeros inside a record that later writes make visible."""
    n = os.pwrite(fd, data, offset)
    if n == len(data):
        return
    view = memoryview(data)
    while n < len(view):
        if n == 0:
            raise OSError(errno.ENOSPC, f"short write: 0 of {len(view)} bytes at offset {offset}")
        view, offset = view[n:], offset + n
        n = os.pwrite(fd, view, offset)


def file_name(offset: int) -> str:
    """RocketMQ names store files by their start offset, 20 digits, so they sort lexically."""
    return f"{offset:020d}"


def parse_file_name(name: str) -> int | None:
    return int(name) if len(name) == 20 and name.isdigit() else None


class MappedFile:
    __slots__ = ("path", "start", "size", "fd", "mm", "mv", "reserved")

    def __init__(self, path: Path, start: int, size: int, *, create: bool) -> None:
        self.path = path
        self.start = start
        self.size = size
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        self.fd = os.open(path, flags, 0o644)
        try:
            actual = os.fstat(self.fd).st_size
            if actual != size:
                if actual > size:
                    raise OSError(f"{path} is {actual} bytes, larger than the configured {size}")
                # A file shorter than configured was being created when the process died: extend it sparse.
                os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.mv = memoryview(self.mm)
        self.reserved = 0  # [0, reserved) is known to have disk blocks (see ``reserve``)

    @classmethod
    def create(cls, path: Path, start: int, size: int) -> MappedFile:
        return cls(path, start, size, create=True)

    @classmethod
    def open(cls, path: Path, start: int, size: int) -> MappedFile:
        return cls(path, start, size, create=False)

    def reserve(self, end: int) -> None:
        """Allocate disk blocks for ``[reserved, end)`` and up to a chunk beyond, before writing there through
        the mapping. Raises ``OSError`` (ENOSPC on a full disk) instead of the SIGBUS the write would get."""
        if end <= self.reserved:
            return
        chunk = RESERVE_CHUNK_BYTES
        new_end = min(self.size, -(-max(end, self.reserved + chunk) // chunk) * chunk)
        os.posix_fallocate(self.fd, self.reserved, new_end - self.reserved)
        self.reserved = new_end

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def release(self, upto: int) -> None:
        """Drop resident pages of ``[0, upto)`` from this process (see the module docstring). Called again
        for the same range it drops what readers faulted back in meanwhile; untouched ranges cost a page-table
        walk only."""
        upto -= upto % PAGE_SIZE
        if upto > 0:
            self.mm.madvise(mmap.MADV_DONTNEED, 0, upto)

    def drop_cached(self, begin: int, end: int) -> None:
        """Drop the page-cache pages of ``[begin, end)`` (they must be flushed: the kernel keeps dirty ones).
        A later read faults them in from disk again."""
        if end > begin:
            os.posix_fadvise(self.fd, begin, end - begin, os.POSIX_FADV_DONTNEED)

    def release_range(self, begin: int, end: int) -> None:
        begin += -begin % PAGE_SIZE
        end -= end % PAGE_SIZE
        if end > begin:
            self.mm.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    def release_all(self) -> None:
        self.mm.madvise(mmap.MADV_DONTNEED, 0, self.size)

    def zero(self, begin: int, end: int) -> None:
        """Zero ``[begin, end)`` in bounded steps (a torn tail; recovery only)."""
        step = 1 << 20
        zeros = bytes(min(step, max(end - begin, 0)))
        pos = begin
        while pos < end:
            n = min(step, end - pos)
            self.mm[pos:pos + n] = zeros[:n]
            pos += n

    def close(self) -> None:
        """Unmap and close. A reader may still hold a view of the mapping (a pulled message on its way out): the
        mapping then stays until that view is gone, and only the descriptor is closed now."""
        self.mv.release()
        try:
            self.mm.close()
        except BufferError:
            log.debug("mapping still exported at close path=%s", self.path)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def destroy(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __repr__(self) -> str:
        return f"MappedFile({self.path.name}, start={self.start}, size={self.size})"
