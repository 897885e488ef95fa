"""The trio face of a DLedger member: ``async with open_dledger_group(config, state_machine) as group``.

Rules of this module (the essay the rest of ``dledger`` leans on):

- **Group commit.** ``await group.append(record)`` queues the record; one batcher task turns queued records into
  one entry (up to ``max_batch_messages`` / ``max_batch_bytes``; when batches are already in flight it waits up
  to ``max_batch_delay_ms`` for more; a batch waiting for a slot takes what is queued meanwhile) and proposes it
  with ONE pysyncobj call. A record bigger than ``max_batch_bytes`` (up to ``max_record_bytes``, e.g. one 4 MiB
  message) is proposed alone. Records are packed by their own bytes, but a state machine may prepare an entry
  several times their size: a batch past ``max_entry_bytes`` is proposed in parts, in order, the rest put back at
  the head of the queue (with entries in flight, the whole batch waits for them to drain: the state machine's plan
  counted it), so only a record too large alone ever fails so (``PreparedEntryTooLargeError``). At most
  ``max_in_flight_batches`` entries are in flight. Few Raft calls keep pysyncobj's work per message small (it is
  ticked on this thread, between trio tasks), and so keep the term from moving under load.
- **Planned offsets.** Each entry carries the commit-log offset it expects to start at: the state machine's end
  when nothing is in flight, else the planned end of the previous in-flight entry. The state machine builds the
  payload once, here (``prepare_batch``), and knows every record's result before the entry is proposed. A leader
  proposes only once its own no-op entry is applied (every earlier entry is then applied too, so the end is
  current). After any failure the batcher waits for the pipeline to drain and re-reads the end.
- **Acknowledgement.** A caller is answered only from the commit callback, i.e. after a majority holds the entry
  and this member applied it; the answer is the Raft index and that record's result from the state machine.
  pysyncobj calls back inside a tick (it is ticked on the trio thread, ``dledger.poller``); the callback only
  records the completion, and the tick task runs the completions as soon as the tick returns, so a tick never
  runs caller code. The callers are answered (inside ``completion_context``: the broker corks its connections
  there, so each gets one write) *before* the followers are sent the new commit index (``dledger.patches``,
  10): with one append in flight that notice cost ~0.3 ms of latency when it went first.
- **Roles.** Followers get no leader-change callback from pysyncobj, so role, term and leader are read after
  every tick (cheap: raw state compared first) and changes published (``wait_leader``, ``role_changes``); a
  slower poll every ``status_poll_interval_ms`` catches a leader whose id only the members table knows.
- **Catch-up.** When a loaded snapshot is ahead of the commit log, the catch-up task (``dledger.catch_up``)
  copies the missing bytes from a peer (``fetch_range``, leader first) while the apply gate is closed;
  ``serving_reads`` is False until then.
- **Snapshots.** A snapshot written in a tick is put in place by the snapshot task (``dledger.snapshot``) once
  the state machine's log is on disk up to its end offset; the journal keeps what it covers until then.
"""

from __future__ import annotations

import collections
import enum
import functools
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import trio
from pysyncobj import FAIL_REASON

from dledger.catch_up import CatchUp, FetchRange
from dledger.config import DLedgerConfig, MemberAddress
from dledger.entry import EntryTooLargeError, encode_entry
from dledger.errors import (AppendOutcomeUnknownError, AppendTimeoutError, BatchRejectedError, DLedgerError,
                            GroupBusyError, LeaderChangedError, MembershipChangeError, MemberStoreError,
                            NotLeaderError, PreparedEntryTooLargeError, RecordTooLargeError,
                            TransferLeadershipError)
from dledger.member import RaftMember
from dledger.patches import OUTCOME_UNKNOWN, JournalWriteError
from dledger.pending import CallbackPending, Pending
from dledger.snapshot import SnapshotWriter
from dledger.state_machine import ApplyStatus, StateMachine
from remoting.errors import FatalServerError

log = logging.getLogger(__name__)

__all__ = ["Role", "RoleChange", "AppendResult", "DLedgerStatistics", "DLedgerGroup", "open_dledger_group",
           "FetchRange", "MEMBERS_TABLE"]

# Metadata table holding members added at run time: id -> [raft_address, service_address].
MEMBERS_TABLE = "dledger.members"
_FAIL_NAMES = {v: k for k, v in vars(FAIL_REASON).items() if not k.startswith("_")}


class Role(enum.Enum):
    FOLLOWER = "FOLLOWER"
    CANDIDATE = "CANDIDATE"
    LEADER = "LEADER"


_ROLE_OF_STATE = {0: Role.FOLLOWER, 1: Role.CANDIDATE, 2: Role.LEADER}


@dataclass(frozen=True, slots=True)
class RoleChange:
    role: Role
    term: int
    leader_id: str | None
    leader_service_address: str | None


class AppendResult(NamedTuple):
    """The Raft index of the entry holding the record, and the state machine's result for the record (a
    NamedTuple: one is built per append, so its construction cost counts)."""

    index: int
    result: Any


@dataclass(frozen=True, slots=True)
class DLedgerStatistics:
    group: str
    self_id: str
    role: Role
    term: int
    leader_id: str | None
    committed_index: int
    last_applied_index: int
    end_offset: int
    appended_records: int
    appended_batches: int
    failed_batches: int
    in_flight_batches: int
    pending_records: int
    busy_records: int  # appends refused or dropped unproposed with GroupBusyError
    applied_batches: int
    duplicate_batches: int
    rejected_batches: int
    snapshots_written: int
    snapshots_loaded: int
    journal_flushes: int
    pre_votes: int  # pre-vote rounds this member began (patches.py, 15): its election timer fired
    leader_changes: int  # leaders (itself too) this member learnt of, each of a new term: elections it saw won
    log_entries_in_memory: int
    catch_up_bytes: int
    serving_reads: bool
    connected_peers: tuple[str, ...]  # ids of the members this one has a Raft connection with now
    rejoining: bool  # started with dledger.rejoin and no leader heard yet: it neither votes nor stands


