"""Containment of pysyncobj 0.3.17's measured defects (see ``docs/architecture.md``, "Replication (dledger)").

Every fix here is a small wrapper around one pysyncobj internal, applied once by ``apply_patches()`` when
``dledger.member`` is imported, and each has a regression test in ``tests/unit/dledger/test_patches.py`` that
fails without it. The wrappers reach into name-mangled attributes (``_SyncObj__raftNextIndex``), which is only
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
import errno
import hmac
import logging
import math
import os
import pickle
import queue
import socket
import struct
from pathlib import Path
from typing import Any

import blake3
import pysyncobj.config as pso_config
import pysyncobj.journal as pso_journal
import pysyncobj.pickle as pso_pickle
import pysyncobj.serializer as pso_serializer
import pysyncobj.syncobj as pso_syncobj
import pysyncobj.tcp_connection as pso_tcp
import pysyncobj.tcp_server as pso_tcp_server
import pysyncobj.transport as pso_transport
from pysyncobj.monotonic import monotonic as monotonic_time
from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.version import VERSION as PYSYNCOBJ_VERSION

from dledger.poller import EpollPoller
from dledger.snapshot import fsync_path
from remoting.errors import RESOURCE_ERRNOS

log = logging.getLogger(__name__)

__all__ = ["PINNED_VERSION", "check_version", "apply_patches", "FrameAuthenticator", "WIRE_PICKLE_PROTOCOL",
           "OUTCOME_UNKNOWN"]

PINNED_VERSION = "0.3.17"
WIRE_PICKLE_PROTOCOL = 5
# 16: the error code a commit callback gets when a snapshot covered its entry. Not one of pysyncobj's FAIL_REASON
# values (0..6), so it cannot be taken for one.
OUTCOME_UNKNOWN = 100
_TAG_SIZE = 32
_LENGTH = struct.Struct("i")  # pysyncobj's own length prefix (native int); both ends run this code
_patched = False


class UnsupportedPySyncObjVersion(ImportError):
    pass


def check_version(found: str = PYSYNCOBJ_VERSION) -> None:
    if found != PINNED_VERSION:
        raise UnsupportedPySyncObjVersion(
            f"dledger patches pysyncobj {PINNED_VERSION} internals but pysyncobj {found} is installed; "
            f"pin pysyncobj=={PINNED_VERSION} or re-validate every fix in dledger/patches.py")


# The tag's key is derived from the cluster secret in this context: a new context is a new wire version.
_KEY_CONTEXT = "raftmq-dledger-v4 2026-11-28 raft frame MAC key"


class FrameAuthenticator:
    """Authenticates each frame body: keyed BLAKE3, its key derived from the cluster secret, over the
    connection's random key and the BLAKE3 digest of the body (hash, then MAC).

    The random key (pysyncobj's handshake, one per connection and direction) ties a frame to its connection, so
    a frame recorded on one connection is refused on any other before it is unpickled. Hashing first lets a
    leader hash an append_entries body once for all its followers, who usually get the same bytes: the sender
    keeps the digest of the last body it tagged. The body hash is BLAKE3 rather than SHA-256 because every
    replicated byte passes through it on every member: SHA-256 (1.3-1.5 GB/s here, with SHA-NI) cost ~0.8 µs
    per 1 KiB message on the leader and again on each follower, BLAKE3 (4.5-6.5 GB/s) ~0.2 µs. Both are
    collision-resistant 256-bit hashes, which is what hash-then-MAC needs of the inner hash. The MAC is BLAKE3's
    keyed mode (a PRF, as HMAC is) rather than HMAC-SHA256 because OpenSSL 3's one-shot HMAC, cheap in a loop
    (1.3 µs), took ~10 µs a call inside a member that wakes for each frame, and every Raft hop pays two: the
    change cut one-at-a-time send latency by ~12 % (docs/benchmarks.md, twenty-fourth session). Stands where
    pysyncobj expects its Fernet encryptor (its truthiness turns on the random-key handshake); only
    ``tag``/``verify`` are used, by the frame codec below.
    """

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("a DLedger member needs a non-empty cluster secret")
        # v4: keyed BLAKE3 instead of HMAC-SHA256 (v3; v2 also hashed bodies with SHA-256); a member of another
        # version fails authentication.
        self._key = blake3.blake3(secret.encode(), derive_key_context=_KEY_CONTEXT).digest()
        self._last: tuple[bytes, bytes] = (b"", blake3.blake3(b"").digest())  # one tuple: swapped atomically

    def tag(self, body: bytes, rand_key: bytes | None = None) -> bytes:
        last_body, digest = self._last
        if body is not last_body and body != last_body:
            digest = blake3.blake3(body).digest()
            self._last = (body, digest)
        return blake3.blake3((rand_key or b"") + digest, key=self._key).digest()

    def verify(self, tag: bytes, body: bytes | memoryview, rand_key: bytes | None = None) -> bool:
        expected = blake3.blake3((rand_key or b"") + blake3.blake3(body).digest(), key=self._key).digest()
        return hmac.compare_digest(tag, expected)

    def __bool__(self) -> bool:
        return True


def encode_frame(auth: FrameAuthenticator, message: Any, rand_key: bytes | None = None) -> bytes:
    body = pickle.dumps(message, protocol=WIRE_PICKLE_PROTOCOL)
    return _LENGTH.pack(_TAG_SIZE + len(body)) + auth.tag(body, rand_key) + body


def _send(self: Any, message: Any) -> None:
    auth = self.encryptor
    if not auth:
        # Never reached in dledger (the member refuses to start without a secret); refuse rather than
        # fall back to an unauthenticated wire.
        raise RuntimeError("pysyncobj connection without an authenticator")
    # 12: judge the connection's silence before this send counts as talking. 13: a connection that was dropped
    # here loses the message, as pysyncobj's own disconnect does; its reconnect must begin with the handshake.
    if _connection_timed_out(self):
        return
    self._dledger_last_send = monotonic_time()
    # pysyncobj wraps the message as (sendRandKey, message); here the key goes into the tag instead.
    frame = encode_frame(auth, message, self.sendRandKey)
    buf = self._TcpConnection__writeBuffer
    if not buf:
        # 26: the usual case, nothing waiting: the frame itself goes to the socket, not a copy of it.
        self._TcpConnection__writeBuffer = frame
    else:
        if type(buf) is not bytearray:
            buf = self._TcpConnection__writeBuffer = bytearray(buf)
        buf += frame
    self._TcpConnection__trySendBuffer()


def _process_send(self: Any) -> bool:
    """26: stock ``__processSend``, cutting what the socket took from the front of the buffer in place."""
    buf = self._TcpConnection__writeBuffer
    if not buf:
        return False
    try:
        res = self._TcpConnection__socket.send(buf)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
            self.disconnect()
        return False
    if res < 0:
        self.disconnect()
        return False
    if res == 0:
        return False
    if type(buf) is bytearray:
        del buf[:res]
    elif res == len(buf):
        self._TcpConnection__writeBuffer = b""
    else:
        # What the socket did not take is copied once into a bytearray, then cut from its front in place.
        self._TcpConnection__writeBuffer = bytearray(memoryview(buf)[res:])
    return True


def _transport_send(self: Any, node: Any, message: Any) -> bool:
    """13: an outgoing connection is not connected for Raft messages until the peer's key arrived."""
    conn = self._connections.get(node)
    if conn is not None and conn.sendRandKey is None and self._syncObj.encryptor:
        return False
    return _original_transport_send(self, node, message)


def _try_read_buffer(self: Any) -> None:
    """14: read until the socket is empty, as pysyncobj does, but no more than one receive buffer per event.
    The buffer is made a ``bytearray`` first (pysyncobj resets it to ``bytes()`` on every (re)connect): stock
    ``__processRead``'s ``+=`` then appends in place, and ``_parse_message`` cuts frames from its front."""
    buf = self._TcpConnection__readBuffer
    if type(buf) is not bytearray:
        buf = self._TcpConnection__readBuffer = bytearray(buf)
    budget = len(buf) + self._TcpConnection__recvBufferSize
    while self._TcpConnection__processRead() and len(self._TcpConnection__readBuffer) < budget:
        pass
    self._TcpConnection__lastReadTime = monotonic_time()


def _connection_timed_out(self: Any) -> bool:
    """12: pysyncobj's read timeout (nothing read for ``timeout``), counted only while this side is talking: it
    sent within the timeout, as a leader does to a follower that stopped answering. A connected link quiet both
    ways (two followers') is idle, not dead: its clock restarts. Still applies while connecting. Returns
    whether it disconnected."""
    now = monotonic_time()
    timeout = self._TcpConnection__timeout
    if now - self._TcpConnection__lastReadTime <= timeout:
        return False
    if (self._TcpConnection__state == pso_tcp.CONNECTION_STATE.CONNECTED
            and now - getattr(self, "_dledger_last_send", float("-inf")) > timeout):
        self._TcpConnection__lastReadTime = now
        return False
    self.disconnect()
    return True


def _parse_message(self: Any) -> Any:
    buf = self._TcpConnection__readBuffer
    if len(buf) < 4:
        return None
    (length,) = _LENGTH.unpack_from(buf, 0)
    if length < _TAG_SIZE:
        log.warning("raft frame rejected reason=short_frame length=%d", length)
        self.disconnect()
        return None
    if len(buf) - 4 < length:
        return None
    auth = self.encryptor
    tag = bytes(buf[4:4 + _TAG_SIZE])
    # No copy of a frame that may be 512 KiB. The views are released before the frame is cut from the buffer
    # (a bytearray cannot shrink while exported); unpickling copies every bytes object out of them.
    whole = memoryview(buf)
    body = whole[4 + _TAG_SIZE:4 + length]
    try:
        if not auth or not auth.verify(tag, body, self.recvRandKey):
            # The only path to pickle.loads goes through this check: an unauthenticated peer, or a frame replayed
            # from another connection, never gets a byte unpickled.
            log.warning("raft frame rejected reason=bad_authentication")
            self.disconnect()
            return None
        try:
            message = pickle.loads(body)
        except Exception as e:  # an authenticated peer sent nonsense: drop the connection, keep the node
            log.warning("raft frame rejected reason=%s", e)
            self.disconnect()
            return None
    finally:
        body.release()
        whole.release()
    if type(buf) is bytearray:
        del buf[:4 + length]  # in place: CPython moves the start of a bytearray, it copies nothing
    else:
        self._TcpConnection__readBuffer = buf[4 + length:]
    return message


_original_parse_message = pso_tcp.TcpConnection._TcpConnection__processParseMessage
_original_process_connection_timeout = pso_tcp.TcpConnection._TcpConnection__processConnectionTimeout
_original_send = pso_tcp.TcpConnection.send
_original_transport_send = pso_transport.TCPTransport.send
_original_try_read_buffer = pso_tcp.TcpConnection._TcpConnection__tryReadBuffer
_LEADER = pso_syncobj._RAFT_STATE.LEADER
_FOLLOWER = pso_syncobj._RAFT_STATE.FOLLOWER
_original_on_message = pso_syncobj.SyncObj._SyncObj__onMessageReceived
_original_check_commands_to_apply = pso_syncobj.SyncObj._checkCommandsToApply
_original_on_tick = pso_syncobj.SyncObj._onTick
_original_send_next_node_idx = pso_syncobj.SyncObj._SyncObj__sendNextNodeIdx
_original_send_append_entries = pso_syncobj.SyncObj._SyncObj__sendAppendEntries
_original_get_entries = pso_syncobj.SyncObj._SyncObj__getEntries
_original_process_send = pso_tcp.TcpConnection._TcpConnection__processSend
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
            if not _connection_timed_out(conn):
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


ACCEPT_PAUSE_S = 0.1
_original_on_new_connection = pso_tcp_server.TcpServer._TcpServer__onNewConnection


def _on_new_connection_kept(self: Any, descr: Any, event: int) -> None:
    """18: stock ``TcpServer.__onNewConnection``, except that a failed accept leaves the listener listening."""
    if event & POLL_EVENT_TYPE.READ:
        try:
            sock, _addr = self._TcpServer__socket.accept()
        except OSError as e:
            if e.errno in RESOURCE_ERRNOS:
                _pause_accepting(self, e)
            elif e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                log.warning("raft listener: an accept failed; still listening error=%s", e)
        else:
            pauses = getattr(self, "_dledger_accept_pauses", 0)
            if pauses:
                self._dledger_accept_pauses = 0
                log.info("raft listener: accepting again after %d pause(s)", pauses)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._TcpServer__sendBufferSize)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._TcpServer__recvBufferSize)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setblocking(False)
                conn = pso_tcp_server.TcpConnection(
                    poller=self._TcpServer__poller, socket=sock, timeout=self._TcpServer__connectionTimeout,
                    sendBufferSize=self._TcpServer__sendBufferSize, recvBufferSize=self._TcpServer__recvBufferSize,
                    keepalive=self._TcpServer__keepalive)
            except OSError as e:  # the peer reset it already, or no descriptor for the connection's timer
                sock.close()
                log.warning("raft listener: an accepted connection failed to set up error=%s", e)
            else:
                self._TcpServer__onNewConnectionCallback(conn)
    if event & POLL_EVENT_TYPE.ERROR:
        self.unbind()


