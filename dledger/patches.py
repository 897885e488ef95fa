"""Containment of pysyncobj 0.3.17's measured defects (see ``docs/architecture.md``, "Replication (dledger)").

Every fix is a small wrapper around one pysyncobj internal, applied once by ``apply_patches()`` when
``dledger.member`` is imported, and each has a regression test in ``tests/unit/dledger/test_patches.py`` that
fails without it. The rules below number them all; the TCP layer's (1, 12-14, 18, 26's write buffer) live in
``dledger.wire_patches``, the journal's and snapshot files' (5, 7, 17, 21-25) in ``dledger.journal_patches``, and
the Raft logic's here. The wrappers reach into name-mangled attributes (``_SyncObj__raftNextIndex``), which is only
safe for the exact version they were written against: ``check_version()`` refuses any other version at import,
so a silent upgrade cannot quietly disable a fix.

1. Wire: stock pysyncobj sends ``zlib.compress(pickle.dumps(msg, protocol=2))`` and unpickles the first frame of
   a new connection before any check (remote code execution for anyone who reaches the port). We replace the
   frame codec of ``TcpConnection``: ``length(4, native int) | tag(32) | body`` where
   ``body = pickle.dumps(msg, protocol=5)`` and ``tag = BLAKE3-keyed(key(secret), connection key || BLAKE3(body))``;
   the tag is verified with ``hmac.compare_digest`` *before* ``pickle.loads`` runs, and a bad tag closes the
   connection. No zlib: the payloads are message batches that the CPU would rather not compress twice. The
   authenticator is handed to pysyncobj as its "encryptor", which also switches on its per-connection random-key
   handshake, so a frame captured on one connection is rejected on every other one.
2. nextIndex rewind: a success reply for an older append moves ``nextIndex`` backwards, so in-flight entries are
   re-sent and followers truncate already-applied entries. On success the leader now keeps ``nextIndex`` at
   ``max(previous, reported)``.
3. SYNC_FLUSH: pysyncobj never msyncs its mmap'd journal. With ``flush_journal=True`` a member flushes the
   journal before it acknowledges entries (follower: before ``next_node_idx``; leader: before it sends entries,
   which is before any majority can include it).
4. Apply gate: ``SyncObj.__applyLogEntries`` is skipped while ``member._dledger_apply_gate_open`` is False, so a
   member whose state machine is behind its snapshot keeps voting, appending and acknowledging (Raft stays live)
   but applies nothing until the missing commit-log bytes were copied from a peer.
5. File handles: pysyncobj leaks the journal meta file it reads and the snapshot file it streams to a lagging
   follower (closed only by the garbage collector, a ResourceWarning each time; also when a newer snapshot
   replaces one still being streamed), and the listening socket of every failed bind attempt. All are closed
   here.
6. ``pysyncobj.win_inet_pton`` (imported by its TCP code) replaces ``socket.inet_ntop`` process-wide on every
   OS, with a Windows-only ctypes function that raises TypeError on Linux: any code in the process that formats
   an IP address (the store's message ids) breaks once pysyncobj is imported. The C function is put back.
7. Journal appends: ``FileJournal.add`` concatenates header, entry and trailer (two copies of every entry,
   up to 256 KiB) before copying them into its mmap; the three pieces are now written in place (same bytes,
   one copy).
8. Pickle protocol 2 is also used by pysyncobj's command encoding (``pysyncobj.pickle.dumps``); raised to 5 so a
   bytes payload is one memcpy instead of a latin-1 string round trip.

9. Ticking from trio: ``pollerType = "epoll"`` makes pysyncobj use ``dledger.poller.EpollPoller`` (its own
   ``createPoller`` knows only poll and select, whose state trio cannot wait on), so ``dledger.group`` can run
   pysyncobj with ``autoTick=False`` from a trio task, without a tick thread.

10. Commit notice after the answer: once a leader applies newly committed entries, stock pysyncobj sends every
    follower an append_entries carrying only the new commit index, inside the same tick and so before the
    commit callbacks can answer anyone; with one append in flight those two sends (each waking a follower's
    process) were ~0.3 ms of the ~0.8 ms commit latency. The send is deferred: ``__applyLogEntries`` of a leader
    marks ``_dledger_commit_notice_due`` instead (a follower's apply asks for a send too, which stock ignores),
    and ``dledger.group``'s tick loop sends it (``RaftMember.send_commit_notice``) ``commit_notice_delay_ms``
    after it ran the commit callbacks. Any append_entries sent meanwhile (new entries, heartbeats) carries the
    commit index too and clears the mark, so under load no such notice goes out at all.

11. Commit index from a snapshot chunk: while a leader streams its snapshot (``append_entries`` without
    ``prevLogIdx``), the follower's handler still sets its commit index to ``min(leader's commit, own last
    index)``, although no chunk checked the follower's own entries against the leader's. A restarted old leader
    whose log ends with entries that never committed (its followers never got them) then applies them, a
    different record at an offset the group filled with another one, before the snapshot replaces its log.
    Seen here on a loaded machine: the member then refused its catch-up copy ("queue offset ... expects ...")
    and stopped. Had the stale record matched the committed one in size and queue, the copy would have passed
    and the member would have served a divergent commit log. The commit index now only rises to what the
    message proved: the index of a snapshot it loaded.

12. Idle connections taken for dead: ``TcpConnection`` disconnects when nothing was *read* for
    ``connectionTimeout``, and checks this first thing when it sends and when data arrives. Two followers never
    write to each other while a leader lives, so after ``connectionTimeout`` (3.5 s) their connection is
    "timed out" the moment it is used: the first candidate's ``request_vote`` after a leader failure is
    dropped by the sender (disconnect instead of send) or by the receiver (disconnect before reading), and the
    election fails. Measured: the first candidacy after every leader kill was lost, costing a second election
    timeout (0.4-0.9 s with the broker's defaults) and a split vote when the other follower timed out
    meanwhile. Silence now counts only while this side is talking (it sent within the timeout): a link quiet
    both ways is idle and kept (its clock restarts), the leader still drops a follower that stops answering,
    and a dead idle peer is found by TCP keepalive or by the error of the next send.

13. Messages sent before a connection's key handshake. (a) Our ``send`` judged the connection's silence (12)
    before queueing the frame; when that disconnected it, pysyncobj's disconnect callback had already opened
    a new connection, and the frame, tagged with no key, went out on it *ahead of* the handshake key. The
    peer took the message for the key: ``TypeError`` out of its tick ("raft tick failed", seen on a lagging
    follower under 4 MB messages, followed by an election). Stock pysyncobj queues first and judges in
    ``__trySendBuffer``, whose disconnect discards the frame; so does ``send`` now. (b) ``TCPTransport.send``
    checks only that the TCP connection is up, so a message (a candidate's ``request_vote``) could be sent on
    an outgoing connection whose key had not arrived yet; the peer refused it ("raft frame rejected
    reason=bad_authentication") and dropped the connection. It now reports such a connection as not
    connected, as it does a dropped one.

14. A read without an end. On a readable socket pysyncobj calls ``recv`` until the socket is empty, appending
    each piece to its ``bytes`` read buffer, which copies the whole buffer every time. A follower that fell
    behind while the leader streams 4 MB entries to it never finds the socket empty: measured (a watchdog
    dump) one tick of 4.6 s inside that loop, quadratic in what it had read. Meanwhile it answered nothing,
    so the leader dropped the connection (``connectionTimeout``), the follower discarded everything it had
    read, and its election timer, not reset for 4.6 s, made it a candidate: elections every few seconds and
    goodput down from ~38 to 12-17 msgs/s. Now one readable event stops reading once it has one receive
    buffer's worth (4 MiB); the messages that completed are handled, and the poller, level-triggered, brings
    the connection back at once if more is waiting. (Stopping after a single ``recv`` instead cost 19 % of
    sequential sends in an A/B; reading on to the budget costs nothing measurable.) The read buffer is also a
    ``bytearray`` now: a receive is appended in place and a parsed frame is cut from the front in place, where
    stock made a new ``bytes`` of everything read so far for each receive (about two per 512 KiB entry under
    load) and another of the rest for each frame parsed.

15. No pre-vote. A follower whose election timer fires becomes a candidate with a higher term at once, and any
    ``request_vote`` of a higher term makes every member, the leader included, take that term: a member back from a
    stall or a partition longer than ``connectionTimeout`` (its link dropped, no heartbeat waiting to be read)
    deposes a healthy leader, for an election it cannot even win when its log is behind. Measured: a follower
    stopped (SIGSTOP) for 6 s under load took the leadership away from the leader on resume, and acknowledged sends
    dipped for ~0.5 s; on an idle group 4 such stops made 4 elections (none with the fix). Raft's pre-vote (Ongaro's
    thesis, 9.6) is added: when the timer fires, a member first asks the others (``pre_vote``, its term + 1 and its
    last log entry) whether they would vote for it, without changing any term; only once a majority says yes does
    pysyncobj's own election begin. A member says yes only if its log is no more up to date and it has no current
    leader: a follower that heard from its leader less than ``raftMinTimeout`` ago, or a leader that heard from a
    majority that recently, says no. A dead leader has been silent that long at every follower by the time the first
    timer fires, so failover costs one round trip more. A leadership transfer (``timeout_now``) skips the pre-vote,
    as the leader asked for the election. (Ignoring ``request_vote`` instead, leader stickiness alone, would leave a
    member whose term had risen unable to rejoin: it ignores the leader's lower-term messages.)
    Two holes in the first version, found by a `tests/cluster/test_rejoin.py` run that elected no one for 30 s:
    (a) the stock tick reads the clock again after work of its own (the journal's one-second timer, a snapshot
    load), so a deadline that passed in between still started an election without a pre-vote; the stock check
    now sees no deadline while the tick runs. (b) A candidate that cannot win (the member holding the longest log
    was down when it asked for votes) stays at its higher term, and refuses every pre-vote for a term not above
    it; the member with the longest log, back at its lower term, asked for that same term for ever. A pre-vote
    answer now carries the answerer's term, and a member refused by a higher term takes it (as etcd's
    pre-candidates do), so its next round asks for a term the candidate can grant.
16. Commit callbacks lost on a snapshot load. ``__loadDumpFile`` moves ``raftLastApplied`` past the snapshot's
    index without calling the callbacks that wait in ``__commandsWaitingCommit`` for the indexes it covers, so
    they are never called. A leader deposed with entries in flight (hung, cut off) and caught up by a snapshot
    kept those entries in flight for ever, and ``DLedgerGroup`` waits for in-flight entries to drain before it
    replans: elected again, that member proposed nothing, and every send was answered SYSTEM_BUSY until the next
    election (38 s stalls in ``raftmq chaos --fault stop`` on a loaded machine; 0 in flight is expected). After
    the load, each callback waiting for an index the snapshot covers is called with ``OUTCOME_UNKNOWN``: the
    snapshot may include the entry (a new leader commits older terms' entries with its own) or not, so neither
    success nor failure can be claimed.
17. A full disk killed the process. The journal (``ResizableFile``) grows its file sparse (``mmap.resize``) and
    writes through the mapping, so when the disk filled, the page fault of a journal write was a SIGBUS: the
    member died with no word in its log. Measured with a follower's data on a 64 MiB tmpfs under load. The
    grown range is now allocated (``posix_fallocate``) before the mapping grows, and from the file's start the
    first time (its initial size is sparse too), so a full disk is an ``OSError``; ``FileJournal.add`` (7)
    raises it as ``JournalWriteError`` and ``dledger.group`` stops the member with ``MemberStoreError``. A term
    and vote that cannot be stored (``FileJournal.setCurrentTerm``, before a vote is granted or asked for) is a
    ``JournalWriteError`` too: stock pysyncobj logs it and goes on with a term and vote in memory that a restart
    forgets. Out of descriptors or memory for a moment (EMFILE, ...) is not a reason to stop: the message that
    raised the term is dropped (its sender sends again), the vote or candidacy is not sent, and the term and
    vote are stored again on pysyncobj's one-second timer. The commit index, stored on that timer, is left to
    stock: a failure is logged and retried.
18. A failed accept closed the Raft listener for good. ``TcpServer.__onNewConnection`` unbinds on any accept
    error but EAGAIN, and the transport binds only once, so a member out of file descriptors for a moment
    (EMFILE: a burst of client connections shares the process's descriptors) never accepted a Raft connection
    again. pysyncobj's connections go one way, from the member with the greater address, so the member with
    the smallest address was cut off from each peer as soon as that peer's connection dropped, a restart of
    the peer included. Now a failed accept leaves the listener listening. Out of descriptors or memory
    (EMFILE, ENFILE, ENOBUFS, ENOMEM), the listener stops being polled for ``ACCEPT_PAUSE_S`` and
    ``RaftMember.tick`` polls it again afterwards (``resume_accepting``), as trio's ``serve_listeners``
    does; otherwise the level-triggered poller would call the failing accept on every tick.
19. A member started empty votes for anyone. Rebuilt from nothing (its disk lost, or its log diverged), a
    member's empty log is older than every candidate's, so it grants every vote, and with one that lacks
    acknowledged entries (a follower that lagged) it makes a majority while the member that holds them is
    down: those entries are then overwritten. Raft assumes a member's log survives; etcd asks a member that
    lost it to join as a new one. Here a member started with ``DLedgerConfig.rejoin`` (``raftmq broker
    --rejoin``) answers no pre-vote, ignores ``request_vote`` and starts no election until it has heard from a
    leader of the current term; the group is then unavailable while it could only elect a member that may lack
    acknowledged entries, instead of losing them. A member whose state machine holds a log but whose Raft
    journal and snapshot are missing (its Raft data directory lost, its store kept) does the same by itself
    (``DLedgerConfig.rejoin_without_raft_data``, checked in ``dledger.member``).
20. A restart between a snapshot and the journal truncation it allows lost the journal's newer entries.
    Compaction puts the snapshot file in place first and drops the journal entries it covers later (stock: in
    the next tick), so a member stopped in between finds a journal that begins before its snapshot. The startup
    load (``__loadDumpFile(clearJournal=False)``) keeps the journal only if its first two entries are the
    snapshot's last two, and otherwise clears it, entries *after* the snapshot included: entries the member had
    acknowledged, and, stopped the same way on a majority, entries the group had committed (each member's
    commit log then ends past its Raft log, at a different place, and the next leader plans new entries on its
    own end: the others reject them, or hold other bytes there and stop as diverged). Now, when the journal holds
    the snapshot's last two entries further in, the load first drops only what comes before them, as the
    truncation would have.
21. A snapshot is put in place in the tick that writes it. With a custom serializer, ``Serializer.serialize``
    calls it in the tick, renames the temporary file over the snapshot at once, and reports success at the next
    tick, whereupon the journal entries the snapshot covers are dropped. ``SyncObjConf.serializeChecker`` is
    pysyncobj's hook "for async serializer", but stock renames the temporary file right after starting the
    serializer all the same. With a checker, the serializer now owns its file: it returns whether it started
    one (False: not now, asked again next tick), puts it in place itself, and the checker says when it has
    (``SUCCESS``: the journal is truncated) or failed (``FAILED``: the journal stays whole). Meanwhile no other
    snapshot is begun and none is streamed to a follower, as stock does while its forked serializer runs; once
    one is in place, transmissions restart from it, as stock's own serializer does. ``RaftMember`` uses this to
    put a snapshot in place only once the commit log is on disk up to the snapshot's end (``dledger.snapshot``).
22. A snapshot received from the leader is not synced before the journal is replaced with it. The last chunk
    closes the incoming file and renames it over the snapshot (``Serializer.setTransmissionData``), and the
    load clears the journal down to the snapshot's two entries at once; neither the file nor the directory is
    fsync'd. The cleared journal may then reach the disk first (SYNC_FLUSH msyncs it before the very
    acknowledgement of the snapshot), and a power loss leaves the old snapshot, or an empty file, beside it:
    the member lost everything it had acknowledged since its old snapshot, or cannot read its state at all. Now
    the incoming file is fsync'd before the rename and the directory after it, before the load. In the tick: a
    snapshot is received only by a follower too far behind for entries, and these are a few KB. A failure
    stops the member (``SnapshotWriteError``, as 17), unless a descriptor or memory was missing for a moment:
    the snapshot is then not loaded, and the leader sends it again.
23. Compaction rewrites the journal in place. ``FileJournal.deleteEntriesTo`` (the truncation once a snapshot is
    in place) writes the header, then the entries it keeps, over the file from its start, through the mapping:
    the entries it keeps were on disk (SYNC_FLUSH msynced them before acknowledging them), and now their pages
    are rewritten with other records at those offsets, synced by the next msync. A power loss during that msync
    leaves a mix of old and new pages: a header counting records that are not there (the journal does not load)
    or records cut across (nonsense entries). Every member compacts at about the same index, so under load a
    power loss of the group could catch all three so. With ``flush_journal`` (SYNC_FLUSH) the kept entries are
    now written to ``raft.journal.tmp``, fsync'd, renamed over the journal and the directory fsync'd, then the
    journal is mapped afresh: the old file stays whole until the new one is on disk. That fsync is in the tick,
    where the msync of the rewritten pages was before. Without it (ASYNC_FLUSH) nothing of the journal is synced
    and the stock rewrite stays. A rewrite that cannot be done for want of a descriptor or memory keeps the
    journal whole (the start-up load trims it, 20); any other failure stops the member (``JournalWriteError``).
24. The term and vote are renamed into place unsynced. ``MetaStorer.storeMeta`` writes ``raft.journal.meta.tmp``
    and renames it over ``raft.journal.meta`` with no fsync of either, in ``setCurrentTerm`` (before a vote is
    granted or asked for: Raft needs it durable first) and every second for the commit index. After a power loss
    a member could forget the vote it gave, and vote again in the same term (two leaders of one term), or find
    the renamed file empty (a rename can reach the disk before the data it names), which pysyncobj reads as
    term 0 and no vote. Now the file is fsync'd before every rename (~0.5 ms, at most once a second outside
    elections), and after a term or vote change the directory too, before the vote goes out.
25. A torn journal append stopped the member for good. An append writes the record, then the header's end
    offset, through the mapping; a power loss during the msync that would sync them can keep any of those
    pages. The stock load trusts the header and checks nothing: a record whose pages never landed reads as
    size 0 (``struct.error``: the member never starts again), or as a record of whatever the pages held. Such a
    record was never acknowledged (SYNC_FLUSH acknowledges only after the msync returned), so the load now
    keeps the records up to the first that is not whole: its size fits before the header's end, its trailer
    repeats the size, its index follows the one before and its term does not fall (a record left from before
    a truncation has an older term). The header is set back to that end and the member starts; the leader
    sends it what follows. Not detected: a record whose head, trailer and index are whole but a page in the
    middle is not (pysyncobj's records carry no checksum).

26. A lagging follower froze its leader. ``__sendAppendEntries`` sends a follower everything from its next index
    in frames of up to ``appendEntriesBatchSizeBytes`` (16 MiB here) until ``appendEntriesPeriod`` (50 ms) has
    passed, and ``TcpConnection`` keeps what the socket did not take in a ``bytes`` buffer that every frame is
    concatenated to and every partial send re-slices: copies of the whole backlog per frame and per send. A
    member rejoining under load (the failover test: a killed leader restarted ~1 s later) made its new leader's
    ticks last 0.1-0.5 s, in which no send was answered; a few sends in flight ran out of their 2 s deadline
    (``RequestTimeoutError``). Now a frame carries at most ``CATCH_UP_FRAME_BYTES`` (1 MiB) of entries (one
    entry, however big, still goes alone), what the socket did not take is kept in a ``bytearray`` cut from
    its front in place (a frame the socket takes whole is not copied at all), and a follower whose connection
    still holds ``BACKLOG_BYTES`` (4 MiB, the socket buffer) unsent is skipped by that round of appends: its
    next index stays, it gets the rest once it has read what it has. Skipping counts as talking for 12, so a
    follower that stopped reading is still dropped after the connection timeout. And a round of appends sends
    for at most ``SEND_ROUND_BUDGET_S`` (10 ms), not the 50 ms of ``appendEntriesPeriod``, which the stock loop
    also uses as its budget: a follower restarted under load took its leader's ticks to ~50 ms each, and with
    ``RaftMember.tick`` ticking 8 times a wake-up the leader answered nothing for 0.4-0.5 s (chaos rounds
    killing a follower). While a follower still lags, the next round is due after the budget; otherwise the
    heartbeat keeps its period.
27. Commands forwarded to another leader. ``_checkCommandsToApply`` sends the commands a member queued while it
    was leader, when it finds itself a follower, to the leader it now knows (``apply_command``), which appends
    them to its own log. A DLedger entry carries the commit-log offset its proposer planned from its own store,
    so no other leader's log may take it: a leader stopped for a second and resumed took the clients' sends
    waiting in its socket, proposed them, read the new leader's term before its tick took the commands, and
    forwarded them; the new leader committed an entry planned at an offset it had already written, and it and
    the old leader stopped, "diverged from the group" (``tests/cluster/test_e2e_stopped_node.py``, once in a
    ``make test``, after the poll before the tick in ``RaftMember.tick``). A member that is not leader now
    fails its queued commands with ``NOT_LEADER`` (the group answers them as not committed, and replans), and a
    leader refuses ``apply_command`` from a peer (``REQUEST_DENIED``).
28. A member still copying its commit log won elections it could not serve. A follower back from a kill loads a
    snapshot from its leader and copies the commit-log bytes it lacks from a peer (``dledger.catch_up``), its
    apply gate closed meanwhile; its Raft log is current, so it may win an election, and then it answers nothing
    until the copy and the apply of what followed are done. In ``raftmq chaos`` rounds killing the leader 5 s after
    the previous one came back (32 senders of 64 KiB messages), the first acknowledgement came 2.2-3.0 s after the
    kill (32 sends timed out once), and in the round traced the member still copying had won and finished its
    copy 2 s later. Now, while its apply gate is closed, a member whose election timer fires
    waits one more timeout before its pre-vote, so a caught-up peer stands first; it stands after that wait if no
    leader was heard from (a group with no caught-up member still elects one).

The chunked-send defect (entries at least ``appendEntriesBatchSizeBytes`` long) is contained by configuration:
``dledger.config`` keeps the entry size limit below half the batch size (16 MiB by default, so ~8 MiB entries:
one 4 MiB message fits) and ``dledger.entry`` refuses bigger entries. It is not patched: the fix would mean
replacing pysyncobj's whole ``__sendAppendEntries`` loop, and chunking buys nothing with the frame codec above
(no frame size limit, one MAC per frame).
"""

