"""What producers, consumers and the admin client share: config, connections, routes, heartbeats.

One ``ClientInstance`` per producer or consumer (RocketMQ's MQClientInstance, without the process-wide
singleton: trio code opens what it uses and closes it with the ``async with``). It owns the remoting pool (one
connection per node, many requests in flight on it), the route cache, the fault tracker and three background
tasks: the periodic route refresh, the heartbeat to every node of every group it knows, and the leader watch.

The leader watch is for a leader that hangs instead of dying (a stopped process, a VM or disk stall, a network
that drops packets without resetting connections). Its connections stay open, so nothing fails fast: every
send waits for its timeout while the rest of the group has long elected a new leader. When a group's leader
connection has requests waiting and has received nothing for ``leader_silence_timeout_ms``, the watch asks the
name servers for the group's route again (every ``leader_silence_timeout_ms / 4``, at most 250 ms, while the
silence lasts), and at the same time asks the group's other nodes for their status (GET_BROKER_RUNTIME_INFO):
the name servers may be cut off too, and a node's own word on the leader is Raft's. As soon as either names
another master (the nodes: the leader named at the highest term they report), the silent connection is closed:
its requests fail with a retriable ``ConnectionClosedError``, and the producer resends them to the new leader
(a leader hint until the route names it) within their deadline.
Long polls (PULL_MESSAGE, POP_MESSAGE) are answered late on purpose and do not count.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import itertools
import logging
import os
import secrets
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import cbor2
import trio

from client.errors import ClientClosedError, NoRouteError, UnknownBrokerError
from client.route import FaultTracker, RouteCache, decode_route_response, parse_broker_addr_table
from remoting.acl import RequestSigner
from remoting.codec import EncodedExt, Frame, make_request, make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.config import ConfigError, bounded, check_fields, config_from_mapping, parse_host_port
from remoting.errors import ConnectError, ConnectionClosedError, RaftMQError, for_code
from remoting.message import CLIENT_ID_MAX_LENGTH, MessageFormatError, ip_bytes
from remoting.tls import ContextReloader, client_context

__all__ = ["ClientConfig", "ClientInstance", "build_config", "raise_for_response", "open_remoting",
           "open_client_nursery", "ServerRequests", "check_instance_name", "detect_client_ip",
           "namesrv_addrs_from_env", "NAMESRV_ADDR_ENV", "DEFAULT_NAMESRV_ADDR", "ACCESS_KEY_ENV",
           "SECRET_KEY_ENV", "TLS_ENABLE_ENV", "TLS_CA_FILE_ENV", "client_tls_context",
           "tls_settings"]

log = logging.getLogger(__name__)

HOUR_MS = 3_600_000  # the longest period or timeout a client config takes

_instance_counter = itertools.count(1)

# Requests a broker holds on purpose (long polling): their wait says nothing about the broker's health. POP_MESSAGE
# is held for its poll_time_ms (a simple consumer's await_duration_ms) as a pull for its suspend time: counted, every
# idle receive had the watch ask the name servers and the group's nodes four times a second from its first second
# on. Each is bounded by its own timeout instead (the request timeout plus the time it asked to be held); a leader
# that hangs is still found by the other requests on its connection (heartbeats, acks, sends).
_LONG_POLL_CODES = frozenset({RequestCode.PULL_MESSAGE, RequestCode.POP_MESSAGE})


# Where the client looks for its name servers when none are given: RocketMQ's clients and mqadmin read the same
# variable (a deployment sets it once for every process), and raftmq dev's name server is the last resort.
NAMESRV_ADDR_ENV = "NAMESRV_ADDR"
DEFAULT_NAMESRV_ADDR = "127.0.0.1:9876"


def _check_addrs(value: tuple[str, ...]) -> str | None:
    if not value:
        return "must name at least one name server"
    for addr in value:
        parse_host_port(addr, key="namesrv_addrs", dial=True)
    return None


def _split_addrs(value: str) -> list[str]:
    # RocketMQ separates name servers with ';', raftmq's options with ',' too: either here.
    return [a.strip() for a in value.replace(",", ";").split(";") if a.strip()]


def namesrv_addrs_from_env() -> tuple[str, ...] | None:
    """The name servers ``NAMESRV_ADDR`` names ("HOST:PORT[;HOST:PORT...]"), None when it is not set. Set but
    empty or malformed is a ``ConfigError`` naming it: taken as unset, the client would quietly dial another
    cluster (127.0.0.1:9876) than the one the operator meant."""
    value = os.environ.get(NAMESRV_ADDR_ENV)
    if value is None:
        return None
    addrs = _split_addrs(value)
    if not addrs:
        raise ConfigError(f"{NAMESRV_ADDR_ENV} needs HOST:PORT[;HOST:PORT...], got {value!r} (unset it for the "
                          f"default {DEFAULT_NAMESRV_ADDR})")
    for addr in addrs:
        parse_host_port(addr, key=NAMESRV_ADDR_ENV, dial=True)
    return tuple(addrs)


def _default_namesrv_addrs() -> tuple[str, ...]:
    # Read each time a config is built without name servers, not once at import: a process may set it later.
    return namesrv_addrs_from_env() or (DEFAULT_NAMESRV_ADDR,)


def _usable_ipv4(value: str) -> bool:
    """An address other hosts could tell this one by: not loopback (127.0.1.1 is Debian's name for the host),
    not link-local (169.254/16, self-assigned without DHCP), not unspecified or multicast."""
    try:
        ip = ipaddress.IPv4Address(value)
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast)


def detect_client_ip() -> str:
    """This host's IPv4 address, as RocketMQ's clients find theirs (``NetworkUtil.getLocalAddress``), for a
    client whose config names none: the first usable address its host name resolves to, else the first of an
    interface that is up, else 127.0.0.1. Nothing is sent to learn it (no UDP "connect" towards some address,
    which needs a route and names whatever interface that route takes). The host name comes first: it is what the
    operator named this host as (a container's own address in its /etc/hosts); interfaces may include bridges that
    every host has alike (docker0's 172.17.0.1)."""
    candidates: list[str] = []
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)
        candidates += [str(info[4][0]) for info in infos]
    except (OSError, UnicodeError):  # a host name that does not resolve: the interfaces say it
        pass
    try:
        import psutil  # a dependency already (the servers' metrics); imported here, as only this needs it

        stats = psutil.net_if_stats()
        for name, addrs in psutil.net_if_addrs().items():
            if name in stats and stats[name].isup:
                candidates += [a.address for a in addrs if a.family == socket.AF_INET]
    except (OSError, RuntimeError):  # psutil cannot list the interfaces here: the host name or loopback
        pass
    return next((c for c in candidates if _usable_ipv4(c)), "127.0.0.1")


@functools.cache
def _default_client_ip() -> str:
    # Once per process: the host's address does not change under a running client as often as configs are built.
    return detect_client_ip()


def _field_from(factory: Callable[[], Any], **meta: Any) -> Any:
    """A ``bounded`` field whose default ``factory`` computes each time a config is built without it."""
    return dataclasses.field(default_factory=factory, metadata=bounded(None, **meta).metadata)


def _check_ip(value: str) -> str | None:
    # The born and store hosts of a batch are 4-byte IPv4 addresses: any other value failed every send_batch.
    try:
        ip_bytes(value, "client_ip")
    except MessageFormatError:
        return "must be an IPv4 address"
    return None


# Part of the client id "{client_ip}@{pid}#{start}#{instance_name}#{n}" (ClientInstance), which brokers hold to
# CLIENT_ID_MAX_LENGTH (255): an IPv4 address (15), a pid (10), the process's start part (about 20), the
# separators and the instance counter (20) take at most 75.
INSTANCE_NAME_MAX_LENGTH = 127

# What tells this process's client ids from those of any other process (RocketMQ's "pid#nanoTime" instance name):
# its start time in milliseconds (hex) and 32 random bits. The address and pid alone did not: in containers every
# client is pid 1, and two hosts (their names resolving to loopback, or two containers given the same bridge
# address) both were "127.0.0.1@1#DEFAULT#1"; brokers key a group's members by id, so both took the same queues
# and the others had no consumer. Taken once, at import: a forked child differs by its pid.
PROCESS_START_ID = f"{time.time_ns() // 1_000_000:x}-{secrets.token_hex(4)}"


# Where a client looks for its ACL credentials when its config names none (``raftmq admin`` and ``raftmq bench``
# take --access-key/--secret-key too).
ACCESS_KEY_ENV = "RAFTMQ_ACCESS_KEY"
SECRET_KEY_ENV = "RAFTMQ_SECRET_KEY"
# Likewise for TLS (``raftmq admin`` and ``raftmq bench`` take --tls/--tls-ca-file and export them so).
TLS_ENABLE_ENV = "RAFTMQ_TLS_ENABLE"
TLS_CA_FILE_ENV = "RAFTMQ_TLS_CA_FILE"


def _tls_enable_from_env() -> bool:
    value = os.environ.get(TLS_ENABLE_ENV, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    # Read as off, a typo would have the client talk plain TCP to a cluster its operator meant to reach over TLS.
    raise ConfigError(f"${TLS_ENABLE_ENV} must be true or false (or 1 or 0), got {os.environ[TLS_ENABLE_ENV]!r}")


def _tls_ca_file_from_env() -> str:
    return os.environ.get(TLS_CA_FILE_ENV, "")


def tls_settings(*, enable: bool | None = None, ca_file: str | None = None) -> tuple[bool, str]:
    """``(tls_enable, tls_ca_file)`` as a client resolves them: each one given, else its variable
    ($RAFTMQ_TLS_ENABLE, read strictly; $RAFTMQ_TLS_CA_FILE), as ``ClientConfig``'s defaults read them. For a
    command that opens a remoting client of its own (``raftmq.bench.common.tls_context_from_args``)."""
    return (_tls_enable_from_env() if enable is None else enable,
            _tls_ca_file_from_env() if ca_file is None else ca_file)


def _credential_problem(value: str) -> str | None:
    # Whitespace or control characters around a key are a paste gone wrong: refused here, rather than as a
    # signature mismatch on the broker. The value is not repeated (it may be the secret).
    if value != value.strip() or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return "must not contain control characters or begin or end with whitespace"
    return None


def check_instance_name(value: str) -> str | None:
    """What is wrong with an ``instance_name``, None if nothing."""
    # Also part of a BROADCASTING consumer's offset file name under offset_store_dir: '/', '\\' or '..' put that
    # file elsewhere ("../../x" anywhere the process may write), a NUL names no file at all, and other control
    # characters garble logs and file listings.
    if not 1 <= len(value) <= INSTANCE_NAME_MAX_LENGTH:
        return (f"must be 1 to {INSTANCE_NAME_MAX_LENGTH} characters long (is {len(value)}; it is part of the client "
                f"id, which brokers hold to {CLIENT_ID_MAX_LENGTH})")
    if "/" in value or "\\" in value or ".." in value:
        return "must not contain '/', '\\' or '..' (it names a BROADCASTING consumer's offset file)"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return "must not contain control characters (NUL, newline, ...)"
    return None


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    namesrv_addrs: tuple[str, ...] = _field_from(_default_namesrv_addrs, check=_check_addrs,
                                                 doc="name servers, HOST:PORT each (default: those NAMESRV_ADDR "
                                                     "names, else 127.0.0.1:9876)")
    instance_name: str = bounded("DEFAULT", check=check_instance_name,
                                 doc="part of the client id and of a BROADCASTING consumer's offset file name")
    client_ip: str = _field_from(_default_client_ip, check=_check_ip,
                                 doc="reported in heartbeats (the client id) and message born hosts (default: this "
                                     "host's address, detect_client_ip)")
    # Every period and timeout at most an hour, as the servers' intervals: a value past any use (2**64 was taken)
    # only switched the thing off by accident.
    poll_name_server_interval_ms: int = bounded(30_000, min=10, max=HOUR_MS, doc="periodic route refresh")
    # Brokers forget a client whose last heartbeat is older than their channel_expired_timeout_ms (120 s by
    # default; pulls do not count): a longer interval dropped consumers from their group between heartbeats, and
    # the others took their queues each time.
    heartbeat_broker_interval_ms: int = bounded(10_000, min=10, max=60_000,
                                                doc="heartbeat to every broker node (at most half the brokers' "
                                                    "default 120 s channel expiry)")
    request_timeout_ms: int = bounded(3_000, min=1, max=HOUR_MS, doc="default timeout of one request")
    connect_timeout_ms: int = bounded(3_000, min=1, max=HOUR_MS)
    fault_isolation_ms: int = bounded(1_000, min=0, max=HOUR_MS, doc="how long a failed group is avoided")
    leader_silence_timeout_ms: int = bounded(
        1_000, min=0, max=HOUR_MS,
        doc="a leader connection with requests waiting that received nothing this long makes the client ask the name "
            "servers whether the group has another leader (0: never)")
    max_frame_size_bytes: int = bounded(16 * 1024 * 1024, min=1024, max=256 * 1024 * 1024)  # as the servers' max
    # ACL (RocketMQ's SessionCredentials): every request is signed with them (remoting/acl.py). Read from the
    # environment when not given, as the name servers are: a deployment sets them once for its tools.
    access_key: str = _field_from(functools.partial(os.environ.get, ACCESS_KEY_ENV, ""),
                                  doc=f"ACL account to sign requests as (default: ${ACCESS_KEY_ENV}; empty: none)")
    # Out of repr and of every error message: configs get logged.
    secret_key: str = dataclasses.field(
        default_factory=functools.partial(os.environ.get, SECRET_KEY_ENV, ""), repr=False,
        metadata=bounded(None, doc=f"the account's secret key (default: ${SECRET_KEY_ENV})").metadata)
    # RocketMQ's tls.enable and its client files (remoting/tls.py; docs/operations.md, "TLS").
    tls_enable: bool = _field_from(_tls_enable_from_env,
                                   doc=f"connect to name servers and brokers over TLS (default: ${TLS_ENABLE_ENV})")
    tls_ca_file: str = _field_from(_tls_ca_file_from_env,
                                   doc=f"PEM CA certificates servers are verified against (default: "
                                       f"${TLS_CA_FILE_ENV}, else the system's)")
    tls_verify: bool = bounded(True, doc="verify the servers' certificates and names; false: encrypted but not "
                                         "authenticated (logged as a WARNING)")
    tls_cert_file: str = bounded("", doc="PEM client certificate, for servers with tls_need_client_auth")
    tls_key_file: str = bounded("", doc="PEM private key of tls_cert_file")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.tls_enable:
            # The files read and checked now (the warning of tls_verify = false waits for open_remoting).
            client_context(ca_file=self.tls_ca_file or None, cert_file=self.tls_cert_file or None,
                           key_file=self.tls_key_file or None)
        else:
            given = [k for k in ("tls_ca_file", "tls_cert_file", "tls_key_file") if getattr(self, k)]
            if given or not self.tls_verify:
                # Without tls_enable they would be ignored, and the client would talk plain TCP unawares.
                raise ConfigError(f"{(given or ['tls_verify'])[0]} is set but tls_enable is not: set tls_enable "
                                  f"= true (or ${TLS_ENABLE_ENV}) to connect over TLS")
        for name in ("access_key", "secret_key"):
            problem = _credential_problem(getattr(self, name))
            if problem:
                raise ConfigError(f"{name} {problem}")
        if bool(self.access_key) != bool(self.secret_key):
            # One without the other signs nothing: every request of an ACL cluster would be refused, far from here.
            given, missing = ("access_key", "secret_key") if self.access_key else ("secret_key", "access_key")
            raise ConfigError(f"{given} is set but {missing} is not: ACL credentials need both (or neither; "
                              f"see ${ACCESS_KEY_ENV} and ${SECRET_KEY_ENV})")


def answer_data(frame: Frame) -> Any:
    """What an answer carries as one CBOR item: its body, or (a small answer may inline it) its ext. A body that
    is not CBOR raises cbor2.CBORError; the caller says whose answer it was."""
    return cbor2.loads(frame.body) if frame.body else frame.ext


# The field of a name server's answer that is empty while no broker has registered there (restarted a moment ago).
_REGISTERED_FIELDS = {RequestCode.GET_BROKER_CLUSTER_INFO: "broker_addr_table",
                      RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER: "topic_list"}


def _knows_nothing(code: int, frame: Frame) -> bool:
    """Whether a name server's answer to request ``code`` has nothing in it (see ``invoke_namesrv``)."""
    if frame.code == ResponseCode.TOPIC_NOT_EXIST:
        return True
    field = _REGISTERED_FIELDS.get(code)
    if field is None:
        return False
    try:
        return not answer_data(frame).get(field)
    except (cbor2.CBORError, AttributeError, TypeError, ValueError):
        return False  # malformed: the caller reads it and says so, naming the request


def build_config(cls: type, options: Mapping[str, Any]) -> Any:
    """``cls`` from keyword options, validated like a TOML file; ``namesrv`` may be "a:1;b:2" or a list."""
    data = dict(options)
    namesrv = data.pop("namesrv", None)
    if namesrv is not None:
        if isinstance(namesrv, str):
            namesrv = _split_addrs(namesrv)
        elif isinstance(namesrv, (bytes, bytearray)) or not isinstance(namesrv, Iterable):
            raise ConfigError(f'namesrv must be "HOST:PORT[;HOST:PORT...]" or a list of HOST:PORT, got {namesrv!r}')
        data["namesrv_addrs"] = list(namesrv)
    return config_from_mapping(cls, data)


class ServerRequests:
    """Answers what brokers send *to* the client: NOTIFY_CONSUMER_IDS_CHANGED (a member joined or left: the
    consumer rebalances at once instead of at its next period), RESET_CONSUMER_CLIENT_OFFSET (an operator
    reset the group's offsets: the consumer drops what it cached of those queues and pulls from the new offsets),
    CHECK_TRANSACTION_STATE (a transaction left unknown: the producer asks its listener, then answers with an
    END_TRANSACTION of its own; oneway, as RocketMQ's), PUSH_REPLY_MESSAGE_TO_CLIENT (the reply to a
    ``Producer.request``: it completes the request waiting for it) and GET_CONSUMER_RUNNING_INFO (an admin asks,
    through a broker, what a consumer is doing: ``client/running_info.py`` draws the answer).
    """

    def __init__(self) -> None:
        self.on_consumer_ids_changed: Callable[[str | None], None] | None = None
        # (consumer_group, topic, broker_name, {queue_id: offset})
        self.on_reset_offset: Callable[[str, str, str, dict[int, int]], None] | None = None
        # Must not wait: it runs in the connection's reader (the producer starts a task).
        self.on_check_transaction: Callable[[Frame], None] | None = None
        # Must not wait either; returns what is malformed in the push (answered INVALID_REQUEST), else None.
        self.on_reply_message: Callable[[Frame], str | None] | None = None
        # A consumer's running info (jstack: its task dump too), a CBOR-able map; must not wait either.
        self.on_consumer_running_info: Callable[[bool], Mapping[str, Any]] | None = None

    async def handle(self, request: Frame, conn: Any) -> Frame | None:
        if request.code == RequestCode.PUSH_REPLY_MESSAGE_TO_CLIENT:
            if self.on_reply_message is None:
                # Only a producer sends requests: the broker logs this answer as a failed push.
                return make_response(request, ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                                     remark="this client is no producer: it sent no request to reply to")
            problem = self.on_reply_message(request)
            if problem is not None:
                return make_response(request, ResponseCode.INVALID_REQUEST, remark=problem)
            return make_response(request, ResponseCode.SUCCESS)
        if request.code == RequestCode.CHECK_TRANSACTION_STATE:
            if self.on_check_transaction is None:
                log.warning("transaction check ignored: this client is no producer remote=%s",
                            getattr(conn, "remote_address", "?"))
            else:
                self.on_check_transaction(request)
            return None if request.is_oneway else make_response(request, ResponseCode.SUCCESS)
        if request.code == RequestCode.GET_CONSUMER_RUNNING_INFO:
            return self._running_info(request)
        if request.code == RequestCode.NOTIFY_CONSUMER_IDS_CHANGED:
            if self.on_consumer_ids_changed is not None:
                self.on_consumer_ids_changed(request.ext.get("consumer_group"))
            return None if request.is_oneway else make_response(request, ResponseCode.SUCCESS)
        if request.code == RequestCode.RESET_CONSUMER_CLIENT_OFFSET:
            ext = request.ext
            try:
                pairs = cbor2.loads(request.body)["offsets"]
                offsets = {int(q): int(o) for q, o in pairs}
                group, topic, broker_name = str(ext["consumer_group"]), str(ext["topic"]), str(ext["broker_name"])
                if min(offsets.values(), default=0) < 0:
                    raise ValueError("a negative offset")
            except (KeyError, TypeError, ValueError, cbor2.CBORDecodeError) as e:
                log.warning("malformed offset reset ignored remote=%s error=%s", getattr(conn, "remote_address", "?"),
                            e)
                return None if request.is_oneway else make_response(request, ResponseCode.INVALID_REQUEST,
                                                                    remark=f"malformed offset reset: {e}")
            if self.on_reset_offset is not None:
                self.on_reset_offset(group, topic, broker_name, offsets)
            return None if request.is_oneway else make_response(request, ResponseCode.SUCCESS)
        return make_response(request, ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                             remark=f"the client does not serve request code {request.code}")

    def _running_info(self, request: Frame) -> Frame:
        if self.on_consumer_running_info is None:
            # A producer or an admin client whose id a broker was asked about: no consumer to describe.
            return make_response(request, ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                                 remark="this client runs no consumer: it has no running info")
        jstack = request.ext.get("jstack") is True
        try:
            info = self.on_consumer_running_info(jstack)
            body = cbor2.dumps(info)
        except Exception:
            # A bug in drawing the answer must not take the connection's reader down with it.
            log.exception("running info not drawn")
            return make_response(request, ResponseCode.SYSTEM_ERROR,
                                 remark="the consumer failed to draw its running info; see its log")
        return make_response(request, ResponseCode.SUCCESS, body=body)


def open_remoting(config: ClientConfig, handler: ServerRequests | None = None) -> Any:
    """The connection pool for one client, sized by ``config``."""
    from remoting.transport import open_remoting_client  # the trio shell; imported where sockets are needed

    signer = RequestSigner(config.access_key, config.secret_key).sign if config.access_key else None
    tls: Any = client_tls_context(config)
    if tls is not None and config.tls_verify:
        # Its files as they are at each connection: a CA or client certificate rotated on disk is used without a
        # restart (remoting/tls.py). Not without verification, whose every build warns again (and has no CA to follow).
        tls = ContextReloader(functools.partial(client_tls_context, config))
    return open_remoting_client(handler=handler, max_frame_size=config.max_frame_size_bytes,
                                connect_timeout_s=config.connect_timeout_ms / 1000, signer=signer, tls_context=tls)


def client_tls_context(config: ClientConfig) -> ssl.SSLContext | None:
    """The TLS context of a client with ``tls_enable``; None without."""
    if not config.tls_enable:
        return None
    return client_context(ca_file=config.tls_ca_file or None, verify=config.tls_verify,
                          cert_file=config.tls_cert_file or None, key_file=config.tls_key_file or None)


def open_client_nursery() -> Any:
    """The nursery a producer, consumer or admin client runs its background tasks in, around the caller's
    ``async with`` body: remoting's, which unwraps a lone exception, so ``except SendFailedError`` around the
    block catches what a call in it raised (a plain nursery handed it out wrapped in an ExceptionGroup)."""
    from remoting.transport import background_nursery  # the trio shell, as open_remoting

    return background_nursery()


def raise_for_response(frame: Frame, *, ok: Iterable[int] = (ResponseCode.SUCCESS,), **context: Any) -> Frame:
    """Return ``frame`` if its code is in ``ok``, else raise the registered ``BrokerError`` for its code."""
    if frame.code in ok:
        return frame
    fields = dict(context)
    for key in ("leader_addr", "topic", "broker_name"):
        if key in frame.ext and frame.ext[key] is not None:
            fields[key] = frame.ext[key]
    raise for_code(frame.code, frame.remark, **fields)


class ClientInstance:
    def __init__(self, config: ClientConfig, remoting: Any, nursery: trio.Nursery) -> None:
        self.config = config
        self.remoting = remoting
        self.nursery = nursery
        self.client_id = (f"{config.client_ip}@{os.getpid()}#{PROCESS_START_ID}#{config.instance_name}"
                          f"#{next(_instance_counter)}")
        self.routes = RouteCache(config.namesrv_addrs, self._query_route)
        self.faults = FaultTracker(isolation_ms=config.fault_isolation_ms)
        self.closed = False
        # Filled by producers/consumers: what the heartbeat tells brokers about us.
        self.heartbeat_data: Callable[[], dict[str, Any]] = lambda: {}
        self._background: list[trio.CancelScope] = []
        self._refreshing: set[str] = set()
        self._probe = 0
        # addr -> the connection the last heartbeat there was answered on: a broker knows a client by the
        # connection its heartbeat came on, so a new connection (a restarted node) needs one again. Pruned by
        # send_heartbeat_to_all.
        self._heartbeat_conns: dict[str, Any] = {}

    @property
    def timeout_s(self) -> float:
        return self.config.request_timeout_ms / 1000

    # -- requests -------------------------------------------------------------------------------------------------
    async def invoke(self, addr: str, code: int, ext: Mapping[str, Any] | None = None, body: bytes = b"",
                     *, timeout_s: float | None = None) -> Frame:
        if self.closed:
            raise ClientClosedError("the client is closed")
        # A copy: the caller may change its map once this returns (an EncodedExt cannot change).
        request = make_request(code, ext=ext if type(ext) is EncodedExt else dict(ext or {}), body=body)
        return await self.remoting.invoke(addr, request, timeout_s=timeout_s or self.timeout_s)

    async def invoke_oneway(self, addr: str, code: int, ext: Mapping[str, Any] | None = None,
                            body: bytes = b"") -> None:
        if self.closed:
            raise ClientClosedError("the client is closed")
        await self.remoting.invoke_oneway(addr, make_request(code, ext=dict(ext or {}), body=body, oneway=True))

    async def invoke_namesrv(self, code: int, ext: Mapping[str, Any] | None = None, body: bytes = b"",
                             *, ok: Iterable[int] = (ResponseCode.SUCCESS,)) -> Frame:
        """Ask the name servers as routes are asked (``RouteCache.ask_namesrvs``, with its memory: the one that
        answered last first, those that failed lately last) and return the first answer in ``ok`` with something
        in it. An answer with nothing in it (TOPIC_NOT_EXIST, a cluster info naming no broker, an empty topic list:
        a name server restarted a moment ago, with no registration yet) or a retriable error sends on to the next,
        as a failure does. Not a merge: each name server's tables are one consistent view, and a route, like the
        cluster info, is taken from one. When none has anything, the last empty answer (TOPIC_NOT_EXIST raised as
        its error); when none answers, the last failure. An error that is not retriable is raised as it comes."""
        ok = tuple(ok)

        async def ask(addr: str) -> Frame:
            frame = await self.invoke(addr, code, ext, body)
            if frame.code == ResponseCode.TOPIC_NOT_EXIST:
                return frame  # knows nothing of the topic: judged by _knows_nothing
            return raise_for_response(frame, ok=ok)

        answers = await self.routes.ask_namesrvs(ask, functools.partial(_knows_nothing, code), f"request code {code}")
        if answers.answered_by is not None:
            return answers.answer
        if answers.empty:
            return raise_for_response(answers.empty[-1][1], ok=ok)
        raise next(reversed(answers.errors.values()))

    async def _query_route(self, addr: str, topic: str) -> Mapping[str, Any] | None:
        frame = await self.invoke(addr, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
        if frame.code == ResponseCode.TOPIC_NOT_EXIST:
            return None
        raise_for_response(frame, topic=topic)
        return decode_route_response(frame.ext, frame.body, topic)

    async def install_default_route(self, topic: str, queue_nums: int) -> None:
        """Route an unknown topic to every registered broker group, so a send can auto-create it there."""
        frame = await self.invoke_namesrv(RequestCode.GET_BROKER_CLUSTER_INFO)
        try:
            brokers = parse_broker_addr_table(answer_data(frame))
        except (cbor2.CBORError, TypeError, ValueError, AttributeError, OverflowError) as e:
            # Raised as itself, it ended an auto-batch's task, which expects RaftMQError, and the producer.
            raise NoRouteError(f"topic {topic!r} is unknown and the name server's cluster info, to send it to "
                               f"every group for auto-create, is malformed: {type(e).__name__}: {e}",
                               topic=topic) from None
        self.routes.install_default(topic, brokers, queue_nums)
        log.info("topic not routed yet, sending to every group to auto-create it topic=%s groups=%d", topic,
                 len(brokers))

    def master_addr(self, broker_name: str) -> str:
        addr = self.routes.master_addr(broker_name)
        if not addr:
            raise UnknownBrokerError(f"broker group {broker_name!r} has no known leader in the cached routes",
                                     broker_name=broker_name)
        return addr

    # -- reacting to errors ---------------------------------------------------------------------------------------
    def on_error(self, error: BaseException, topic: str | None, broker_name: str, addr: str) -> None:
        """Learn from a failed request: leader hints and an immediate background route refresh."""
        hint = getattr(error, "leader_addr", None)
        if hint and hint != addr:
            self.routes.set_leader_hint(broker_name, hint)
        elif isinstance(error, (ConnectError, ConnectionClosedError)) and addr == self.routes.master_addr(
                broker_name):
            # The leader is gone. The name server learns the new one only when it registers, but any surviving
            # node answers NOT_LEADER with the new leader's address as soon as it knows it: ask the next node.
            others = [a for a in self.routes.replica_addrs(broker_name) if a != addr]
            self.routes.set_leader_hint(broker_name, others[self._probe % len(others)] if others else None)
            self._probe += 1
        else:
            self.routes.drop_leader_hint(broker_name, addr)
        if getattr(error, "refresh_route", False) and topic:
            self.refresh_soon(topic)

    def refresh_soon(self, topic: str) -> None:
        if topic in self._refreshing or self.closed:
            return
        self._refreshing.add(topic)

        async def _refresh() -> None:
            try:
                await self.routes.refresh(topic)
            except RaftMQError as e:
                log.info("route refresh failed topic=%s error=%s", topic, e)
            finally:
                self._refreshing.discard(topic)

        self.nursery.start_soon(_refresh)

    # -- background -----------------------------------------------------------------------------------------------
    def start_background(self) -> None:
        self.nursery.start_soon(self._serve_route_refresh)
        self.nursery.start_soon(self._serve_heartbeat)
        if self.config.leader_silence_timeout_ms > 0:
            self.nursery.start_soon(self._serve_leader_watch)

    async def _serve_leader_watch(self) -> None:
        silence_s = self.config.leader_silence_timeout_ms / 1000
        interval_s = min(max(silence_s / 4, 0.01), 0.25)
        ask_for_s = max(silence_s, 0.1)  # how long the name servers and the other nodes get to answer
        with trio.CancelScope() as scope:
            self._background.append(scope)
            while True:
                await trio.sleep(interval_s)
                now = trio.current_time()
                connections = self.remoting.connections()
                suspects = []
                for broker_name in self.routes.broker_names():
                    addr = self.routes.master_addr(broker_name)
                    conn = connections.get(addr) if addr else None
                    if conn is None:
                        continue
                    sent_at = conn.oldest_request_sent_at(_LONG_POLL_CODES)
                    if sent_at is None:
                        continue
                    quiet_since = max(sent_at, conn.last_received_at)  # requests waiting, nothing received
                    if now - quiet_since >= silence_s:
                        suspects.append((broker_name, addr, now - quiet_since))
                for broker_name, addr, silent_s in suspects:
                    await self._check_silent_leader(broker_name, addr, silent_s, ask_for_s)

    async def _check_silent_leader(self, broker_name: str, addr: str, silent_s: float, bound_s: float) -> None:
        """Close the connection to ``addr`` if the name servers now route another node as ``broker_name``'s
        master, or the group's other nodes name another leader, whichever says so first (both are asked at
        once, for ``bound_s`` at most): a deposed leader that answers nothing holds its requests until they time
        out."""
        topic = self.routes.topic_on(broker_name)
        if topic is None:
            return
        found: list[tuple[str, str]] = []  # (new master, who named it)
        async with trio.open_nursery() as nursery:
            nursery.cancel_scope.deadline = trio.current_time() + bound_s

            async def ask_name_servers() -> None:
                try:
                    await self.routes.refresh(topic)
                except RaftMQError as e:
                    log.info("route refresh for a silent leader failed broker_name=%s addr=%s error=%s",
                             broker_name, addr, e)
                    return
                master = self.routes.routed_master_addr(broker_name)
                if master is not None and master != addr:  # else not replaced (yet), or merely slow
                    found.append((master, f"the name servers now route {master}"))
                    nursery.cancel_scope.cancel()

            async def ask_replicas() -> None:
                master, term = await self._leader_named_by_replicas(broker_name, addr, bound_s)
                if master is not None:
                    found.append((master, f"the group's other nodes name {master} (term {term})"))
                    nursery.cancel_scope.cancel()

            nursery.start_soon(ask_name_servers)
            nursery.start_soon(ask_replicas)
        if not found:
            return
        master, source = found[0]
        if self.routes.routed_master_addr(broker_name) == master:
            self.routes.drop_leader_hint(broker_name, addr)
        else:
            self.routes.set_leader_hint(broker_name, master)
        reason = f"{addr} answered nothing for {silent_s:.1f}s and {source} as the leader of {broker_name}"
        log.warning("closing the connection to a silent leader broker_name=%s addr=%s new_leader=%s silent_s=%.1f",
                    broker_name, addr, master, silent_s)
        self.remoting.close_connection(addr, reason)

    async def _leader_named_by_replicas(self, broker_name: str, silent: str,
                                        timeout_s: float) -> tuple[str | None, int]:
        """The leader that ``broker_name``'s nodes other than ``silent`` name at the highest term they report
        (GET_BROKER_RUNTIME_INFO, all asked at once), if that is not ``silent``; else ``(None, term)``."""
        answers: list[tuple[int, str]] = []

        async def ask(addr: str) -> None:
            try:
                frame = await self.invoke(addr, RequestCode.GET_BROKER_RUNTIME_INFO, timeout_s=timeout_s)
                status = cbor2.loads(frame.body) if frame.code == ResponseCode.SUCCESS and frame.body else {}
            except (RaftMQError, ValueError, cbor2.CBORError) as e:  # cbor2 6 raises no ValueError on garbage
                log.debug("status of a replica not read addr=%s error=%s", addr, e)
                return
            if not isinstance(status, dict):
                log.debug("status of a replica not read addr=%s error=a %s, not a map", addr, type(status).__name__)
                return
            term, leader = status.get("term"), status.get("leader_addr")
            if type(term) is int and isinstance(leader, str) and leader:
                answers.append((term, leader))

        async with trio.open_nursery() as nursery:
            for replica in self.routes.replica_addrs(broker_name):
                if replica != silent:
                    nursery.start_soon(ask, replica)
        if not answers:
            return None, -1
        term, leader = max(answers)
        return (leader if leader != silent else None), term

    async def _serve_route_refresh(self) -> None:
        with trio.CancelScope() as scope:
            self._background.append(scope)
            while True:
                await trio.sleep(self.config.poll_name_server_interval_ms / 1000)
                for topic in self.routes.topics:
                    try:
                        await self.routes.refresh(topic)
                    except RaftMQError as e:
                        log.info("periodic route refresh failed topic=%s error=%s", topic, e)

    async def _serve_heartbeat(self) -> None:
        with trio.CancelScope() as scope:
            self._background.append(scope)
            while True:
                await self.send_heartbeat_to_all()
                await trio.sleep(self.config.heartbeat_broker_interval_ms / 1000)

    async def send_heartbeat_to_all(self) -> None:
        addrs = {addr for addrs in self.routes.all_broker_addrs().values() for addr in addrs}
        # Pruned each round: an entry whose connection is not the pool's any more (closed, replaced) or whose node
        # no route names says nothing heartbeat_needed can use, and kept, every node that ever answered held its
        # last connection for the client's life.
        conns = self.remoting.connections()
        self._heartbeat_conns = {addr: conn for addr, conn in self._heartbeat_conns.items()
                                 if addr in addrs and conns.get(addr) is conn}
        await self.send_heartbeat(addrs)

    async def send_heartbeat(self, addrs: Iterable[str]) -> None:
        """HEART_BEAT to each of ``addrs`` at once; a failure is only logged (the next round tries again)."""
        data = self.heartbeat_data()
        if not data:
            return
        body = cbor2.dumps({"client_id": self.client_id, **data})

        async def _one(addr: str) -> None:
            try:
                frame = await self.invoke(addr, RequestCode.HEART_BEAT, None, body)
                raise_for_response(frame)
            except RaftMQError as e:
                log.debug("heartbeat failed addr=%s error=%s", addr, e)
                return
            conn = self.remoting.connections().get(addr)
            if conn is not None:
                self._heartbeat_conns[addr] = conn

        async with trio.open_nursery() as nursery:
            for addr in addrs:
                nursery.start_soon(_one, addr)

    def heartbeat_needed(self, addrs: Iterable[str]) -> list[str]:
        """Those of ``addrs`` whose open connection has carried no answered heartbeat (none open yet, or opened
        again since): a broker does not know this client there, so it cannot push anything to it."""
        conns = self.remoting.connections()
        return [addr for addr in addrs
                if (conn := conns.get(addr)) is None or self._heartbeat_conns.get(addr) is not conn]

    async def unregister(self, producer_group: str | None, consumer_group: str | None) -> None:
        ext = {"client_id": self.client_id, "producer_group": producer_group, "consumer_group": consumer_group}

        async def _one(addr: str) -> None:
            try:
                await self.invoke(addr, RequestCode.UNREGISTER_CLIENT, ext, timeout_s=1.0)
            except RaftMQError as e:
                log.debug("unregister failed addr=%s error=%s", addr, e)

        async with trio.open_nursery() as nursery:
            for addrs in self.routes.all_broker_addrs().values():
                for addr in addrs:
                    nursery.start_soon(_one, addr)

    def stop_background(self) -> None:
        for scope in self._background:
            scope.cancel()


def now_ms() -> int:
    return int(time.time() * 1000)
