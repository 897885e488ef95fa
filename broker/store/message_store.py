"""``MessageStore``: the single-node storage engine: CommitLog + ConsumeQueue + IndexFile + services.

Threads and tasks:

* ``append_batch`` / ``append_commit_log_raw`` may run on any one thread at a time (pysyncobj's tick thread
  applies Raft entries); they write bytes, then publish the new end under a tiny lock, then poke the reput task
  through the trio token (``run_sync_soon`` is thread-safe), or set its event directly when they run on the trio
  thread itself (dledger ticks pysyncobj there). No trio call and no I/O wait on this path.
* Reads run on the trio thread and look only at published state: the commit-log end and each ConsumeQueue's
  max offset (advanced by the reput task after the unit is written).
* ``serve`` runs three child tasks: reput (dispatch into ConsumeQueue/IndexFile), flush (fdatasync in a worker
  thread; group commit for SYNC_FLUSH; checkpoint) and clean (retention and the disk guard).
"""

from __future__ import annotations

import logging
import shutil
import struct
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio
from crc32c import crc32c

from remoting.dirlock import DirectoryLock
from remoting.message import (CheckedBatch, MessageFormatError, MessageView, batch_store_host, decode_record,
                              parse_msg_id, validate_batch)

from .checkpoint import StoreCheckpoint
from .commit_log import BuiltBatch, CommitLog
from .config import StoreConfig
from .consume_queue import CQ_UNIT
from .dispatch import Dispatcher, DispatchListener, decode_start_state
from .dispatch_info import DispatchHint
from .errors import StoreClosedError, StoreCorruptedError
from .index_file import IndexService
from .raw_copy import validate_raw
from .results import (AppendResult, AppendStatus, GetMessageResult, GetMessageStatus, QueryMessageResult,
                      StoreStatistics)
from .retention import Retention
from .services import run_services

log = logging.getLogger(__name__)

__all__ = ["MessageStore"]

_STORE_TS = struct.Struct(">q")
_STORE_TS_AT = 56  # byte position of store_timestamp inside a record
_MIN_FILTER_UNITS = 800  # RocketMQ scans at least 16,000 bytes of ConsumeQueue per pull


def _disk_usage_ratio(path: Path) -> float:
    usage = shutil.disk_usage(path)
    return usage.used / usage.total if usage.total else 0.0


