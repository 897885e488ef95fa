"""What a DLedger group replicates into: a byte log with offsets (the broker's commit log).

``dledger`` knows bytes and offsets, not messages. The broker plugs its ``MessageStore`` in through
``broker/commit_log_machine.py``; tests plug in a small file-backed log. Rules an implementation keeps:

- ``prepare_batch`` runs once, on the leader, before the entry is proposed: it turns the records into the
  payload every member will apply, planned to start at ``start_offset`` with ``store_timestamp``, and knows each
  record's result already (valid once the entry is applied at that offset). ``fresh`` says nothing is in flight,
  so the plan starts from the applied state; otherwise it continues from the previous prepared batch.
- ``apply_batch`` is deterministic (everything it writes follows from the payload, ``store_timestamp`` and
  ``expected_start_offset``) and idempotent: ``expected_start_offset < end_offset`` means the batch was already
  applied (DUPLICATE, write nothing), ``>`` means a batch planned against a state that never happened (REJECTED,
  write nothing). pysyncobj replays its journal on restart, so duplicates are routine. What the log holds of a
  duplicate must be the batch's own bytes, else ``LogMismatchError``; and a batch is written whole, so a log
  that ends *inside* one lost the rest of it (a tail lost behind the Raft journal): it writes the rest
  (APPLIED).
- ``apply_batch`` (inside a pysyncobj tick) and ``write_raw`` (catch-up) both run on the trio thread, never
  interleaved with each other (the apply gate is closed while raw bytes are copied in).
- ``read_raw`` returns bytes of the log as stored, so a copy written with ``write_raw`` is byte-identical.
- ``wait_durable(offset)`` returns once every byte before ``offset`` is on disk (fdatasync'd), without blocking
  the trio thread. A Raft snapshot records the applied end offset and replaces the journal entries that wrote
  the bytes before it, so it is put in place only after this (``dledger.snapshot``).
- ``prepare_checksums`` runs on the trio thread and only captures what will be read; the function it returns
  reads and hashes, in a worker thread (``DLedgerService``): hundreds of MB take tens of ms from the page cache
  and seconds from disk, during which the trio thread must go on serving requests and ticking Raft. That function
  stops between chunks of ``CHECKSUM_CHUNK_BYTES`` once its caller gives up (``ChecksumStopped``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import crc32c

__all__ = ["ApplyStatus", "BatchResult", "PreparedBatch", "StateMachine", "ChecksumWork", "ChecksumStopped",
           "CHECKSUM_CHUNK_BYTES", "checksum_views"]

# Bytes hashed between two looks at the caller's stop flag: ~0.5 ms from the page cache, a few ms from disk.
CHECKSUM_CHUNK_BYTES = 8 << 20
# ``work(stop)``: ``(segment_start, length_covered, crc32c)`` per segment; ``stop()`` is asked between chunks.
ChecksumWork = Callable[[Callable[[], bool]], list[tuple[int, int, int]]]


class ChecksumStopped(Exception):
    """A checksum computation whose caller gave up (cancelled request, closed connection) stopped early."""


def checksum_views(views: Iterable[tuple[int, memoryview]], stop: Callable[[], bool]) -> list[tuple[int, int, int]]:
    """crc32c of each ``(segment_start, view)``, ``CHECKSUM_CHUNK_BYTES`` at a time (crc32c releases the GIL on
    large buffers), asking ``stop()`` before each chunk. Every view is released on the way out: a view keeps its
    segment mapped after retention deleted it (``MappedFile.close``)."""
    views = list(views)
    out = []
    try:
        for start, view in views:
            crc = 0
            for pos in range(0, len(view), CHECKSUM_CHUNK_BYTES):
                if stop():
                    raise ChecksumStopped(f"checksums stopped at offset {start + pos}")
                crc = crc32c.crc32c(view[pos:pos + CHECKSUM_CHUNK_BYTES], crc)
            out.append((start, len(view), crc))
    finally:
        for _, view in views:
            view.release()
    return out


class ApplyStatus(enum.Enum):
    APPLIED = "APPLIED"
    DUPLICATE = "DUPLICATE"
    REJECTED = "REJECTED"


@dataclass(frozen=True, slots=True)
class BatchResult:
    status: ApplyStatus
    end_offset: int


class PreparedBatch(NamedTuple):
    # The entry payload; None when no record is worth proposing (each was refused: its result says why).
    payload: bytes | None
    # The end offset once applied at the planned start.
    end_offset: int
    # One result per record, in order; whatever the state machine reports (the store: msg ids, queue offsets,
    # or a refusal), handed back to each ``append`` caller untouched once the entry is committed and applied.
    record_results: tuple[Any, ...]


@runtime_checkable
class StateMachine(Protocol):
    @property
    def end_offset(self) -> int:
        """The end of the log: where the next batch starts."""

    def prepare_batch(self, records: Sequence[bytes], start_offset: int, store_timestamp: int, *,
                      fresh: bool) -> PreparedBatch:
        """The payload of one entry holding ``records`` (passed to ``append``, in order), planned to be applied
        at ``start_offset``; no I/O. Raises only for a bug: a bad record gets a refusal as its result."""

    def apply_batch(self, payload: bytes, store_timestamp: int, expected_start_offset: int) -> BatchResult:
        ...

    @property
    def min_offset(self) -> int:
        """The first offset still stored (retention may have deleted what was before it)."""

    def start_state(self, offset: int) -> bytes:
        """What a member beginning its empty log at ``offset`` (this one's ``min_offset``) needs besides the log
        bytes from there, opaque to dledger (``b""`` when nothing): the broker's store sends the queue offsets its
        copy cannot derive from the records. Called on the trio thread together with ``min_offset``."""

    def start_at(self, offset: int, state: bytes | None) -> None:
        """Begin an *empty* log at ``offset`` (a peer's ``min_offset``) instead of 0, so an empty member can
        copy a log whose beginning no peer keeps; ``state`` is that peer's ``start_state(offset)``, None when the
        peer sent none (an older version). Raises ``ValueError`` if not empty, not supported or the state is
        malformed."""

    def read_raw(self, offset: int, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` stored bytes from ``offset`` (empty at the end); ``offset`` below
        ``min_offset`` raises ``ValueError``."""

    def write_raw(self, offset: int, data: bytes) -> None:
        """Append bytes copied from a peer's ``read_raw``; requires ``offset == end_offset``; validates before
        writing anything (raises ``ValueError`` naming what is wrong)."""

    async def wait_durable(self, offset: int) -> None:
        """Return once the log is on disk up to ``offset`` (at most its end), asking for a flush if none is due."""

    def prepare_checksums(self, up_to_offset: int) -> ChecksumWork:
        """The work of ``(segment_start, length_covered, crc32c)`` per segment up to ``up_to_offset``, to be run in
        a worker thread: this call captures what it will read (on the trio thread, so nothing it reads changes
        under it), the returned function reads and hashes, asking ``stop()`` between chunks."""
