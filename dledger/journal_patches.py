"""pysyncobj's journal, term store and snapshot files, contained: durable, whole, and closed.

The fixes here are numbers 5 (file handles), 7, 17 and 21-25 of the rules in ``dledger/patches.py``, which installs
them (``apply_patches``) and explains each; their regression tests are in ``tests/unit/dledger/test_patches.py``.
Every function here replaces one method of ``pysyncobj.journal`` or ``pysyncobj.serializer``, written against the
pinned version only. A write that fails for want of disk is ``JournalWriteError``, on which ``dledger.group``
stops the member; a descriptor or memory missing for a moment is not (``remoting.errors.RESOURCE_ERRNOS``).
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import Any

import pysyncobj.config as pso_config
import pysyncobj.journal as pso_journal
import pysyncobj.serializer as pso_serializer

from dledger.snapshot import fsync_path
from remoting.errors import RESOURCE_ERRNOS

log = logging.getLogger(__name__)

__all__ = ["JournalWriteError", "SnapshotWriteError"]


def _get_meta_closed(self: Any) -> dict:
    try:
        with open(self.getPath(), "rb") as f:
            return pso_journal.loads(f.read())
    except Exception:
        return {}


_original_get_transmission = pso_serializer.Serializer.getTransmissionData
_original_cancel_transmission = pso_serializer.Serializer.cancelTransmisstion


def _close_finished_transmission(self: Any, transmission_id: Any, before: Any) -> None:
    if before is not None and transmission_id not in self._Serializer__transmissions and "file" in before:
        before["file"].close()


def _get_transmission_closed(self: Any, transmission_id: Any) -> Any:
    # A snapshot file is never empty, so the call that opens a transmission is never the one that ends it.
    before = self._Serializer__transmissions.get(transmission_id)
    result = _original_get_transmission(self, transmission_id)
    _close_finished_transmission(self, transmission_id, before)
    return result


_original_set_transmission = pso_serializer.Serializer.setTransmissionData


def _set_transmission_data_synced(self: Any, data: Any) -> bool:
    """22: the last chunk of a received snapshot is fsync'd before stock renames the file into place, and the
    directory after; only then does it report the snapshot complete (and pysyncobj load it)."""
    incoming = self._Serializer__incomingTransmissionFile
    file_name = self._Serializer__fileName
    if data is None or not data[2] or data[1] or incoming is None or file_name is None:
        return _original_set_transmission(self, data)
    try:
        incoming.write(data[0])
        incoming.flush()
        os.fsync(incoming.fileno())
        done = _original_set_transmission(self, (b"", False, True))  # closes and renames
        if done:
            fsync_path(Path(file_name).parent)
    except OSError as e:
        if incoming is self._Serializer__incomingTransmissionFile:
            incoming.close()
            self._Serializer__incomingTransmissionFile = None
        if e.errno in RESOURCE_ERRNOS:
            log.warning("a snapshot received from the leader could not be synced; not loaded, the leader sends it "
                        "again error=%s", e)
            return False
        raise SnapshotWriteError(e.errno, f"syncing the snapshot received at {file_name} failed: "
                                          f"{e.strerror or e}") from e
    return done


def _cancel_transmission_closed(self: Any, transmission_id: Any) -> None:
    before = self._Serializer__transmissions.get(transmission_id)
    _original_cancel_transmission(self, transmission_id)
    _close_finished_transmission(self, transmission_id, before)


_original_check_serializing = pso_serializer.Serializer.checkSerializing
_original_serialize = pso_serializer.Serializer.serialize


def _serialize_handing_over(self: Any, data: Any, id: Any) -> None:  # noqa: A002 (pysyncobj's name)
    """21: with a ``serializeChecker``, the serializer writes and puts its file in place itself, and the checker
    reports when it has; without one, stock."""
    if self._Serializer__serializeChecker is None or self._Serializer__fileName is None:
        _original_serialize(self, data, id)
        return
    if self._Serializer__pid != 0:
        return
    self._Serializer__currentID = id
    if self._Serializer__serializer(self._Serializer__fileName + ".tmp", data[1:]):
        self._Serializer__pid = -1  # as stock's forked serializer: no other snapshot, no transmission meanwhile


def _check_serializing_closing(self: Any) -> Any:
    # A finished snapshot replaces the transmissions table (``self.__transmissions = {}``), dropping the files
    # of snapshots still being streamed to lagging followers; they restart from the new snapshot.
    before = self._Serializer__transmissions
    result = _original_check_serializing(self)
    if self._Serializer__serializeChecker is not None and result[0] == pso_config.SERIALIZER_STATE.SUCCESS:
        self._Serializer__transmissions = {}  # 21: stock does so for its own serializers only
    if self._Serializer__transmissions is not before:
        for transmission in before.values():
            if "file" in transmission:
                transmission["file"].close()
    return result


_RECORD_HEAD = struct.Struct("<IQQ")  # pysyncobj journal record: size, idx, term | command | size
_RECORD_TAIL = struct.Struct("<I")
_original_journal_add = pso_journal.FileJournal.add


class JournalWriteError(OSError):
    """The Raft journal could not be written (17); ``dledger.group`` stops the member on it."""

    action = "write its Raft journal"


class SnapshotWriteError(JournalWriteError):
    """A snapshot received from the leader could not be stored (22)."""

    action = "store the Raft snapshot it received"


def _journal_add_in_place(self: Any, command: Any, idx: int, term: int) -> None:
    data = pso_journal.to_bytes(command)
    size = 16 + len(data)
    offset = self._FileJournal__currentOffset
    journal_file = self._FileJournal__journalFile
    try:
        # Tail first: the file grows once to its final size, then the head and the command fill it.
        journal_file.write(offset + 4 + size, _RECORD_TAIL.pack(size))
        journal_file.write(offset, _RECORD_HEAD.pack(size, idx, term))
        journal_file.write(offset + _RECORD_HEAD.size, data)
    except OSError as e:
        raise JournalWriteError(e.errno, f"Raft journal write at offset {offset} failed: {e.strerror or e}") from e
    # Into the in-memory log only once it is in the file: a failed write leaves no entry that pysyncobj could
    # acknowledge and a restart would not find.
    self._FileJournal__journal.append((command, idx, term))
    self._FileJournal__currentOffset = offset + size + 8
    self._FileJournal__setLastRecordOffset(self._FileJournal__currentOffset)


_original_delete_entries_to = pso_journal.FileJournal.deleteEntriesTo


def _delete_entries_to_replacing(self: Any, entry_to: int) -> None:
    """23: with ``_dledger_sync`` (set by ``RaftMember`` for SYNC_FLUSH), the entries kept go to a new file that
    replaces the journal once it is on disk; otherwise stock's rewrite in place."""
    if not getattr(self, "_dledger_sync", False):
        _original_delete_entries_to(self, entry_to)
        return
    kept = self._FileJournal__journal[entry_to:]
    old = self._FileJournal__journalFile
    path = old._ResizableFile__fileName
    tmp = path + ".tmp"
    offset = pso_journal.FIRST_RECORD_OFFSET
    replaced = False
    try:
        with open(tmp, "wb") as f:
            f.write(self._FileJournal__getDefaultHeader())
            for command, idx, term in kept:
                data = pso_journal.to_bytes(command)
                size = 16 + len(data)
                f.write(_RECORD_HEAD.pack(size, idx, term))
                f.write(data)
                f.write(_RECORD_TAIL.pack(size))
                offset += size + 8
            f.seek(pso_journal.LAST_RECORD_OFFSET_OFFSET)
            f.write(_RECORD_TAIL.pack(offset))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        replaced = True
        fsync_path(Path(path).parent)
        new = pso_journal.ResizableFile(path)
    except OSError as e:
        if e.errno in RESOURCE_ERRNOS and not replaced:
            log.warning("the Raft journal could not be rewritten without the entries its snapshot covers; kept "
                        "whole until the next compaction error=%s", e)
            return
        raise JournalWriteError(e.errno, f"rewriting the Raft journal {path} without the entries its snapshot "
                                         f"covers failed: {e.strerror or e}") from e
    # The old mapping's inode is gone from the directory: closed without a flush, nothing of it is read again.
    old._ResizableFile__mm.close()
    old._ResizableFile__f.close()
    self._FileJournal__journalFile = new
    self._FileJournal__journal = list(kept)
    self._FileJournal__currentOffset = offset