class MessageStore:
    def __init__(self, config: StoreConfig, *, disk_usage_fn: Callable[[Path], float] | None = None,
                 now_fn: Callable[[], float] | None = None) -> None:
        self.config = config
        self.commit_log = CommitLog(config)
        self.dispatcher = Dispatcher(self.commit_log, config.store_dir / "consumequeue",
                                     config.consume_queue_units_per_file,
                                     IndexService(config.store_dir / "index", config.index_hash_slots,
                                                  config.index_max_entries),
                                     deleted_queues_path=config.store_dir / "deleted_queues")
        self.retention = Retention(self, disk_usage_fn or _disk_usage_ratio, now_fn or time.time)
        self._checkpoint: StoreCheckpoint | None = None
        self._queue_offsets: dict[tuple[bytes, int], int] = {}
        self._write_lock = threading.Lock()
        self._files_lock = threading.Lock()  # flush (worker thread) vs retention closing descriptors
        self._flushed = 0
        self._listeners: list[DispatchListener] = []
        self._trio_token: Any = None
        self._trio_thread: int | None = None
        self._reput_wake_pending = False
        self._reput_event: trio.Event | None = None
        self._dispatch_progress: trio.Event | None = None
        self._flush_wanted: trio.Event | None = None
        self._flush_done: trio.Event | None = None
        self._closed = False
        # Set once _recover finished: only a recovered store may dispatch and flush on close. After a refused
        # recovery (say, consume queue files of another units_per_file), close re-dispatched the whole commit log
        # from offset 0 into the files just refused and wrote a checkpoint vouching for them.
        self._recovered = False
        self._dir_lock: DirectoryLock | None = None  # taken by open()

    # -- lifecycle -------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, config: StoreConfig, *, disk_usage_fn: Callable[[Path], float] | None = None,
             now_fn: Callable[[], float] | None = None) -> MessageStore:
        """Open (creating if needed) the store at ``config.store_dir`` and recover from a crash: verify the
        commit log past the checkpoint, cut a torn tail, bring ConsumeQueue/IndexFile back in line."""
        # Before anything in the directory is read: a second process recovering it under a running one would cut
        # what it takes for a torn tail and rewrite the checkpoint (remoting.dirlock).
        lock = DirectoryLock(config.store_dir, "store_dir")
        try:
            store = cls(config, disk_usage_fn=disk_usage_fn, now_fn=now_fn)
        except BaseException:
            lock.release()
            raise
        store._dir_lock = lock
        try:
            store._recover()
        except BaseException:
            store.close()
            raise
        store._recovered = True
        return store

    def _recover(self) -> None:
        started = time.monotonic()
        cfg = self.config
        cfg.store_dir.mkdir(parents=True, exist_ok=True)
        self._checkpoint = StoreCheckpoint(cfg.store_dir / "checkpoint")
        cl = self.commit_log
        end = cl.recover(self._checkpoint.commit_log_flushed)
        # Bytes past the checkpoint survived in the page cache but may never have reached the disk: the
        # flush_all below syncs them before a new checkpoint vouches for them.
        flushed = self._checkpoint.commit_log_flushed
        self._flushed = min(flushed, end) if flushed is not None and flushed >= cl.min_phy_offset \
            else cl.min_phy_offset
        d = self.dispatcher
        d.load_queues(cl.min_phy_offset, end)
        d.index.load(end)
        damage = d.queue_damage(self._checkpoint.dispatched, self._checkpoint.queue_units)
        held = {}
        if damage is not None:
            log.warning("consume queues do not match the commit log, rebuilding them from it dir=%s reason=%s",
                        cfg.store_dir, damage)
            held = d.drop_queues()
        damage = d.index_damage()
        if damage is not None:
            log.warning("index files do not match the commit log, rebuilding them from it dir=%s reason=%s",
                        cfg.store_dir, damage)
            d.index.drop()
        restart = self._checkpoint.dispatched
        if restart is None or (d.index.restart_offset is not None and d.index.restart_offset < restart):
            # The index header names the last record dispatched (its units and entries are written before the
            # header), so without a checkpoint re-dispatch starts there rather than at the start of the log; and
            # there too when the index ends before the checkpoint: its newest file was lost or never published.
            restart = d.index.restart_offset if d.index.restart_offset is not None else cl.min_phy_offset
        if end > cl.min_phy_offset and (not d.has_queue_files() or not d.index.files):
            restart = cl.min_phy_offset  # derived files were deleted: rebuild them from the whole commit log
        d.dispatched = min(max(restart, cl.min_phy_offset), end)
        redispatched = 0
        try:
            while d.dispatched < end:
                redispatched += d.dispatch(end, cfg.dispatch_chunk_bytes, {})
        except StoreCorruptedError as e:
            if flushed is None or d.dispatched >= flushed:
                raise
            raise StoreCorruptedError(f"{e}. The checkpoint vouched for them: remove {self._checkpoint.path}, and "
                                      f"recovery verifies the last segments and ends the log before the damage (a "
                                      f"group member then gets the rest from its peers)") from None
        # A queue whose records retention removed is not in the commit log any more: rebuilt from it alone, it
        # would be gone, and its next message would take offset 0 (appends continue from _queue_offsets below).
        d.restore_offsets(held, cl.min_phy_offset)
        d.delete_leftovers()
        d.load_cuts()
        d.reset_mark()
        self._queue_offsets = d.queue_offsets()
        self.retention.refresh_disk_state()
        self.flush_all()
        log.info("store opened dir=%s min_phy_offset=%d max_phy_offset=%d redispatched=%d elapsed_ms=%.1f",
                 cfg.store_dir, cl.min_phy_offset, end, redispatched, (time.monotonic() - started) * 1000)

    def close(self) -> None:
        if self._closed:
            return
        if self._checkpoint is not None and not self._recovered:
            self._checkpoint.close()
        elif self._checkpoint is not None:
            try:
                if self.dispatcher.dispatched < self.commit_log.end:
                    self.dispatch_pending()
                self.flush_all()
            except OSError as e:
                # Closing anyway, often because of this very error (a full disk): recovery redoes what is lost.
                log.error("store close could not dispatch and flush dir=%s error=%s", self.config.store_dir, e)
            finally:
                self._checkpoint.close()
        self._closed = True
        try:
            self.dispatcher.close()
            self.commit_log.close()
        finally:
            if self._dir_lock is not None:
                self._dir_lock.release()
                self._dir_lock = None

    def __enter__(self) -> MessageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- append ----------------------------------------------------------------------------------------------
    @property
    def max_phy_offset(self) -> int:
        return self.commit_log.end

    @property
    def min_phy_offset(self) -> int:
        return self.commit_log.min_phy_offset

    @property
    def flushed_phy_offset(self) -> int:
        return self._flushed

    @property
    def dispatched_phy_offset(self) -> int:
        return self.dispatcher.dispatched

    def check_batch(self, batch: bytes, at: int, *, check_disk: bool = True) -> tuple[int, AppendResult | None]:
        """The batch's message count and None, or 0 and the refusal ``append_batch`` gives it at offset ``at``
        (malformed: MESSAGE_ILLEGAL / PROPERTIES_SIZE_EXCEEDED; DISK_FULL past ``disk_reject_ratio``)."""
        try:
            if type(batch) is CheckedBatch:
                # The broker's send path checked it, against BrokerConfig.max_message_size (never above ours).
                count = batch.count
            else:
                count = validate_batch(batch, max_message_size=self.config.max_message_size)
        except MessageFormatError as e:
            status = (AppendStatus.PROPERTIES_SIZE_EXCEEDED if e.field == "properties"
                      else AppendStatus.MESSAGE_ILLEGAL)
            return 0, AppendResult(status, at, at, remark=str(e), field=e.field)
        if check_disk and self.retention.disk_full:
            return 0, AppendResult(AppendStatus.DISK_FULL, at, at, field="disk",
                                   remark=f"disk usage {self.retention.disk_usage:.0%} passed disk_reject_ratio "
                                          f"{self.config.disk_reject_ratio:.0%}")
        return count, None

    def append_batch(self, batch: bytes, store_timestamp: int, expected_phy_offset: int, *,
                     check_disk: bool = True) -> AppendResult:
        """Append a whole batch deterministically at the end. DUPLICATE (nothing written) when
        ``expected_phy_offset`` is behind the end, OFFSET_MISMATCH when ahead; bad input gets its status and
        writes nothing. ``check_disk=False`` skips the disk guard: a Raft follower must apply what its group
        committed, so the guard belongs on the leader before it proposes."""
        if self._closed:
            raise StoreClosedError("the message store is closed")
        if not isinstance(batch, bytes):
            batch = bytes(batch)
        with self._write_lock:
            end = self.commit_log.end
            if expected_phy_offset != end:
                status = AppendStatus.DUPLICATE if expected_phy_offset < end else AppendStatus.OFFSET_MISMATCH
                return AppendResult(status, expected_phy_offset, end,
                                    remark=f"expected_phy_offset {expected_phy_offset}, commit log ends at {end}")
            count, refusal = self.check_batch(batch, end, check_disk=check_disk)
            if refusal is not None:
                return refusal
            built = self.commit_log.append(batch, count, store_timestamp, self._queue_offsets)
            self.dispatcher.add_hint(built.hint)
        self._notify_appended()
        phys = built.phy_offsets
        return AppendResult(AppendStatus.PUT_OK, phys[0] if phys else end, built.end, batch_store_host(batch), phys,
                            built.queue_offsets, built.sizes, built.queue_ids)

    def prepare_append(self, batches: Sequence[tuple[bytes, int]], start_phy_offset: int, store_timestamp: int,
                       planned: dict[tuple[bytes, int], int]) -> BuiltBatch:
        """Build the commit-log bytes of validated ``(batch, count)`` pairs as if appended at
        ``start_phy_offset`` (no I/O, any thread): a Raft leader builds once and every replica writes the same
        bytes with ``apply_built``. ``planned`` holds the next queue offsets of batches built but not applied
        yet; it is updated with this one's (the caller clears it once nothing is in flight)."""
        built = self.commit_log.build(batches, start_phy_offset, store_timestamp, self._queue_offsets, planned)
        planned.update(built.touched)
        return built

    def apply_built(self, pieces: Sequence[tuple[int, int, int]], data: bytes | memoryview,
                    touched: Mapping[tuple[bytes, int], int], expected_phy_offset: int,
                    hint: DispatchHint | None = None) -> AppendStatus:
        """Write bytes made by ``prepare_append`` (on this or another replica) at the end: PUT_OK,
        DUPLICATE (``expected_phy_offset`` behind the end: nothing written) or OFFSET_MISMATCH (ahead). With the
        build's ``hint`` the dispatcher writes its units and index entries without parsing the records.

        Behind the end, the log must hold the build's own bytes: CORRUPTED (nothing written) when it holds
        others. A log that ends inside the build lost the rest of it (recovery cut a tail the Raft log still
        has): the rest is written, PUT_OK."""
        if self._closed:
            raise StoreClosedError("the message store is closed")
        with self._write_lock:
            end = self.commit_log.end
            if expected_phy_offset != end:
                if expected_phy_offset > end:
                    return AppendStatus.OFFSET_MISMATCH
                # Written before: pysyncobj replays its journal on restart, and a catch-up copies past entries
                # it then applies. Builds are written whole, so a log that ends inside one lost the rest of it
                # (a power loss, a tail cut by recovery); skipped, it would never be written, and every later
                # build would start past the end.
                rest = self._unwritten_part(pieces, data, end)
                if rest is None:
                    return AppendStatus.CORRUPTED
                if not rest:
                    return AppendStatus.DUPLICATE
                log.warning("commit log completed from a build it held only in part expected_phy_offset=%d "
                            "end=%d build_end=%d", expected_phy_offset, end, rest[-1][0] + rest[-1][2])
                pieces, hint = rest, None
            self.commit_log.write_built(pieces, data, self._queue_offsets, touched)
            if hint is not None:
                self.dispatcher.add_hint(hint)
        self._notify_appended()
        return AppendStatus.PUT_OK

    def _unwritten_part(self, pieces: Sequence[tuple[int, int, int]], data: bytes | memoryview,
                        end: int) -> list[tuple[int, int, int]] | None:
        """The pieces of a build from ``end`` on (empty: all written), or None when the log before ``end`` holds
        other bytes than the build's (retention's deleted segments aside)."""
        cl = self.commit_log
        mv = memoryview(data)
        rest = []
        for phy, o, n in pieces:
            held = min(n, end - phy)
            if held > 0 and phy >= cl.min_phy_offset and cl.read(phy, held) != mv[o:o + held]:
                return None
            held = max(held, 0)
            if held < n:
                rest.append((phy + held, o + held, n - held))
        return rest

    def start_at(self, phy_offset: int, state: bytes | None = None) -> None:
        """Begin an empty store's commit log at ``phy_offset`` (a segment start) instead of 0: a member rebuilt
        empty after its peers' retention deleted the segments before that offset. ``state`` is the peer's
        ``start_state(phy_offset)``: each queue that holds records before it becomes an empty queue at its offset
        there, kept on disk (a restart before any record is copied still knows it), and the peer's
        ``deleted_queues`` become this store's. A queue whose records all lie before ``phy_offset`` is known from
        that alone: unknown, its next message took offset 0 below what the other replicas hold and consumers
        committed. Without a state (a peer of an older version) each queue begins at the queue offset of its
        first record copied (``append_commit_log_raw``), and such idle queues stay unknown (logged).

        "Empty" means no commit-log byte is stored: queues an earlier ``start_at`` left are replaced."""
        if self._closed:
            raise StoreClosedError("the message store is closed")
        cl = self.commit_log
        d = self.dispatcher
        if type(phy_offset) is not int or phy_offset < 0 or phy_offset % cl.segment_size:
            raise ValueError(f"phy_offset {phy_offset!r} is not a segment start (a multiple of "
                             f"segment_size_bytes {cl.segment_size})")
        queues, deleted = decode_start_state(state, phy_offset) if state is not None else ({}, {})
        with self._write_lock:
            readable = sum(cq.min_offset < cq.max_offset for cq in d.queues.values())
            if cl.end != cl.min_phy_offset or cl.segments() or readable:
                raise ValueError(f"start_at needs an empty store; this one holds the commit log "
                                 f"[{cl.min_phy_offset}, {cl.end}) and {readable} queues with messages")
            cl.end = cl.min_phy_offset = phy_offset
            d.start_at(phy_offset, queues, deleted)
            self._queue_offsets = d.queue_offsets()
            self._flushed = phy_offset
        if state is None:
            log.warning("empty store starts its commit log at phy_offset=%d without the peer's queue offsets there "
                        "(a peer of an older version): a queue whose records all lie before it is unknown, and its "
                        "next message takes queue offset 0", phy_offset)
        else:
            log.info("empty store starts its commit log at phy_offset=%d queues=%d deleted_queues=%d", phy_offset,
                     len(queues), len(deleted))
        self.flush_all()  # the checkpoint remembers the start until the first segment exists

    def start_state(self, phy_offset: int) -> bytes:
        """What a replica beginning its empty log at ``phy_offset`` (``start_at``) needs besides the records from
        there: the queue offsets at that point (``Dispatcher.start_state``; layout in docs/store-format.md).
        ``phy_offset`` must lie within what is dispatched and still stored."""
        d = self.dispatcher
        if type(phy_offset) is not int or not self.commit_log.min_phy_offset <= phy_offset <= d.dispatched:
            raise ValueError(f"phy_offset {phy_offset!r} is outside the dispatched commit log "
                             f"[{self.commit_log.min_phy_offset}, {d.dispatched}]")
        return d.start_state(phy_offset)

    def read_commit_log(self, phy_offset: int, max_bytes: int) -> bytes:
        """Raw commit-log bytes from ``phy_offset`` for a catching-up replica: whole records and end-of-segment
        blanks (a blank is its 8-byte header plus zeros up to the segment end), at most ``max_bytes`` unless
        the first record alone is longer. Empty at the end."""
        if phy_offset < self.commit_log.min_phy_offset or phy_offset > self.commit_log.end:
            raise ValueError(f"phy_offset {phy_offset} is outside the commit log "
                             f"[{self.commit_log.min_phy_offset}, {self.commit_log.end}]")
        return self.commit_log.read_raw(phy_offset, max_bytes)

    def append_commit_log_raw(self, phy_offset: int, data: bytes) -> AppendResult:
        """Append raw bytes copied from a peer's ``read_commit_log``. Every record is checked (size, magic,
        offset, CRC, queue offsets) before anything is written; the reput task then indexes them."""
        if self._closed:
            raise StoreClosedError("the message store is closed")
        with self._write_lock:
            end = self.commit_log.end
            if phy_offset != end:
                status = AppendStatus.DUPLICATE if phy_offset < end else AppendStatus.OFFSET_MISMATCH
                return AppendResult(status, phy_offset, end,
                                    remark=f"phy_offset {phy_offset}, commit log ends at {end}")
            mv = memoryview(data)
            # A store that begins past 0 (start_at, or retention) may meet a queue mid-way: the first record of a
            # queue it has never seen sets where that queue begins.
            checked = validate_raw(self.commit_log, mv, end, self._queue_offsets,
                                   open_queues=self.commit_log.min_phy_offset > 0)
            if isinstance(checked, str):
                return AppendResult(AppendStatus.CORRUPTED, end, end, remark=checked, field="data")
            phys, qoffs, sizes, qids, touched, store_host = checked
            new_end = self.commit_log.append_raw(mv)
            self._queue_offsets.update(touched)
        self._notify_appended()
        return AppendResult(AppendStatus.PUT_OK, end, new_end, store_host, phys, qoffs, sizes, qids)

    def segment_checksums(self, up_to_phy_offset: int) -> list[tuple[int, int, int]]:
        """``(segment start, bytes covered, crc32c)`` per segment below ``up_to_phy_offset`` (clamped to the
        end), for comparing replicas."""
        out = []
        for start, view in self.segment_views(up_to_phy_offset):
            with view:
                out.append((start, len(view), crc32c(view)))
        return out

    def segment_views(self, up_to_phy_offset: int) -> list[tuple[int, memoryview]]:
        """``(segment start, view of its bytes below up_to_phy_offset)`` per segment (clamped to the end). Taken on
        the thread that appends and deletes segments; published bytes never change, and a view keeps its segment
        mapped should retention delete it meanwhile, so the views may be read from any thread. Release them."""
        up_to = min(up_to_phy_offset, self.commit_log.end)
        out = []
        for seg in self.commit_log.segments():
            if seg.start >= up_to:
                break
            out.append((seg.start, seg.mv[:min(seg.size, up_to - seg.start)]))
        return out

    # -- dispatch --------------------------------------------------------------------------------------------
    def _notify_appended(self) -> None:
        if threading.get_ident() == self._trio_thread:  # set with the token, None while no trio run serves
            # Applied on the trio thread (dledger ticks pysyncobj there): set the event at once. Through the token
            # every applied entry cost each member a wake-up of its own loop (a write to trio's wake-up socket,
            # an epoll return, a system task step), ~260 a second in a single-send run.
            if self._reput_event is not None:
                self._reput_event.set()
            return
        token = self._trio_token
        if token is not None and not self._reput_wake_pending:
            self._reput_wake_pending = True
            try:
                token.run_sync_soon(self._reput_wakeup)
            except RuntimeError:  # the trio run finished: nobody to wake
                self._reput_wake_pending = False

    def _reput_wakeup(self) -> None:
        self._reput_wake_pending = False
        if self._reput_event is not None:
            self._reput_event.set()

    def add_dispatch_listener(self, callback: DispatchListener) -> None:
        """``callback(topic, queue_id, max_queue_offset)`` after new units of a queue became readable (on the
        thread that dispatches: the trio thread under ``serve``). It must not block."""
        self._listeners.append(callback)

    def remove_dispatch_listener(self, callback: DispatchListener) -> None:
        self._listeners.remove(callback)

    def dispatch_pending(self, max_bytes: int | None = None) -> int:
        """Dispatch committed records now, on the calling thread (``serve`` does this in its reput task);
        returns how many records."""
        touched: dict = {}
        n = self.dispatcher.dispatch(self.commit_log.end, max_bytes or (1 << 62), touched)
        self._fire_listeners(touched)
        return n

    def _fire_listeners(self, touched: dict) -> None:
        if self._listeners:
            for cq in touched.values():
                for cb in list(self._listeners):
                    try:
                        cb(cq.topic, cq.queue_id, cq.max_offset)
                    except Exception:
                        log.exception("dispatch listener failed topic=%s queue_id=%d", cq.topic, cq.queue_id)

    async def wait_dispatched(self, phy_offset: int) -> None:
        """Wait until every record before ``phy_offset`` is readable through the ConsumeQueue."""
        while self.dispatcher.dispatched < phy_offset:
            if self._dispatch_progress is None:  # not serving: dispatch here
                self.dispatch_pending()
                if self.dispatcher.dispatched < phy_offset:
                    await trio.sleep(0.001)  # not appended yet (another thread appends)
                continue
            await self._dispatch_progress.wait()

    # -- flush -----------------------------------------------------------------------------------------------
    def flush(self) -> int:
        """fdatasync the commit log up to its current end (any thread); returns the flushed offset."""
        end = self.commit_log.end
        if end > self._flushed:
            with self._files_lock:
                self.commit_log.sync_range(self._flushed, end)
            self._flushed = max(self._flushed, end)
        return self._flushed

    def flush_all(self) -> None:
        """Flush the commit log, then ConsumeQueue and IndexFile, then write the checkpoint; release pages
        behind the hot window so RSS does not grow with the data stored, and drop flushed commit-log pages
        behind ``page_cache_window_bytes`` from the page cache."""
        # Read before the flush, which syncs the commit log to its end: flushed is then at or past dispatched.
        dispatched, queue_units = self.dispatcher.mark
        flushed = self.flush()
        with self._files_lock:
            self.dispatcher.flush()
            if self._checkpoint is not None:
                self._checkpoint.write(flushed, dispatched, queue_units)
            self.commit_log.release_cold_pages(self.commit_log.end, self.config.hot_window_bytes)
            if self.config.page_cache_window_bytes:
                self.commit_log.drop_cached(flushed - self.config.page_cache_window_bytes)
            self.dispatcher.release_cold_pages()

    async def wait_flushed(self, phy_offset: int) -> None:
        """Wait until the commit log is durable up to ``phy_offset`` (group commit: one fdatasync covers
        every waiter whose bytes were written before it)."""
        while self._flushed < min(phy_offset, self.commit_log.end):
            if self._flush_done is None or self._flush_wanted is None:
                await trio.to_thread.run_sync(self.flush)
                continue
            done = self._flush_done
            self._flush_wanted.set()
            await done.wait()

    # -- services --------------------------------------------------------------------------------------------
    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run reput, flush and clean until cancelled; the final flush is shielded."""
        await run_services(self, task_status)

    # -- reads -----------------------------------------------------------------------------------------------
    def get_messages(self, topic: str, queue_id: int, offset: int, max_nums: int, max_bytes: int,
                     tag_filter: Collection[int] | None = None) -> GetMessageResult:
        """Up to ``max_nums`` messages (``max_bytes`` total, at least one) from queue ``offset`` as raw record
        views. ``tag_filter`` is a set of tags codes (``remoting.message.tags_code``); a match is a hint the
        consumer re-checks on the real tag, as in RocketMQ."""
        cq = self.dispatcher.queue(topic, queue_id)
        if cq is None:
            # A queue deleted with its topic reads as it did before its files went: empty at its max offset.
            mn = mx = self.dispatcher.deleted_offset(topic, queue_id)
            if not mx:
                return GetMessageResult(GetMessageStatus.NO_MATCHED_LOGIC_QUEUE, 0, 0, 0)
        else:
            mn, mx = cq.min_offset, cq.max_offset
        if mx == 0:
            return GetMessageResult(GetMessageStatus.NO_MESSAGE_IN_QUEUE, 0, mn, mx)
        if offset < mn:
            return GetMessageResult(GetMessageStatus.OFFSET_TOO_SMALL, mn, mn, mx)
        if offset == mx:
            return GetMessageResult(GetMessageStatus.OFFSET_OVERFLOW_ONE, offset, mn, mx)
        if offset > mx:
            return GetMessageResult(GetMessageStatus.OFFSET_OVERFLOW_BADLY, mn if mn == 0 else mx, mn, mx)
        units = cq.units(offset, max(max_nums, _MIN_FILTER_UNITS))
        if units is None:
            next_file = (offset // cq.units_per_file + 1) * cq.units_per_file
            return GetMessageResult(GetMessageStatus.OFFSET_FOUND_NULL, min(next_file, mx), mn, mx)
        cl = self.commit_log
        segments = cl._segments
        seg_size = cl.segment_size
        cl_min = cl.min_phy_offset
        cl_end = cl.end
        status = GetMessageStatus.NO_MATCHED_MESSAGE
        last_seg = None
        first_span = 0
        touched_segments = cl._touched_segments
        messages: list[memoryview] = []
        qoffs: list[int] = []
        total = 0
        consumed = 0
        for phy, size, code in CQ_UNIT.iter_unpack(units):
            if phy < cl_min:
                status = GetMessageStatus.MESSAGE_WAS_REMOVING
                consumed += 1
                continue
            if tag_filter is not None and code not in tag_filter:
                consumed += 1
                continue
            if total + size > max_bytes and messages:
                break
            seg = segments.get(phy - phy % seg_size)
            if seg is None or phy + size > cl_end:
                status = GetMessageStatus.MESSAGE_WAS_REMOVING
                consumed += 1
                continue
            if seg is not last_seg:
                last_seg = seg
                touched_segments.add(seg.start)
            if not messages:
                first_span = phy
            off = phy - seg.start
            messages.append(seg.mv[off:off + size])
            qoffs.append(offset + consumed)
            total += size
            consumed += 1
            if len(messages) >= max_nums:
                break
        if messages:
            status = GetMessageStatus.FOUND
            # pages spanned, not bytes returned: a queue's records are interleaved with other queues'
            cl.note_touched(last_seg.start, max(total, last_seg.start + off + size - first_span))
        return GetMessageResult(status, offset + consumed, mn, mx, messages, qoffs, total)

    def has_tags_code_between(self, topic: str, queue_id: int, begin: int, end: int, codes: Collection[int]) -> bool:
        """Whether a unit of the queue in ``[begin, end)`` carries a tags code in ``codes``: whether a pull filtered
        by them could find anything there. True where a unit cannot be read (retention passed ``begin``): the pull
        says what happened."""
        cq = self.dispatcher.queue(topic, queue_id)
        if cq is None or begin < cq.min_offset:
            return True
        offset, end = begin, min(end, cq.max_offset)
        while offset < end:
            units = cq.units(offset, end - offset)
            if units is None:
                return True
            for _phy, _size, code in CQ_UNIT.iter_unpack(units):
                if code in codes:
                    return True
            offset += len(units) // CQ_UNIT.size
        return False

    def get_min_offset_in_queue(self, topic: str, queue_id: int) -> int:
        cq = self.dispatcher.queue(topic, queue_id)
        return cq.min_offset if cq is not None else self.dispatcher.deleted_offset(topic, queue_id)

    def get_max_offset_in_queue(self, topic: str, queue_id: int) -> int:
        cq = self.dispatcher.queue(topic, queue_id)
        return cq.max_offset if cq is not None else self.dispatcher.deleted_offset(topic, queue_id)

    def queue_ids(self, topic: str) -> list[int]:
        """The queues of ``topic`` the store holds (not those deleted with it once their records expired)."""
        return sorted(self.dispatcher.by_topic.get(topic, {}))

    def _store_timestamp(self, phy: int) -> int | None:
        raw = self.commit_log.read(phy + _STORE_TS_AT, 8)
        return None if raw is None else _STORE_TS.unpack(raw)[0]

    def get_offset_by_time(self, topic: str, queue_id: int, timestamp: int) -> int:
        """The first queue offset whose store timestamp is >= ``timestamp`` (binary search); the max offset if
        every message is older."""
        cq = self.dispatcher.queue(topic, queue_id)
        if cq is None:
            return self.dispatcher.deleted_offset(topic, queue_id)
        lo, hi = cq.min_offset, cq.max_offset
        while lo < hi:
            mid = (lo + hi) // 2
            unit = cq.unit(mid)
            ts = self._store_timestamp(unit[0]) if unit is not None and unit[1] else None
            if ts is None or ts < timestamp:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def deleted_with_topic(self, topic: str, phy_offset: int) -> bool:
        """Whether the message of ``topic`` at ``phy_offset`` was deleted with its topic: stored before the
        topic's latest deletion record. Its bytes stay in the commit log until retention, so every lookup that
        starts from an offset (an index hit, a message id) asks this; pulls never see it (the queues are cut)."""
        return phy_offset < self.dispatcher.cut_of(topic)

    def look_record_by_offset(self, phy_offset: int) -> memoryview | None:
        """The record at ``phy_offset``, an offset from outside (a message id, a request's commit-log offset): None
        unless the commit log wrote a record starting there (``CommitLog.record_written_at``), whatever the bytes
        there read as: a body may hold a planted record head naming its own offset."""
        return self.commit_log.record_written_at(phy_offset, self.dispatcher.dispatched, self.dispatcher.queues)

    def look_message_by_offset(self, phy_offset: int) -> MessageView | None:
        raw = self.look_record_by_offset(phy_offset)
        if raw is None:
            return None
        return decode_record(raw, check_crc=False)

    def look_message_by_id(self, msg_id: str) -> MessageView | None:
        """The message of an offset message id; raises ``MessageFormatError`` for a malformed id."""
        _, phy = parse_msg_id(msg_id)
        return self.look_message_by_offset(phy)

    def query_message(self, topic: str, key: str, max_num: int, begin_ts: int = 0,
                      end_ts: int = 2 ** 62) -> QueryMessageResult:
        """Messages of ``topic`` whose KEYS hold ``key`` or whose UNIQ_KEY is ``key``, stored in
        ``[begin_ts, end_ts]``, newest first."""
        index = self.dispatcher.index
        found: list[MessageView] = []
        # Every index hit is read until max_num are found: entries outside the window by milliseconds (an entry
        # knows its second only), of a deleted topic or of another key with the same hash do not count. Before,
        # the walk stopped after max_num * 2 + 8 hits, and 100 messages of one key stored in one second hid the
        # older ones from a window around those. Hits come newest first, so the first one before the topic's
        # latest deletion, or before the commit log's start, ends the walk: every later hit is older.
        oldest = max(self.dispatcher.cut_of(topic), self.commit_log.min_phy_offset)
        # A record is indexed once per key it holds: one whose KEYS name a key twice, or its own UNIQ_KEY, has
        # two entries under that key, and was found twice (each counting against max_num).
        seen: set[int] = set()
        for phy in index.query(topic, key, begin_ts, end_ts):
            if phy < oldest:
                break
            if phy in seen:
                continue
            seen.add(phy)
            view = self.look_message_by_offset(phy)
            if view is None or view.topic != topic or not begin_ts <= view.store_timestamp <= end_ts:
                continue
            if key in view.keys or view.uniq_key == key:
                found.append(view)
                if len(found) >= max_num:
                    break
        last = index.files[-1] if index.files else None
        return QueryMessageResult(found, last.end_timestamp if last else 0, last.end_phy_offset if last else -1)

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(self.commit_log.min_phy_offset, self.commit_log.end, self._flushed,
                               self.dispatcher.dispatched, len(self.dispatcher.queues),
                               len(self.dispatcher.index.files), self.retention.disk_usage,
                               self.retention.disk_full)

