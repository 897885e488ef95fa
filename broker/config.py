"""``BrokerConfig``: one broker node, loaded from ``broker.toml``.

A node is one member of its broker group's Raft group, so the group name, the members and this node's identity
live in the ``[dledger]`` table (``dledger.config.DLedgerConfig``); the node's ``broker_name`` *is* the group name,
its ``broker_id`` in routes is its 1-based position in ``dledger.members`` (0 is reserved for "the current
master"), and it serves remoting on its member's ``service_address`` (peers fetch commit-log bytes there).

Example::

    cluster_name = "DefaultCluster"
    namesrv_addrs = ["127.0.0.1:9876"]
    [store]
    store_dir = "data/n1/store"
    [dledger]
    group = "broker-a"
    self_id = "n1"
    secret = "at-least-sixteen-characters"
    data_dir = "data/n1/dledger"
    members = [{id = "n1", raft_address = "127.0.0.1:20911", service_address = "127.0.0.1:10911"}, ...]
"""

from __future__ import annotations

import dataclasses
import json
import socket
import ssl
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from broker.delay_level import DEFAULT_MESSAGE_DELAY_LEVEL, delay_levels_problem, parse_delay_levels
from broker.store.config import StoreConfig
from broker.topic_config import PERM_READ, PERM_READ_WRITE, PERM_WRITE
from dledger.config import DLedgerConfig
from dledger.service import MAX_FETCH_BYTES
from remoting.config import (ConfigError, bounded, check_fields, config_from_mapping, metrics_listen_problem,
                             name_problem, parse_host_port, read_config_data, replace_file)
from remoting.message import BATCH_HEAD, MAX_PROPERTIES_SIZE, MAX_TOPIC_LENGTH, record_size, topic_problem
from remoting.tls import TLS_MODES, client_context, server_context_for_mode

__all__ = ["BrokerConfig", "load_broker_config", "RUNTIME_KEYS", "RUNTIME_OVERRIDES_FILE", "RuntimeConfigError",
           "check_runtime_key",
           "parse_runtime_value", "with_runtime_values", "runtime_overrides", "read_runtime_overrides",
           "write_runtime_overrides"]

# What one message's dledger record holds besides its body: batch head, record header, topic, properties.
_RECORD_OVERHEAD_BYTES = BATCH_HEAD.size + record_size(0, MAX_TOPIC_LENGTH, MAX_PROPERTIES_SIZE)
# Room for a remoting frame's header and ext around a body.
_FRAME_SLACK_BYTES = 64 * 1024


def _addrs_ok(value: tuple[str, ...]) -> str | None:
    for addr in value:
        # Dialed by every registration: port 0 was taken and every one failed (the group never in any route).
        parse_host_port(addr, key="namesrv_addrs", dial=True)
    return None


