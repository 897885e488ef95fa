"""The store's background services as trio tasks: reput (dispatch), flush (group commit + checkpoint) and clean.

Blocking work (``fdatasync``) runs in a worker thread so the trio thread keeps serving; dispatch runs on the
trio thread in chunks of ``dispatch_chunk_bytes`` with a checkpoint between them, so a burst of appends cannot
starve request handling.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import trio

from remoting.errors import RESOURCE_ERRNOS

from .errors import StoreIOError

if TYPE_CHECKING:
    from .message_store import MessageStore

log = logging.getLogger(__name__)

__all__ = ["run_services"]


async def run_services(store: MessageStore, task_status: Any) -> None:
    store._trio_token = trio.lowlevel.current_trio_token()
    store._trio_thread = threading.get_ident()
    store._reput_event = trio.Event()
    store._dispatch_progress = trio.Event()
    store._flush_wanted = trio.Event()
    store._flush_done = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reput_loop, store)
            nursery.start_soon(_flush_loop, store)
            nursery.start_soon(_clean_loop, store)
            task_status.started()
    finally:
        store._trio_token = store._trio_thread = None
        store._reput_event = store._dispatch_progress = None
        store._flush_wanted = store._flush_done = None
        with trio.CancelScope(shield=True):
            if not store._closed:
                try:
                    if store.dispatcher.dispatched < store.commit_log.end:
                        store.dispatch_pending()
                    await trio.to_thread.run_sync(store.flush_all)
                except OSError as e:
                    # Stopping anyway (often for this very error): the commit log up to the last good flush
                    # is on disk, the rest in the group's Raft log.
                    log.error("final dispatch and flush failed dir=%s error=%s", store.config.store_dir, e)


# Out of descriptors or memory for a moment (RESOURCE_ERRNOS): dispatch waits and tries again. Dispatch is
# idempotent from its last published offset (units go to their queue offsets), so a retry redoes what the failed
# chunk wrote. A full disk or an I/O error stops the node instead.
DISPATCH_RETRY_S = 0.1


async def _reput_loop(store: MessageStore) -> None:
    chunk = store.config.dispatch_chunk_bytes
    failures = 0
    while True:
        event = trio.Event()
        store._reput_event = event
        while store.dispatcher.dispatched < store.commit_log.end:
            touched: dict = {}
            try:
                store.dispatcher.dispatch(store.commit_log.end, chunk, touched)
            except OSError as e:
                if e.errno not in RESOURCE_ERRNOS:
                    raise StoreIOError(store.config.store_dir, "write its consume queues and index", e) from e
                if not failures:
                    log.warning("dispatch failed, retrying every %.0f ms dir=%s dispatched=%d error=%s",
                                DISPATCH_RETRY_S * 1000, store.config.store_dir, store.dispatcher.dispatched, e)
                failures += 1
                await trio.sleep(DISPATCH_RETRY_S)
                continue
            if failures:
                log.info("dispatch resumed after %d failed attempt(s) dir=%s", failures, store.config.store_dir)
                failures = 0
            store._fire_listeners(touched)
            progress, store._dispatch_progress = store._dispatch_progress, trio.Event()
            if progress is not None:
                progress.set()
            if store.dispatcher.dispatched < store.commit_log.end:
                await trio.sleep(0)  # more to dispatch: let the other tasks run between chunks
        await event.wait()  # a checkpoint too, when the event is set already


async def _flush_loop(store: MessageStore) -> None:
    cfg = store.config
    interval_s = cfg.flush_interval_ms / 1000.0
    all_interval_s = cfg.flush_consume_queue_interval_ms / 1000.0
    next_all = trio.current_time() + all_interval_s
    while True:
        wanted = store._flush_wanted
        assert wanted is not None
        with trio.move_on_after(interval_s):
            await wanted.wait()
        store._flush_wanted = trio.Event()
        try:
            await trio.to_thread.run_sync(store.flush)
        except OSError as e:
            # After a failed fdatasync the kernel may have dropped the dirty pages it could not write, and a
            # retry can report success: only a restart, recovering from the log, is safe.
            raise StoreIOError(store.config.store_dir, "flush the commit log", e) from e
        done, store._flush_done = store._flush_done, trio.Event()
        if done is not None:
            done.set()
        if trio.current_time() >= next_all:
            try:
                await trio.to_thread.run_sync(store.flush_all)
            except OSError as e:
                raise StoreIOError(store.config.store_dir, "flush its consume queues, index and checkpoint",
                                   e) from e
            next_all = trio.current_time() + all_interval_s


async def _clean_loop(store: MessageStore) -> None:
    interval_s = store.config.clean_interval_ms / 1000.0
    while True:
        try:
            store.retention.clean_once()
        except OSError:
            log.exception("retention pass failed; retrying next interval")
        await trio.sleep(interval_s)