_original_resizable_write = pso_journal.ResizableFile.write


def _resizable_write_allocated(self: Any, offset: int, values: bytes) -> None:
    """17: ``ResizableFile.write`` with the blocks allocated before the mapping is written, so a full disk is an
    OSError (the file and the mapping as they were), not a SIGBUS. The file grows as stock does (by its resize
    factor, or to the end of the write), through ``mmap.resize`` (Linux has no need of stock's fallback)."""
    mm = self._ResizableFile__mm
    end = offset + len(values)
    if end > getattr(self, "_dledger_allocated", 0):
        mapped = len(mm)
        target = mapped if end <= mapped else max(int(mapped * self._ResizableFile__resizeFactor), end)
        # From the start: the file's initial size is sparse too, and allocated ranges cost nothing again.
        os.posix_fallocate(self._ResizableFile__f.fileno(), 0, target)
        if target > mapped:
            mm.resize(target)
        self._dledger_allocated = target
    mm[offset:end] = values


_original_store_meta = pso_journal.MetaStorer.storeMeta
_original_file_journal_init = pso_journal.FileJournal.__init__


def _store_meta_synced(self: Any, meta: dict) -> None:
    """24: stock ``MetaStorer.storeMeta`` with the new file fsync'd before it is renamed over the old one."""
    path = self.getPath()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(pso_journal.dumps(meta))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load_whole_records(self: Any) -> None:
    """25: the records of a journal file up to the first one a torn append left (see the module's rules)."""
    journal_file = self._FileJournal__journalFile
    mm = journal_file._ResizableFile__mm
    header_end = self._FileJournal__getLastRecordOffset()
    end = min(header_end, len(mm))
    records = self._FileJournal__journal
    offset = pso_journal.FIRST_RECORD_OFFSET
    prev_idx = prev_term = None
    why = None
    while offset < end:
        if offset + _RECORD_HEAD.size > end:
            why = "a record head cut short"
            break
        size, idx, term = _RECORD_HEAD.unpack_from(mm, offset)
        if size < 16 or offset + size + 8 > end:
            why = f"a record size of {size} bytes"
            break
        if _RECORD_TAIL.unpack_from(mm, offset + 4 + size)[0] != size:
            why = "a record whose trailer does not repeat its size"
            break
        if prev_idx is not None and (idx != prev_idx + 1 or term < prev_term):
            why = f"record {idx} (term {term}) after record {prev_idx} (term {prev_term})"
            break
        records.append((mm[offset + _RECORD_HEAD.size:offset + 4 + size], idx, term))
        prev_idx, prev_term = idx, term
        offset += size + 8
    self._FileJournal__currentOffset = offset
    if offset != header_end:
        log.warning("the Raft journal ends with a torn append (a power loss during its sync): kept %d records, "
                    "dropped %d bytes from offset %d at %s; the leader sends what follows", len(records),
                    header_end - offset, offset, why or "the end of the file")
        self._FileJournal__setLastRecordOffset(offset)


