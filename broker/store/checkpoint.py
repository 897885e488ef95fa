"""``StoreCheckpoint``: how far the commit log and the derived files were durable, so recovery starts near the
end instead of verifying every record.

Layout (big-endian, 40 bytes, rewritten in place then fdatasync'd)::

    | magic 4 | version 2 (4) | commit_log_flushed 8 | dispatched 8 | queue_units 8 | crc32c of the 32 bytes before 4 |
    | pad 4 |

``commit_log_flushed``: every commit-log byte before it was fdatasync'd (always a record boundary).
``dispatched``: every record before it has its ConsumeQueue unit and index entries flushed. ``queue_units``: the
sum of every ConsumeQueue's max offset when dispatch stood at ``dispatched``, the queues deleted with their topics
counted at the offsets ``deleted_queues`` keeps (``broker.store.dispatch``); recovery counts the units its files
hold below ``dispatched`` (and those offsets) and rebuilds the queues from the commit log when they fall short (a
lost file). A torn
or missing checkpoint is not an error: recovery then verifies the last segments and re-dispatches from the last
record the index header names as dispatched, else from the start of the commit log (both idempotent). Version 1
(32 bytes, no ``queue_units``) is still read.
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

CHECKPOINT = struct.Struct(">IIqqqII")
_CHECKPOINT_V1 = struct.Struct(">IIqqII")
_MAGIC = 0x524D434B  # "RMCK"
_VERSION = 2


class StoreCheckpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.commit_log_flushed: int | None = None
        self.dispatched: int | None = None
        self.queue_units: int | None = None  # None: a version 1 checkpoint, which did not count them
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        data = os.pread(self._fd, CHECKPOINT.size, 0)
        if len(data) >= _CHECKPOINT_V1.size:
            magic, version = struct.unpack_from(">II", data)
            if magic == _MAGIC and version == 1:
                _, _, flushed, dispatched, crc, _ = _CHECKPOINT_V1.unpack_from(data)
                units, covered = None, 24
            elif magic == _MAGIC and version == _VERSION and len(data) == CHECKPOINT.size:
                _, _, flushed, dispatched, units, crc, _ = CHECKPOINT.unpack(data)
                covered = 32
            else:
                crc = covered = None
            if crc is not None and crc == crc32c(data[:covered]) and flushed >= 0 and dispatched >= 0 \
                    and (units is None or units >= 0):
                self.commit_log_flushed = flushed
                self.dispatched = dispatched
                self.queue_units = units
                return
        if data.strip(b"\x00"):
            log.warning("store checkpoint unreadable, recovery verifies from the last segments path=%s", path)

    def write(self, commit_log_flushed: int, dispatched: int, queue_units: int) -> None:
        head = struct.pack(">IIqqq", _MAGIC, _VERSION, commit_log_flushed, dispatched, queue_units)
        pwrite_all(self._fd, head + struct.pack(">II", crc32c(head), 0), 0)
        os.fdatasync(self._fd)
        self.commit_log_flushed = commit_log_flushed
        self.dispatched = dispatched
        self.queue_units = queue_units

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