from __future__ import annotations

import _socket
import logging
import math
import queue
import socket
from typing import Any

import pysyncobj.journal as pso_journal
import pysyncobj.pickle as pso_pickle
import pysyncobj.serializer as pso_serializer
import pysyncobj.syncobj as pso_syncobj
import pysyncobj.tcp_connection as pso_tcp
import pysyncobj.tcp_server as pso_tcp_server
import pysyncobj.transport as pso_transport
from pysyncobj.monotonic import monotonic as monotonic_time
from pysyncobj.version import VERSION as PYSYNCOBJ_VERSION

from dledger import journal_patches as journal
from dledger import wire_patches as wire
from dledger.journal_patches import JournalWriteError, SnapshotWriteError
from dledger.poller import EpollPoller
from dledger.wire_patches import WIRE_PICKLE_PROTOCOL, FrameAuthenticator, encode_frame, resume_accepting

log = logging.getLogger(__name__)

# The wire's and the journal's names are re-exported: ``dledger.patches`` is where the rest of dledger finds them.
__all__ = ["PINNED_VERSION", "check_version", "apply_patches", "FrameAuthenticator", "WIRE_PICKLE_PROTOCOL",
           "OUTCOME_UNKNOWN", "encode_frame", "resume_accepting", "JournalWriteError", "SnapshotWriteError"]

