"""The store's trio services in-process: reput wake-ups from another thread, group commit, clean shutdown."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import trio

from broker.store import GetMessageStatus, MessageStore
from broker.store.checkpoint import StoreCheckpoint
from broker.store.errors import StoreIOError
from remoting.errors import FatalServerError
from tests.unit.store.helpers import make_batch, small_config


async def test_appends_from_another_thread_are_dispatched_and_announced(tmp_path):
    store = MessageStore.open(small_config(tmp_path / "s", flush_interval_ms=50))
    seen: list[tuple[str, int, int]] = []
    store.add_dispatch_listener(lambda topic, queue_id, max_offset: seen.append((topic, queue_id, max_offset)))
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(store.serve)
            ends = []

            def writer() -> None:  # stands in for pysyncobj's tick thread applying entries
                for seq in range(50):
                    ends.append(store.append_batch(make_batch(seq), seq, store.max_phy_offset).end_phy_offset)

            await trio.to_thread.run_sync(writer)
            with trio.fail_after(10):
                await store.wait_dispatched(ends[-1])
            assert store.get_max_offset_in_queue("TopicTest", 1) == 100
            result = store.get_messages("TopicTest", 1, 64, 1000, 1 << 24)  # 64 units per file here
            assert result.status is GetMessageStatus.FOUND and result.queue_offsets == list(range(64, 100))
            assert ("TopicTest", 1, 100) in seen
            nursery.cancel_scope.cancel()
        # the shielded final flush wrote a checkpoint covering everything
        cp = StoreCheckpoint(tmp_path / "s" / "checkpoint")
        assert cp.commit_log_flushed == store.max_phy_offset == cp.dispatched
        cp.close()
    finally:
        store.close()


async def test_sync_flush_group_commit_covers_many_waiters_with_few_fsyncs(tmp_path):
    store = MessageStore.open(small_config(tmp_path / "s", flush_disk_type="SYNC_FLUSH",
                                           flush_interval_ms=1000))
    syncs = []
    real_sync = store.commit_log.sync_range

    def counting_sync(begin: int, end: int) -> None:
        syncs.append((begin, end))
        real_sync(begin, end)

    store.commit_log.sync_range = counting_sync
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(store.serve)
            done = []

            async def producer(seq: int) -> None:
                result = store.append_batch(make_batch(seq), seq, store.max_phy_offset)
                await store.wait_flushed(result.end_phy_offset)
                assert store.flushed_phy_offset >= result.end_phy_offset
                done.append(seq)

            with trio.fail_after(10):
                async with trio.open_nursery() as producers:
                    for seq in range(64):
                        producers.start_soon(producer, seq)
            assert len(done) == 64
            assert 1 <= len(syncs) < 64
            nursery.cancel_scope.cancel()
    finally:
        store.close()


async def test_wait_flushed_without_serve_flushes_inline(tmp_path):
    with MessageStore.open(small_config(tmp_path / "s")) as store:
        end = store.append_batch(make_batch(0), 1, 0).end_phy_offset
        await store.wait_flushed(end)
        assert store.flushed_phy_offset == end
        await store.wait_dispatched(end)
        assert store.get_max_offset_in_queue("TopicTest", 0) == 2


async def test_writer_thread_and_reader_task_run_together(tmp_path):
    store = MessageStore.open(small_config(tmp_path / "s", segment_size_bytes=128 * 1024))
    stop = threading.Event()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(store.serve)

            def writer() -> None:
                seq = 0
                while not stop.is_set() and seq < 400:
                    store.append_batch(make_batch(seq, queues=1), seq, store.max_phy_offset)
                    seq += 1

            nursery.start_soon(trio.to_thread.run_sync, writer)
            offset = 0
            with trio.fail_after(20):
                while offset < 400 * 8:
                    result = store.get_messages("TopicTest", 0, offset, 64, 1 << 24)
                    if result.status is GetMessageStatus.FOUND:
                        assert result.queue_offsets[0] == offset
                        offset = result.next_begin_offset
                    else:
                        await trio.sleep(0.001)
            stop.set()
            nursery.cancel_scope.cancel()
    finally:
        stop.set()
        store.close()


async def test_a_dispatch_that_finds_the_disk_full_stops_the_store_with_a_fatal_error(tmp_path):
    store = MessageStore.open(small_config(tmp_path / "s"))

    def no_space(*_args) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    try:
        with pytest.raises(BaseExceptionGroup) as info:
            async with trio.open_nursery() as nursery:
                await nursery.start(store.serve)
                store.dispatcher.dispatch = no_space
                store.append_batch(make_batch(0), 1, store.max_phy_offset)
                await trio.sleep(5)  # the reput task wakes at once and fails
        fatal, rest = info.value.split(StoreIOError)
        assert rest is None and fatal is not None
        error = fatal.exceptions[0]
        while isinstance(error, BaseExceptionGroup):
            error = error.exceptions[0]
        assert isinstance(error, FatalServerError) and error.error.errno == errno.ENOSPC
        assert "could not write its consume queues and index" in str(error) and "Free space" in str(error)
    finally:
        store.close()  # the final dispatch fails again: logged, the store still closes


async def test_a_dispatch_out_of_descriptors_for_a_moment_is_retried(tmp_path):
    store = MessageStore.open(small_config(tmp_path / "s"))
    real_dispatch = store.dispatcher.dispatch
    failures = [errno.EMFILE, errno.ENFILE]

    def sometimes_out_of_descriptors(*args) -> int:
        if failures:
            raise OSError(failures.pop(0), os.strerror(errno.EMFILE))
        return real_dispatch(*args)

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(store.serve)
            store.dispatcher.dispatch = sometimes_out_of_descriptors
            end = store.append_batch(make_batch(0), 1, store.max_phy_offset).end_phy_offset
            with trio.fail_after(5):
                await store.wait_dispatched(end)
            assert not failures and store.get_max_offset_in_queue("TopicTest", 1) == 2
            nursery.cancel_scope.cancel()
    finally:
        store.close()