def _file_journal_init_checked(self: Any, journal_file: str) -> None:
    """25: stock ``FileJournal.__init__`` with the records loaded by ``_load_whole_records``."""
    self._FileJournal__journalFile = pso_journal.ResizableFile(journal_file,
                                                               defaultContent=self._FileJournal__getDefaultHeader())
    self._FileJournal__journal = []
    self._FileJournal__metaStorer = pso_journal.MetaStorer(journal_file + ".meta")
    self._FileJournal__meta = self._FileJournal__metaStorer.getMeta()
    self._FileJournal__metaSaved = True
    _load_whole_records(self)


_original_set_current_term = pso_journal.FileJournal.setCurrentTerm


def _set_current_term_or_stop(self: Any, term: int, voted_for: Any) -> None:
    """17: a term and vote that cannot be stored stop the member (``JournalWriteError``), unless only a
    descriptor or memory was missing for a moment: then stock behaviour, and the timer stores them again."""
    try:
        _original_set_current_term(self, term, voted_for)
        # 24: the rename on disk before the vote (or the request for one) goes out.
        fsync_path(Path(self._FileJournal__metaStorer.getPath()).parent)
    except OSError as e:
        if e.errno in RESOURCE_ERRNOS:
            self._FileJournal__metaSaved = False  # stored again by onOneSecondTimer
            raise
        raise JournalWriteError(e.errno, f"storing the Raft term {term} and vote failed: {e.strerror or e}") \
            from e