class DLedgerGroup:
    def __init__(self, config: DLedgerConfig, state_machine: StateMachine, *,
                 fetch_range: FetchRange | None = None,
                 completion_context: Callable[[], AbstractContextManager[Any]] = nullcontext) -> None:
        self.config = config
        self._sm = state_machine
        self._completion_context = completion_context
        # Commit callbacks recorded during a tick, run by the tick task once the tick returned.
        self._completions: list[tuple[Any, ...]] = []
        self._in_tick = False  # inside pysyncobj's tick: its callbacks are run when it returns
        self._ticking = False  # inside _tick_once: no nested tick from an append made by a completion
        self._tick_wait: trio.CancelScope | None = None  # the tick task's wait for an event, while it waits
        # A tick raised an error the member cannot go on from (MemberStoreError): no more ticks, and the tick
        # loop raises it, which stops the group and the process (exit status 3, one CRITICAL line).
        self._fatal: FatalServerError | None = None
        self._tick_interval_s = config.tick_interval_ms / 1000
        self._notice_delay_s = config.commit_notice_delay_ms / 1000
        self._notice_at: float | None = None
        self._batcher_idle = False
        self._transferring = 0  # transfer_leadership calls under way: the batcher holds new entries
        self._transfer_phase = ""  # what the last transfer waited for last (transfer_phase)
        self._transfer_done = trio.Event()
        # Callers sending one record at a time: the pipeline's last flight (proposal to drain) carried a single
        # record. Only then does append_nowait propose inline; under load, records proposed inline would split
        # the waves of records the batcher puts into one entry (measured: -25 % single sends at 256 in flight).
        self._one_at_a_time = True
        self._records_in_flight_since_drain = 0
        self._member: RaftMember | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._queue: collections.deque[Pending] = collections.deque()
        self._queue_wakeup: trio.Event | None = None
        self._max_queue_wait_s = config.max_queue_wait_ms / 1000
        self._busy_records = 0  # refused or dropped with GroupBusyError
        self._slots = trio.Semaphore(config.max_in_flight_batches)
        self._drained = trio.Event()
        self._drained.set()
        self._replan = True
        # The entries in flight (their batches, by id: ``_in_flight`` counts them) and the no-op index of the
        # leadership that proposed them: see _drop_stale_flights.
        self._flights: dict[int, list[Pending]] = {}
        self._flights_noop: int | None = None
        self._split_batches = 0  # batches whose prepared entry was too large, proposed in parts (_fewer)
        self._planned_end = 0
        self._last_store_timestamp = 0
        # A record bigger than max_batch_bytes is proposed alone (the batcher never adds one to a non-empty
        # batch), so a record only has to fit one entry.
        self._max_record_bytes = config.max_record_bytes
        self._role = RoleChange(Role.FOLLOWER, 0, None, None)
        self._raw_role: tuple[Any, ...] = ()
        self._leader_flag = False
        self._leader_changes = 0
        self._last_leader: tuple[int, str] | None = None  # (term, leader_id) last counted in _leader_changes
        # Refreshed by the expiry task every 50 ms: deadlines need no finer clock, and reading trio's clock
        # once per append is a measurable cost.
        self._coarse_now = 0.0
        self._changed = trio.Event()
        self._role_listeners: list[trio.MemorySendChannel[RoleChange]] = []
        self._metadata_listeners: list[Callable[[], None]] = []
        self._metadata_seen = 0
        self._catch_up = CatchUp(config, state_machine, fetch_range, lambda: self._role.leader_id)
        self._snapshot_writer = SnapshotWriter(state_machine)
        self._waiting: set[Pending] = set()
        self._appended_records = 0
        self._appended_batches = 0
        self._failed_batches = 0

    # ---- lifecycle ----

    def _open_member(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._coarse_now = trio.current_time()
        sys.setswitchinterval(self.config.gil_switch_interval_ms / 1000)
        # No tick thread: the member is ticked by _tick_loop on this (the trio) thread.
        self._member = RaftMember(self.config, self._sm, notify=self._notify_threadsafe)
        if self._member.catch_up_target is not None:
            self._catch_up.want()

    def _start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._tick_loop)
        nursery.start_soon(self._poll_status)
        nursery.start_soon(self._batcher)
        nursery.start_soon(self._catch_up.run, self._member)
        nursery.start_soon(self._snapshot_writer.run, self._member)
        nursery.start_soon(self._expire_appends)

    def _close(self) -> None:
        if self._member is not None:
            self._member.close()
            log.info("raft member stopped group=%s id=%s", self.config.group, self.config.self_id)

    @property
    def member(self) -> RaftMember:
        assert self._member is not None, "the group is not open"
        return self._member

    # ---- roles ----

    @property
    def role(self) -> Role:
        return self._role.role

    @property
    def term(self) -> int:
        return self._role.term

    @property
    def leader_id(self) -> str | None:
        return self._role.leader_id

    @property
    def is_leader(self) -> bool:
        return self._leader_flag

    @property
    def is_ready_leader(self) -> bool:
        """Leader with its no-op entry applied, so every entry committed before its term is applied too: what it
        has applied is all that was ever acknowledged."""
        return self._can_propose()

    @property
    def serving_reads(self) -> bool:
        """False while the commit log is behind a loaded snapshot (bytes still being copied from a peer)."""
        return self.member.catch_up_target is None

    def member_address(self, member_id: str) -> MemberAddress | None:
        for m in self.config.members:
            if m.id == member_id:
                return m
        extra = self.member.metadata_get(MEMBERS_TABLE, member_id)
        if extra:
            return MemberAddress(id=member_id, raft_address=extra[0], service_address=extra[1])
        return None

    def _member_by_raft_address(self, raft_address: str) -> MemberAddress | None:
        found = self.config.member_by_raft_address(raft_address)
        if found is not None:
            return found
        for member_id, (raft, service) in self.member.metadata_view(MEMBERS_TABLE).items():
            if raft == raft_address:
                return MemberAddress(id=member_id, raft_address=raft, service_address=service)
        return None

    def _read_role(self) -> RoleChange:
        m = self.member
        role = _ROLE_OF_STATE.get(getattr(m, "_SyncObj__raftState", 0), Role.FOLLOWER)
        leader_node = m._getLeader()
        leader = self._member_by_raft_address(leader_node.address) if leader_node is not None else None
        return RoleChange(role, m._getTerm(), leader.id if leader else None,
                          leader.service_address if leader else None)

    def _refresh_role(self) -> None:
        """Publish the role if a tick changed it: the raw state is compared first (three attribute reads), so
        the check after every tick costs nearly nothing."""
        m = self.member
        raw = (getattr(m, "_SyncObj__raftState", 0), m._getTerm(), m._getLeader())
        if raw != self._raw_role:
            self._raw_role = raw
            self._publish_role(self._read_role())

    async def _poll_status(self) -> None:
        # Safety net for what the raw state does not show: a leader added at run time becomes known by id only
        # once the members table replicates.
        interval = self.config.status_poll_interval_ms / 1000
        while True:
            self._publish_role(self._read_role())
            await trio.sleep(interval)

    def _publish_role(self, current: RoleChange) -> None:
        if current == self._role:
            return
        previous, self._role = self._role, current
        self._leader_flag = current.role is Role.LEADER
        if current.leader_id is not None and (current.term, current.leader_id) != self._last_leader:
            # A leader lost from sight and found again in the same term is no new election.
            self._last_leader = (current.term, current.leader_id)
            self._leader_changes += 1
        if current.role is not previous.role or current.leader_id != previous.leader_id:
            log.info("role changed group=%s id=%s role=%s term=%d leader=%s", self.config.group,
                     self.config.self_id, current.role.value, current.term, current.leader_id)
        for listener in list(self._role_listeners):
            try:
                listener.send_nowait(current)
            except trio.WouldBlock:
                pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._role_listeners.remove(listener)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    async def wait_leader(self) -> RoleChange:
        """Wait until a leader is known and return the current role/term/leader."""
        while self._role.leader_id is None:
            await self._changed.wait()
        return self._role

    async def wait_ready_leader(self) -> None:
        """Wait until this member is leader and may propose (its no-op entry is applied)."""
        while not self._can_propose():
            await trio.sleep(0.005)  # the no-op is applied within a few ticks of the election

    @asynccontextmanager
    async def role_changes(self, buffer: int = 64) -> AsyncIterator[trio.MemoryReceiveChannel[RoleChange]]:
        """A stream of ``RoleChange``; changes are dropped while the reader lags ``buffer`` behind."""
        send, recv = trio.open_memory_channel[RoleChange](buffer)
        self._role_listeners.append(send)
        try:
            async with recv:
                yield recv
        finally:
            if send in self._role_listeners:
                self._role_listeners.remove(send)
            send.close()

    @property
    def _in_flight(self) -> int:
        """Entries proposed here and not yet answered (``_flights``)."""
        return len(self._flights)

    def _can_propose(self) -> bool:
        m = self.member
        noop = m.noop_index
        return (self._role.role is Role.LEADER and m._isLeader() and noop is not None
                and m.raftLastApplied >= noop and m.catch_up_target is None)

    def _not_leader(self, why: str | None = None) -> NotLeaderError:
        leader_id = self._role.leader_id if self._role.leader_id != self.config.self_id else None
        return NotLeaderError(self.config.group, leader_id,
                              self._role.leader_service_address if leader_id else None, why=why)

    # ---- append (group commit) ----

    async def append(self, record: bytes, *, timeout_s: float = 3.0) -> AppendResult:
        """Replicate one record; returns its Raft index and the state machine's result for it once the entry
        is committed and applied here. Raises NotLeaderError / LeaderChangedError / BatchRejectedError
        (retriable, nothing applied), AppendTimeoutError (outcome unknown), GroupBusyError, RecordTooLargeError."""
        self._admit(record)
        # Per-record costs matter at tens of thousands of appends/s: a deque instead of a channel, a parked
        # task instead of an Event, no cancel scope (the expiry task answers callers whose deadline passed).
        pending = Pending(record, timeout_s, self._coarse_now)
        self._enqueue(pending)
        try:
            await trio.lowlevel.wait_task_rescheduled(pending.abort)
        finally:
            self._waiting.discard(pending)
        if pending.error is not None:
            raise pending.error
        return AppendResult(pending.index, pending.result)

    def append_nowait(self, record: bytes, on_done: Callable[[Pending], None], *, timeout_s: float = 3.0) -> None:
        """``append`` without a task per record: queues ``record`` and returns; ``on_done(pending)`` is called
        once, from the trio thread, with ``pending.error`` set or ``pending.index`` / ``pending.result`` filled
        (commit, failure or expiry, as for ``append``). Raises what ``append`` raises before queueing.

        A group serving one record at a time (nothing in flight, the last flight carried one record, batcher
        waiting) proposes the record here and now, and ticks so the entry leaves at once: two task switches
        less per commit. A record the state machine refuses is then answered before this returns."""
        self._admit(record)
        pending = CallbackPending(record, timeout_s, self._coarse_now, on_done, self._waiting)
        # Not while a follower catches up: each of the tick's rounds then sends it a frame of old entries, and a
        # send path ticking inline held its connection's reader for all of them (0.4-0.5 s a send after a
        # hand-over to a leader whose peer had just restarted: each send alone in its flight kept the group "one at
        # a time", so every send waited for the ones before it, and sends of 2 s timed out).
        if (self._batcher_idle and self._in_flight == 0 and self._one_at_a_time and not self._queue
                and not self._transferring
                and self._can_propose() and self.member.followers_current()):
            self._waiting.add(pending)
            self._slots.acquire_nowait()  # nothing in flight and the batcher idle: every slot is free
            self._propose_now([pending])
            if not self._ticking:  # an append made by a completion: the tick loop ticks again right away
                if self._tick_once() <= 0 and self._tick_wait is not None:
                    self._tick_wait.cancel()  # work left over: the tick task must not sleep on it
            return
        self._enqueue(pending)

    def _admit(self, record: bytes) -> None:
        """What ``append`` and ``append_nowait`` refuse before queueing anything."""
        if len(record) > self._max_record_bytes:
            raise RecordTooLargeError(len(record), self._max_record_bytes)
        if not self.is_leader:
            raise self._not_leader()
        if len(self._queue) >= self.config.max_pending_records:
            self._busy_records += 1
            raise GroupBusyError(self.config.group, f"{len(self._queue)} records are already waiting to be "
                                                    f"replicated (max_pending_records)")

    def _enqueue(self, pending: Pending) -> None:
        self._queue.append(pending)
        wakeup = self._queue_wakeup
        if wakeup is not None:
            self._queue_wakeup = None
            wakeup.set()
        self._waiting.add(pending)

    async def _wait_queue(self, deadline: float | None = None) -> None:
        self._queue_wakeup = wakeup = trio.Event()
        if deadline is None:
            await wakeup.wait()
        else:
            with trio.move_on_at(deadline):
                await wakeup.wait()
        self._queue_wakeup = None

    async def _tick_loop(self) -> None:
        """Drive pysyncobj on the trio thread: tick when its epoll descriptor is readable (a socket or the command
        pipe has an event), and at least every ``tick_interval_ms`` for its timers."""
        fd = self.member.tick_fd
        while True:
            wait_s = self._tick_once()
            if self._fatal is not None:
                raise self._fatal
            if wait_s <= 0:  # the tick stopped at its budget with work left: the others' turn, then tick again
                await trio.lowlevel.checkpoint()
                continue
            with trio.move_on_after(wait_s) as self._tick_wait:
                await trio.lowlevel.wait_readable(fd)
            self._tick_wait = None

    def _tick_once(self) -> float:
        """One tick, then the commit completions it produced, then (when due) the commit notice; returns how
        long the tick loop may wait for the next event, 0 when the tick stopped at its time budget with events
        still coming (``RaftMember.tick``). Also called by ``append_nowait`` right after an inline proposal, so
        the entry leaves without waiting for the tick task."""
        m = self.member
        wait_s = self._tick_interval_s
        if self._fatal is not None:
            return wait_s
        self._ticking = True
        try:
            self._in_tick = True
            try:
                if m.tick():
                    wait_s = 0.0
            finally:
                self._in_tick = False
            if m.metadata_applied != self._metadata_seen:
                self._metadata_seen = m.metadata_applied
                self._metadata_applied()
            if self._completions:
                self._run_completions()
            if m.commit_notice_due:
                now = trio.current_time()
                if self._notice_at is None:
                    self._notice_at = now + self._notice_delay_s
                if now >= self._notice_at:
                    m.send_commit_notice()
                    self._notice_at = None
                else:
                    wait_s = min(wait_s, self._notice_at - now)
            else:
                self._notice_at = None
            self._refresh_role()
            # After the role is published (_can_propose reads it): a tick may win an election and apply its no-op.
            if self._flights and m.noop_index != self._flights_noop and self._can_propose():
                self._drop_stale_flights()
        except FatalServerError as e:  # the state machine failed to apply an entry (dledger.member)
            self._fatal = e
        except JournalWriteError as e:
            self._fatal = MemberStoreError(self.config.group, self.config.self_id, e.action, e)
        except Exception:
            # As pysyncobj's own tick thread does: log and go on; Raft recovers on the next ticks.
            log.exception("raft tick failed group=%s id=%s", self.config.group, self.config.self_id)
        finally:
            self._ticking = False
        return wait_s

    def _drop_stale_flights(self) -> None:
        """This member leads again, its new term's no-op applied, with entries of an earlier leadership still
        counted in flight. Every entry up to the no-op is applied by now, so theirs lay above it: overwritten by
        another leader's while this member followed (pysyncobj answers such a callback only once its index is
        written again, by whoever leads), and never committed, as no later log holding this term's no-op can hold
        them. Counted in flight, they held the batcher in its wait for a drain before it replans, and every append
        was refused busy until unrelated writes filled those indexes (a cut-off leader that rejoined, then led
        again). Their callers are answered as a leader change (nothing applied); a callback that still comes is
        for a batch no longer counted, and is dropped (``_committed``)."""
        stale = list(self._flights.values())
        self._flights.clear()
        for _ in stale:
            self._slots.release()
        self._records_in_flight_since_drain = 0
        self._drained.set()
        self._replan = True
        log.warning("entries of an earlier leadership never committed, their callers told so group=%s batches=%d "
                    "records=%d", self.config.group, len(stale), sum(len(b) for b in stale))
        error = LeaderChangedError(self.config.group, "its entry was overwritten while this member followed another "
                                                      "leader")
        self._failed_batches += len(stale)
        for batch in stale:
            self._fail(batch, error)

    def _metadata_applied(self) -> None:
        for listener in list(self._metadata_listeners):
            try:
                listener()
            except Exception:
                log.exception("metadata listener failed group=%s id=%s", self.config.group, self.config.self_id)

    def _run_completions(self) -> None:
        completions, self._completions = self._completions, []
        with self._completion_context():
            for args in completions:
                try:
                    self._committed(*args)
                except Exception:
                    log.exception("commit completion failed group=%s", self.config.group)

    async def _expire_appends(self) -> None:
        while True:
            self._coarse_now = trio.current_time()
            await trio.sleep(0.05)
            now = self._coarse_now = trio.current_time()
            self._drop_stale_queued(now)
            for pending in [p for p in self._waiting if p.deadline <= now]:
                if not pending.done:
                    pending.error = AppendTimeoutError(self.config.group, pending.timeout_s)
                    pending.finish()

    def _drop_stale_queued(self, now: float) -> None:
        """Answer GroupBusyError to the records queued longer than max_queue_wait_ms, oldest first. They were
        never proposed, so unlike a timeout of a proposed record the caller knows they are not stored."""
        queue = self._queue
        oldest_allowed = now - self._max_queue_wait_s
        while queue and queue[0].queued_at < oldest_allowed:
            pending = queue.popleft()
            if pending.done:
                continue
            pending.error = GroupBusyError(
                self.config.group, f"the record waited {(now - pending.queued_at) * 1000:.0f} "
                                   f"ms in the queue (max_queue_wait_ms {self.config.max_queue_wait_ms}), "
                                   f"{len(queue)} still queued")
            self._busy_records += 1
            pending.finish()

    async def _batcher(self) -> None:
        cfg = self.config
        delay_s = cfg.max_batch_delay_ms / 1000
        queue = self._queue
        while True:
            while not queue:
                self._batcher_idle = True
                try:
                    await self._wait_queue()
                finally:
                    self._batcher_idle = False
            batch: list[Pending] = []
            size = 0
            deadline = trio.current_time() + delay_s
            while True:
                size = self._take_queued(batch, size)
                if queue or len(batch) >= cfg.max_batch_messages:
                    break  # full
                # Wait for company only when the pipeline is busy anyway; an idle group proposes at once.
                if self._in_flight == 0 or delay_s <= 0 or trio.current_time() >= deadline:
                    break
                await self._wait_queue(deadline)
                if not queue:
                    break
            if batch:
                await self._propose(batch, size)

    def _take_queued(self, batch: list[Pending], size: int) -> int:
        """Move queued records into ``batch`` (holding ``size`` bytes) until the queue is empty or the batch is
        full; returns the batch's size in bytes."""
        cfg = self.config
        queue = self._queue
        while queue and len(batch) < cfg.max_batch_messages:
            nxt = queue[0]
            if nxt.done:  # cancelled or expired while queued
                queue.popleft()
                continue
            if batch and size + len(nxt.record) > cfg.max_batch_bytes:
                break
            queue.popleft()
            batch.append(nxt)
            size += len(nxt.record)
        return size

    async def _propose(self, batch: list[Pending], size: int) -> None:
        # A batch stays open until it is proposed: records queued while it waited for a slot (or a drain, or a
        # leadership transfer) join it instead of starting the next entry. Senders come back in waves, one entry's
        # answers at a time, and a wave split over two entries stayed split; sealing at proposal made entries
        # ~15 % larger and single sends ~4 % faster (docs/benchmarks.md, twenty-third session).
        if not (self._transferring or self._slots.value == 0 or (self._replan and self._in_flight)):
            await self._wait_to_propose()
            self._take_queued(batch, size)
            self._propose_now(batch)
            return
        # The batch has left the queue but is not proposed yet, so the queue's wait limit still applies to it.
        with trio.move_on_at(batch[0].queued_at + self._max_queue_wait_s):
            await self._wait_to_propose()
            self._take_queued(batch, size)
            self._propose_now(batch)
            return
        self._busy_records += len(batch)
        self._fail(batch, GroupBusyError(
            self.config.group, f"{len(batch)} records waited {self.config.max_queue_wait_ms} ms (max_queue_wait_ms) "
                               f"for the {self._in_flight} batches in flight to commit (at most "
                               f"{self.config.max_in_flight_batches})"))

    async def _transfers_done(self) -> None:
        """Until no leadership transfer runs: what is proposed meanwhile waits for it (the batcher, metadata)."""
        while self._transferring:
            await self._transfer_done.wait()

    async def _wait_to_propose(self) -> None:
        """Until a slot is held and nothing is in flight if a replan is due; a cancelled wait holds no slot."""
        await self._transfers_done()
        await self._slots.acquire()
        if self._replan and self._in_flight:
            try:
                await self._drained.wait()
            except trio.Cancelled:
                self._slots.release()
                raise

    def _propose_now(self, batch: list[Pending]) -> None:
        """Prepare and propose ``batch`` (a slot is held; nothing in flight if a replan is due)."""
        if not self._can_propose():
            self._slots.release()
            self._fail(batch, self._not_leader())
            return
        m = self.member
        if self._flights and m.noop_index != self._flights_noop:
            # Proposed before a tick saw this leadership's no-op applied: its entries would be planned after (and
            # this proposal would make them look like) the earlier leadership's.
            self._drop_stale_flights()
        fresh = self._in_flight == 0 or self._replan
        start = self._sm.end_offset if fresh else self._planned_end
        store_timestamp = max(int(time.time() * 1000), self._last_store_timestamp)
        while True:
            try:
                prepared = self._sm.prepare_batch([p.record for p in batch], start, store_timestamp, fresh=fresh)
                if prepared.payload is None:  # every record refused: nothing to replicate
                    self._slots.release()
                    self._finish(batch, 0, prepared.record_results)
                    return
                entry = encode_entry(start, store_timestamp, prepared.payload,
                                     max_entry_bytes=self.config.max_entry_bytes)
                break
            except EntryTooLargeError as e:
                if len(batch) > 1 and fresh:
                    batch = self._fewer(batch, e)
                    continue  # prepared afresh, which drops the plan of the records that did not fit
                if len(batch) > 1:
                    # The state machine's plan now counts these records, so nothing may be planned after the
                    # entries in flight: back at the head of the queue, proposed (and split) once they drained.
                    self._queue.extendleft(reversed(batch))
                    self._slots.release()
                    self._replan = True
                    self._log_split(len(batch), e)
                    return
                error: Exception = e
            except Exception as e:
                error = e
            self._slots.release()
            self._replan = True  # the state machine may hold a plan for this batch
            log.warning("batch not proposed group=%s records=%d error=%s", self.config.group, len(batch), error)
            self._fail(batch, self._entry_too_large(batch[0], error) if isinstance(error, EntryTooLargeError)
                       else error)
            return
        self._replan = False
        self._last_store_timestamp = store_timestamp
        self._planned_end = prepared.end_offset
        self._records_in_flight_since_drain += len(batch)
        self._flights[id(batch)] = batch
        self._flights_noop = m.noop_index
        if self._drained.is_set():
            self._drained = trio.Event()
        m.apply_entry(entry, callback=functools.partial(self._on_commit, batch, start, prepared.record_results))

    def _fewer(self, batch: list[Pending], error: EntryTooLargeError) -> list[Pending]:
        """The first records of ``batch``, whose prepared entry was past ``max_entry_bytes``, that are proposed
        instead (their share of the entry the limit holds, fewer each time, one at least); the others go back to
        the head of the queue in their order. Records are packed by their own bytes, but a state machine may make
        an entry several times that (the message store adds 12 bytes of index per key): senders whose records each
        fit one entry were all answered busy, and packed together again when they retried."""
        keep = max(1, min(len(batch) - 1, len(batch) * error.max_entry_bytes // error.size))
        self._queue.extendleft(reversed(batch[keep:]))
        self._log_split(len(batch), error)
        return batch[:keep]

    def _log_split(self, records: int, error: EntryTooLargeError) -> None:
        # Once loud: a group that splits often packs by too many record bytes for what its entries carry.
        self._split_batches += 1
        log.log(logging.WARNING if self._split_batches == 1 else logging.DEBUG,
                "batch proposed in parts, its entry too large group=%s records=%d entry_bytes=%d "
                "max_entry_bytes=%d splits=%d (frequent: lower dledger.max_batch_bytes)", self.config.group, records,
                error.size, error.max_entry_bytes, self._split_batches)

    def _entry_too_large(self, pending: Pending, error: EntryTooLargeError) -> DLedgerError:
        """What the caller of a record proposed alone whose prepared entry is past ``max_entry_bytes`` is told: it
        never fits, so not retriable (a bare ValueError was answered as a broker defect, which producers retry).
        Records proposed together are never failed so: the batch is split (``_fewer``)."""
        return PreparedEntryTooLargeError(self.config.group, len(pending.record), error.size, error.max_entry_bytes)

    def _on_commit(self, batch: list[Pending], start: int, results: tuple[Any, ...], res: Any, err: int) -> None:
        # pysyncobj's callback, on the trio thread: inside a tick (the tick task runs the completion once the
        # tick returns), or outside one when pysyncobj refuses a command at once (QUEUE_FULL).
        self._completions.append((batch, start, results, res, err))
        if not self._in_tick and len(self._completions) == 1:
            try:
                assert self._token is not None
                self._token.run_sync_soon(self._run_completions)
            except trio.RunFinishedError:
                pass

    def _committed(self, batch: list[Pending], start: int, results: tuple[Any, ...], res: Any, err: int) -> None:
        if self._flights.pop(id(batch), None) is None:
            return  # dropped as stale (_drop_stale_flights): its callers were told, and it is counted no more
        self._slots.release()
        if self._in_flight == 0:
            self._drained.set()
            self._one_at_a_time = self._records_in_flight_since_drain == 1
            self._records_in_flight_since_drain = 0
        if err == FAIL_REASON.SUCCESS:
            index, result = res
            if result.status is ApplyStatus.APPLIED:
                self._appended_batches += 1
                self._appended_records += len(batch)
                self._finish(batch, index, results)
                return
            error: Exception = BatchRejectedError(self.config.group, result.status.value, start, result.end_offset)
        else:
            error = self._commit_failure(err)
        self._replan = True
        self._failed_batches += 1
        self._fail(batch, error)

    @staticmethod
    def _finish(batch: list[Pending], index: int, results: tuple[Any, ...]) -> None:
        for pending, record_result in zip(batch, results):
            pending.index = index
            pending.result = record_result
            pending.finish()

    @staticmethod
    def _fail(batch: list[Pending], error: BaseException) -> None:
        for pending in batch:
            pending.error = error
            pending.finish()

    # ---- replicated metadata ----

    async def put_metadata(self, table: str, items: dict[str, Any], *, timeout_s: float = 3.0) -> int:
        """Replicate key/value changes of a metadata table (None deletes a key); leader only. Held while a leadership
        transfer runs, then refused with NOT_LEADER if the leadership moved, and with LeaderChangedError if it moved
        and came back (the caller decided on what it read in the earlier term)."""
        if not self.is_leader:
            raise self._not_leader()
        if self._transferring:
            term = self.term
            # Held like the batcher's entries: one appended after the TimeoutNow leaves the target a log shorter
            # than this member's, so the target loses the election it was asked to hold and this member, stepping
            # down, wins it back (seen under load, most likely a broker's periodic consumer-offset flush: its clean
            # stop then waited out the hand-over timeout and stopped without one).
            deadline = trio.current_time() + timeout_s
            with trio.move_on_at(deadline):
                await self._transfers_done()
            if self._transferring:
                raise GroupBusyError(self.config.group, f"a leadership transfer held the change for {timeout_s:g} s")
            if not self.is_leader:
                raise self._not_leader()
            if self.term != term:
                # Led again in a later term, after another member may have led and changed the table: a lock
                # grant or offset decided on the earlier term's table would land over that member's changes.
                raise LeaderChangedError(self.config.group, f"the leadership moved and came back (term {term} to "
                                                            f"{self.term}) while a transfer held the change")
            timeout_s = max(deadline - trio.current_time(), 0.001)
        outcome = await self._call_replicated(lambda cb: self.member.put_metadata(table, items, callback=cb),
                                              timeout_s)
        return outcome

    def metadata(self, table: str) -> dict[str, Any]:
        """A copy of this member's applied metadata table: for a caller that keeps it, or changes it. It costs the
        table's size; ``metadata_get`` and ``metadata_view`` read without copying."""
        return self.member.metadata(table)

    def metadata_get(self, table: str, key: str, default: Any = None) -> Any:
        """One key of this member's applied metadata table, without copying the table (a consumer offset lookup
        copied a table of every group's offsets, 200k keys: 3.8 ms a commit)."""
        return self.member.metadata_get(table, key, default)

    def metadata_view(self, table: str) -> Mapping[str, Any]:
        """This member's applied metadata table itself, read-only, not a copy. Valid until the next tick applies a
        change (ticks run on the trio thread, between tasks): read it with no checkpoint in between, never keep it
        or its values (nor change a value), and copy (``metadata``) what must outlive the read. A table nothing was
        ever put in answers an empty view, which does not follow later puts; a snapshot load replaces every
        table."""
        return self.member.metadata_view(table)

    def metadata_generation(self, table: str) -> int:
        """Moves whenever ``table`` may have changed: compare it to tell whether a copy is still current."""
        return self.member.metadata_generation(table)

    def on_metadata_applied(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every tick that applied a metadata change or loaded a snapshot, on the trio
        thread and before any other task runs: a copy kept up to date by it is never behind the applied tables
        while a request is served."""
        self._metadata_listeners.append(callback)

    async def _call_replicated(self, call: Callable[[Callable[[Any, int], None]], None], timeout_s: float) -> Any:
        done = trio.Event()
        box: list[Any] = []
        token = self._token
        assert token is not None

        def on_result(res: Any, err: int) -> None:
            def deliver() -> None:
                box.append((res, err))
                done.set()
            try:
                token.run_sync_soon(deliver)
            except trio.RunFinishedError:
                pass

        call(on_result)
        with trio.move_on_after(timeout_s):
            await done.wait()
        if not done.is_set():
            raise AppendTimeoutError(self.config.group, timeout_s)
        res, err = box[0]
        if err != FAIL_REASON.SUCCESS:
            raise self._commit_failure(err)
        return res

    def _commit_failure(self, err: int) -> DLedgerError:
        """The error for a commit callback's failure code: unknown outcome when a snapshot overtook the entry
        (dledger/patches.py, 16), else never applied."""
        if err == OUTCOME_UNKNOWN:
            return AppendOutcomeUnknownError(self.config.group)
        return LeaderChangedError(self.config.group, _FAIL_NAMES.get(err, str(err)))

    # ---- leadership and membership ----

    @property
    def transfer_phase(self) -> str:
        """What the running (else the last) ``transfer_leadership`` waited for last, "" before any: a caller that
        gave up on one says where it was stuck."""
        return self._transfer_phase

    async def transfer_leadership(self, to: str | None = None, *, timeout_s: float = 3.0) -> RoleChange:
        """Hand leadership to member ``to`` (None: the most caught-up follower); returns the new role view."""
        if not self.is_leader:
            raise self._not_leader()
        target = None
        if to is not None:
            if to == self.config.self_id:
                # DLedger answers a transfer to its own leader with "already the leader"; saying the target is
                # no member, as this did, sent operators looking for a typo in a valid member id.
                raise TransferLeadershipError(self.config.group, to, f"{to} is already the leader",
                                              retriable=False)
            target_member = self.member_address(to)
            if target_member is None:
                others = sorted(({m.id for m in self.config.members} | set(self.member.metadata(MEMBERS_TABLE)))
                                - {self.config.self_id})
                raise TransferLeadershipError(self.config.group, to, f"no such other member (the others: "
                                                                     f"{', '.join(others)})", retriable=False)
            target = target_member.raft_address
        m = self.member
        deadline = trio.current_time() + timeout_s
        # As DLedger does: hold new entries while the transfer runs, so the target can catch up (pysyncobj
        # refuses a target whose match index is behind the last entry) and nothing is proposed by a leader
        # about to step down. Records keep queueing; the new leader's NOT_LEADER answers redirect them.
        self._transferring += 1
        try:
            while True:  # a round per TimeoutNow sent
                while True:
                    self._transfer_phase = "the entries in flight to commit"
                    # Bounded by the deadline too: without a majority the batches in flight never commit, and an
                    # unbounded wait held the request (and every new entry) past the caller's timeout. Ended by a
                    # step-down as well: a leader that lost its majority leaves its entries in flight uncommitted.
                    # (The event is read once: a batch proposed while this task wakes replaces ``_drained``, and a
                    # wait that did end would read as one that timed out.)
                    drained = self._drained
                    with trio.move_on_at(deadline) as drain_wait:
                        while self.is_leader and not drained.is_set():
                            await _first_set(drained, self._changed)
                    if not self.is_leader:
                        return await self._leader_after_step_down(to, deadline)
                    if drain_wait.cancelled_caught:
                        raise TransferLeadershipError(
                            self.config.group, to, f"the entries in flight did not commit within {timeout_s:g} s")
                    self._transfer_phase = "the target to be connected and caught up"
                    try:
                        await self._call_replicated(
                            lambda cb: m.call_on_tick_thread(lambda: m.transferLeadership(target, callback=cb)),
                            max(deadline - trio.current_time(), 0.001))
                        break
                    except AppendTimeoutError:
                        # pysyncobj did not answer in time: the transfer's timeout, not an append's.
                        raise TransferLeadershipError(self.config.group, to, f"no answer within {timeout_s:g} s") \
                            from None
                    except LeaderChangedError as e:
                        if not self.is_leader or e.reason == "NOT_LEADER":
                            return await self._leader_after_step_down(to, deadline)
                        if e.reason != "REQUEST_DENIED" or trio.current_time() + 0.02 >= deadline:
                            raise TransferLeadershipError(
                                self.config.group, to, f"refused ({e.reason}: the target must be connected and "
                                                       f"fully caught up)") from None
                    await trio.sleep(0.02)  # the target is still catching up (or not connected yet)
                self._transfer_phase = "the target to win its election"
                sent_term = self._role.term
                # A TimeoutNow can go unheeded: lost with a connection judged dead, or its election lost to a log
                # that grew after it (pysyncobj checks the target's match index only when it sends). This member then
                # leads on, or is elected again; it asks again after an election timeout instead of waiting out the
                # caller's whole deadline.
                ask_again_at = min(deadline, trio.current_time() + self.config.election_timeout_min_ms / 1000)
                with trio.move_on_at(ask_again_at):
                    while True:
                        role = self._role
                        if role.leader_id not in (None, self.config.self_id):
                            if to and role.leader_id != to:
                                # Another member won an election meanwhile: the target will not lead in this term.
                                raise self._not_leader(f"it stepped down during the leadership transfer to {to}, "
                                                       f"and another member was elected")
                            return role
                        if role.leader_id == self.config.self_id and role.term > sent_term:
                            break
                        await self._changed.wait()
                if not self.is_leader:
                    # Stepped down, the election not decided yet: wait for it; the next round reads its outcome.
                    with trio.move_on_at(deadline):
                        while self._role.leader_id is None:
                            await self._changed.wait()
                if trio.current_time() >= deadline:
                    raise TransferLeadershipError(self.config.group, to, f"no new leader within {timeout_s:g} s")
                if self.is_leader:  # else another member leads: the next round returns it (or says who)
                    log.info("leadership transfer asked again group=%s to=%s term=%d: %s", self.config.group,
                             to or "any follower", self._role.term,
                             "elected again" if self._role.term > sent_term else "no election followed")
        finally:
            self._transferring -= 1
            if not self._transferring:
                self._transfer_done.set()
                self._transfer_done = trio.Event()

    async def _leader_after_step_down(self, to: str | None, deadline: float) -> RoleChange:
        """This member stopped leading before the transfer was asked of pysyncobj (its majority lost, or a higher
        term seen). Waits up to one election timeout (within the transfer's deadline) for the group to name a
        leader: the target (or any other member when none was named) is the transfer done; anyone else, or no
        one yet, is a ``NotLeaderError`` naming who leads now, which a caller can act on: ask that leader, or
        look the leader up and ask again."""
        wait_until = min(deadline, trio.current_time() + self.config.election_timeout_max_ms / 1000)
        with trio.move_on_at(wait_until):
            while self._role.leader_id is None:
                await self._changed.wait()
        leader = self._role.leader_id
        if leader is not None and leader != self.config.self_id and (to is None or leader == to):
            return self._role
        if leader == self.config.self_id:
            raise TransferLeadershipError(self.config.group, to, "this member lost its leadership during the "
                                                                 "transfer and was elected again; ask again")
        raise self._not_leader(f"it stepped down during the leadership transfer to {to or 'a follower'}")

    async def add_member(self, member: MemberAddress, *, timeout_s: float = 5.0) -> None:
        """Add one member (one change at a time); it must be started with the full new member list."""
        if not self.is_leader:
            raise self._not_leader()
        if self.member_address(member.id) is not None:
            raise MembershipChangeError(self.config.group, "add", member.id, "a member with this id exists")
        await self.put_metadata(MEMBERS_TABLE, {member.id: [member.raft_address, member.service_address]},
                                timeout_s=timeout_s)
        try:
            await self._call_replicated(lambda cb: self.member.addNodeToCluster(member.raft_address, callback=cb),
                                        timeout_s)
        except LeaderChangedError as e:
            raise MembershipChangeError(self.config.group, "add", member.id, e.reason) from None

    async def remove_member(self, member_id: str, *, timeout_s: float = 5.0) -> None:
        if not self.is_leader:
            raise self._not_leader()
        target = self.member_address(member_id)
        if target is None or member_id == self.config.self_id:
            raise MembershipChangeError(self.config.group, "remove", member_id,
                                        "not another member of this group (transfer leadership first to "
                                        "remove the leader)")
        try:
            await self._call_replicated(
                lambda cb: self.member.removeNodeFromCluster(target.raft_address, callback=cb), timeout_s)
        except LeaderChangedError as e:
            raise MembershipChangeError(self.config.group, "remove", member_id, e.reason) from None
        await self.put_metadata(MEMBERS_TABLE, {member_id: None}, timeout_s=timeout_s)

    # ---- catch-up ----

    def _notify_threadsafe(self, kind: str, value: Any) -> None:
        wake = {"catch_up": self._catch_up.want, "snapshot": self._snapshot_writer.want}.get(kind)
        if wake is not None and self._token is not None:
            try:
                self._token.run_sync_soon(wake)
            except trio.RunFinishedError:
                pass

    # ---- statistics ----

    def statistics(self) -> DLedgerStatistics:
        m = self.member
        counters = m.counters()
        return DLedgerStatistics(
            group=self.config.group, self_id=self.config.self_id, role=self._role.role, term=m._getTerm(),
            leader_id=self._role.leader_id, committed_index=m.raftCommitIndex,
            last_applied_index=m.raftLastApplied, end_offset=self._sm.end_offset,
            appended_records=self._appended_records, appended_batches=self._appended_batches,
            failed_batches=self._failed_batches, in_flight_batches=self._in_flight,
            pending_records=len(self._queue), busy_records=self._busy_records,
            applied_batches=counters["applied_batches"], duplicate_batches=counters["duplicate_batches"],
            rejected_batches=counters["rejected_batches"], snapshots_written=counters["snapshots_written"],
            snapshots_loaded=counters["snapshots_loaded"], journal_flushes=counters["journal_flushes"],
            pre_votes=counters["pre_votes"], leader_changes=self._leader_changes,
            log_entries_in_memory=counters["log_entries_in_memory"],
            catch_up_bytes=self._catch_up.copied_bytes,
            serving_reads=m.catch_up_target is None, connected_peers=m.connected_peers(),
            rejoining=m.rejoining)


async def _first_set(*events: trio.Event) -> None:
    """Return once any of ``events`` is set."""
    async with trio.open_nursery() as nursery:
        for event in events:
            async def wait(event: trio.Event = event) -> None:
                await event.wait()
                nursery.cancel_scope.cancel()
            nursery.start_soon(wait)


@asynccontextmanager
async def open_dledger_group(config: DLedgerConfig, state_machine: StateMachine, *,
                             fetch_range: FetchRange | None = None,
                             completion_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
                             ) -> AsyncIterator[DLedgerGroup]:
    """Start this process's member of the group; on exit stop ticking and close the Raft port.
    ``completion_context()`` is entered around each run of commit callbacks (the broker corks its connections
    there, so the answers to one commit leave in one write per connection)."""
    group = DLedgerGroup(config, state_machine, fetch_range=fetch_range, completion_context=completion_context)
    group._open_member()  # outside the nursery: a bind error surfaces as itself, not in an ExceptionGroup
    try:
        async with trio.open_nursery() as nursery:
            group._start(nursery)
            try:
                yield group
            finally:
                nursery.cancel_scope.cancel()
    finally:
        group._close()
