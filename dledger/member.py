"""The pysyncobj side of a DLedger member: a ``SyncObj`` whose replicated state is small.

Rules (the trio side in ``dledger.group`` relies on them):

- There is no tick thread (``autoTick=False``): ``dledger.group``'s tick task calls ``tick()`` on the trio
  thread whenever the member's epoll descriptor (``tick_fd``) is readable or ``tick_interval_ms`` passed, so
  network, apply and callbacks all run there, between trio tasks. Anything that touches pysyncobj's transport
  from another task goes through ``call_on_tick_thread`` (run at the end of the next tick).
- Callbacks never block: results go to the waiting side with ``TrioToken.run_sync_soon`` (never a ``sync=True``
  call: it would wait for a tick that cannot run while it waits).
- The replicated state is only: the applied commit-log end offset and generic metadata tables
  (``table -> key -> value``: topic configs, subscription groups, consumer offsets). The commit log itself lives
  in the state machine. Snapshots (log compaction) are therefore tiny; they are written by our own serializer
  (pickle protocol 5 + crc32c), never pysyncobj's gzip of ``__dict__``.
- A snapshot whose end offset is ahead of the local commit log closes the apply gate (``dledger.patches``) and
  asks the trio side to copy the missing bytes from a peer; Raft keeps voting and acknowledging meanwhile.
- A snapshot of our own is written in the tick but put in place by the trio side, once the commit log is on
  disk up to its end offset (``dledger.snapshot``); pysyncobj drops the journal entries it covers only then.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any

import crc32c
from pysyncobj import SERIALIZER_STATE, SyncObj, SyncObjException, replicated
from pysyncobj.monotonic import monotonic as monotonic_time

from dledger import patches
from remoting.dirlock import DirectoryLock
from dledger.config import DLedgerConfig, build_syncobj_conf
from dledger.entry import decode_entry
from dledger.errors import LogMismatchError, MemberDivergedError, MemberStoreError
from dledger.snapshot import PendingSnapshot
from dledger.state_machine import ApplyStatus, BatchResult, StateMachine
from remoting.errors import RESOURCE_ERRNOS

# An apply out of descriptors or memory is tried again this often, this many times, before the member stops.
APPLY_RETRY_S = 0.05
APPLY_RETRY_LIMIT = 10
# A snapshot that could not be written or put in place is not tried again for this long (a full disk, say).
SNAPSHOT_RETRY_S = 1.0
# One wake-up of the tick task ticks again while its polls deliver events, for at most this long; then it lets
# the trio side run (the requests waiting there) and ticks again right after. Ordinary ticks take well under a
# millisecond; a leader sending a rejoined follower its backlog took ~50 ms a tick, 8 ticks in a row.
TICK_BUDGET_S = 0.02

patches.apply_patches()

log = logging.getLogger(__name__)

__all__ = ["RaftMember", "RaftPortError", "SNAPSHOT_MAGIC", "read_snapshot"]


class RaftPortError(OSError):
    def __init__(self, raft_address: str, reason: str | None = None) -> None:
        # reason: the bind's own error ("Address already in use") when pysyncobj let us see it.
        super().__init__(f"could not bind the Raft port {raft_address} "
                         f"({reason or 'in use, or not an address of this host'})")
        self.raft_address = raft_address
        self.reason = reason


class _BindFailureCatcher(logging.Filter):
    """Drops pysyncobj's ERROR "failed to perform initialization" (with its traceback), logged by
    ``SyncObj.__init__`` on this thread just before it raises: the caller answers with one ``RaftPortError``
    line instead, carrying the bind's reason kept here."""

    MESSAGE = "failed to perform initialization"

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        self.reason: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != self.MESSAGE or record.thread != self.thread:
            return True
        error = record.exc_info[1] if record.exc_info else None
        # pysyncobj raises TransportNotReadyError while handling the socket's OSError.
        cause = getattr(error, "__context__", None)
        if isinstance(cause, OSError):
            self.reason = cause.strerror or str(cause)
        log.debug("pysyncobj could not bind the Raft port", exc_info=record.exc_info)
        return False