PINNED_VERSION = "0.3.17"
# 16: the error code a commit callback gets when a snapshot covered its entry. Not one of pysyncobj's FAIL_REASON
# values (0..6), so it cannot be taken for one.
OUTCOME_UNKNOWN = 100
_patched = False


class UnsupportedPySyncObjVersion(ImportError):
    pass


def check_version(found: str = PYSYNCOBJ_VERSION) -> None:
    if found != PINNED_VERSION:
        raise UnsupportedPySyncObjVersion(
            f"dledger patches pysyncobj {PINNED_VERSION} internals but pysyncobj {found} is installed; "
            f"pin pysyncobj=={PINNED_VERSION} or re-validate every fix in dledger/patches.py")


_LEADER = pso_syncobj._RAFT_STATE.LEADER
_FOLLOWER = pso_syncobj._RAFT_STATE.FOLLOWER
_original_on_message = pso_syncobj.SyncObj._SyncObj__onMessageReceived
_original_check_commands_to_apply = pso_syncobj.SyncObj._checkCommandsToApply
_original_on_tick = pso_syncobj.SyncObj._onTick
_original_send_next_node_idx = pso_syncobj.SyncObj._SyncObj__sendNextNodeIdx
_original_send_append_entries = pso_syncobj.SyncObj._SyncObj__sendAppendEntries
_original_get_entries = pso_syncobj.SyncObj._SyncObj__getEntries
CATCH_UP_FRAME_BYTES = 1 << 20
BACKLOG_BYTES = 4 << 20
SEND_ROUND_BUDGET_S = 0.01
_original_apply_log_entries = pso_syncobj.SyncObj._SyncObj__applyLogEntries
_original_load_dump_file = pso_syncobj.SyncObj._SyncObj__loadDumpFile


