"""``StoreCheckpoint``: how far the commit log and the derived files were durable, so recovery starts near the
end instead of verifying every record.

Layout (big-endian, 32 bytes, rewritten in place then fdatasync'd)::

    | magic 4 | version 4 | commit_log_flushed 8 | dispatched 8 | crc32c of the 24 bytes before 4 | pad 4 |

``commit_log_flushed``: every commit-log byte before it was fdatasync'd (always a record boundary).
``dispatched``: every record before it has its ConsumeQueue unit and index entries flushed. A torn or missing
checkpoint is not an error: recovery then verifies the last two segments and re-dispatches from the last record
the index header names as dispatched, else from the start of the commit log (both idempotent).
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

from crc32c import crc32c

from .mapped_file import pwrite_all

log = logging.getLogger(__name__)

__all__ = ["StoreCheckpoint", "CHECKPOINT"]

CHECKPOINT = struct.Struct(">IIqqII")
_MAGIC = 0x524D434B  # "RMCK"
_VERSION = 1


class StoreCheckpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.commit_log_flushed: int | None = None
        self.dispatched: int | None = None
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        data = os.pread(self._fd, CHECKPOINT.size, 0)
        if len(data) == CHECKPOINT.size:
            magic, version, flushed, dispatched, crc, _ = CHECKPOINT.unpack(data)
            if magic == _MAGIC and version == _VERSION and crc == crc32c(data[:24]) and flushed >= 0 \
                    and dispatched >= 0:
                self.commit_log_flushed = flushed
                self.dispatched = dispatched
                return
        if data.strip(b"\x00"):
            log.warning("store checkpoint unreadable, recovery verifies from the last segments path=%s", path)

    def write(self, commit_log_flushed: int, dispatched: int) -> None:
        head = struct.pack(">IIqq", _MAGIC, _VERSION, commit_log_flushed, dispatched)
        pwrite_all(self._fd, head + struct.pack(">II", crc32c(head), 0), 0)
        os.fdatasync(self._fd)
        self.commit_log_flushed = commit_log_flushed
        self.dispatched = dispatched

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