@dataclasses.dataclass(frozen=True)
class BrokerConfig:
    cluster_name: str = bounded("DefaultCluster", check=name_problem, doc="cluster the group registers under")
    namesrv_addrs: tuple[str, ...] = bounded((), check=_addrs_ok, doc="every name server, HOST:PORT")
    listen: str = bounded("", doc="HOST:PORT to bind remoting on; default: this member's service_address, which "
                                  "is always the advertised address")
    # Off by default, as RocketMQ's metricsExporterType: a port more to open and firewall is the operator's call.
    metrics_listen: str = bounded("", check=metrics_listen_problem,
                                  doc="HOST:PORT to serve Prometheus metrics on (GET /metrics); empty: none")
    store: StoreConfig = dataclasses.field(default_factory=StoreConfig)
    dledger: DLedgerConfig | None = None
    # RocketMQ's brokerPermission: what this node allows, over every topic's own perm. 4 (read only) takes the group
    # out of write traffic before maintenance: its topics register not writable and sends are refused; 6 puts it
    # back. 2 (write only) is accepted, as RocketMQ accepts it, and refuses pulls alike.
    broker_permission: int = bounded(PERM_READ_WRITE, min=PERM_WRITE, max=PERM_READ_WRITE,
                                     choices=(PERM_WRITE, PERM_READ, PERM_READ_WRITE),
                                     doc="2 write only, 4 read only, 6 read and write")
    auto_create_topic_enable: bool = bounded(True, doc="create unknown topics on first send (RocketMQ default)")
    default_topic_queue_nums: int = bounded(4, min=1, max=1024, doc="queues of an auto-created topic")
    # RocketMQ's traceTopicEnable / msgTraceTopicName: the group's leader creates the trace topic at start, so the
    # clients' traces (client/trace.py) are stored without auto_create_topic_enable.
    trace_topic_enable: bool = bounded(False, doc="create msg_trace_topic_name at start if missing")
    msg_trace_topic_name: str = bounded("RMQ_SYS_TRACE_TOPIC", check=topic_problem,
                                        doc="the topic trace_topic_enable creates")
    # Every registration carries the whole topic table. Unbounded, a client sending to ever new names (auto-create
    # is on by default) grew it past a name server's frame limit (16 MiB: ~80k topics with 127-character names),
    # after which every registration of the group was refused and it fell out of every route. The count alone does
    # not hold it below that with long names: creation also stops at the registration's byte budget, what
    # max_frame_size leaves (broker.registration.registration_body_budget, node._check_topic_room).
    max_topic_count: int = bounded(50_000, min=1, max=200_000,
                                   doc="topics this group holds; creating (or auto-creating) one more is refused")
    # RocketMQ's autoCreateSubscriptionGroup (broker/subscription_group.py): off, a consumer group's pulls are
    # refused (SUBSCRIPTION_GROUP_NOT_EXIST) until `raftmq admin update-sub-group` creates it. The count bounds the
    # replicated table, which every Raft snapshot carries, against clients pulling under ever new group names.
    auto_create_subscription_group: bool = bounded(True, doc="create a consumer group's config on its first pull "
                                                             "or send-back (RocketMQ default)")
    max_subscription_group_count: int = bounded(50_000, min=1, max=200_000,
                                                doc="consumer groups this group holds a config for; creating (or "
                                                    "auto-creating) one more is refused")
    long_polling_timeout_ms: int = bounded(15_000, min=1, max=3_600_000, doc="longest hold of a pull")
    long_polling_check_interval_ms: int = bounded(1000, min=10, max=60_000)
    max_transfer_count: int = bounded(1024, min=1, max=65_536, doc="messages per pull response, at most")
    max_transfer_bytes: int = bounded(1 << 20, min=1024, max=64 << 20, doc="bytes per pull response, at most")
    max_batch_messages: int = bounded(1024, min=1, max=65_536, doc="messages per SEND_BATCH_MESSAGE")
    # RocketMQ's enablePropertyFilter, off by default as there: a SQL92 pull reads every candidate message's
    # properties from the commit log (tags codes cannot help), which costs what a tag pull does not.
    enable_property_filter: bool = bounded(False, doc="serve SQL92 subscriptions (MessageSelector.by_sql)")
    # A name server evicted a node not heard from for its broker_expired_ms (120 s by default): registering every
    # 120 s or more (up to 600 s was taken) left the group out of every route for most of each interval. 60 s is
    # RocketMQ's cap on registerNameServerPeriod (the node now sends its timeout, held to twice the interval).
    register_interval_ms: int = bounded(30_000, min=10, max=60_000, doc="periodic registration")
    register_timeout_ms: int = bounded(3000, min=10, max=60_000)
    # Sent in every registration (RocketMQ 5's heartbeatTimeoutMillis): name servers evict this node after this long
    # without one, whatever their own broker_expired_ms, which they cannot hold to an interval they do not know.
    broker_not_active_timeout_ms: int = bounded(
        120_000, min=20, max=86_400_000, doc="name servers evict this node after this long without a registration; "
                                             "at least 2 x register_interval_ms")
    consumer_offset_flush_interval_ms: int = bounded(200, min=1, max=60_000,
                                                     doc="how often pending offset commits are replicated")
    # Only a client's heartbeat (client.heartbeat_broker_interval_ms, 10 s by default) keeps it in its groups: a
    # shorter expiry (100 ms was taken) dropped every live consumer between two heartbeats and the groups rebalanced
    # at each one. 30 s is three default heartbeats (RocketMQ's fixed 120 s is four of its 30 s ones).
    channel_expired_timeout_ms: int = bounded(120_000, min=30_000, max=3_600_000,
                                              doc="a client silent this long leaves its groups")
    # RocketMQ's rebalanceLockMaxLiveTime. A member trusts a lock for half of it after asking (client.orderly), and
    # a deposed leader that still thinks it leads may renew locks until leader_fallback_timeout_ms after the new
    # leader restored them: both must end before the new leader's copy lapses (see __post_init__).
    rebalance_lock_max_live_time_ms: int = bounded(
        60_000, min=1_000, max=3_600_000, doc="an orderly consumer's queue lock lapses this long after its holder's "
                                              "last lock request; more than 2 x dledger.leader_fallback_timeout_ms")
    send_timeout_ms: int = bounded(5000, min=10, max=600_000, doc="longest wait for a Raft commit of a send")
    # raftmq.runner.DRAIN_TIMEOUT_S (5 s) bounds everything done on a signal before the node stops serving.
    leadership_handover_timeout_ms: int = bounded(
        2000, min=0, max=5000, doc="on SIGTERM/SIGINT a leader first hands its leadership to its most caught-up "
                                   "connected follower, waiting at most this long; 0: it stops without")
    max_frame_size: int = bounded(16 << 20, min=1024, max=1 << 30)
    message_delay_level: str = bounded(DEFAULT_MESSAGE_DELAY_LEVEL, check=delay_levels_problem,
                                       doc="delay of each level of delayed messages and consumer retries, "
                                           "RocketMQ's format (units ms, s, m, h, d)")
    # RocketMQ 5's timerMaxDelaySec. A timer message hops through the delay levels (broker/schedule.py), one
    # re-append a longest level: 3 days are 36 hops of 2 h, and the bound keeps a message's hops to hundreds.
    timer_max_delay_sec: int = bounded(3 * 86_400, min=1, max=30 * 86_400,
                                       doc="how far ahead a timer message's delivery time may be")
    # Transactional messages (broker/transaction.py), RocketMQ's transactionTimeOut, transactionCheckMax and
    # transactionCheckInterval.
    transaction_timeout_ms: int = bounded(6_000, min=1, max=86_400_000,
                                          doc="a half message not ended this long after it was stored is checked "
                                              "back with its producer group")
    transaction_check_max: int = bounded(15, min=1, max=1_000,
                                         doc="checks of one half message before it is discarded to "
                                             "TRANS_CHECK_MAX_TIME_TOPIC")
    transaction_check_interval_ms: int = bounded(60_000, min=10, max=86_400_000,
                                                 doc="how often the leader scans the half messages for checks")
    # POP consumption (broker/pop.py): how soon a popped message whose invisible time passed is visible again, and
    # the invisible times a POP or a change may ask for.
    pop_revive_interval_ms: int = bounded(1_000, min=10, max=60_000,
                                          doc="how often the leader revives popped messages not acked in time")
    pop_invisible_time_min_ms: int = bounded(1_000, min=1, max=86_400_000,
                                             doc="shortest invisible time a POP or change may ask for")
    pop_invisible_time_max_ms: int = bounded(43_200_000, min=1, max=86_400_000,
                                             doc="longest invisible time a POP or change may ask for (12 h)")
    # RocketMQ's aclEnable, off by default as there (broker/acl.py; docs/operations.md, "Access control (ACL)").
    acl_enable: bool = bounded(False, doc="judge every client request by the ACL file's accounts and permissions")
    acl_file: str = bounded("", doc="the ACL file (TOML, re-read when it changes); empty: plain_acl.toml in "
                                    "store.store_dir")
    # RocketMQ's tls.server.mode and its files (remoting/tls.py; docs/operations.md, "TLS"). The Raft port is not
    # concerned: pysyncobj's traffic is authenticated by dledger.secret.
    tls_mode: str = bounded("disabled", choices=TLS_MODES,
                            doc="disabled: plain TCP; enforcing: TLS only; permissive: both on one port")
    tls_cert_file: str = bounded("", doc="PEM certificate chain this node presents, as a server and (with "
                                         "tls_client_enable) as a client")
    tls_key_file: str = bounded("", doc="PEM private key of tls_cert_file")
    tls_ca_file: str = bounded("", doc="PEM CA certificates that client certificates (tls_need_client_auth) and, "
                                       "with tls_client_enable, the servers this node dials are checked against")
    tls_need_client_auth: bool = bounded(False, doc="clients must present a certificate signed by tls_ca_file")
    # RocketMQ's tls.enable for the broker's own client: registrations with the name servers and requests to its
    # peers' service ports (catch-up fetches). Peers of an enforcing group need it (checked in __post_init__).
    tls_client_enable: bool = bounded(False, doc="dial name servers and peers over TLS")

    def __post_init__(self) -> None:
        check_fields(self)
        # The files read and checked at start: a ConfigError naming the key at fault, not a failed handshake later.
        # Built once: the node's start and a runtime update's checks get these same contexts back.
        self.tls_server_context()
        self.tls_client_context()
        if self.tls_mode == "enforcing" and not self.tls_client_enable:
            # Its peers enforce too: a plain catch-up fetch to them is closed, which shows only when a member lags
            # (recovery), long after start.
            raise ConfigError('tls_mode = "enforcing" needs tls_client_enable = true: the members of a group fetch '
                              'from each other\'s service ports to catch up, and an enforcing peer closes plain '
                              'connections (tls_mode = "permissive" serves both)')
        if self.dledger is None:
            raise ConfigError("broker config needs a [dledger] table: group, self_id, secret and members")
        if self.pop_invisible_time_min_ms > self.pop_invisible_time_max_ms:
            raise ConfigError(f"pop_invisible_time_min_ms must be <= pop_invisible_time_max_ms "
                              f"({self.pop_invisible_time_max_ms}), got {self.pop_invisible_time_min_ms}")
        if self.broker_not_active_timeout_ms < 2 * self.register_interval_ms:
            # One registration lost or late must not take the node out of every route.
            raise ConfigError(f"broker_not_active_timeout_ms must be >= 2 x register_interval_ms "
                              f"({2 * self.register_interval_ms}), got {self.broker_not_active_timeout_ms}")
        if self.rebalance_lock_max_live_time_ms <= 2 * self.dledger.leader_fallback_timeout_ms:
            raise ConfigError(f"rebalance_lock_max_live_time_ms must be > 2 x dledger.leader_fallback_timeout_ms "
                              f"({2 * self.dledger.leader_fallback_timeout_ms}): a member may consume for half a lock "
                              f"life after a deposed leader renewed it, got {self.rebalance_lock_max_live_time_ms}")
        if self.listen:
            # Clients and peers dial the service_address's port: bound to any other, the node was unreachable.
            parse_host_port(self.listen, key="listen", dial=True)
        key = f"dledger.members[{self.dledger.self_id}].service_address"
        host, _port = parse_host_port(self.dledger.self_member.service_address or "", key=key, dial=True)
        try:
            socket.inet_pton(socket.AF_INET, host)
        except OSError:
            # It becomes the store host of every stored message and message id, in RocketMQ's IPv4 form; the
            # IPv6 form (sys flag STOREHOSTADDRESS_V6) is not implemented.
            raise ConfigError(f"{key} must be an IPv4 address and port, got "
                              f"{self.dledger.self_member.service_address!r}") from None
        # The largest frame: a send of max_message_size; a pull answer (max_transfer_bytes, or one whole record);
        # a catch-up answer (dledger.catch_up_chunk_bytes capped by the service, or one whole record).
        largest = max(self.max_message_size + _RECORD_OVERHEAD_BYTES, self.max_transfer_bytes,
                      min(self.dledger.catch_up_chunk_bytes, MAX_FETCH_BYTES)) + _FRAME_SLACK_BYTES
        if self.max_frame_size < largest:
            raise ConfigError(f"max_frame_size must be >= {largest} (one message of max_message_size "
                              f"{self.max_message_size} with its headers, a pull of max_transfer_bytes, a catch-up "
                              f"chunk), got {self.max_frame_size}")

    def tls_server_context(self) -> ssl.SSLContext | None:
        """What ``serve_remoting`` takes as ``tls_context``: None with tls_mode "disabled". The one built when the
        config was checked, until a file it reads changes (remoting/tls.py)."""
        return server_context_for_mode(self.tls_mode, self.tls_cert_file, self.tls_key_file, self.tls_ca_file,
                                       self.tls_need_client_auth)

    def tls_client_context(self) -> ssl.SSLContext | None:
        """The context of this node's own client (``tls_client_enable``), None without: servers verified against
        ``tls_ca_file`` (the system's CAs if empty), ``tls_cert_file`` presented to those that ask for one."""
        if not self.tls_client_enable:
            return None
        return client_context(ca_file=self.tls_ca_file or None, cert_file=self.tls_cert_file or None,
                              key_file=self.tls_key_file or None)

    @property
    def broker_name(self) -> str:
        return self.dledger.group  # type: ignore[union-attr]

    @property
    def broker_id(self) -> int:
        """1-based position of this node in the group's members (0 means "master" in routes). Every node of a group
        must list ``dledger.members`` in the same order: two that disagree may take one id, and a name server
        refuses the second while the first is registered (docs/operations.md). The position stays the rule, not
        the sorted ids: any other would renumber the nodes of a running group whose list is not sorted, and
        during a rolling upgrade old and new numbering would collide."""
        ids = [m.id for m in self.dledger.members]  # type: ignore[union-attr]
        return ids.index(self.dledger.self_id) + 1  # type: ignore[union-attr]

    @property
    def listen_address(self) -> str:
        """Where to bind: ``listen`` if set (e.g. 0.0.0.0:10911), else the advertised address."""
        return self.listen or self.broker_addr

    @property
    def broker_addr(self) -> str:
        """The advertised address: registered with name servers, given as ``leader_addr``, in message ids."""
        return self.dledger.self_member.service_address  # type: ignore[union-attr]

    @property
    def delay_levels_ms(self) -> tuple[int, ...]:
        return parse_delay_levels(self.message_delay_level)

    @property
    def max_message_size(self) -> int:
        """THE broker's message size limit, derived here and nowhere else: the largest body of a SEND_MESSAGE and
        the largest whole body of a SEND_BATCH_MESSAGE. It is ``store.max_message_size`` (4 MiB, RocketMQ's
        default) unless one message's record would not fit one dledger record (``dledger.max_record_bytes``, about
        half of ``dledger.append_entries_batch_size_bytes``): then that lower value. The reservation covers the
        batch head, the record header, the longest topic and the longest properties, so a message within the limit
        is never refused further down."""
        assert self.dledger is not None
        return max(1, min(self.store.max_message_size, self.dledger.max_record_bytes - _RECORD_OVERHEAD_BYTES))

    @property
    def max_message_size_reason(self) -> str:
        """Which setting the limit comes from, for the MESSAGE_ILLEGAL remark."""
        if self.max_message_size == self.store.max_message_size:
            return "store.max_message_size"
        return "one dledger record: dledger.append_entries_batch_size_bytes"

    @property
    def writable(self) -> bool:
        return bool(self.broker_permission & PERM_WRITE)

    @property
    def readable(self) -> bool:
        return bool(self.broker_permission & PERM_READ)

    @property
    def runtime_overrides_path(self) -> Path:
        """Where this node keeps what UPDATE_BROKER_CONFIG changed (in its store directory, which only it uses)."""
        return self.store.store_dir / RUNTIME_OVERRIDES_FILE

    def member_service_address(self, member_id: str) -> str | None:
        assert self.dledger is not None
        for m in self.dledger.members:
            if m.id == member_id:
                return m.service_address or None
        return None


