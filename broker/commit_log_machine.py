"""``CommitLogMachine``: the message store as the replicated state machine of a DLedger group.

``dledger`` speaks bytes and offsets; this adapter maps them onto ``broker.store.MessageStore``:

- A record passed to ``group.append(record)`` is one encoded batch (``remoting.message`` batch layout: a 16-byte
  head with magic, count and store host, then the messages). ``join_records`` merges the records of one Raft
  entry into ONE batch (head of the first record, counts summed, message bytes concatenated) so the store
  appends the whole entry with one ``append_batch`` call. Each caller later gets back its own slice of the
  store's ``AppendResult`` (``phy_offsets``, ``queue_offsets``... of its messages only). The entry payload
  therefore remembers the record boundaries in a small prefix::

      record_count (uint16 BE) | message_count (uint32 BE) x record_count | joined batch
- ``apply_batch`` runs on every member with the entry's ``store_timestamp`` and ``expected_start_offset``;
  the store's DUPLICATE / OFFSET_MISMATCH map to dledger's DUPLICATE / REJECTED (nothing written). Any other
  refusal (a malformed batch) is deterministic too, writes nothing on any member, and goes back to the callers
  as their result. The disk guard is off here (``check_disk=False``): a follower must apply what its group
  committed; the leader checks the disk before it proposes.
- Catch-up copies use the store's raw commit-log read/append (whole records and end-of-segment blanks, every
  record checked before anything is written).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence

from broker.store import AppendedMessage, AppendResult, AppendStatus, MessageStore
from dledger import ApplyStatus, BatchResult
from remoting.message import BATCH_HEAD, BATCH_MAGIC, MessageFormatError, batch_count

__all__ = ["CommitLogMachine", "RecordResult", "join_batches", "split_result", "encode_payload", "decode_payload"]

_RECORD_COUNT = struct.Struct(">H")
MAX_RECORDS_PER_ENTRY = 0xFFFF


def join_batches(batches: Sequence[bytes]) -> bytes:
    """One batch holding every message of ``batches`` in order (store host taken from the first)."""
    if len(batches) == 1:
        return batches[0]
    total = 0
    for i, b in enumerate(batches):
        if len(b) < BATCH_HEAD.size or BATCH_HEAD.unpack_from(b, 0)[0] != BATCH_MAGIC:
            raise MessageFormatError("batch", f"record {i} of the entry is not a message batch")
        total += batch_count(b)
    magic, _count, ip, port = BATCH_HEAD.unpack_from(batches[0], 0)
    return b"".join([BATCH_HEAD.pack(magic, total, ip, port)] + [b[BATCH_HEAD.size:] for b in batches])


class RecordResult:
    """One record's share of the store's ``AppendResult`` for a whole entry. Built on pysyncobj's tick thread
    for every record, so it only remembers a slice; the per-message columns are cut when first read (on the
    trio thread, by whoever awaited the append)."""

    __slots__ = ("_entry", "_start", "_count", "__dict__")

    def __init__(self, entry: AppendResult, start: int, count: int) -> None:
        self._entry = entry
        self._start = start
        self._count = count

    @property
    def status(self) -> AppendStatus:
        return self._entry.status

    @property
    def ok(self) -> bool:
        return self._entry.ok

    @property
    def remark(self) -> str:
        return self._entry.remark

    @property
    def field(self) -> str:
        return self._entry.field

    @property
    def store_host(self) -> tuple[str, int]:
        return self._entry.store_host

    def _cut(self, column: list[int]) -> list[int]:
        return column[self._start:self._start + self._count] if self._entry.ok else []

    @property
    def phy_offsets(self) -> list[int]:
        return self._cut(self._entry.phy_offsets)

    @property
    def queue_offsets(self) -> list[int]:
        return self._cut(self._entry.queue_offsets)

    @property
    def sizes(self) -> list[int]:
        return self._cut(self._entry.sizes)

    @property
    def queue_ids(self) -> list[int]:
        return self._cut(self._entry.queue_ids)

    @property
    def start_phy_offset(self) -> int:
        phys = self.phy_offsets
        return phys[0] if phys else self._entry.start_phy_offset

    @property
    def end_phy_offset(self) -> int:
        return self._entry.end_phy_offset

    @property
    def messages(self) -> list[AppendedMessage]:
        if "messages" not in self.__dict__:
            self.__dict__["messages"] = (self._entry.messages[self._start:self._start + self._count]
                                         if self._entry.ok else [])
        return self.__dict__["messages"]

    def as_append_result(self) -> AppendResult:
        if not self.ok:
            return self._entry
        return dataclasses.replace(self._entry, start_phy_offset=self.start_phy_offset,
                                   phy_offsets=self.phy_offsets, queue_offsets=self.queue_offsets,
                                   sizes=self.sizes, queue_ids=self.queue_ids)


def split_result(result: AppendResult, counts: Sequence[int]) -> tuple[RecordResult, ...]:
    """Per-record views of one ``AppendResult`` (a refusal is every record's result)."""
    out = []
    pos = 0
    for n in counts:
        out.append(RecordResult(result, pos, n))
        pos += n
    return tuple(out)


def encode_payload(batches: Sequence[bytes]) -> bytes:
    if not batches or len(batches) > MAX_RECORDS_PER_ENTRY:
        raise ValueError(f"an entry holds 1..{MAX_RECORDS_PER_ENTRY} records, got {len(batches)}")
    counts = [batch_count(b) for b in batches]
    return _RECORD_COUNT.pack(len(counts)) + struct.pack(f">{len(counts)}I", *counts) + join_batches(batches)


def decode_payload(payload: bytes) -> tuple[list[int], bytes]:
    (n,) = _RECORD_COUNT.unpack_from(payload, 0)
    head = _RECORD_COUNT.size + 4 * n
    if n == 0 or len(payload) < head:
        raise MessageFormatError("batch", f"entry payload of {len(payload)} bytes has no valid record table")
    counts = list(struct.unpack_from(f">{n}I", payload, _RECORD_COUNT.size))
    return counts, payload[head:]


class CommitLogMachine:
    """``dledger.StateMachine`` over a ``MessageStore``."""

    def __init__(self, store: MessageStore) -> None:
        self.store = store

    @property
    def end_offset(self) -> int:
        return self.store.max_phy_offset

    def join_records(self, records: Sequence[bytes]) -> bytes:
        return encode_payload(records)

    def plan_batch_end(self, payload: bytes, start_offset: int) -> int:
        return self.store.plan_batch_end(decode_payload(payload)[1], start_offset)

    def apply_batch(self, payload: bytes, store_timestamp: int, expected_start_offset: int) -> BatchResult:
        counts, batch = decode_payload(payload)
        result = self.store.append_batch(batch, store_timestamp, expected_start_offset, check_disk=False)
        if result.status is AppendStatus.DUPLICATE:
            return BatchResult(ApplyStatus.DUPLICATE, self.store.max_phy_offset)
        if result.status is AppendStatus.OFFSET_MISMATCH:
            return BatchResult(ApplyStatus.REJECTED, self.store.max_phy_offset)
        return BatchResult(ApplyStatus.APPLIED, self.store.max_phy_offset, split_result(result, counts))

    def read_raw(self, offset: int, max_bytes: int) -> bytes:
        return self.store.read_commit_log(offset, max_bytes)

    def write_raw(self, offset: int, data: bytes) -> None:
        result = self.store.append_commit_log_raw(offset, data)
        if not result.ok:
            raise ValueError(f"raw commit-log copy at offset {offset} refused: {result.status.value} "
                             f"{result.remark}")

    def checksums(self, up_to_offset: int) -> list[tuple[int, int, int]]:
        return self.store.segment_checksums(up_to_offset)