def _pause_accepting(server: Any, error: OSError) -> None:
    fileno = server._TcpServer__fileno
    if fileno is None:
        return
    server._TcpServer__poller.unsubscribe(fileno)
    server._dledger_accept_resume_at = monotonic_time() + ACCEPT_PAUSE_S
    pauses = getattr(server, "_dledger_accept_pauses", 0)
    server._dledger_accept_pauses = pauses + 1
    if not pauses:
        log.warning("raft listener: accept failed (%s); not accepting for %.0f ms at a time until it succeeds",
                    error, ACCEPT_PAUSE_S * 1000)


def resume_accepting(server: Any) -> None:
    """Poll a listener paused by a failed accept again once its pause is over (18). Called after every tick."""
    resume_at = getattr(server, "_dledger_accept_resume_at", None)
    if resume_at is None or monotonic_time() < resume_at:
        return
    server._dledger_accept_resume_at = None
    fileno = server._TcpServer__fileno
    if fileno is not None and server._TcpServer__state == pso_tcp_server.SERVER_STATE.BINDED:
        server._TcpServer__poller.subscribe(fileno, server._TcpServer__onNewConnection,
                                            POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR)


_original_bind = pso_tcp_server.TcpServer.bind


def _bind_closing_on_failure(self: Any) -> None:
    try:
        _original_bind(self)
    except Exception:
        sock = getattr(self, "_TcpServer__socket", None)
        if sock is not None:
            sock.close()
        raise


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
    pso_tcp.TcpConnection.send = _send
    pso_transport.TCPTransport.send = _transport_send
    pso_tcp.TcpConnection._TcpConnection__tryReadBuffer = _try_read_buffer
    pso_tcp.TcpConnection._TcpConnection__processParseMessage = _parse_message
    pso_tcp.TcpConnection._TcpConnection__processConnectionTimeout = _connection_timed_out
    pso_syncobj.SyncObj._SyncObj__onMessageReceived = _on_message
    pso_syncobj.SyncObj._checkCommandsToApply = _check_commands_to_apply_as_leader
    pso_syncobj.SyncObj._onTick = _on_tick_pre_vote
    pso_syncobj.SyncObj._SyncObj__sendNextNodeIdx = _send_next_node_idx_flushed
    pso_syncobj.SyncObj._SyncObj__sendAppendEntries = _send_append_entries_flushed
    pso_syncobj.SyncObj._SyncObj__getEntries = _get_entries_capped
    pso_tcp.TcpConnection._TcpConnection__processSend = _process_send
    pso_syncobj.SyncObj._SyncObj__applyLogEntries = _apply_log_entries_gated
    pso_syncobj.SyncObj._SyncObj__loadDumpFile = _load_dump_file_patched
    pso_journal.MetaStorer.getMeta = _get_meta_closed
    pso_journal.MetaStorer.storeMeta = _store_meta_synced
    pso_journal.FileJournal.__init__ = _file_journal_init_checked
    pso_journal.FileJournal.setCurrentTerm = _set_current_term_or_stop
    pso_journal.FileJournal.add = _journal_add_in_place
    pso_journal.FileJournal.deleteEntriesTo = _delete_entries_to_replacing
    pso_journal.ResizableFile.write = _resizable_write_allocated
    pso_tcp_server.TcpServer.bind = _bind_closing_on_failure
    pso_tcp_server.TcpServer._TcpServer__onNewConnection = _on_new_connection_kept
    pso_syncobj.createPoller = _create_poller
    pso_serializer.Serializer.getTransmissionData = _get_transmission_closed
    pso_serializer.Serializer.cancelTransmisstion = _cancel_transmission_closed
    pso_serializer.Serializer.checkSerializing = _check_serializing_closing
    pso_serializer.Serializer.serialize = _serialize_handing_over
    pso_serializer.Serializer.setTransmissionData = _set_transmission_data_synced
    # Module global read by pysyncobj.pickle.dumps (not name-mangled: it is a module, not a class).
    setattr(pso_pickle, "__protocol", WIRE_PICKLE_PROTOCOL)
    _patched = True
    log.debug("pysyncobj patched version=%s", PYSYNCOBJ_VERSION)


ORIGINALS = {
    "journal_add": _original_journal_add,
    "delete_entries_to": _original_delete_entries_to,
    "parse_message": _original_parse_message,
    "process_connection_timeout": _original_process_connection_timeout,
    "send": _original_send,
    "transport_send": _original_transport_send,
    "try_read_buffer": _original_try_read_buffer,
    "on_message": _original_on_message,
    "check_commands_to_apply": _original_check_commands_to_apply,
    "on_tick": _original_on_tick,
    "send_next_node_idx": _original_send_next_node_idx,
    "send_append_entries": _original_send_append_entries,
    "get_entries": _original_get_entries,
    "process_send": _original_process_send,
    "apply_log_entries": _original_apply_log_entries,
    "load_dump_file": _original_load_dump_file,
    "serialize": _original_serialize,
    "set_transmission_data": _original_set_transmission,
    "resizable_write": _original_resizable_write,
    "set_current_term": _original_set_current_term,
    "store_meta": _original_store_meta,
    "file_journal_init": _original_file_journal_init,
    "on_new_connection": _original_on_new_connection,
}