def load_broker_config(path: str | Path | None, overrides: dict | None = None) -> BrokerConfig:
    data = read_config_data(path, overrides=overrides)
    store, ledger = data.get("store"), data.get("dledger")
    if isinstance(store, dict) and "flush_disk_type" in store and isinstance(ledger, dict) \
            and "flush_disk_type" not in ledger:
        # RocketMQ's one knob: SYNC_FLUSH means an acknowledged message survives a power loss, which on a Raft
        # group takes the members' journals synced too (docs/operations.md). Set apart only when asked.
        ledger["flush_disk_type"] = store["flush_disk_type"]
    return config_from_mapping(BrokerConfig, data)


# --- runtime updates (UPDATE_BROKER_CONFIG) ---------------------------------------------------------------------

# The keys UPDATE_BROKER_CONFIG may change on a running node, each with when the new value takes effect. Every one
# is read from ``BrokerNode.config`` where it is used, at each use, and sizes nothing made at start (a file, a
# buffer, a service's period): so the next request obeys it. Any other key needs its config file edited and the
# node restarted.
RUNTIME_KEYS: Mapping[str, str] = {
    "broker_permission": "at once: re-registered with every name server before the answer; the next send (or pull)",
    "auto_create_topic_enable": "the next send to an unknown topic",
    "default_topic_queue_nums": "the next auto-created topic",
    "max_topic_count": "the next topic created or auto-created",
    "long_polling_timeout_ms": "pulls held from then on (a pull held already keeps its deadline)",
    "max_transfer_count": "the next pull answer",
    "max_transfer_bytes": "the next pull answer",
    "max_batch_messages": "the next SEND_BATCH_MESSAGE",
    "enable_property_filter": "the next SQL92 pull (a pull held already is judged again when it resumes)",
    "timer_max_delay_sec": "the next timer message sent",
}

