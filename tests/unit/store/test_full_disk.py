"""Writes on a disk that fills up: every store write either lands whole or raises OSError, before anything that
depends on it is published; none may be a SIGBUS (a write through a mapping into an unallocated block) or a
short write taken for a whole one."""

from __future__ import annotations

import errno
import os

import pytest

from broker.store import MessageStore
from broker.store import mapped_file as mapped_file_module
from broker.store.consume_queue import CQ_UNIT_SIZE, ConsumeQueue
from broker.store.mapped_file import RESERVE_CHUNK_BYTES, MappedFile, pwrite_all
from tests.unit.store.helpers import fill, make_batch, small_config


def _no_space(*_args) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_pwrite_all_finishes_a_short_write_and_reports_the_error_that_follows(tmp_path, monkeypatch):
    path = tmp_path / "f"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        real_pwrite = os.pwrite
        calls = []

        def short_pwrite(fd_: int, data, offset: int) -> int:  # the disk takes 3 bytes per write
            calls.append(offset)
            return real_pwrite(fd_, bytes(data)[:3], offset)

        monkeypatch.setattr(mapped_file_module.os, "pwrite", short_pwrite)
        pwrite_all(fd, b"0123456789", 5)
        assert calls == [5, 8, 11, 14]
        monkeypatch.setattr(mapped_file_module.os, "pwrite", real_pwrite)
        assert os.pread(fd, 15, 0) == bytes(5) + b"0123456789"

        taken = iter([4])

        def full_after_four(fd_: int, data, offset: int) -> int:
            n = next(taken, None)
            if n is None:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_pwrite(fd_, bytes(data)[:n], offset)

        monkeypatch.setattr(mapped_file_module.os, "pwrite", full_after_four)
        with pytest.raises(OSError) as info:
            pwrite_all(fd, b"abcdefgh", 0)
        assert info.value.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_mapped_file_is_sparse_until_reserved_then_allocated_a_chunk_ahead(tmp_path):
    size = 4 * RESERVE_CHUNK_BYTES
    f = MappedFile.create(tmp_path / "m", 0, size)
    try:
        assert os.stat(f.path).st_blocks == 0  # an unused file costs no disk
        f.reserve(100)
        assert f.reserved == RESERVE_CHUNK_BYTES
        assert os.stat(f.path).st_blocks * 512 >= RESERVE_CHUNK_BYTES
        f.reserve(RESERVE_CHUNK_BYTES + 1)
        assert f.reserved == 2 * RESERVE_CHUNK_BYTES
        f.reserve(size + 10)  # never past the file
        assert f.reserved == size
    finally:
        f.close()


def test_a_consume_queue_unit_that_finds_the_disk_full_raises_and_publishes_nothing(tmp_path, monkeypatch):
    cq = ConsumeQueue(tmp_path / "cq", "T", 0, units_per_file=100_000)
    try:
        cq.put(0, 0, 100, 7)
        reserved = cq._files[0].reserved
        assert reserved >= CQ_UNIT_SIZE
        # Fill the reserved chunk, so the next unit needs a new one from a full disk.
        units_in_chunk = reserved // CQ_UNIT_SIZE
        cq.put_units(1, bytes(CQ_UNIT_SIZE) * (units_in_chunk - 1))
        monkeypatch.setattr(mapped_file_module.os, "posix_fallocate", _no_space)
        with pytest.raises(OSError) as info:
            cq.put(units_in_chunk, 1000, 100, 7)
        assert info.value.errno == errno.ENOSPC
        assert cq.max_offset == units_in_chunk
        with pytest.raises(OSError):
            cq.put_units(units_in_chunk, bytes(CQ_UNIT_SIZE) * 3)
        assert cq.max_offset == units_in_chunk
    finally:
        cq.close()


def test_a_commit_log_write_that_finds_the_disk_full_leaves_the_store_as_it_was(tmp_path, monkeypatch):
    store = MessageStore.open(small_config(tmp_path / "s"))
    try:
        fill(store, 3)
        store.dispatch_pending()
        end = store.max_phy_offset
        offsets = store.get_max_offset_in_queue("TopicTest", 1)
        real_pwrite = os.pwrite
        calls = []

        def full_after_the_first_write(fd: int, data, offset: int) -> int:
            calls.append(offset)
            if len(calls) > 1:  # the record's head (without its magic) is written, its body is not
                _no_space()
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(mapped_file_module.os, "pwrite", full_after_the_first_write)
        with pytest.raises(OSError):
            store.append_batch(make_batch(3), 1_700_000_003_000, end)
        assert len(calls) == 2
        assert store.max_phy_offset == end
        monkeypatch.undo()
        store.close()  # the half-written record has no magic: recovery ends the log before it
        store = MessageStore.open(small_config(tmp_path / "s"))
        assert store.max_phy_offset == end
        # Applied again once space is back: the same offsets, as if the failed attempt never happened.
        result = store.append_batch(make_batch(3), 1_700_000_003_000, end)
        assert result.ok and result.start_phy_offset == end
        store.dispatch_pending()
        assert offsets == 6 and store.get_max_offset_in_queue("TopicTest", 1) == offsets + 2
    finally:
        store.close()