def _check_commands_to_apply_as_leader(self: Any) -> None:
    """27: the queued commands are appended by this member as leader, or failed; never forwarded."""
    if self._SyncObj__raftState == _LEADER:
        _original_check_commands_to_apply(self)
        return
    commands = self._SyncObj__commandsQueue
    while True:
        try:
            _command, callback = commands.get_nowait()
        except queue.Empty:  # what pysyncobj's FastQueue raises
            return
        self._SyncObj__callErrCallback(pso_syncobj.FAIL_REASON.NOT_LEADER, callback)


def _refuse_forwarded_command(self: Any, node: Any, message: dict) -> None:
    """27: a peer's ``apply_command`` is answered as refused, not appended."""
    log.warning("raft command forwarded by %s refused: a member appends only the entries it planned itself",
                getattr(node, "address", node))
    if "request_id" in message:
        self._SyncObj__transport.send(node, {"type": "apply_command_response", "request_id": message["request_id"],
                                             "error": pso_syncobj.FAIL_REASON.REQUEST_DENIED})


def _on_message(self: Any, node: Any, message: Any) -> None:
    """pysyncobj's message handler with fixes 2, 11, 15 and 27 around the messages they concern."""
    if isinstance(message, dict):
        kind = message.get("type")
        if kind == "apply_command":
            _refuse_forwarded_command(self, node, message)
            return
        if kind == "request_vote" and getattr(self, "_dledger_rejoining", False):
            return  # 19: no vote before a leader was heard from
        if kind == "next_node_idx":
            _on_message_monotonic_next_index(self, node, message)
            return
        if kind == "append_entries":
            if "prevLogIdx" not in message:
                _on_snapshot_message_commit_clamped(self, node, message)
            else:
                _original_on_message(self, node, message)
            if self._SyncObj__raftLeader == node and message.get("term") == self._SyncObj__raftCurrentTerm:
                self._dledger_leader_heard_at = monotonic_time()
                self._dledger_pre_vote = None  # a leader answered the question: no election
                self._dledger_pre_vote_won = False
                if getattr(self, "_dledger_rejoining", False):
                    self._dledger_rejoining = False
                    log.info("rejoined: heard from the leader at %s, term %d; voting again", node.address,
                             self._SyncObj__raftCurrentTerm)
            return
        if kind == "pre_vote":
            _answer_pre_vote(self, node, message)
            return
        if kind == "pre_vote_response":
            _count_pre_vote(self, node, message)
            return
    _original_on_message(self, node, message)