# In the store directory: a JSON object of runtime key -> value, each differing from the config file's
# (docs/operations.md, "Changing a node's config at runtime").
RUNTIME_OVERRIDES_FILE = "runtime_config.json"


class RuntimeConfigError(ConfigError):
    """A runtime update refused; ``key`` is the key at fault (None: only the keys together are)."""

    def __init__(self, message: str, key: str | None) -> None:
        super().__init__(message)
        self.key = key


def check_runtime_key(key: Any) -> str:
    """``key`` if UPDATE_BROKER_CONFIG may change it; else the ConfigError that names it and says why not."""
    if key in RUNTIME_KEYS:
        return key
    known = ", ".join(RUNTIME_KEYS)
    top = key.split(".", 1)[0] if isinstance(key, str) else None
    if top in {f.name for f in dataclasses.fields(BrokerConfig)}:
        raise RuntimeConfigError(f"config key {key!r} cannot be changed at runtime: edit the node's config file and "
                                 f"restart the node (keys that can: {known})", str(key))
    raise RuntimeConfigError(f"unknown config key {key!r} (keys that can change at runtime: {known})", str(key))


def parse_runtime_value(key: str, text: Any) -> Any:
    """A value of UPDATE_BROKER_CONFIG, sent as text, read as a value of the TOML config file is (``raftmq broker
    --set``'s rule): "4" an integer, "true" a boolean. Text TOML cannot read stays text, which the type check then
    refuses naming the key ("must be an integer, got 'x'"). One line only: a newline would let a second key in."""
    if not isinstance(text, str):
        raise RuntimeConfigError(f"{key} must be sent as text, got {text!r}", key)
    if "\n" in text or "\r" in text:
        raise RuntimeConfigError(f"{key} must be one value on one line, got {text!r}", key)
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def with_runtime_values(config: BrokerConfig, values: Mapping[str, Any]) -> BrokerConfig:
    """``config`` with ``values`` (runtime key -> typed value), judged by the rules the config file is: each key's
    type, bounds and choices, then the checks across keys (``max_transfer_bytes`` against ``max_frame_size``).
    Raises RuntimeConfigError naming the key and the value; ``config`` itself never changes (it is frozen)."""
    for key in values:
        check_runtime_key(key)
    for key, value in values.items():
        try:
            dataclasses.replace(config, **{key: value})
        except (ConfigError, TypeError, ValueError) as e:
            # A check of the key itself names it and the value already; one across keys names the other key.
            text = str(e)
            raise RuntimeConfigError(text if text.startswith(f"{key} ") else f"{key} = {value!r} refused: {text}",
                                     key) from None
    try:
        return dataclasses.replace(config, **values)
    except (ConfigError, TypeError, ValueError) as e:
        given = ", ".join(f"{k} = {v!r}" for k, v in values.items())
        raise RuntimeConfigError(f"{given} refused together: {e}", None) from None


