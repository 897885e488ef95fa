"""Putting a Raft snapshot in place: only once the log it vouches for is on disk.

A snapshot records the state machine's applied end offset, and once it is in place pysyncobj drops the journal
entries it covers: from then on the bytes before that offset exist only in the state machine's log. Put in place
while those bytes were still in the page cache (ASYNC_FLUSH syncs every ``flush_interval_ms``; followers'
commit logs are synced that way in SYNC_FLUSH too), a power loss of the whole group left every member with a
snapshot past the end of its log and no journal entry to write the rest again from: each closed its apply gate
to copy the missing bytes from a peer that lacked them as well, and the group was stuck for good.

So a snapshot goes in place in steps, none of them on the tick (a flush there would stall elections and
heartbeats for as long as the fdatasync takes):

1. pysyncobj's compaction calls ``RaftMember._write_snapshot`` in a tick; it writes the file under a temporary
   name (a few KB: metadata and an offset) and hands it here as a ``PendingSnapshot``. A member whose log is
   still behind its applied end (catching up after a snapshot from the leader) writes none.
2. ``SnapshotWriter`` waits until the state machine's log is on disk up to the snapshot's end offset
   (``StateMachine.wait_durable``; the store asks its flush service for a flush at once).
3. It fsyncs the file, renames it over the previous snapshot (unless a snapshot from the leader was loaded
   meanwhile: that one is newer, and the journal was replaced with it) and fsyncs the directory, so the new
   snapshot, not an empty file nor the old one, is what a power loss leaves. Before, the file was fsync'd in
   SYNC_FLUSH only (in the tick) and the directory never, so the truncated journal could reach the disk before
   the snapshot: a member found the old snapshot, or a torn new one, beside a journal that had dropped what
   only the new one held.
4. ``RaftMember``'s serialize checker then reports success to pysyncobj at its next tick, which drops the journal
   entries the snapshot covers (``dledger.patches``, 21). Until then the previous snapshot and the whole journal
   stand; a member stopped in between keeps the journal's entries after the new snapshot (``dledger.patches``, 20).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from dledger.state_machine import StateMachine

if TYPE_CHECKING:
    from dledger.member import RaftMember

log = logging.getLogger(__name__)

__all__ = ["PendingSnapshot", "SnapshotWriter", "fsync_path"]


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (after a rename in it), by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(slots=True)
class PendingSnapshot:
    """A snapshot written under ``tmp_path``, to be put in place at ``path`` once the log is durable up to
    ``end_offset``. ``loads`` is how many snapshots the member had loaded when it was written (a later load is a
    newer snapshot, which this one must not replace)."""

    tmp_path: Path
    path: Path
    end_offset: int
    loads: int
    written_at: float = field(default_factory=time.monotonic)
    done: bool = False
    in_place: bool = False

    def finish(self, in_place: bool) -> None:
        self.done = True
        self.in_place = in_place


class SnapshotWriter:
    """The trio task of one member that puts its snapshots in place: ``run`` waits until ``want`` is called."""

    def __init__(self, state_machine: StateMachine) -> None:
        self._sm = state_machine
        self._wanted = trio.Event()

    def want(self) -> None:
        """A snapshot was written (on the trio thread, after the tick)."""
        self._wanted.set()

    async def run(self, member: RaftMember) -> None:
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            pending = member.pending_snapshot
            if pending is not None and not pending.done:
                await self._put_in_place(member, pending)

    async def _put_in_place(self, member: RaftMember, pending: PendingSnapshot) -> None:
        try:
            await self._sm.wait_durable(pending.end_offset)
            await trio.to_thread.run_sync(fsync_path, pending.tmp_path)
            if member.snapshots_loaded != pending.loads:
                log.info("snapshot end_offset=%d not put in place: a newer one from the leader was loaded meanwhile",
                         pending.end_offset)
                pending.finish(False)
                return
            # On the trio thread, between ticks: no tick can load a received snapshot between the check and this.
            os.replace(pending.tmp_path, pending.path)
            await trio.to_thread.run_sync(fsync_path, pending.path.parent)
        except OSError as e:
            log.error("snapshot end_offset=%d could not be put in place; the journal keeps its entries and the "
                      "next compaction tries again error=%s", pending.end_offset, e)
            pending.finish(False)
            return
        pending.finish(True)
        log.debug("snapshot in place end_offset=%d waited_ms=%.1f", pending.end_offset,
                  (time.monotonic() - pending.written_at) * 1000)