def _on_tick_pre_vote(self: Any, timeToWait: float = 0.0) -> None:  # noqa: N803 (pysyncobj's name)
    """15: where pysyncobj's tick would start an election, a pre-vote round goes first (the deadline moves on,
    so the tick starts nothing); the tick after a won round starts the election. 28: a member still copying its
    commit log first waits one more timeout."""
    if (self._SyncObj__raftState == _LEADER or self._SyncObj__selfNode is None or self._SyncObj__transferInProgress
            or not self._SyncObj__otherNodes):
        _original_on_tick(self, timeToWait)
        return
    if self._SyncObj__raftElectionDeadline < monotonic_time():
        if getattr(self, "_dledger_rejoining", False):  # 19: no candidacy before a leader was heard from
            self._SyncObj__raftElectionDeadline = monotonic_time() + self._SyncObj__generateRaftTimeout()
        elif getattr(self, "_dledger_pre_vote_won", False):
            self._dledger_pre_vote_won = False
            _original_on_tick(self, timeToWait)  # the election
            return
        elif (not getattr(self, "_dledger_apply_gate_open", True)
              and self._SyncObj__raftElectionDeadline != getattr(self, "_dledger_deferred_deadline", None)):
            # 28: still copying its commit log; a deadline that is not this wait's own came from a new period
            deadline = monotonic_time() + self._SyncObj__generateRaftTimeout()
            self._SyncObj__raftElectionDeadline = self._dledger_deferred_deadline = deadline
        else:
            _start_pre_vote(self)
    # The stock tick reads the clock again after work of its own (the journal's one-second timer, a snapshot
    # load): a deadline that passed in between started an election without a pre-vote. Its check sees no
    # deadline now; a message handled inside the tick may still set one.
    deadline = self._SyncObj__raftElectionDeadline
    self._SyncObj__raftElectionDeadline = math.inf
    try:
        _original_on_tick(self, timeToWait)
    finally:
        if self._SyncObj__raftElectionDeadline == math.inf:
            self._SyncObj__raftElectionDeadline = deadline


