"""``Dispatcher``: the one path that derives ConsumeQueue units and IndexFile entries from the commit log.

It tails committed commit-log bytes (never past the published end) and, per record, writes the ConsumeQueue
unit at the record's own queue offset and, unless the index already covers the record, the index entries for
its UNIQ_KEY and each of its KEYS. Both writes are idempotent, so recovery may re-dispatch from any point at or
before the checkpoint; deleting every derived file and dispatching from the start of the commit log rebuilds
them: the same units at the same queue offsets (queues whose records retention removed given back at their old
offsets, ``restore_offsets``), and every record indexed once under each key, though index file names and
boundaries may differ from the files dispatch wrote (docs/store-format.md, "IndexFile").

Deleting a topic is a record too: the broker appends one to ``TOPIC_DELETE_LOG`` whose body names the topic,
through the group's log like any message. Dispatching it *cuts* the topic's queues at the record's own
offset: units before it are no longer served (``ConsumeQueue.apply_cut``), so a topic created again under the
same name starts empty. The cut is ordered with the topic's own records by construction (dispatch follows the
commit log), it is the same on every replica (byte-identical logs), and it needs no file of its own: after a
restart the cuts are read back from ``TOPIC_DELETE_LOG``'s ConsumeQueue, rebuilt like any other.

Queue offsets are never given twice, whatever files go. Once retention removed every record of a deleted topic's
queue, the queue is closed and its directory deleted (``drop_deleted_topic_queues``), but its max offset is kept
in ``deleted_queues`` first: a topic created again under the name continues from there, as it did while the
files stayed. And a rebuild of every queue from the commit log (``drop_queues``, ``restore_offsets``) gives back
each queue it knew whose records retention removed as an empty queue at its old max offset, rather than
forgetting it and starting its next message at 0 below what consumers committed. So does a replica rebuilt empty
that begins its log at a peer's min offset (``MessageStore.start_at``): the peer's ``start_state`` gives it each
queue's offset at that point and the peer's ``deleted_queues``, which its copy of the log from there cannot.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

from crc32c import crc32c

from remoting.config import replace_file
from remoting.message import BLANK_MAGIC, BODY_LEN, MESSAGE_MAGIC, PROPS_LEN, RECORD_HEAD, MessageFormatError, \
    check_topic, decode_record

from .commit_log import MIN_RECORD_SIZE, SIZE_MAGIC, CommitLog
from .consume_queue import CQ_UNIT, ConsumeQueue
from .dispatch_info import DispatchHint, index_hashes, scan_properties, tags_code_of
from .errors import StoreCorruptedError
from .index_file import IndexService
from .mapped_file import file_name

log = logging.getLogger(__name__)

__all__ = ["Dispatcher", "DispatchListener", "TOPIC_DELETE_LOG"]

DispatchListener = Callable[[str, int, int], None]

# The system topic of topic deletions (RocketMQ 5 reserves the ``rmq_sys_`` prefix); queue 0, body = topic name.
TOPIC_DELETE_LOG = "rmq_sys_TOPIC_DELETE_LOG"
_TOPIC_DELETE_LOG = TOPIC_DELETE_LOG.encode("ascii")

# ``<store_dir>/deleted_queues``: the max offset of every queue deleted with its topic (its files removed once
# retention passed its records), so that the queue continues from there should the topic be created again. Not
# derived (those records are gone), so it lives outside ``consumequeue/``, which may be removed and rebuilt.
# Replaced whole (written beside it, fsynced, renamed over it). Big-endian:
#
#   | magic "RMDQ" 4 | version 1 (4) | count 4 | count entries | crc32c of every byte before it 4 |
#   entry: | queue_id 4 | max_offset 8 | topic_len 1 | topic (ASCII) |
DELETED_QUEUES_HEAD = struct.Struct(">III")
DELETED_QUEUE_ENTRY = struct.Struct(">iqB")
_DELETED_QUEUES_MAGIC = 0x524D4451  # "RMDQ"
_DELETED_QUEUES_VERSION = 1
_CRC = struct.Struct(">I")


def encode_deleted_queues(deleted: dict[tuple[bytes, int], int]) -> bytes:
    """The bytes of ``deleted_queues`` for ``{(topic, queue_id): max_offset}`` (sorted, so deterministic)."""
    out = bytearray(DELETED_QUEUES_HEAD.pack(_DELETED_QUEUES_MAGIC, _DELETED_QUEUES_VERSION, len(deleted)))
    for (topic, queue_id), max_offset in sorted(deleted.items()):
        out += DELETED_QUEUE_ENTRY.pack(queue_id, max_offset, len(topic)) + topic
    out += _CRC.pack(crc32c(out))
    return bytes(out)


def decode_deleted_queues(data: bytes, path: Path) -> dict[tuple[bytes, int], int]:
    """The inverse of ``encode_deleted_queues``; ``StoreCorruptedError`` naming ``path`` for bytes it did not
    write. Nothing else holds these offsets (the records are gone), so a damaged file is not guessed around."""
    def damaged(why: str) -> StoreCorruptedError:
        return StoreCorruptedError(
            f"{path} is damaged ({why}): it holds the queue offsets of deleted topics whose messages expired. "
            f"Removing it makes a topic created again under such a name start its queues at offset 0")
    if len(data) < DELETED_QUEUES_HEAD.size + _CRC.size:
        raise damaged(f"{len(data)} bytes")
    if _CRC.unpack_from(data, len(data) - _CRC.size)[0] != crc32c(data[:-_CRC.size]):
        raise damaged("its CRC does not match")
    magic, version, count = DELETED_QUEUES_HEAD.unpack_from(data)
    if magic != _DELETED_QUEUES_MAGIC or version != _DELETED_QUEUES_VERSION:
        raise damaged(f"magic {magic:#x}, version {version}")
    deleted: dict[tuple[bytes, int], int] = {}
    pos, end = DELETED_QUEUES_HEAD.size, len(data) - _CRC.size
    for _ in range(count):
        if pos + DELETED_QUEUE_ENTRY.size > end:
            raise damaged(f"it ends inside entry {len(deleted)} of {count}")
        queue_id, max_offset, topic_len = DELETED_QUEUE_ENTRY.unpack_from(data, pos)
        pos += DELETED_QUEUE_ENTRY.size
        deleted[(bytes(data[pos:pos + topic_len]), queue_id)] = max_offset
        pos += topic_len
    if pos != end:
        raise damaged(f"{end - pos} bytes follow its {count} entries")
    return deleted


# The start state (``Dispatcher.start_state``): what a replica that begins an empty commit log at a peer's min
# offset (``MessageStore.start_at``) cannot derive from the records it copies from there. Per queue holding a unit
# before ``phy_offset``: its max offset at that point and its last unit before it (written back as is, an empty
# queue at that offset, as ``restore_offsets`` does); then the peer's ``deleted_queues`` entries. Sent in the
# PULL_OFFSET_MOVED answer of FETCH_COMMIT_LOG (docs/protocol.md). Big-endian:
#
#   | magic "RMSS" 4 | version 1 (4) | phy_offset 8 | queue_count 4 | deleted_count 4 |
#   | queue_count queue entries | deleted_count deleted entries | crc32c of every byte before it 4 |
#   queue entry:   | queue_id 4 | max_offset 8 | unit phy_offset 8 | unit size 4 | unit tags_code 8 | topic_len 1 |
#                  | topic (ASCII) |
#   deleted entry: | queue_id 4 | max_offset 8 | topic_len 1 | topic (ASCII) |      (a deleted_queues entry)
START_STATE_HEAD = struct.Struct(">IIqII")
START_STATE_QUEUE = struct.Struct(">iqqiqB")
_START_STATE_MAGIC = 0x524D5353  # "RMSS"
_START_STATE_VERSION = 1
# (topic, queue_id) -> (max_offset, its last unit (phy_offset, size, tags_code)), the queue part of a start state.
StartQueues = dict[tuple[bytes, int], tuple[int, tuple[int, int, int]]]


def encode_start_state(phy_offset: int, queues: StartQueues, deleted: dict[tuple[bytes, int], int]) -> bytes:
    """The bytes of a start state (sorted, so deterministic)."""
    out = bytearray(START_STATE_HEAD.pack(_START_STATE_MAGIC, _START_STATE_VERSION, phy_offset, len(queues),
                                          len(deleted)))
    for (topic, queue_id), (max_offset, unit) in sorted(queues.items()):
        out += START_STATE_QUEUE.pack(queue_id, max_offset, *unit, len(topic)) + topic
    for (topic, queue_id), max_offset in sorted(deleted.items()):
        out += DELETED_QUEUE_ENTRY.pack(queue_id, max_offset, len(topic)) + topic
    out += _CRC.pack(crc32c(out))
    return bytes(out)


def decode_start_state(data: bytes, phy_offset: int) -> tuple[StartQueues, dict[tuple[bytes, int], int]]:
    """The inverse of ``encode_start_state`` for a store beginning at ``phy_offset``; ``ValueError`` saying what
    is wrong for bytes it did not write, or of a state at another offset, or one naming a queue twice, an illegal
    topic, an offset below 1 or a unit that is not one of a record before ``phy_offset``."""
    def bad(why: str) -> ValueError:
        return ValueError(f"the peer's start state ({len(data)} bytes) is malformed: {why}")
    if len(data) < START_STATE_HEAD.size + _CRC.size:
        raise bad(f"{len(data)} bytes are fewer than its head and CRC")
    if _CRC.unpack_from(data, len(data) - _CRC.size)[0] != crc32c(data[:-_CRC.size]):
        raise bad("its CRC does not match")
    magic, version, at, n_queues, n_deleted = START_STATE_HEAD.unpack_from(data)
    if magic != _START_STATE_MAGIC or version != _START_STATE_VERSION:
        raise bad(f"magic {magic:#x}, version {version}")
    if at != phy_offset:
        raise bad(f"it is the state at phy_offset {at}, not at {phy_offset} where this store begins")
    queues: StartQueues = {}
    deleted: dict[tuple[bytes, int], int] = {}
    pos, end = START_STATE_HEAD.size, len(data) - _CRC.size
    for i in range(n_queues + n_deleted):
        entry = START_STATE_QUEUE if i < n_queues else DELETED_QUEUE_ENTRY
        what = f"queue entry {i}" if i < n_queues else f"deleted entry {i - n_queues}"
        if pos + entry.size > end:
            raise bad(f"it ends inside {what} of {n_queues} + {n_deleted}")
        fields = entry.unpack_from(data, pos)
        pos += entry.size
        queue_id, max_offset, topic_len = fields[0], fields[1], fields[-1]
        if pos + topic_len > end:
            raise bad(f"it ends inside the topic of {what}")
        topic = bytes(data[pos:pos + topic_len])
        pos += topic_len
        try:
            check_topic(topic.decode("ascii"))
        except (UnicodeDecodeError, MessageFormatError):
            raise bad(f"{what} names an illegal topic {topic!r}") from None
        key = (topic, queue_id)
        if key in queues or key in deleted:
            raise bad(f"{what} names queue {key[0].decode()}:{queue_id} again")
        if queue_id < 0 or max_offset < 1:
            raise bad(f"{what} gives queue {key[0].decode()}:{queue_id} max offset {max_offset}")
        if i < n_queues:
            unit = fields[2:5]
            if unit[0] < 0 or unit[1] <= 0 or unit[0] + unit[1] > phy_offset:
                raise bad(f"{what} gives queue {key[0].decode()}:{queue_id} a last unit {unit} that is no record "
                          f"before phy_offset {phy_offset}")
            queues[key] = (max_offset, unit)
        else:
            deleted[key] = max_offset
    if pos != end:
        raise bad(f"{end - pos} bytes follow its {n_queues} + {n_deleted} entries")
    return queues, deleted


class Dispatcher:
    def __init__(self, commit_log: CommitLog, cq_root: Path, units_per_file: int, index: IndexService, *,
                 deleted_queues_path: Path) -> None:
        self.commit_log = commit_log
        self.cq_root = cq_root
        self.deleted_queues_path = deleted_queues_path
        self.units_per_file = units_per_file
        self.index = index
        self.queues: dict[tuple[bytes, int], ConsumeQueue] = {}
        self.by_topic: dict[str, dict[int, ConsumeQueue]] = {}
        self.dispatched = 0  # every record before this offset is dispatched
        self.queue_units = 0  # the sum of every queue's max offset
        # (dispatched, queue_units) at the end of the last dispatch round, in one tuple: the flush thread reads it
        # for the checkpoint while the reput task dispatches.
        self.mark = (0, 0)
        self._hints: collections.deque[DispatchHint] = collections.deque()
        self.cuts: dict[str, int] = {}  # topic -> commit-log offset of its latest deletion record
        # (topic, queue_id) -> max offset of a queue deleted with its topic (deleted_queues_path). A queue of the
        # same key created again takes the entry over (``_queue``); ``queue_units`` counts both alike.
        self.deleted: dict[tuple[bytes, int], int] = {}
        # Entries of deleted_queues whose queue was created again (its files reach past them), as loaded: what
        # the checkpoint counted for the queue while dispatch stood before its first new unit.
        self._taken_over: dict[tuple[bytes, int], int] = {}
        self._leftovers: list[ConsumeQueue] = []  # files of deleted queues a crash left, for delete_leftovers

    def load_queues(self, commit_log_min: int, commit_log_end: int) -> None:
        self.cq_root.mkdir(parents=True, exist_ok=True)
        path = self.deleted_queues_path
        try:
            deleted = decode_deleted_queues(path.read_bytes(), path)
        except FileNotFoundError:
            deleted = {}
        self.deleted = {}
        for topic in sorted(os.listdir(self.cq_root)):
            topic_dir = self.cq_root / topic
            if not topic_dir.is_dir():
                continue
            for qdir in sorted(os.listdir(topic_dir)):
                if qdir.isdigit():
                    cq = self._queue(topic.encode(), int(qdir))
                    cq.load(commit_log_min, commit_log_end)
        for key in list(deleted):
            cq = self.queues.get(key)
            if cq is None:
                continue
            if cq.max_offset > deleted[key]:
                self._taken_over[key] = deleted.pop(key)  # its topic created again: the files win
            else:
                # Files left by a crash while deleting them, after the entry was written: the entry wins, and
                # delete_leftovers finishes the job (the deletion record that made the queue go may be gone with
                # the segment retention deleted, so retention would not).
                self._forget(cq)
                cq.close()
                self._leftovers.append(cq)
        self.deleted = deleted

    def delete_leftovers(self) -> None:
        """Delete the files ``load_queues`` found of queues deleted with their topic, once recovery went through
        (a refused start writes nothing)."""
        leftovers, self._leftovers = self._leftovers, []
        for cq in leftovers:
            if (cq.topic.encode("ascii"), cq.queue_id) not in self.queues:  # not dispatched into again meanwhile
                cq.destroy()
                log.info("consume queue of a deleted topic deleted after an interrupted deletion topic=%s "
                         "queue_id=%d", cq.topic, cq.queue_id)

    def has_queue_files(self) -> bool:
        return any(cq.max_offset for cq in self.queues.values())

    def deleted_offset(self, topic: str, queue_id: int) -> int:
        """The max offset of a queue deleted with its topic (``drop_deleted_topic_queues``), else 0."""
        if not topic.isascii():
            return 0  # no topic is, and a reader may ask for anything
        return self.deleted.get((topic.encode("ascii"), queue_id), 0)

    def queue_damage(self, dispatched: int | None, queue_units: int | None) -> str | None:
        """Why the loaded ConsumeQueue files cannot be trusted, or None. Appends take each queue's next offset
        from its files, so a queue that lost its newest file (or its directory) would give its offsets again, and
        pulls skip a lost middle file: a file missing inside a queue, or fewer units before ``dispatched`` than
        the checkpoint counted (``queue_units``), means the queues must be rebuilt from the commit log."""
        for cq in self.queues.values():
            gap = cq.missing_file()
            if gap is not None:
                return f"consume queue {cq.topic}:{cq.queue_id} lacks its file {file_name(gap * cq.file_size)}"
        if dispatched is not None and queue_units is not None:
            taken_over = self._taken_over
            held = sum(self.deleted.values())
            for key, cq in self.queues.items():
                # Before its first new unit, a queue created again was counted at its offset in deleted_queues
                # (its files hold only holes below that unit, which max_offset_at takes for a queue begun there).
                held += max(cq.max_offset_at(dispatched), taken_over.get(key, 0))
            if held != queue_units:
                return (f"the consume queues hold {held} units before dispatched offset {dispatched}, the checkpoint "
                        f"counted {queue_units}")
        return None

    def index_damage(self) -> str | None:
        """Why the loaded IndexFiles cannot be trusted, or None. A file is begun only when the one before is full,
        at the record after that one's last (its ``end_phy_offset``), and retention deletes only the oldest files,
        those ending before the commit log begins: so the first file begins at or before the commit log's start
        and each next one at the record after its predecessor's end. Otherwise files were lost, and dispatch
        from the checkpoint on would never index the keys they held."""
        files = self.index.files
        cl = self.commit_log
        if not files or cl.end <= cl.min_phy_offset:
            return None
        if files[0].begin_phy_offset > cl.min_phy_offset:
            return (f"the first index file begins at phy_offset {files[0].begin_phy_offset}, after the commit log's "
                    f"start {cl.min_phy_offset}")
        for before, after in zip(files, files[1:]):
            following = self._record_after(before.end_phy_offset)
            if following is not None and after.begin_phy_offset > following:
                return (f"index file {file_name(after.begin_phy_offset)} follows one ending at phy_offset "
                        f"{before.end_phy_offset}, whose next record is at {following}")
        return None

    def _record_after(self, phy: int) -> int | None:
        """The offset of the record after the one at ``phy`` (past a segment's closing blank); None when no record
        starts at ``phy`` (retention removed it)."""
        raw = self.commit_log.record_at(phy)
        if raw is None:
            return None
        pos = phy + len(raw)
        seg = self.commit_log.segment_at(pos)
        if seg is not None and pos < self.commit_log.end:
            size, magic = SIZE_MAGIC.unpack_from(seg.mm, pos - seg.start)
            if magic == BLANK_MAGIC:
                pos += size
        return pos

    def drop_queues(self) -> dict[tuple[bytes, int], tuple[int, tuple[int, int, int]]]:
        """Delete every ConsumeQueue file, for recovery to rebuild them from the commit log; returns each queue's
        max offset and last unit as loaded, for ``restore_offsets`` after the rebuild."""
        held = {}
        for key, cq in self.queues.items():
            last = cq.unit(cq.max_offset - 1) if cq.max_offset else None
            if last is not None and last[1]:
                held[key] = (cq.max_offset, last)
            cq.close()
        self.queues.clear()
        self.by_topic.clear()
        shutil.rmtree(self.cq_root)
        self.cq_root.mkdir(parents=True)
        return held

    def restore_offsets(self, held: dict[tuple[bytes, int], tuple[int, tuple[int, int, int]]],
                        commit_log_min: int) -> int:
        """After a rebuild from the commit log: give back each queue of ``held`` (``drop_queues``) that came back
        lower, or not at all, because retention removed its records. It is an empty queue at its old max offset
        again (its old last unit, pointing before ``commit_log_min``, is written back, so a restart finds it
        too): forgotten, its next message took offset 0 below offsets its consumers had committed. Returns how
        many queues; where the rebuild found more, the rebuild wins."""
        restored = 0
        for key, (max_offset, (phy, size, tags_code)) in held.items():
            cq = self.queues.get(key)
            if cq is not None and cq.max_offset >= max_offset:
                continue
            if phy >= commit_log_min:
                # Its last unit names a record still in the log, which the rebuild did not find at that offset:
                # the file disagreed with the commit log, and the commit log is the truth.
                log.warning("consume queue not restored: its last unit names a record the commit log does not "
                            "hold there topic=%s queue_id=%d max_offset=%d phy_offset=%d", key[0].decode("ascii"),
                            key[1], max_offset, phy)
                continue
            cq = self._queue(*key)
            self.queue_units += cq.put(max_offset - 1, phy, size, tags_code)
            cq.correct_min_offset(commit_log_min)
            restored += 1
            log.info("consume queue restored empty after a rebuild topic=%s queue_id=%d offset=%d", cq.topic,
                     cq.queue_id, max_offset)
        return restored

    def start_state(self, phy_offset: int) -> bytes:
        """The start state at ``phy_offset`` (dispatched past it) for a replica that begins its log there: each
        queue's max offset at that point with its last unit before it, and ``deleted``. A queue without a unit
        there (its first unit at or past it, or its unit before it in a file retention deleted) is left out: its
        records from ``phy_offset`` on set where it begins on that replica."""
        queues: StartQueues = {}
        for key, cq in self.queues.items():
            max_offset = cq.max_offset_at(phy_offset)
            unit = cq.unit(max_offset - 1) if max_offset else None
            if unit is not None and unit[1]:
                queues[key] = (max_offset, unit)
        return encode_start_state(phy_offset, queues, self.deleted)

    def start_at(self, phy_offset: int, queues: StartQueues, deleted: dict[tuple[bytes, int], int]) -> None:
        """Dispatch of a store that begins its empty log at ``phy_offset``, with a peer's start state there
        (``decode_start_state``; both empty when the peer sent none). Each queue of ``queues`` is an empty queue
        at its max offset, its unit written (a restart finds it, as after ``restore_offsets``), and ``deleted``
        replaces ``deleted_queues``. Queues and entries an earlier ``start_at`` of the same empty log left go
        first: they were the state at another offset."""
        for cq in list(self.queues.values()):
            self._forget(cq)
            cq.destroy()
        self.deleted = dict(deleted)
        if deleted or self.deleted_queues_path.exists():
            self._write_deleted()
        for key, (max_offset, (phy, size, tags_code)) in queues.items():
            cq = self._queue(*key)
            cq.put(max_offset - 1, phy, size, tags_code)
            cq.correct_min_offset(phy_offset)
        self.dispatched = phy_offset
        self.reset_mark()

    def drop_deleted_topic_queues(self, commit_log_min: int) -> int:
        """Close and delete each queue of a deleted topic that holds no unit at or past its topic's latest
        deletion and whose records retention removed; returns how many. Kept, every topic ever deleted held its
        queues open (two descriptors each) and on disk for good. Their max offsets are written to
        ``deleted_queues_path`` before any file goes (a crash in between leaves both, and the files win)."""
        doomed = []
        for topic, cut in self.cuts.items():
            if topic == TOPIC_DELETE_LOG:
                continue  # recovery reads every cut back from this queue
            for cq in self.by_topic.get(topic, {}).values():
                last = cq.unit(cq.max_offset - 1) if cq.max_offset else None
                if last is not None and last[1] and last[0] < min(cut, commit_log_min):
                    doomed.append(cq)
        if not doomed:
            return 0
        for cq in doomed:
            self.deleted[(cq.topic.encode("ascii"), cq.queue_id)] = cq.max_offset
        self._write_deleted()
        for cq in doomed:
            self._forget(cq)
            cq.destroy()
            log.info("consume queue of a deleted topic deleted topic=%s queue_id=%d max_offset=%d", cq.topic,
                     cq.queue_id, cq.max_offset)
        return len(doomed)

    def _forget(self, cq: ConsumeQueue) -> None:
        """Take ``cq`` out of the dispatcher (its caller destroys it)."""
        del self.queues[(cq.topic.encode("ascii"), cq.queue_id)]
        same_topic = self.by_topic[cq.topic]
        del same_topic[cq.queue_id]
        if not same_topic:
            del self.by_topic[cq.topic]

    def _write_deleted(self) -> None:
        """Replace the ``deleted_queues`` file with ``self.deleted``, durably (entries a queue took over since
        stay in it until then: the queue's files win over them at load)."""
        replace_file(self.deleted_queues_path, encode_deleted_queues(self.deleted))

    def reset_mark(self) -> None:
        """Count the queues' units afresh and mark the current dispatch position (recovery, ``start_at``)."""
        self.queue_units = sum(cq.max_offset for cq in self.queues.values()) + sum(self.deleted.values())
        self.mark = (self.dispatched, self.queue_units)

    def _queue(self, topic: bytes, queue_id: int) -> ConsumeQueue:
        cq = self.queues.get((topic, queue_id))
        if cq is None:
            name = topic.decode("ascii")
            cq = ConsumeQueue(self.cq_root, name, queue_id, self.units_per_file)
            # A queue deleted with its topic, its topic created again: it continues where it stood (its units
            # then come at that offset), and its offset stays counted once in queue_units. Loading files sets
            # the offsets again from them.
            cq.max_offset = cq.min_offset = self.deleted.pop((topic, queue_id), 0)
            self.queues[(topic, queue_id)] = cq
            self.by_topic.setdefault(name, {})[queue_id] = cq
        return cq

    def queue(self, topic: str, queue_id: int) -> ConsumeQueue | None:
        return self.by_topic.get(topic, {}).get(queue_id)

    def queue_offsets(self) -> dict[tuple[bytes, int], int]:
        """The next queue offset of every queue (those deleted with their topic too), the state appends continue
        from."""
        offsets = dict(self.deleted)
        offsets.update((key, cq.max_offset) for key, cq in self.queues.items() if cq.max_offset)
        return offsets

    def add_hint(self, hint: DispatchHint) -> None:
        """What an append built for ``[hint.start, hint.end)`` (any thread; called in log order)."""
        self._hints.append(hint)

    def dispatch(self, upto: int, max_bytes: int, touched: dict[tuple[bytes, int], ConsumeQueue]) -> int:
        """Dispatch records in ``[dispatched, min(upto, dispatched + max_bytes))`` (whole records; a hinted
        batch whole even past ``max_bytes``); returns how many. Touched queues are collected into ``touched``
        for listeners."""
        pos = self.dispatched
        stop = min(upto, pos + max_bytes)
        hints = self._hints
        count = 0
        while pos < stop:
            while hints and hints[0].start < pos:  # already dispatched (re-dispatch, raw copy, replay)
                hints.popleft()
            if hints and hints[0].start == pos and hints[0].end <= upto:
                count += self._dispatch_hint(hints.popleft(), touched)
                pos = self.dispatched
                continue
            count += self._dispatch_records(min(stop, hints[0].start) if hints else stop, touched)
            if self.dispatched == pos:
                break  # nothing published past here yet
            pos = self.dispatched
        self.index.write_headers()
        self.mark = (self.dispatched, self.queue_units)
        return count

    def _dispatch_hint(self, hint: DispatchHint, touched: dict[tuple[bytes, int], ConsumeQueue]) -> int:
        queues = self.queues
        deletions: list[int] = []
        for key, first, units in hint.queues:
            cq = queues.get(key) or self._queue(*key)
            # Counted at once: a later step of the round may fail (out of descriptors creating a file) and the
            # round be retried, when these units are in already and put_units says 0 for them.
            self.queue_units += cq.put_units(first, units)
            touched[key] = cq
            if key[0] == _TOPIC_DELETE_LOG:
                deletions += [phy for phy, _, _ in CQ_UNIT.iter_unpack(units)]
        if deletions:
            # After every unit of the batch is in: a cut hides the units before it, found by offset.
            for phy in deletions:
                self._cut_at(phy)
        index = self.index
        if hint.last_phy > index.indexed_up_to:
            indexed_up_to = index.indexed_up_to
            ts = hint.store_timestamp
            index_file = index.current(hint.start)
            entries = hint.index
            n = len(entries)
            i = 0
            while i < n and entries[i][1] <= indexed_up_to:  # put in order: the indexed ones come first
                i += 1
            while i < n:
                i = index_file.put_many(entries, i, ts)
                if i == n:
                    break
                # The file is full. It ends at the record before this one, as if dispatched record by record.
                h, phy = entries[i]
                before = self._record_before(hint.start, phy)
                if before is not None:
                    index_file.end_phy_offset = before
                    index_file.end_timestamp = ts
                index_file = index.current(phy)
                index_file.put(h, phy, ts)
                i += 1
            index_file.end_phy_offset = hint.last_phy
            index_file.end_timestamp = ts
        self.dispatched = hint.end
        return hint.count

    def _record_before(self, start: int, phy: int) -> int | None:
        """The offset of the record before ``phy`` in ``[start, phy)`` (None if there is none); rare: only when
        an index file fills up."""
        cl = self.commit_log
        pos, before = start, None
        while pos < phy:
            seg = cl.segment_at(pos)
            if seg is None:
                return before
            size, magic = SIZE_MAGIC.unpack_from(seg.mm, pos - seg.start)
            if magic != BLANK_MAGIC:
                before = pos
            pos += size
        return before

    def _dispatch_records(self, stop: int, touched: dict[tuple[bytes, int], ConsumeQueue]) -> int:
        """Dispatch by parsing each record in ``[dispatched, stop)``."""
        cl = self.commit_log
        pos = self.dispatched
        index = self.index
        indexed_up_to = index.indexed_up_to
        index_file = None
        queues = self.queues
        unpack8 = SIZE_MAGIC.unpack_from
        unpack_head = RECORD_HEAD.unpack_from
        unpack_i = BODY_LEN.unpack_from
        unpack_h = PROPS_LEN.unpack_from
        head_size = RECORD_HEAD.size
        seg_size = cl.segment_size
        count = 0
        seg = None
        while pos < stop:
            if seg is None or not seg.start <= pos < seg.start + seg_size:
                seg = cl.segment_at(pos)
                if seg is not None:
                    cl._touched_segments.add(seg.start)
                if seg is None:  # removed by retention under us: skip to the oldest segment left
                    pos = max(pos + 1, cl.min_phy_offset)
                    continue
                mm = seg.mm
            off = pos - seg.start
            size, magic = unpack8(mm, off)
            if magic == BLANK_MAGIC and size == seg_size - off:
                pos += size
                continue
            if magic != MESSAGE_MAGIC or size < MIN_RECORD_SIZE or off + size > seg_size:
                # Only whole records are published, so the bytes changed after they were written; a size of 0
                # would not even move on.
                raise StoreCorruptedError(f"commit log holds no record at phy_offset {pos} (size {size}, magic "
                                          f"{magic:#x}), before its end {cl.end}: its bytes were lost or damaged "
                                          f"after they were written")
            head = unpack_head(mm, off)
            queue_id = head[3]
            queue_offset = head[5]
            store_ts = head[11]
            t = off + head_size + 4 + unpack_i(mm, off + head_size)[0]
            tl = mm[t]
            topic = mm[t + 1:t + 1 + tl]
            p = t + 1 + tl
            pl = unpack_h(mm, p)[0]
            props = mm[p + 2:p + 2 + pl] if pl else b""
            key = (topic, queue_id)
            cq = queues.get(key) or self._queue(topic, queue_id)
            code = 0
            tags = raw_keys = uniq = None
            if props:
                tags, raw_keys, uniq = scan_properties(bytes(props))
                if tags:
                    code = tags_code_of(tags)
            self.queue_units += cq.put(queue_offset, pos, size, code)  # at once, as in _dispatch_hint
            touched[key] = cq
            if topic == _TOPIC_DELETE_LOG:
                self._cut_at(pos)
            if pos > indexed_up_to:
                if index_file is None:
                    index_file = index.current(pos)
                if uniq or raw_keys:
                    for h in index_hashes(bytes(topic), uniq, raw_keys):
                        if not index_file.put(h, pos, store_ts):
                            index_file = index.current(pos)
                            index_file.put(h, pos, store_ts)
                index_file.end_phy_offset = pos
                index_file.end_timestamp = store_ts
            pos += size
            count += 1
        if count:
            cl.note_touched(seg.start, pos - self.dispatched)
        self.dispatched = pos
        return count

    # -- topic deletions ---------------------------------------------------------------------------------------
    def _cut_at(self, phy: int) -> None:
        """Apply the deletion record at ``phy``: cut its topic's queues there."""
        raw = self.commit_log.record_at(phy)
        if raw is None:
            return  # removed by retention: every record before it is gone too
        try:
            topic = decode_record(raw, check_crc=False).body.decode("ascii")
            check_topic(topic)
        except (MessageFormatError, UnicodeDecodeError, ValueError) as e:
            # Only the broker writes this topic (producers may not send to it); never fail dispatch over it.
            log.warning("topic deletion record ignored phy_offset=%d reason=%s", phy, e)
            return
        if phy > self.cuts.get(topic, -1):
            self.cuts[topic] = phy
        for cq in self.by_topic.get(topic, {}).values():
            cq.apply_cut(phy)

    def load_cuts(self) -> None:
        """Re-apply every deletion still in the commit log (after recovery's re-dispatch)."""
        cq = self.queue(TOPIC_DELETE_LOG, 0)
        if cq is None:
            return
        for offset in range(cq.min_offset, cq.max_offset):
            unit = cq.unit(offset)
            if unit is not None and unit[1]:
                self._cut_at(unit[0])

    def cut_of(self, topic: str) -> int:
        """Commit-log offset before which ``topic``'s records were deleted (0: never deleted)."""
        return self.cuts.get(topic, 0)

    def flush(self) -> None:
        for cq in list(self.queues.values()):
            cq.flush()
        self.index.flush()

    def release_cold_pages(self) -> None:
        for cq in list(self.queues.values()):
            cq.release_cold_pages()
        self.index.release_cold_pages()

    def close(self) -> None:
        for cq in self.queues.values():
            cq.close()
        self.queues.clear()
        self.by_topic.clear()
        self.index.close()
