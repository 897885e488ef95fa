"""``DLedgerConfig`` (the ``[dledger]`` table) and the ONE place that builds pysyncobj's ``SyncObjConf``.

``SyncObjConf`` reads its options with ``kwargs.get``: a misspelt option is silently ignored. So the conf is
built only in ``build_syncobj_conf``, every key it passes is checked against the options ``SyncObjConf``
really has (``unknown_syncobj_options``), and a unit test pins the values that the fixes depend on.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from pysyncobj import SyncObjConf

from dledger.entry import ENTRY_HEADER
from remoting.config import ConfigError, bounded, check_fields, name_problem, parse_host_port

__all__ = ["MemberAddress", "DLedgerConfig", "build_syncobj_conf", "unknown_syncobj_options", "MIN_SECRET_LENGTH"]

MIN_SECRET_LENGTH = 16
# Bytes pysyncobj adds around an entry in an append_entries message (pickled tuple, dict keys, our frame).
_WIRE_OVERHEAD_BYTES = 4096
# What a state machine's ``prepare_batch`` may add around ONE record proposed alone (the message store adds 40
# bytes per message, which the broker's message size limit leaves room for).
_SOLO_JOIN_OVERHEAD_BYTES = 64 + 8


@dataclass(frozen=True)
class MemberAddress:
    id: str = bounded("", check=name_problem, doc="member id, unique in the group")
    raft_address: str = bounded("", doc="HOST:PORT of the member's Raft (pysyncobj) port, bound exactly")
    service_address: str = bounded("", doc="HOST:PORT of the member's remoting port (catch-up fetches)")

    def __post_init__(self) -> None:
        check_fields(self)
        host, _port = parse_host_port(self.raft_address, key=f"members[{self.id}].raft_address", dial=True)
        _check_dialable(host, self.raft_address, f"members[{self.id}].raft_address")
        if self.service_address:
            host, _port = parse_host_port(self.service_address, key=f"members[{self.id}].service_address")
            _check_dialable(host, self.service_address, f"members[{self.id}].service_address")


def _check_dialable(host: str, address: str, key: str) -> None:
    """A member address is dialed by its peers (and a service_address by clients, from routes): 0.0.0.0 or ::
    there made a peer on another host dial itself, and a multicast or broadcast address reaches no one member."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return  # a host name: looked up when dialed
    if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        raise ConfigError(f"{key} must be an address peers can dial, not an unspecified, multicast or broadcast "
                          f"one (bind every interface with the broker's `listen`), got {address!r}")