def _start_pre_vote(self: Any) -> None:
    term = self._SyncObj__raftCurrentTerm + 1
    self._SyncObj__raftElectionDeadline = monotonic_time() + self._SyncObj__generateRaftTimeout()
    self._dledger_pre_vote = (term, set())
    self._dledger_pre_votes = getattr(self, "_dledger_pre_votes", 0) + 1
    message = {"type": "pre_vote", "term": term, "last_log_index": self._SyncObj__getCurrentLogIndex(),
               "last_log_term": self._SyncObj__getCurrentLogTerm()}
    transport = self._SyncObj__transport
    for node in self._SyncObj__otherNodes:
        transport.send(node, dict(message))


def _answer_pre_vote(self: Any, node: Any, message: Any) -> None:
    term, last_term, last_index = message.get("term"), message.get("last_log_term"), message.get("last_log_index")
    granted = (type(term) is int and type(last_term) is int and type(last_index) is int
               and not getattr(self, "_dledger_rejoining", False)  # 19
               and term > self._SyncObj__raftCurrentTerm and not _has_current_leader(self)
               and (last_term, last_index) >= (self._SyncObj__getCurrentLogTerm(),
                                               self._SyncObj__getCurrentLogIndex()))
    # Our own term goes with the answer: a member that missed a higher term (down while a candidate asked for
    # votes) learns it here, as it would from a request_vote.
    self._SyncObj__transport.send(node, {"type": "pre_vote_response", "term": term, "granted": granted,
                                         "current_term": self._SyncObj__raftCurrentTerm})


def _count_pre_vote(self: Any, node: Any, message: Any) -> None:
    current = message.get("current_term")
    if type(current) is int and current > self._SyncObj__raftCurrentTerm and self._SyncObj__raftState != _LEADER:
        # A candidate stuck at a higher term (it can win no vote) refuses every pre-vote for a term that is not
        # above its own: take its term, as etcd's pre-candidates do, so the next round asks for one it can grant.
        self._SyncObj__setCurrentTerm(current, None)
        self._SyncObj__setState(_FOLLOWER)
        self._SyncObj__raftLeader = None
        self._dledger_pre_vote = None
        return
    round_ = getattr(self, "_dledger_pre_vote", None)
    if (round_ is None or not message.get("granted") or message.get("term") != round_[0]
            or round_[0] != self._SyncObj__raftCurrentTerm + 1 or self._SyncObj__raftState == _LEADER):
        return
    round_[1].add(node)
    if _is_majority(self, 1 + len(round_[1])):
        self._dledger_pre_vote = None
        self._dledger_pre_vote_won = True
        self._SyncObj__raftElectionDeadline = 0.0  # the next tick starts the election


def _is_majority(self: Any, members: int) -> bool:
    """Whether ``members`` (this one included) are a majority of the group, as pysyncobj counts votes."""
    return members > (len(self._SyncObj__otherNodes) + 1) / 2


def _has_current_leader(self: Any) -> bool:
    """15: whether this member heard from a current leader within the minimum election timeout (a leader: from a
    majority of the group, itself included)."""
    now = monotonic_time()
    lease = self._SyncObj__conf.raftMinTimeout
    if self._SyncObj__raftState == _LEADER:
        responded = self._SyncObj__lastResponseTime
        return _is_majority(self, 1 + sum(1 for other in self._SyncObj__otherNodes
                                          if now - responded.get(other, -math.inf) < lease))
    heard_at = getattr(self, "_dledger_leader_heard_at", None)
    return self._SyncObj__raftLeader is not None and heard_at is not None and now - heard_at < lease