def runtime_overrides(file_config: BrokerConfig, config: BrokerConfig) -> dict[str, Any]:
    """The runtime keys whose value in ``config`` differs from the config file's: what the overrides file holds.
    A key set back to the file's value is no override any more, so a later edit of the file is not masked."""
    return {key: getattr(config, key) for key in RUNTIME_KEYS if getattr(config, key) != getattr(file_config, key)}


def read_runtime_overrides(config: BrokerConfig) -> tuple[BrokerConfig, dict[str, Any]]:
    """``config`` (the config file with ``--set``) with this node's persisted runtime overrides applied over it,
    and those overrides; no file, ``config`` as it is. A file that cannot be read or holds what the config would
    refuse is a ConfigError naming it: the node does not start on a config other than the one it was told."""
    path = config.runtime_overrides_path
    where = f"runtime config overrides {str(path)!r}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return config, {}
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where} cannot be read: {e}") from None
    try:
        values = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{where} are not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a JSON object of config key -> value, got {type(values).__name__}")
    try:
        return with_runtime_values(config, values), values
    except ConfigError as e:
        raise ConfigError(f"{where}: {e} (fix or remove that key, or remove the file to drop every override)") \
            from None


def write_runtime_overrides(path: Path, values: Mapping[str, Any]) -> None:
    """Replace the overrides file whole (``remoting.config.replace_file``: a crash at any point leaves the old file
    or the new one, never a part of one)."""
    replace_file(path, (json.dumps(dict(sorted(values.items())), indent=2) + "\n").encode("utf-8"))