@dataclass(frozen=True)
class DLedgerConfig:
    group: str = bounded("broker-a", check=name_problem, doc="Raft group name (the broker name)")
    self_id: str = bounded("", doc="which of members is this process")
    members: tuple[MemberAddress, ...] = ()
    secret: str = bounded("", doc="cluster secret authenticating every Raft frame (>= 16 characters)")
    data_dir: Path = Path("data/dledger")
    flush_disk_type: Literal["ASYNC_FLUSH", "SYNC_FLUSH"] = "ASYNC_FLUSH"
    election_timeout_min_ms: int = bounded(400, min=20, max=60_000)
    election_timeout_max_ms: int = bounded(900, min=30, max=120_000)
    heartbeat_interval_ms: int = bounded(50, min=5, max=10_000)
    connection_timeout_ms: int = bounded(3500, min=100, max=120_000)
    leader_fallback_timeout_ms: int = bounded(3000, min=50, max=120_000)
    max_batch_messages: int = bounded(1024, min=1, max=100_000)
    # 512 KiB: bench dledger 27k msgs/s vs 22k with 128 KiB (fewer entries, same p99 within noise).
    max_batch_bytes: int = bounded(512 * 1024, min=1024, max=16 << 20)
    max_batch_delay_ms: float = bounded(1.0, min=0.0, max=1000.0)
    max_in_flight_batches: int = bounded(4, min=1, max=64)
    max_pending_records: int = bounded(100_000, min=1, max=10_000_000)
    # RocketMQ's waitTimeMillsInSendQueue: a record still unproposed after this long is dropped and its caller
    # told the group is busy (queue times come from a clock refreshed every 50 ms, so within 50 ms).
    # Without it an overloaded leader stores sends whose callers gave up long ago (4 MB messages at 64 in
    # flight: p99 16.7 s against a 3 s timeout). 1000 ms rather than RocketMQ's 200: a Python leader's GC and
    # fsync pauses reach tens of ms, and under ordinary load records are proposed within a few ms.
    max_queue_wait_ms: int = bounded(1000, min=1, max=600_000)
    # pysyncobj's chunked-send threshold AND how many bytes of entries it packs into one append_entries message
    # for a lagging follower. 16 MiB: max_entry_bytes (half, minus overhead) is ~8 MiB, so one 4 MiB message
    # (store.max_message_size) plus its record fits one entry, which stays below the broken chunked path.
    append_entries_batch_size_bytes: int = bounded(16 << 20, min=16 * 1024, max=64 << 20,
                                                   doc="pysyncobj appendEntriesBatchSizeBytes; entries stay "
                                                       "below half of it")
    socket_buffer_bytes: int = bounded(4 << 20, min=64 * 1024, max=256 << 20)
    log_compaction_min_entries: int = bounded(100, min=2, max=10_000_000)
    log_compaction_min_time_s: int = bounded(60, min=1, max=86_400)
    catch_up_chunk_bytes: int = bounded(1 << 20, min=4096, max=64 << 20)
    # Role changes are read after every tick; this poll only catches a leader id that arrives with the members
    # table (a member added at run time).
    status_poll_interval_ms: int = bounded(200, min=1, max=5000)
    # Longest wait between two pysyncobj ticks when no socket has anything (timers: heartbeats, elections).
    tick_interval_ms: float = bounded(20.0, min=1.0, max=100.0)
    # How long a leader holds the append_entries that only tells followers a new commit index: an append sent
    # meanwhile carries it (so under load no such notice is sent at all), and an idle group's followers apply
    # this much later. 0 sends it right after the commit callbacks answered their callers.
    commit_notice_delay_ms: float = bounded(2.0, min=0.0, max=1000.0)
    # Worker threads (the store's fdatasync) share the GIL with trio: a thread woken by I/O waits for the running
    # one to reach the switch interval (CPython's default 5 ms), which would delay a SYNC_FLUSH answer by that.
    gil_switch_interval_ms: float = bounded(0.5, min=0.05, max=50.0)
    # A member started empty to rejoin its group (``raftmq broker --rejoin``) neither votes nor stands for
    # election until it has heard from a leader: with an empty log it would vote for any candidate, one that
    # lacks acknowledged entries included (docs/operations.md, "Rebuilding a member").
    rejoin: bool = False
    # A member whose state machine holds a log but whose Raft journal and snapshot are both missing (the Raft data
    # directory lost or moved, the store kept) has the same empty log, so it rejoins as if ``rejoin`` were set.
    # False only to restart a group every member of which lost its Raft data (docs/operations.md).
    rejoin_without_raft_data: bool = True
    # A member that starts with no log at all asks its peers (GET_RAFT_STATUS, this long at most) whether they
    # hold a log; if one does, it is a member rebuilt empty, not one of a new group, and it rejoins as with
    # ``rejoin``. 0 skips the question (then only ``--rejoin`` says so).
    rejoin_probe_timeout_ms: int = bounded(1000, min=0, max=60_000)

    def __post_init__(self) -> None:
        check_fields(self)
        if len(self.secret) < MIN_SECRET_LENGTH:
            raise ConfigError(f"dledger.secret must be at least {MIN_SECRET_LENGTH} characters (every Raft frame "
                              f"is authenticated with it; `raftmq dev` generates one), got "
                              f"{len(self.secret)} characters")
        try:
            self.secret.encode("utf-8")
        except UnicodeEncodeError as e:
            # A --set argument that is not UTF-8 arrives with surrogate escapes, which the frame authenticator
            # could not encode: a traceback once the store was open. The value is a secret, so it is not shown.
            raise ConfigError(f"dledger.secret must be UTF-8 text (every Raft frame is authenticated with its "
                              f"bytes), got a character that is not at position {e.start}") from None
        ids = [m.id for m in self.members]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"dledger.members ids must be unique, got {ids}")
        if self.self_id not in ids:
            raise ConfigError(f"dledger.self_id must name one of members {ids}, got {self.self_id!r}")
        raft = [m.raft_address for m in self.members]
        if len(set(raft)) != len(raft):
            raise ConfigError(f"dledger.members raft_address values must be unique, got {raft}")
        # Every port of the group is one thing: a raft_address that is also a service_address (the member's own
        # or another's) had one server fail to bind after the store was opened, or, across hosts, peers sent Raft
        # frames to a remoting port (or catch-up fetches and clients to a Raft port) and the member never joined;
        # two members sharing a service_address made routes and catch-ups go to the wrong one.
        seen: dict[str, str] = {}
        for m in self.members:
            for kind, address in (("raft_address", m.raft_address), ("service_address", m.service_address)):
                if not address:
                    continue
                where = f"members[{m.id}].{kind}"
                if address in seen:
                    raise ConfigError(f"dledger.{where} must differ from every other member address, got "
                                      f"{address!r}, which is also {seen[address]}")
                seen[address] = where
        if self.election_timeout_max_ms <= self.election_timeout_min_ms:
            raise ConfigError(f"dledger.election_timeout_max_ms must be > election_timeout_min_ms "
                              f"({self.election_timeout_min_ms}), got {self.election_timeout_max_ms}")
        if self.election_timeout_min_ms <= 3 * self.heartbeat_interval_ms:
            raise ConfigError(f"dledger.election_timeout_min_ms must be > 3 x heartbeat_interval_ms "
                              f"({3 * self.heartbeat_interval_ms}), got {self.election_timeout_min_ms}")
        if self.connection_timeout_ms < self.election_timeout_max_ms:
            raise ConfigError(f"dledger.connection_timeout_ms must be >= election_timeout_max_ms "
                              f"({self.election_timeout_max_ms}), got {self.connection_timeout_ms}")
        if self.tick_interval_ms >= self.heartbeat_interval_ms:
            raise ConfigError(f"dledger.tick_interval_ms must be < heartbeat_interval_ms "
                              f"({self.heartbeat_interval_ms}), got {self.tick_interval_ms}")
        if self.commit_notice_delay_ms >= self.heartbeat_interval_ms:
            raise ConfigError(f"dledger.commit_notice_delay_ms must be < heartbeat_interval_ms "
                              f"({self.heartbeat_interval_ms}), got {self.commit_notice_delay_ms}")
        if self.leader_fallback_timeout_ms <= self.heartbeat_interval_ms:
            raise ConfigError(f"dledger.leader_fallback_timeout_ms must be > heartbeat_interval_ms, "
                              f"got {self.leader_fallback_timeout_ms}")
        if 2 * self.max_batch_bytes + self.join_overhead_bytes > self.max_entry_bytes:
            raise ConfigError(
                f"dledger.max_batch_bytes must be <= {(self.max_entry_bytes - self.join_overhead_bytes) // 2} (a "
                f"quarter of append_entries_batch_size_bytes minus overheads: a prepared entry may be twice its "
                f"records, and entries stay below pysyncobj's chunked-send threshold), got {self.max_batch_bytes}")

    @property
    def max_entry_bytes(self) -> int:
        """Largest entry the batcher may propose: half the pysyncobj batch size, minus wire overhead."""
        return self.append_entries_batch_size_bytes // 2 - _WIRE_OVERHEAD_BYTES

    @property
    def max_record_bytes(self) -> int:
        """Largest record ``append`` accepts. Records up to ``max_batch_bytes`` are group-committed together; a
        bigger one is proposed alone as its own entry, so it only has to fit ``max_entry_bytes``."""
        return self.max_entry_bytes - ENTRY_HEADER.size - _SOLO_JOIN_OVERHEAD_BYTES

    @property
    def join_overhead_bytes(self) -> int:
        """Room kept for the entry header and what a state machine's ``prepare_batch`` may add besides doubling
        the records (8 bytes per record plus 64). The message store adds 40 bytes of record header, a 20-byte
        ConsumeQueue unit and 12 bytes per index key to each message; a batch that still grows past
        ``max_entry_bytes`` is proposed in parts by the group (only a record too large alone is refused)."""
        return ENTRY_HEADER.size + 64 + 8 * self.max_batch_messages

    @property
    def self_member(self) -> MemberAddress:
        return next(m for m in self.members if m.id == self.self_id)

    @property
    def peers(self) -> tuple[MemberAddress, ...]:
        return tuple(m for m in self.members if m.id != self.self_id)

    def member_by_raft_address(self, raft_address: str) -> MemberAddress | None:
        return next((m for m in self.members if m.raft_address == raft_address), None)

    @property
    def journal_path(self) -> Path:
        return self.data_dir / "raft.journal"

    @property
    def snapshot_path(self) -> Path:
        return self.data_dir / "raft.snapshot"

    def has_raft_data(self) -> bool:
        """Whether this member kept a Raft journal or snapshot from an earlier run."""
        return self.journal_path.exists() or self.snapshot_path.exists()

    def replace(self, **changes: Any) -> "DLedgerConfig":
        return dataclasses.replace(self, **changes)