def _on_snapshot_message_commit_clamped(self: Any, node: Any, message: Any) -> None:
    # 11: the handler ends every append_entries, snapshot chunks included, with
    # commit = min(leader's commit, own last index). A chunk validates none of the follower's own entries, so
    # a restarted old leader would commit and apply the uncommitted tail of its log while the snapshot is
    # still on its way. Only what the message proved may count: a loaded snapshot (applied up to its index).
    before = self._SyncObj__raftCommitIndex
    _original_on_message(self, node, message)
    limit = max(before, self._SyncObj__raftLastApplied)
    if self._SyncObj__raftCommitIndex > limit:
        self._SyncObj__raftCommitIndex = limit
        self._SyncObj__raftLog.setRaftCommitIndex(limit)


def _on_message_monotonic_next_index(self: Any, node: Any, message: Any) -> None:
    if message.get("success") and not message.get("reset"):
        before = self._SyncObj__raftNextIndex.get(node)
        _original_on_message(self, node, message)
        after = self._SyncObj__raftNextIndex.get(node)
        if before is not None and after is not None and after < before:
            self._SyncObj__raftNextIndex[node] = before
        return
    _original_on_message(self, node, message)


def _flush_journal(self: Any) -> None:
    if getattr(self, "_dledger_flush_journal", False):
        self._SyncObj__raftLog.flush()
        self._dledger_journal_flushes = getattr(self, "_dledger_journal_flushes", 0) + 1


def _send_next_node_idx_flushed(self: Any, node: Any, reset: bool = False, nextNodeIdx: Any = None,
                                success: bool = False) -> None:
    if success:
        _flush_journal(self)
    _original_send_next_node_idx(self, node, reset=reset, nextNodeIdx=nextNodeIdx, success=success)


def _send_append_entries_flushed(self: Any) -> None:
    _flush_journal(self)
    self._dledger_commit_notice_due = False  # every append_entries carries the commit index
    others = self._SyncObj__otherNodes
    backlogged = _backlogged_nodes(self, others)
    # 26: the stock loop sends until appendEntriesPeriod (the heartbeat period) has passed; it reads the period
    # for that budget and for the next heartbeat's time, so it runs with SEND_ROUND_BUDGET_S and the heartbeat
    # time is set back after it.
    conf = self._SyncObj__conf
    period = conf.appendEntriesPeriod
    started = monotonic_time()
    conf.appendEntriesPeriod = min(period, SEND_ROUND_BUDGET_S)
    try:
        if not backlogged:
            _original_send_append_entries(self)
        else:
            # The stock loop walks __otherNodes (and __readonlyNodes, which dledger never has); a follower that has
            # not read its backlog yet sits this round out.
            self._SyncObj__otherNodes = others - backlogged
            try:
                _original_send_append_entries(self)
            finally:
                self._SyncObj__otherNodes = others
    finally:
        conf.appendEntriesPeriod = period
        if not backlogged and not followers_lagging(self, others):
            self._SyncObj__newAppendEntriesTime = started + period
        # else: the next round is due after the budget (stock set it so), not after a heartbeat period


def followers_lagging(self: Any, nodes: Any) -> bool:
    """Whether a connected member of ``nodes`` has a next index still at or before the log's last entry: it has
    not been sent the whole log (``RaftMember.followers_current`` asks the same of every follower)."""
    last = self._SyncObj__getCurrentLogIndex()
    next_index = self._SyncObj__raftNextIndex
    connected = self._SyncObj__connectedNodes
    return any(node in connected and next_index.get(node, 0) <= last for node in nodes)


def _backlogged_nodes(self: Any, nodes: Any) -> set:
    backlogged: set = set()
    if not nodes:
        return backlogged
    connections = self._SyncObj__transport._connections
    for node in nodes:
        conn = connections.get(node)
        if conn is not None and len(conn._TcpConnection__writeBuffer) >= BACKLOG_BYTES:
            # Skipping counts as talking (12): a follower that stopped reading is still dropped once its
            # connection has been silent for the timeout.
            if not wire._connection_timed_out(conn):
                conn._dledger_last_send = monotonic_time()
            backlogged.add(node)
    return backlogged


def _get_entries_capped(self: Any, from_idx: Any, count: Any = None, max_size_bytes: Any = None) -> Any:
    """26: the only caller passing a size is ``__sendAppendEntries``: frames of at most CATCH_UP_FRAME_BYTES."""
    if max_size_bytes is not None:
        max_size_bytes = min(max_size_bytes, CATCH_UP_FRAME_BYTES)
    return _original_get_entries(self, from_idx, count, max_size_bytes)


def _apply_log_entries_gated(self: Any) -> bool:
    if not getattr(self, "_dledger_apply_gate_open", True):
        return False
    need_send = _original_apply_log_entries(self)
    if need_send and getattr(self, "_dledger_defer_commit_notice", False):
        # Stock asks for a send after every apply, a follower's too (it is then ignored there); marking a
        # follower due had its tick loop wake commit_notice_delay_ms later for nothing, ~70 times a second under
        # load, each wake-up a tick and a cancelled wait.
        if self._SyncObj__raftState == _LEADER:
            self._dledger_commit_notice_due = True
        return False
    return need_send


def _trim_journal_to_snapshot(self: Any) -> None:
    """20: drop the journal entries before the snapshot's last two when the journal holds those two further in (a
    member stopped between its snapshot and the truncation), so the stock load keeps the entries after them.
    ``_dledger_snapshot_entries()`` (``RaftMember``) reads them from the snapshot file without loading it."""
    peek = getattr(self, "_dledger_snapshot_entries", None)
    journal = self._SyncObj__raftLog
    if peek is None or len(journal) < 3:
        return
    entries = peek()
    if entries is None:
        return
    before, last = entries
    k = before[1] - journal[0][1]
    if 0 < k < len(journal) - 1 and journal[k] == before and journal[k + 1] == last:
        kept = len(journal) - k - 2
        journal.deleteEntriesTo(k)
        log.info("the Raft journal begins before its snapshot (stopped before the entries the snapshot covers were "
                 "dropped): dropping them now, keeping the %d entries after index %d", kept, last[1])


