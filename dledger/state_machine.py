"""What a DLedger group replicates into: a byte log with offsets (the broker's commit log).

``dledger`` knows bytes and offsets, not messages. The broker plugs its ``MessageStore`` in through
``broker/commit_log_machine.py``; tests plug in a small file-backed log. Rules an implementation keeps:

- ``apply_batch`` is deterministic (everything it writes follows from the payload, ``store_timestamp`` and
  ``expected_start_offset``) and idempotent: ``expected_start_offset < end_offset`` means the batch was already
  applied (DUPLICATE, write nothing), ``>`` means a batch planned against a state that never happened (REJECTED,
  write nothing). pysyncobj replays its journal on restart, so duplicates are routine.
- ``apply_batch`` and ``write_raw`` run on pysyncobj's tick thread or on the trio thread, never both at once
  (the apply gate is closed while raw bytes are copied in).
- ``read_raw`` returns bytes of the log as stored, so a copy written with ``write_raw`` is byte-identical.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["ApplyStatus", "BatchResult", "StateMachine"]


class ApplyStatus(enum.Enum):
    APPLIED = "APPLIED"
    DUPLICATE = "DUPLICATE"
    REJECTED = "REJECTED"


@dataclass(frozen=True, slots=True)
class BatchResult:
    status: ApplyStatus
    end_offset: int
    # One result per record of the batch, in order (only for APPLIED); whatever the state machine reports
    # (the store: msg_id, queue_offset, phy_offset...). Handed back to each ``append`` caller untouched.
    record_results: tuple[Any, ...] = ()


@runtime_checkable
class StateMachine(Protocol):
    @property
    def end_offset(self) -> int:
        """The end of the log: where the next batch starts."""

    def join_records(self, records: Sequence[bytes]) -> bytes:
        """One batch payload from records passed to ``append``, in order (no I/O)."""

    def plan_batch_end(self, payload: bytes, start_offset: int) -> int:
        """The end offset ``apply_batch`` would leave if this payload were applied at ``start_offset``."""

    def apply_batch(self, payload: bytes, store_timestamp: int, expected_start_offset: int) -> BatchResult:
        ...

    def read_raw(self, offset: int, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` stored bytes from ``offset`` (empty at the end)."""

    def write_raw(self, offset: int, data: bytes) -> None:
        """Append bytes copied from a peer's ``read_raw``; requires ``offset == end_offset``; validates before
        writing anything (raises ``ValueError`` naming what is wrong)."""

    def checksums(self, up_to_offset: int) -> list[tuple[int, int, int]]:
        """``(segment_start, length_covered, crc32c)`` per segment up to ``up_to_offset``."""