def unknown_syncobj_options(options: dict[str, Any]) -> list[str]:
    """Keys ``SyncObjConf`` would silently ignore."""
    known = vars(SyncObjConf())
    return sorted(k for k in options if k not in known)


def syncobj_options(config: DLedgerConfig, *, serializer: Callable | None, deserializer: Callable | None,
                    on_state_changed: Callable | None, serialize_checker: Callable | None = None) -> dict[str, Any]:
    member = config.self_member
    return {
        # Fix: bind exactly the configured address (pysyncobj's default is 0.0.0.0).
        "bindAddress": member.raft_address,
        # Authentication is done by dledger.patches (a MAC checked before unpickling); pysyncobj's own Fernet password
        # stays off (it needs `cryptography` and base64-encodes every frame).
        "password": None,
        # No tick thread: dledger.group ticks pysyncobj from a trio task (dledger.poller explains why).
        "autoTick": False,
        "raftMinTimeout": config.election_timeout_min_ms / 1000,
        "raftMaxTimeout": config.election_timeout_max_ms / 1000,
        "appendEntriesPeriod": config.heartbeat_interval_ms / 1000,
        "connectionTimeout": config.connection_timeout_ms / 1000,
        "connectionRetryTime": 0.2,
        "leaderFallbackTimeout": config.leader_fallback_timeout_ms / 1000,
        # Group commit already batches; send each entry at once (0.2-0.5 ms commit vs ~appendEntriesPeriod).
        "appendEntriesUseBatch": False,
        "appendEntriesBatchSizeBytes": config.append_entries_batch_size_bytes,
        "sendBufferSize": config.socket_buffer_bytes,
        "recvBufferSize": config.socket_buffer_bytes,
        "commandsQueueSize": 10_000,
        "commandsWaitLeader": False,
        "logCompactionMinEntries": config.log_compaction_min_entries,
        "logCompactionMinTime": config.log_compaction_min_time_s,
        "logCompactionSplit": False,
        "logCompactionBatchSize": 1 << 16,
        "journalFile": str(config.journal_path),
        "fullDumpFile": str(config.snapshot_path),
        "serializer": serializer,
        "deserializer": deserializer,
        # The serializer puts its snapshot in place off the tick; this says when (dledger.patches, 21).
        "serializeChecker": serialize_checker,
        "useFork": False,
        "dynamicMembershipChange": True,
        "onStateChanged": on_state_changed,
        "bindRetryTime": 0.2,
        "maxBindRetries": 10,
        "pollerType": "epoll",
        "tcp_keepalive": (16, 3, 5),
    }


def build_syncobj_conf(config: DLedgerConfig, *, serializer: Callable | None = None,
                       deserializer: Callable | None = None, on_state_changed: Callable | None = None,
                       serialize_checker: Callable | None = None) -> SyncObjConf:
    options = syncobj_options(config, serializer=serializer, deserializer=deserializer,
                              on_state_changed=on_state_changed, serialize_checker=serialize_checker)
    unknown = unknown_syncobj_options(options)
    if unknown:
        raise ConfigError(f"SyncObjConf has no option(s) {unknown}; pysyncobj would silently ignore them")
    conf = SyncObjConf(**options)
    conf.validate()
    return conf
