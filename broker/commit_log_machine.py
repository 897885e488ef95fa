"""``CommitLogMachine``: the message store as the replicated state machine of a DLedger group.

``dledger`` speaks bytes and offsets; this adapter maps them onto ``broker.store.MessageStore``:

- A record passed to ``group.append(record)`` is one encoded batch (``remoting.message`` batch layout: a 16-byte
  head with magic, count and store host, then the messages).
- **The leader builds, every replica copies.** ``prepare_batch`` runs once, on the leader: it validates each
  record (a bad one gets its own refusal and is left out, the others go on), checks the disk guard, and builds
  the final commit-log bytes of the whole entry (headers, queue offsets, physical offsets, store timestamp,
  segment-end blanks) against the planned end and the planned queue offsets of entries still in flight. The
  entry payload is those bytes::

      version (u8 = 2) | piece_count (u16) | queue_count (u32) | index_count (u32) | record_count (u32)
        | last_record_offset (u64)
      piece  x piece_count: phy_offset (u64) | data_offset (u32) | length (u32)   -- runs of data; a run ends
                                                                                      with a segment's blank
      queue  x queue_count: topic_len (u8) | topic | queue_id (i32) | first_queue_offset (u64) | count (u32)
                            | count ConsumeQueue units (20 bytes each: the records' units in that queue)
      index  x index_count: hash (u32) | phy_offset (u64)      -- IndexFile entries, in put order
      data   the commit-log bytes

  ``apply_batch`` on every member (leader included) checks the expected start offset (behind: DUPLICATE, ahead:
  REJECTED, nothing written) and writes the pieces, then hands the units and index entries to the dispatcher
  (``broker.store.dispatch_info``): no parsing per message, which is what the followers' CPU went to. Replicas
  are byte-identical because they write the same bytes. Each caller's result (msg id, queue offset...) is known
  at prepare time and handed back once the entry is committed and applied.
- Planned queue offsets live in ``_planned`` until the entries are applied; ``fresh=True`` (nothing in flight)
  clears them. A plan made against a state that did not happen (a zombie entry applied meanwhile) has a start
  offset that no longer matches, so it is REJECTED everywhere, never half applied.
- Catch-up copies use the store's raw commit-log read/append (whole records and end-of-segment blanks, every
  record checked before anything is written). A member rebuilt empty that begins its log at a peer's min offset
  gets the queue offsets there with it (``start_state`` / ``start_at``: ``MessageStore.start_state``).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from itertools import starmap

from broker.store import AppendedMessage, AppendResult, AppendStatus, MessageStore
from broker.store.commit_log import BuiltBatch
from broker.store.consume_queue import CQ_UNIT_SIZE
from broker.store.dispatch_info import DispatchHint
from dledger import ApplyStatus, BatchResult, LogMismatchError, PreparedBatch
from dledger.entry import ENTRY_HEADER
from dledger.state_machine import ChecksumWork, checksum_views
from remoting.message import BATCH_HEAD, ENTRY_HEAD, RECORD_HEAD, batch_store_host

__all__ = ["CommitLogMachine", "RecordResult", "encode_payload", "decode_payload", "least_entry_bytes",
           "PAYLOAD_VERSION"]

PAYLOAD_VERSION = 2
_HEAD = struct.Struct(">BHIIIQ")
_PIECE = struct.Struct(">QII")
_QUEUE = struct.Struct(">iQI")
_INDEX = struct.Struct(">IQ")


def encode_payload(built: BuiltBatch) -> bytes:
    hint = built.hint
    parts = [_HEAD.pack(PAYLOAD_VERSION, len(built.pieces), len(hint.queues), len(hint.index), hint.count,
                        hint.last_phy)]
    parts += [_PIECE.pack(*p) for p in built.pieces]
    for (topic, queue_id), first, units in hint.queues:
        parts += [bytes((len(topic),)), topic, _QUEUE.pack(queue_id, first, len(units) // CQ_UNIT_SIZE), units]
    parts += starmap(_INDEX.pack, hint.index)  # C-level loop: one entry per message
    parts.append(built.data)
    return b"".join(parts)


def least_entry_bytes(batch_bytes: int, count: int, topic_length: int, index_keys: int) -> int:
    """The fewest bytes of the DLedger entry ``prepare_batch`` makes of one encoded batch of ``batch_bytes``
    holding ``count`` messages of one topic (``topic_length`` bytes) in one queue, with ``index_keys`` IndexFile
    keys (``remoting.message.batch_index_keys``), as ``encode_entry`` holds it to ``max_entry_bytes``: the entry
    header, the payload head, one piece, the queue's head and a unit per message, the index, and the records (each
    its batch entry plus the record header's extra fields). Exact when the build crosses no segment end; each end
    crossed adds a blank and a piece (24 bytes), which depends on where the log will end. From sizes alone, nothing
    built: a sender can be refused an entry that cannot fit before the leader spends its Raft thread building it."""
    return (ENTRY_HEADER.size + _HEAD.size + _PIECE.size + 1 + topic_length + _QUEUE.size + count * CQ_UNIT_SIZE
            + index_keys * _INDEX.size + batch_bytes - BATCH_HEAD.size + count * (RECORD_HEAD.size - ENTRY_HEAD.size))


def decode_payload(payload: bytes, expected_start: int, store_timestamp: int) -> tuple[
        list[tuple[int, int, int]], dict[tuple[bytes, int], int], memoryview, DispatchHint]:
    """``(pieces, next queue offsets, data, dispatch hint)`` of an entry payload."""
    version, n_pieces, n_queues, n_index, count, last_phy = _HEAD.unpack_from(payload, 0)
    if version != PAYLOAD_VERSION:
        raise ValueError(f"commit-log entry payload version {version}, this broker applies {PAYLOAD_VERSION}")
    mv = memoryview(payload)
    pos = _HEAD.size
    pieces = [_PIECE.unpack_from(payload, pos + i * _PIECE.size) for i in range(n_pieces)]
    pos += n_pieces * _PIECE.size
    touched = {}
    queues = []
    for _ in range(n_queues):
        tl = payload[pos]
        topic = payload[pos + 1:pos + 1 + tl]
        pos += 1 + tl
        queue_id, first, n = _QUEUE.unpack_from(payload, pos)
        pos += _QUEUE.size
        key = (topic, queue_id)
        touched[key] = first + n
        queues.append((key, first, mv[pos:pos + n * CQ_UNIT_SIZE]))
        pos += n * CQ_UNIT_SIZE
    index = list(_INDEX.iter_unpack(mv[pos:pos + n_index * _INDEX.size]))
    pos += n_index * _INDEX.size
    data = mv[pos:]
    end = pieces[-1][0] + pieces[-1][2] if pieces else expected_start
    return pieces, touched, data, DispatchHint(expected_start, end, store_timestamp, last_phy, count, queues, index)


class RecordResult:
    """One record's share of the store's ``AppendResult`` for a whole entry. Built at prepare time for every
    record, so it only remembers a slice; the per-message columns are cut when first read (by whoever awaited
    the append, once the entry is committed)."""

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


class CommitLogMachine:
    """``dledger.StateMachine`` over a ``MessageStore``."""

    def __init__(self, store: MessageStore) -> None:
        self.store = store
        self._planned: dict[tuple[bytes, int], int] = {}

    @property
    def end_offset(self) -> int:
        return self.store.max_phy_offset

    def prepare_batch(self, records: Sequence[bytes], start_offset: int, store_timestamp: int, *,
                      fresh: bool) -> PreparedBatch:
        store = self.store
        if fresh:
            self._planned.clear()
        good: list[tuple[bytes, int]] = []
        results: list[RecordResult | None] = []
        for record in records:
            count, refusal = store.check_batch(record, start_offset)
            if refusal is not None:
                results.append(RecordResult(refusal, 0, 0))
            else:
                good.append((record, count))
                results.append(None)
        if not good:
            return PreparedBatch(None, start_offset, tuple(results))
        built = store.prepare_append(good, start_offset, store_timestamp, self._planned)
        entry = AppendResult(AppendStatus.PUT_OK, start_offset, built.end, batch_store_host(good[0][0]),
                             built.phy_offsets, built.queue_offsets, built.sizes, built.queue_ids)
        pos = 0
        counts = iter(good)
        for i, r in enumerate(results):
            if r is None:
                n = next(counts)[1]
                results[i] = RecordResult(entry, pos, n)
                pos += n
        return PreparedBatch(encode_payload(built), built.end, tuple(results))

    def apply_batch(self, payload: bytes, store_timestamp: int, expected_start_offset: int) -> BatchResult:
        pieces, touched, data, hint = decode_payload(payload, expected_start_offset, store_timestamp)
        status = self.store.apply_built(pieces, data, touched, expected_start_offset, hint)
        if status is AppendStatus.CORRUPTED:
            raise LogMismatchError(expected_start_offset, f"the commit log holds other bytes than the committed "
                                   f"entry written from offset {expected_start_offset} to {hint.end}")
        if status is AppendStatus.DUPLICATE:
            return BatchResult(ApplyStatus.DUPLICATE, self.store.max_phy_offset)
        if status is AppendStatus.OFFSET_MISMATCH:
            return BatchResult(ApplyStatus.REJECTED, self.store.max_phy_offset)
        return BatchResult(ApplyStatus.APPLIED, self.store.max_phy_offset)

    @property
    def min_offset(self) -> int:
        return self.store.min_phy_offset

    def start_state(self, offset: int) -> bytes:
        return self.store.start_state(offset)

    def start_at(self, offset: int, state: bytes | None) -> None:
        self.store.start_at(offset, state)

    def read_raw(self, offset: int, max_bytes: int) -> bytes:
        return self.store.read_commit_log(offset, max_bytes)

    def write_raw(self, offset: int, data: bytes) -> None:
        result = self.store.append_commit_log_raw(offset, data)
        if not result.ok:
            raise ValueError(f"raw commit-log copy at offset {offset} refused: {result.status.value} "
                             f"{result.remark}")

    async def wait_durable(self, offset: int) -> None:
        await self.store.wait_flushed(offset)  # the flush service's group commit, asked for a flush now

    def prepare_checksums(self, up_to_offset: int) -> ChecksumWork:
        views = self.store.segment_views(up_to_offset)
        return functools.partial(checksum_views, views)