@contextmanager
def _catching_bind_failure() -> Iterator[_BindFailureCatcher]:
    catcher = _BindFailureCatcher()
    syncobj_log = logging.getLogger("pysyncobj.syncobj")
    syncobj_log.addFilter(catcher)
    try:
        yield catcher
    finally:
        syncobj_log.removeFilter(catcher)


# Snapshot file: magic(8) | crc32c(4, BE) of body | body = pickle5({"version", "group", "end_offset",
# "metadata", "raft"}), where "raft" is the tuple pysyncobj hands its serializer (last entries, cluster).
SNAPSHOT_MAGIC = b"RMQDLSN1"
# What ``metadata_view`` answers for a table nothing was ever put in.
_NO_ROWS: Mapping[str, Any] = MappingProxyType({})
_CRC = struct.Struct(">I")


def read_snapshot(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != SNAPSHOT_MAGIC:
        raise ValueError(f"{path}: not a DLedger snapshot (bad magic)")
    (crc,) = _CRC.unpack_from(data, 8)
    body = data[12:]
    if crc32c.crc32c(body) != crc:
        raise ValueError(f"{path}: DLedger snapshot checksum mismatch")
    return pickle.loads(body)


class RaftMember(SyncObj):
    def __init__(self, config: DLedgerConfig, state_machine: StateMachine, *,
                 notify: Callable[[str, Any], None]) -> None:
        """``notify(kind, value)`` is called inside a tick (it must only schedule work elsewhere):
        ``("catch_up", target_end_offset)`` when a loaded snapshot is ahead of the state machine, and
        ``("snapshot", PendingSnapshot)`` when a snapshot was written, to be put in place (``dledger.snapshot``)."""
        # Set before SyncObj.__init__: its transport starts inside it.
        self._dledger_auth = patches.FrameAuthenticator(config.secret)
        self._dledger_flush_journal = config.flush_disk_type == "SYNC_FLUSH"
        self._dledger_journal_flushes = 0
        self._dledger_pre_votes = 0
        self._dledger_apply_gate_open = True
        # No vote, no candidacy until a leader is heard (patches, 19): when told, or when the Raft log is gone but
        # the state machine's is not (checked before SyncObj.__init__ creates a new journal).
        raft_data_lost = (config.rejoin_without_raft_data and state_machine.end_offset > 0
                          and not config.has_raft_data())
        self._dledger_rejoining = config.rejoin or raft_data_lost
        # dledger.patches (10): the commit-index notice goes out after the commit callbacks (send_commit_notice).
        self._dledger_defer_commit_notice = True
        self._dledger_commit_notice_due = False
        self._config = config
        self._sm = state_machine
        self._notify = notify
        self._metadata: dict[str, dict[str, Any]] = {}
        # Counts applied metadata changes (a replicated put, a loaded snapshot); per table, the count at its last
        # change, so the trio side can tell cheaply whether a table it mirrors moved (metadata_generation).
        self._metadata_applied = 0
        self._metadata_changed_at: dict[str, int] = {}
        self._snapshot_loaded_at = 0
        self._applied_end_offset = state_machine.end_offset
        self._catch_up_target: int | None = None
        self._applied_batches = 0
        self._duplicate_batches = 0
        self._rejected_batches = 0
        self._snapshots_written = 0
        self._snapshots_loaded = 0
        self._pending_snapshot: PendingSnapshot | None = None
        self._snapshot_retry_at = 0.0
        self._tick_calls: collections.deque[Callable[[], None]] = collections.deque()
        # Before pysyncobj opens the journal: a second process on this directory would load and rewrite it under
        # the running member (remoting.dirlock).
        self._dir_lock: DirectoryLock | None = DirectoryLock(config.data_dir, "the Raft data directory",
                                                              "raft.lock")
        conf = build_syncobj_conf(config, serializer=self._write_snapshot, deserializer=self._read_snapshot,
                                  serialize_checker=self._snapshot_state)
        me = config.self_member
        try:
            # Without a tick thread, SyncObj.__init__ itself retries the bind and raises when it gives up.
            with _catching_bind_failure() as bind_failure:
                super().__init__(me.raft_address, [p.raft_address for p in config.peers], conf)
        except SyncObjException:
            self._release_files()
            raise RaftPortError(me.raft_address, bind_failure.reason) from None
        except BaseException:
            self._dir_lock.release()
            raise
        self.addOnTickCallback(self._run_tick_calls)
        # dledger.patches, 23: compaction replaces the journal file instead of rewriting it in place.
        self._SyncObj__raftLog._dledger_sync = self._dledger_flush_journal
        log.info("raft member started group=%s id=%s raft=%s flush=%s", config.group, me.id, me.raft_address,
                 config.flush_disk_type)
        if raft_data_lost and not config.rejoin:
            log.warning("group=%s id=%s: the store holds a log up to offset %d but the Raft data directory %s has "
                        "no journal and no snapshot (lost or moved aside?); rejoining as with --rejoin",
                        config.group, me.id, state_machine.end_offset, config.data_dir)
        if self._dledger_rejoining:
            log.warning("rejoining group=%s id=%s: no vote and no candidacy until a leader is heard from",
                        config.group, me.id)

    # pysyncobj's transport asks the SyncObj for its "encryptor"; ours authenticates, see dledger.patches.
    @property
    def encryptor(self) -> patches.FrameAuthenticator:
        return self._dledger_auth

    def _getEncryptor(self) -> patches.FrameAuthenticator:
        return self._dledger_auth

    # ---- replicated commands (run on every member, in log order) ----

    @replicated
    def apply_entry(self, entry: bytes) -> tuple[int, BatchResult]:
        index = self.raftLastApplied + 1
        decoded = decode_entry(entry)
        waited = 0
        while True:
            try:
                result = self._sm.apply_batch(decoded.payload, decoded.store_timestamp,
                                              decoded.expected_start_offset)
                break
            except OSError as e:
                # Out of descriptors or memory for a moment (the store opening its next segment during a burst
                # of connections): wait here, on the tick, and apply again; an apply that failed published
                # nothing, so it can be repeated. The tick blocks meanwhile, which may cost an election.
                if e.errno not in RESOURCE_ERRNOS or waited >= APPLY_RETRY_LIMIT:
                    error: Exception = e
                else:
                    if not waited:
                        log.warning("apply of entry %d failed, retrying for up to %.1f s error=%s", index,
                                    APPLY_RETRY_LIMIT * APPLY_RETRY_S, e)
                    waited += 1
                    time.sleep(APPLY_RETRY_S)
                    continue
            except LogMismatchError as e:
                # The state machine holds, where the entry goes, bytes the group never committed: a restart
                # would find them again, so the member stops as one that diverged (rebuilt, not restarted).
                self._dledger_apply_gate_open = False
                raise MemberDivergedError(self._config.group, self._config.self_id, e.offset, e.reason) from e
            except Exception as e:
                error = e
            # pysyncobj would leave the entry unapplied and try it again on every tick (and it already dropped
            # the entry's commit callbacks): close the gate so nothing after it is applied either, and stop the
            # member (dledger.group raises this out of its tick loop).
            self._dledger_apply_gate_open = False
            raise MemberStoreError(self._config.group, self._config.self_id, f"apply committed entry {index}",
                                   error) from error
        if result.status is ApplyStatus.APPLIED:
            self._applied_batches += 1
        elif result.status is ApplyStatus.DUPLICATE:
            self._duplicate_batches += 1
        else:
            self._rejected_batches += 1
            log.warning("batch rejected index=%d expected_start_offset=%d end_offset=%d", index,
                        decoded.expected_start_offset, result.end_offset)
        self._applied_end_offset = max(self._applied_end_offset, result.end_offset)
        return index, result

    @replicated
    def put_metadata(self, table: str, items: dict[str, Any]) -> int:
        """Set keys of a metadata table (a value of None deletes the key); returns the table size."""
        target = self._metadata.setdefault(table, {})
        for key, value in items.items():
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value
        self._metadata_applied += 1
        self._metadata_changed_at[table] = self._metadata_applied
        return len(target)

    # ---- reads for the trio side ----

    def metadata(self, table: str) -> dict[str, Any]:
        return dict(self._metadata.get(table, {}))

    def metadata_get(self, table: str, key: str, default: Any = None) -> Any:
        rows = self._metadata.get(table)
        return default if rows is None else rows.get(key, default)

    def metadata_view(self, table: str) -> Mapping[str, Any]:
        rows = self._metadata.get(table)
        return _NO_ROWS if rows is None else MappingProxyType(rows)

    @property
    def metadata_applied(self) -> int:
        return self._metadata_applied

    def metadata_generation(self, table: str) -> int:
        """A number that moves whenever ``table`` may have changed (its own changes, and every snapshot load)."""
        return max(self._metadata_changed_at.get(table, 0), self._snapshot_loaded_at)

    @property
    def applied_end_offset(self) -> int:
        return self._applied_end_offset

    @property
    def catch_up_target(self) -> int | None:
        return self._catch_up_target

    @property
    def rejoining(self) -> bool:
        """Started with ``rejoin`` (or without Raft data beside a kept log) and no leader heard from yet (patches,
        19)."""
        return self._dledger_rejoining

    @property
    def noop_index(self) -> int | None:
        """Index of this leader's no-op entry; once applied, every earlier entry is applied too."""
        return getattr(self, "_SyncObj__noopIDx", None)

    @property
    def pending_snapshot(self) -> PendingSnapshot | None:
        """The snapshot written and not yet in place (``dledger.snapshot``)."""
        return self._pending_snapshot

    @property
    def snapshots_loaded(self) -> int:
        return self._snapshots_loaded

    @property
    def journal_flushes(self) -> int:
        return self._dledger_journal_flushes

    def connected_peers(self) -> tuple[str, ...]:
        ids = {p.raft_address: p.id for p in self._config.peers}
        return tuple(sorted(ids.get(node.address, node.address) for node in self._SyncObj__otherNodes
                            if self.isNodeConnected(node)))

    def counters(self) -> dict[str, int]:
        return {"applied_batches": self._applied_batches, "duplicate_batches": self._duplicate_batches,
                "rejected_batches": self._rejected_batches, "snapshots_written": self._snapshots_written,
                "snapshots_loaded": self._snapshots_loaded, "journal_flushes": self._dledger_journal_flushes,
                "pre_votes": self._dledger_pre_votes, "log_entries_in_memory": self._getRaftLogSize()}

    # ---- thread crossing ----

    def call_on_tick_thread(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at the end of the next tick (pysyncobj's transport is not thread-safe)."""
        self._tick_calls.append(fn)

    def _run_tick_calls(self) -> None:
        while self._tick_calls:
            fn = self._tick_calls.popleft()
            try:
                fn()
            except Exception:
                log.exception("tick-thread call failed")

    def extend_catch_up(self, target: int) -> None:
        """Copy up to ``target`` (a peer's applied end, past the snapshot's) before the apply gate opens."""
        if self._catch_up_target is not None and target > self._catch_up_target:
            self._catch_up_target = target
            self._applied_end_offset = max(self._applied_end_offset, target)

    def finish_catch_up(self) -> None:
        """Called by the trio side once the state machine reached the snapshot's end offset."""
        target = self._catch_up_target
        self._catch_up_target = None
        self._applied_end_offset = max(self._applied_end_offset, self._sm.end_offset)
        self._dledger_apply_gate_open = True
        log.info("catch-up finished end_offset=%d target=%s", self._sm.end_offset, target)

    # ---- snapshots (custom serializer: small, checksummed) ----

    def _write_snapshot(self, file_name: str, raft_data: Any) -> bool:
        """pysyncobj's serializer, in a tick (dledger.patches, 21): write the snapshot under ``file_name``, a
        temporary name, and hand it to the trio side to put in place; False when no snapshot is due now."""
        end_offset = self._applied_end_offset
        if self._sm.end_offset < end_offset or monotonic_time() < self._snapshot_retry_at:
            # Catching up: the commit log does not hold what the snapshot would vouch for (the snapshot loaded
            # from the leader does, and stays). Asked again next tick.
            return False
        body = pickle.dumps({"version": 1, "group": self._config.group, "end_offset": end_offset,
                             "metadata": self._metadata, "raft": raft_data}, protocol=5)
        try:
            with open(file_name, "wb") as f:  # synced off the tick, before it is put in place (dledger.snapshot)
                f.write(SNAPSHOT_MAGIC + _CRC.pack(crc32c.crc32c(body)) + body)
        except OSError as e:
            log.error("writing a snapshot failed; the journal keeps its entries path=%s error=%s", file_name, e)
            self._snapshot_retry_at = monotonic_time() + SNAPSHOT_RETRY_S
            return False
        self._pending_snapshot = PendingSnapshot(Path(file_name), self._config.snapshot_path, end_offset,
                                                 self._snapshots_loaded)
        self._notify("snapshot", self._pending_snapshot)
        return True

    def _snapshot_state(self) -> int:
        """pysyncobj's serialize checker, every tick: SUCCESS (drop the journal entries the snapshot covers) only
        once the trio side put it in place."""
        pending = self._pending_snapshot
        if pending is None:
            return SERIALIZER_STATE.NOT_SERIALIZING
        if not pending.done:
            return SERIALIZER_STATE.SERIALIZING
        self._pending_snapshot = None
        if pending.in_place and pending.loads == self._snapshots_loaded:
            self._snapshots_written += 1
            return SERIALIZER_STATE.SUCCESS
        if not pending.in_place and pending.loads == self._snapshots_loaded:
            self._snapshot_retry_at = monotonic_time() + SNAPSHOT_RETRY_S
        return SERIALIZER_STATE.FAILED

    def _read_snapshot(self, file_name: str) -> Any:
        snap = read_snapshot(file_name)
        if snap.get("group") != self._config.group:
            raise ValueError(f"snapshot of group {snap.get('group')!r} loaded into group {self._config.group!r}")
        # Checked before anything is taken from it: pysyncobj logs a failed load and goes on, so a snapshot (from
        # a leader of another version, say) whose end_offset failed below had already replaced the metadata, and
        # metadata that is no map of maps then raised in the broker's registration task and stopped the node.
        metadata, target, raft = snap.get("metadata"), snap.get("end_offset"), snap.get("raft")
        if raft is None:
            raise ValueError("snapshot holds no Raft state")
        if not isinstance(metadata, dict) or not all(isinstance(t, dict) for t in metadata.values()):
            raise ValueError(f"snapshot metadata is a {type(metadata).__name__}, not a map of tables")
        if type(target) is not int or target < 0:
            raise ValueError(f"snapshot end_offset {target!r} is not an offset")
        self._metadata = metadata
        self._metadata_applied += 1
        self._snapshot_loaded_at = self._metadata_applied
        self._snapshots_loaded += 1
        local_end = self._sm.end_offset
        if local_end < target:
            # Close the gate before returning: pysyncobj applies the next entries right after this load.
            self._dledger_apply_gate_open = False
            self._catch_up_target = target
            log.info("snapshot ahead of commit log end_offset=%d snapshot_end_offset=%d: catching up from a peer",
                     local_end, target)
            self._notify("catch_up", target)
        self._applied_end_offset = max(local_end, target)
        return raft

    def _dledger_snapshot_entries(self) -> tuple[Any, Any] | None:
        """The last two Raft entries the snapshot file covers, read without loading it (dledger.patches, 20);
        None without a readable snapshot (the load itself then says why)."""
        try:
            last, before = read_snapshot(self._config.snapshot_path)["raft"][:2]
        except (OSError, ValueError, KeyError, TypeError, pickle.UnpicklingError):
            return None
        return before, last

    # ---- ticking (from dledger.group's tick task, on the trio thread) ----

    @property
    def tick_fd(self) -> int:
        """Readable when a socket or the command pipe has an event: time to ``tick``."""
        return self._poller.fileno()

    def tick(self) -> bool:
        """A poll, then one pysyncobj tick (timers, queued commands, commit, apply, sends, then a poll), repeated
        while the poll delivered events: pysyncobj acts on a reply (commit, apply, the next send) only in the tick
        after the poll that read it.

        The tick task calls this when the epoll descriptor is readable, so there is usually something to read:
        polling before the first tick lets that tick act on it. Without it, every wake-up cost a tick that had
        nothing to act on, then the one that did: one-at-a-time sends took 2.0 pysyncobj ticks per wake-up on a
        follower and 2.0 on the leader, now 1.0 and 1.3 (2-4 % of their latency; docs/benchmarks.md,
        twenty-fourth session). A wake-up by the timer pays one empty poll. A leader resumed after a stall now reads
        the answers waiting in its sockets before its tick judges its followers silent, and commits what a
        majority acknowledged before it hears of a newer term (as Raft allows: those entries are on a majority).

        pysyncobj checks a follower's election deadline at the start of a tick and polls at its end. A follower
        that was busy or starved of CPU for longer than the election timeout (applying 4 MB messages on a
        loaded machine) would then start an election before reading the leader's heartbeats that wait in its
        socket, and its higher term deposes a healthy leader. The poll before the first tick reads them, and every
        later tick of the loop follows the poll that ended the one before, after its work (one tick that applied
        a large batch can outlast the timeout too). Until the transport is ready there is no connection whose
        heartbeats could wait.

        The ticks of one call stop after ``TICK_BUDGET_S`` even while polls still deliver events; the call then
        returns True: tick again as soon as the trio side had its turn. A leader sending a follower that had
        just restarted its backlog spent ~50 ms a tick (up to ``appendEntriesPeriod``, now capped lower by
        patches 26) for 8 ticks: 0.4-0.5 s in which no request was read and no answer sent (acknowledgements
        stopped for up to 0.96 s in ``raftmq chaos`` rounds killing a follower).

        Last, a Raft listener paused by a failed accept is polled again once its pause is over (patches, 18)."""
        poller = self._poller
        if self._SyncObj__transport.ready:  # pysyncobj's tick binds the listener before it polls; so do we
            poller.poll(0.0)
        stop_at = monotonic_time() + TICK_BUDGET_S
        more = False
        for _ in range(8):
            self.doTick(0.0)
            if not poller.handled:
                break
            if monotonic_time() >= stop_at:
                more = True
                break
        server = self._SyncObj__transport._server
        if server is not None:
            patches.resume_accepting(server)
        return more

    def followers_current(self) -> bool:
        """Whether every connected follower has been sent the whole log (its next index is past the last entry):
        the tick that sends a new entry then sends that entry and nothing else. pysyncobj sends a lagging
        follower everything from its next index within one tick, tens of milliseconds a tick while a restarted
        follower catches up."""
        return not patches.followers_lagging(self, self._SyncObj__otherNodes)

    @property
    def commit_notice_due(self) -> bool:
        return self._dledger_commit_notice_due

    def send_commit_notice(self) -> None:
        """Tell the followers the commit index that a tick advanced, unless an append_entries sent since did
        (``dledger.patches``, 10). Called by the tick loop after ``commit_notice_delay_ms``."""
        if self._dledger_commit_notice_due:
            self._dledger_commit_notice_due = False
            if self._isLeader():
                self._SyncObj__sendAppendEntries()

    def _release_files(self, *, transport: bool = True) -> None:
        if transport:  # a failed start: SyncObj.__init__ raised before anyone could destroy() it
            for name, closer in (("_SyncObj__transport", "destroy"), ("_SyncObj__raftLog", "_destroy")):
                part = getattr(self, name, None)
                if part is not None:
                    getattr(part, closer)()
        notifier = getattr(self, "_SyncObj__pipeNotifier", None)
        for fd_name in ("_PipeNotifier__pipeR", "_PipeNotifier__pipeW"):
            fd = getattr(notifier, fd_name, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        poller = getattr(self, "_poller", None)
        if poller is not None and hasattr(poller, "close"):
            poller.close()
        if self._dir_lock is not None:
            self._dir_lock.release()
            self._dir_lock = None

    def close(self) -> None:
        self.destroy()  # without a tick thread this closes the transport and the journal at once
        self._release_files(transport=False)
