"""The DLedger entry: what one Raft log entry carries.

A leader's group-commit batcher turns many ``append(record)`` calls into one entry; every member applies the
entry to its state machine with the values *in the entry*, never with local ones, so commit logs stay
byte-identical across replicas::

    offset  size  field
    0       1     magic                 0xD1 (format version 1)
    1       8     expected_start_offset  uint64 BE: the commit-log end the leader planned this batch to start at
    9       8     store_timestamp        int64 BE, ms since the epoch, chosen once by the leader
    17      4     payload_length         uint32 BE
    21      n     payload                opaque batch built by the state machine's ``prepare_batch``

Entries must stay below pysyncobj's chunked-send threshold (``appendEntriesBatchSizeBytes``): an entry at least
that long takes a path whose 'finish' chunk is computed from the wrong length and the follower fails to
unpickle it. ``dledger.config`` fixes ``max_entry_bytes`` below half the batch size and ``encode_entry``
refuses anything longer (``EntryTooLargeError``), so the bad path is unreachable.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["ENTRY_HEADER", "ENTRY_MAGIC", "Entry", "EntryError", "EntryTooLargeError", "encode_entry", "decode_entry"]

ENTRY_MAGIC = 0xD1
ENTRY_HEADER = struct.Struct(">BQqI")


class EntryError(ValueError):
    pass


class EntryTooLargeError(EntryError):
    def __init__(self, size: int, max_entry_bytes: int) -> None:
        super().__init__(f"a DLedger entry of {size} bytes exceeds max_entry_bytes={max_entry_bytes}; "
                         f"split the batch (bigger entries hit pysyncobj's chunked-send bug)")
        self.size = size
        self.max_entry_bytes = max_entry_bytes


@dataclass(frozen=True, slots=True)
class Entry:
    expected_start_offset: int
    store_timestamp: int
    payload: bytes


def encode_entry(expected_start_offset: int, store_timestamp: int, payload: bytes, *, max_entry_bytes: int) -> bytes:
    size = ENTRY_HEADER.size + len(payload)
    if size > max_entry_bytes:
        raise EntryTooLargeError(size, max_entry_bytes)
    return ENTRY_HEADER.pack(ENTRY_MAGIC, expected_start_offset, store_timestamp, len(payload)) + payload


def decode_entry(data: bytes) -> Entry:
    if len(data) < ENTRY_HEADER.size:
        raise EntryError(f"a DLedger entry needs at least {ENTRY_HEADER.size} bytes, got {len(data)}")
    magic, start, ts, length = ENTRY_HEADER.unpack_from(data, 0)
    if magic != ENTRY_MAGIC:
        raise EntryError(f"bad DLedger entry magic 0x{magic:02x}, expected 0x{ENTRY_MAGIC:02x}")
    if len(data) - ENTRY_HEADER.size != length:
        raise EntryError(f"DLedger entry payload_length={length} but {len(data) - ENTRY_HEADER.size} bytes follow")
    return Entry(start, ts, bytes(data[ENTRY_HEADER.size:]))
