"""Copying the commit-log bytes a loaded snapshot is ahead of, from a peer.

A member that loads a snapshot (pysyncobj sends one to a follower too far behind) has its Raft state at the
snapshot's index while its commit log may end earlier: the snapshot holds the state machine's metadata and the
log's end offset, not the log. ``RaftMember`` then closes its apply gate and sets ``catch_up_target``; this task
copies the missing range with ``fetch_range`` (the leader first, then the other peers), and opens the gate again
once the log reaches the target. Until then the member serves no reads (``DLedgerGroup.serving_reads``).

Peers keep identical logs, so bytes that do not continue ours mean ours holds something the group never
committed (``MemberDivergedError``), and a log whose missing range every peer has deleted cannot be filled
(``MemberFellBehindError``), and copied bytes that cannot be written (a full disk: ``MemberStoreError``) leave
the log short: all three are raised out of the task, ending the group's nursery, rather than let the member
serve a log with a hole.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

import trio

from dledger.config import DLedgerConfig, MemberAddress
from dledger.errors import CommitLogMovedError, MemberDivergedError, MemberFellBehindError, MemberStoreError
from dledger.member import RaftMember
from dledger.state_machine import StateMachine

log = logging.getLogger(__name__)

__all__ = ["FetchRange", "CatchUp"]

# fetch_range(peer, offset, max_bytes) -> the peer's commit-log bytes from offset (b"" when its log ends there).
FetchRange = Callable[[MemberAddress, int, int], Awaitable[bytes]]
# A peer a fetch failed from is asked after the others for this long.
FAILED_PEER_LAST_S = 2.0


class CatchUp:
    """The catch-up task of one member: ``run`` waits until ``want`` is called, then copies until caught up."""

    def __init__(self, config: DLedgerConfig, state_machine: StateMachine, fetch_range: FetchRange | None,
                 leader_id: Callable[[], str | None]) -> None:
        self.config = config
        self._sm = state_machine
        self._fetch_range = fetch_range
        self._leader_id = leader_id
        self._wanted = trio.Event()
        self.copied_bytes = 0
        self._failed_at: dict[str, float] = {}  # peer id -> when a fetch from it last failed (trio clock)

    def want(self) -> None:
        """Look at the member's catch-up target again (on the trio thread)."""
        self._wanted.set()

    def sources(self) -> list[MemberAddress]:
        """The peers to copy from, the current leader first, and last those a fetch failed from within
        ``FAILED_PEER_LAST_S``: a leader killed while we copy stays the leader we know until the next election, and
        each chunk (1 MiB) tried it first, a refused connection and a warning per chunk (378 in 0.6 s)."""
        peers = [p for p in self.config.peers if p.service_address]
        leader = self._leader_id()
        now = trio.current_time()
        peers.sort(key=lambda p: (now - self._failed_at.get(p.id, -math.inf) < FAILED_PEER_LAST_S, p.id != leader))
        return peers

    async def run(self, member: RaftMember) -> None:
        m = member
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            while (target := m.catch_up_target) is not None:
                end = self._sm.end_offset
                if end >= target:
                    m.finish_catch_up()
                    break
                if self._fetch_range is None:
                    log.error("commit log behind snapshot end_offset=%d target=%d and no fetch_range: "
                              "cannot catch up", end, target)
                    await trio.sleep(1.0)
                    continue
                copied = False
                sources = self.sources()
                moved: list[CommitLogMovedError] = []  # the peers that no longer keep the log from `end`
                # Peers whose log ends at or before ours (empty ones being rebuilt too) have nothing to give and
                # deleted nothing we need: they neither supply the bytes nor hold the decision below back.
                ending_here = 0
                for peer in sources:
                    try:
                        with trio.fail_after(5.0):
                            data = await self._fetch_range(peer, end, min(self.config.catch_up_chunk_bytes,
                                                                          target - end))
                    except CommitLogMovedError as e:
                        log.warning("catch-up: %s", e)
                        moved.append(e)
                        continue
                    except Exception as e:
                        last = self._failed_at.get(peer.id, -math.inf)
                        now = self._failed_at[peer.id] = trio.current_time()
                        # At most once per FAILED_PEER_LAST_S a peer: the next chunks ask the other peers first.
                        log.log(logging.DEBUG if now - last < FAILED_PEER_LAST_S else logging.WARNING,
                                "catch-up fetch failed peer=%s offset=%d error=%r", peer.id, end, e)
                        continue
                    self._failed_at.pop(peer.id, None)
                    if not data:
                        ending_here += 1
                        continue
                    try:
                        self._sm.write_raw(end, data)
                    except ValueError as e:
                        # The peer's bytes do not continue ours: our log holds something the group never
                        # committed. Another peer would say the same (their logs are identical).
                        raise MemberDivergedError(self.config.group, self.config.self_id, end, str(e)) from None
                    except OSError as e:
                        raise MemberStoreError(self.config.group, self.config.self_id,
                                               f"write the commit-log bytes copied from {peer.id} at offset {end}",
                                               e) from e
                    self.copied_bytes += len(data)
                    copied = True
                    break
                if not copied and moved and len(moved) + ending_here == len(sources):
                    first = min(moved, key=lambda e: e.min_offset)
                    # Empty (a rebuilt member): begin the log where that peer's log begins. Not empty: our log
                    # ends where every peer's log has been deleted, and the gap cannot be filled.
                    try:
                        # With the state that peer sent with its min offset: what the bytes from there do not say.
                        self._sm.start_at(first.min_offset, first.state)
                    except ValueError as e:  # not empty, or not a start this store can take (a segment's)
                        log.error("catch-up: the commit log cannot begin at member %s's min offset %d: %s",
                                  first.peer_id, first.min_offset, e)
                        raise MemberFellBehindError(self.config.group, self.config.self_id, end,
                                                    first.min_offset) from None
                    log.warning("catch-up: empty commit log starts at offset %d, member %s's min offset "
                                "start_state_bytes=%s", first.min_offset, first.peer_id,
                                "none (a member of an older version)" if first.state is None else len(first.state))
                    if first.min_offset > target:
                        # Past the snapshot's end: copy up to the peer's end instead. The entries after the
                        # snapshot that precede it are then in the log already and apply as duplicates, as
                        # after a restart (a peer's applied end is an entry boundary of the same log).
                        m.extend_catch_up(first.end_offset)
                        log.warning("catch-up: member %s's log begins past the snapshot's end %d: copying up to "
                                    "its end %d", first.peer_id, target, first.end_offset)
                if not copied:  # also after a start_at: peers answering "moved" again must not be asked in a spin
                    await trio.sleep(0.2)