def _load_dump_file_patched(self: Any, clearJournal: bool) -> None:
    if not clearJournal:  # the load at start-up; a snapshot received from a leader replaces the journal
        _trim_journal_to_snapshot(self)
    _load_dump_file_releasing_callbacks(self, clearJournal)


def _load_dump_file_releasing_callbacks(self: Any, clearJournal: bool) -> None:
    """16: after a snapshot load, the commit callbacks of the entries it covers are called (``OUTCOME_UNKNOWN``)
    instead of waiting for an apply that will never come."""
    _original_load_dump_file(self, clearJournal)
    applied = self._SyncObj__raftLastApplied
    waiting = self._SyncObj__commandsWaitingCommit
    covered = sorted(i for i in waiting if i <= applied)
    if covered:
        log.info("snapshot up to index %d covers %d entries proposed here that wait for their commit: their outcome "
                 "is unknown (first index %d)", applied, len(covered), covered[0])
    for idx in covered:
        for _term, callback in waiting.pop(idx):
            callback(None, OUTCOME_UNKNOWN)


_original_create_poller = pso_syncobj.createPoller


def _create_poller(poller_type: str) -> Any:
    if poller_type == "epoll":
        return EpollPoller()
    return _original_create_poller(poller_type)


def apply_patches() -> None:
    """Install every fix; idempotent."""
    global _patched
    check_version()
    socket.inet_ntop = _socket.inet_ntop
    if _patched:
        return
    pso_tcp.TcpConnection.send = wire._send
    pso_transport.TCPTransport.send = wire._transport_send
    pso_tcp.TcpConnection._TcpConnection__tryReadBuffer = wire._try_read_buffer
    pso_tcp.TcpConnection._TcpConnection__processParseMessage = wire._parse_message
    pso_tcp.TcpConnection._TcpConnection__processConnectionTimeout = wire._connection_timed_out
    pso_syncobj.SyncObj._SyncObj__onMessageReceived = _on_message
    pso_syncobj.SyncObj._checkCommandsToApply = _check_commands_to_apply_as_leader
    pso_syncobj.SyncObj._onTick = _on_tick_pre_vote
    pso_syncobj.SyncObj._SyncObj__sendNextNodeIdx = _send_next_node_idx_flushed
    pso_syncobj.SyncObj._SyncObj__sendAppendEntries = _send_append_entries_flushed
    pso_syncobj.SyncObj._SyncObj__getEntries = _get_entries_capped
    pso_tcp.TcpConnection._TcpConnection__processSend = wire._process_send
    pso_syncobj.SyncObj._SyncObj__applyLogEntries = _apply_log_entries_gated
    pso_syncobj.SyncObj._SyncObj__loadDumpFile = _load_dump_file_patched
    pso_journal.MetaStorer.getMeta = journal._get_meta_closed
    pso_journal.MetaStorer.storeMeta = journal._store_meta_synced
    pso_journal.FileJournal.__init__ = journal._file_journal_init_checked
    pso_journal.FileJournal.setCurrentTerm = journal._set_current_term_or_stop
    pso_journal.FileJournal.add = journal._journal_add_in_place
    pso_journal.FileJournal.deleteEntriesTo = journal._delete_entries_to_replacing
    pso_journal.ResizableFile.write = journal._resizable_write_allocated
    pso_tcp_server.TcpServer.bind = wire._bind_closing_on_failure
    pso_tcp_server.TcpServer._TcpServer__onNewConnection = wire._on_new_connection_kept
    pso_syncobj.createPoller = _create_poller
    pso_serializer.Serializer.getTransmissionData = journal._get_transmission_closed
    pso_serializer.Serializer.cancelTransmisstion = journal._cancel_transmission_closed
    pso_serializer.Serializer.checkSerializing = journal._check_serializing_closing
    pso_serializer.Serializer.serialize = journal._serialize_handing_over
    pso_serializer.Serializer.setTransmissionData = journal._set_transmission_data_synced
    # Module global read by pysyncobj.pickle.dumps (not name-mangled: it is a module, not a class).
    setattr(pso_pickle, "__protocol", WIRE_PICKLE_PROTOCOL)
    _patched = True
    log.debug("pysyncobj patched version=%s", PYSYNCOBJ_VERSION)


ORIGINALS = {
    "journal_add": journal._original_journal_add,
    "delete_entries_to": journal._original_delete_entries_to,
    "parse_message": wire._original_parse_message,
    "process_connection_timeout": wire._original_process_connection_timeout,
    "send": wire._original_send,
    "transport_send": wire._original_transport_send,
    "try_read_buffer": wire._original_try_read_buffer,
    "on_message": _original_on_message,
    "check_commands_to_apply": _original_check_commands_to_apply,
    "on_tick": _original_on_tick,
    "send_next_node_idx": _original_send_next_node_idx,
    "send_append_entries": _original_send_append_entries,
    "get_entries": _original_get_entries,
    "process_send": wire._original_process_send,
    "apply_log_entries": _original_apply_log_entries,
    "load_dump_file": _original_load_dump_file,
    "serialize": journal._original_serialize,
    "set_transmission_data": journal._original_set_transmission,
    "resizable_write": journal._original_resizable_write,
    "set_current_term": journal._original_set_current_term,
    "store_meta": journal._original_store_meta,
    "file_journal_init": journal._original_file_journal_init,
    "on_new_connection": wire._original_on_new_connection,
}
