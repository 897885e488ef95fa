"""Decoding and validating the fields of name-server requests (the layouts are in docs/protocol.md).

Pure functions over a request's ``ext`` map and ``body`` bytes; each failure raises ``InvalidRequestError``
naming the field, which the processor answers with INVALID_REQUEST. A name server must never let a malformed
registration into its table: a bad route would send every client of the cluster astray.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import cbor2

from namesrv.route_info import ROLES, Registration, TopicConfig
from remoting.codec import BodyFormatError, decode_body
from remoting.config import ConfigError, name_problem, parse_host_port
from remoting.message import I64, MessageFormatError, check_topic, ip_bytes

__all__ = ["InvalidRequestError", "TopicConfigCache", "parse_register_broker", "parse_unregister_broker", "parse_topic",
           "decode_topic_configs", "encode_topic_configs"]

_PERM_MAX = 0xF  # PRIORITY | READ | WRITE | INHERIT
_MAX_QUEUE_NUMS = 1 << 16
_SYS_FLAG_MAX = 2**31 - 1
# broker_id, term and data_version are RocketMQ's longs (I64). CBOR carries up to 2**64 - 1, which a route table
# would keep and hand to every client (and a term that high would outrank every real leader of its group for good).
HEARTBEAT_TIMEOUT_MAX_MS = 86_400_000  # a day, the most broker_expired_ms takes
_CONFIG_KEYS = frozenset({"read_queue_nums", "write_queue_nums", "perm", "topic_sys_flag", "order"})


class InvalidRequestError(ValueError):
    """A request field is missing or wrong; ``field`` names it and the message reads as a sentence."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _require(ext: Mapping[str, Any], name: str) -> Any:
    if name not in ext or ext[name] is None:
        raise InvalidRequestError(name, f"request field {name!r} is missing")
    return ext[name]


def _int_field(value: Any, name: str, *, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"request field {name!r} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"within {lo}..{hi}"
        raise InvalidRequestError(name, f"request field {name!r} must be {bounds}, got {value!r}")
    return value


def _name_field(value: Any, name: str) -> str:
    """A cluster or broker name, by the rule every broker's config is held to (``name_problem``): the table
    must not hold a name no broker can be configured with (it took '.', which brokers refuse)."""
    if not isinstance(value, str):
        raise InvalidRequestError(name, f"request field {name!r} must be a string, got {value!r}")
    problem = name_problem(value)
    if problem:
        raise InvalidRequestError(name, f"request field {name!r} {problem}, got {value!r}")
    return value


def _topic_field(value: Any, name: str) -> str:
    """A topic name, by the rule of every client and broker (``check_topic``): the table must route exactly the
    names they can send to and create."""
    if not isinstance(value, str):
        raise InvalidRequestError(name, f"request field {name!r} must be a string, got {value!r}")
    try:
        check_topic(value)
    except MessageFormatError as e:
        raise InvalidRequestError(name, f"request field {name!r}: {e}") from None
    return value


def _legal_topic(topic: str) -> bool:
    try:
        check_topic(topic)
    except MessageFormatError:
        return False
    return True


def _addr_field(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(name, f"request field {name!r} must be a 'host:port' string, got {value!r}")
    try:
        host, port = parse_host_port(value, key=name, dial=True)
    except ConfigError as e:
        raise InvalidRequestError(name, f"request field {e}") from None
    # What a broker advertises is its service_address, which its config holds to an IPv4 address (the store
    # host of every message id) and a plain port; routes must not hand clients '[::1]:5', 'a b:5' or 'h:+5'.
    try:
        ip_bytes(host, name)
    except MessageFormatError:
        canonical = False
    else:
        canonical = value == f"{host}:{port}"
    if not canonical:
        raise InvalidRequestError(name, f"request field {name!r} must be an IPv4 address and a port, as a broker's "
                                        f"service_address, got {value!r}")
    return value


def parse_topic(ext: Mapping[str, Any]) -> str:
    return _topic_field(_require(ext, "topic"), "topic")


def decode_topic_configs(body: bytes) -> dict[str, TopicConfig]:
    """The REGISTER_BROKER body: a CBOR map ``{topic: {read_queue_nums, write_queue_nums, perm,
    topic_sys_flag?, order?}}``; an empty body means no topics."""
    if not body:
        return {}
    try:
        data = decode_body(body)
    except BodyFormatError as e:
        raise InvalidRequestError("body", f"request body is not plain CBOR data: {e}") from None
    if not isinstance(data, Mapping):
        raise InvalidRequestError("body",
                                  f"request body must be a CBOR map of topic configs, got {type(data).__name__}")
    # Brokers re-send their whole topic set every registration, so this loop runs once per topic per node per
    # interval: a fast path checks the common, well-formed entry with plain type tests and shares one
    # TopicConfig between topics with equal settings (most are); anything odd goes to the slow path, which
    # finds and names the bad field.
    configs: dict[str, TopicConfig] = {}
    shared: dict[tuple, TopicConfig] = {}
    topic_ok = _legal_topic
    for topic, raw in data.items():
        if type(raw) is dict and type(topic) is str and raw.keys() <= _CONFIG_KEYS and topic_ok(topic):
            get = raw.get
            key = (get("read_queue_nums"), get("write_queue_nums"), get("perm"), get("topic_sys_flag", 0),
                   get("order", False))
            try:
                config = shared.get(key)
            except TypeError:  # a list or map where a number belongs (unhashable): the slow path names it
                configs[topic] = _decode_topic_config(topic, raw)
                continue
            if config is not None:
                configs[topic] = config
                continue
            r, w, perm, sys_flag, order = key
            if (type(r) is int and type(w) is int and type(perm) is int and type(sys_flag) is int
                    and type(order) is bool and 0 <= r <= _MAX_QUEUE_NUMS and 0 <= w <= _MAX_QUEUE_NUMS
                    and 0 <= perm <= _PERM_MAX and 0 <= sys_flag <= _SYS_FLAG_MAX):
                configs[topic] = shared[key] = TopicConfig(r, w, perm, sys_flag, order)
                continue
        configs[topic] = _decode_topic_config(topic, raw)
    return configs


def _cut(text: str) -> str:
    """``text``, cut to 80 characters: a value echoed in a refusal as large as the request made the answer bigger
    than a frame may be (SYSTEM_ERROR, or a client closing on it)."""
    return text if len(text) <= 80 else f"{text[:80]}...({len(text) - 80} more characters)"


def _decode_topic_config(topic: Any, raw: Any) -> TopicConfig:
    _topic_field(topic, "body topic")
    where = f"body[{topic!r}]"  # a legal topic name: short
    if not isinstance(raw, Mapping):
        raise InvalidRequestError(where, f"{where} must be a map of topic config fields, got {_cut(repr(raw))}")
    # Other keys are ignored, as a frame header's are: a field a newer broker adds must not cost it its whole
    # registration (every route of its group) at a name server not upgraded yet.
    for key in ("read_queue_nums", "write_queue_nums", "perm"):
        if key not in raw:
            raise InvalidRequestError(f"{where}.{key}", f"{where}.{key} is missing")
    order = raw.get("order", False)
    if not isinstance(order, bool):
        raise InvalidRequestError(f"{where}.order", f"{where}.order must be true or false, got {order!r}")
    return TopicConfig(
        read_queue_nums=_int_field(raw["read_queue_nums"], f"{where}.read_queue_nums", lo=0, hi=_MAX_QUEUE_NUMS),
        write_queue_nums=_int_field(raw["write_queue_nums"], f"{where}.write_queue_nums", lo=0, hi=_MAX_QUEUE_NUMS),
        perm=_int_field(raw["perm"], f"{where}.perm", lo=0, hi=_PERM_MAX),
        topic_sys_flag=_int_field(raw.get("topic_sys_flag", 0), f"{where}.topic_sys_flag", lo=0, hi=_SYS_FLAG_MAX),
        order=order)


def encode_topic_configs(configs: Mapping[str, TopicConfig]) -> bytes:
    """The inverse of ``decode_topic_configs`` (tests and tools build registrations with it)."""
    return cbor2.dumps({t: {"read_queue_nums": c.read_queue_nums, "write_queue_nums": c.write_queue_nums,
                            "perm": c.perm, "topic_sys_flag": c.topic_sys_flag, "order": c.order}
                        for t, c in configs.items()})


class TopicConfigCache:
    """The last decoded body per registered node: a heartbeat that re-sends the same topic set (the usual case)
    costs a byte comparison instead of a CBOR decode, and hands the route table the same dict, which it then
    compares by identity.

    An entry is stored only once the table accepted its registration (``store``), and dropped when the node leaves
    the table (``forget``, on every eviction): before, a refused registration was cached too, and so was every
    node evicted by its connection closing or by expiry, so one client registering and dropping big topic sets
    grew a name server with an empty table past 2 GB. The dict is the node's own in the table, so what the cache
    adds is the body bytes, held to ``max_bytes`` in all: past it the entries stored longest ago go first, and
    their nodes' next heartbeat is decoded again."""

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._last: dict[tuple[str, int], tuple[bytes, dict[str, TopicConfig]]] = {}
        self._bytes = 0

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._last)

    def lookup(self, node: tuple[str, int], body: bytes) -> dict[str, TopicConfig] | None:
        """The topic set ``node`` last registered, if ``body`` is byte for byte what it sent then."""
        hit = self._last.get(node)
        return hit[1] if hit is not None and hit[0] == body else None

    def store(self, node: tuple[str, int], body: bytes, configs: dict[str, TopicConfig]) -> None:
        """Remember ``configs`` as ``node``'s decoded ``body``: call it once the registration was accepted."""
        self.forget(node)
        if len(body) > self.max_bytes:
            return
        while self._bytes + len(body) > self.max_bytes:
            oldest = next(iter(self._last))
            self.forget(oldest)
        self._last[node] = (bytes(body), configs)
        self._bytes += len(body)

    def forget(self, node: tuple[str, int]) -> None:
        hit = self._last.pop(node, None)
        if hit is not None:
            self._bytes -= len(hit[0])


def parse_register_broker(ext: Mapping[str, Any], body: bytes, cache: TopicConfigCache | None = None
                          ) -> Registration:
    """The registration ``ext`` and ``body`` carry; ``cache`` is only read (the processor stores the decoded body
    once the table accepted it)."""
    role = _require(ext, "role")
    if role not in ROLES:
        raise InvalidRequestError("role", f"request field 'role' must be one of {', '.join(ROLES)}, got {role!r}")
    cluster_name = _name_field(_require(ext, "cluster_name"), "cluster_name")
    broker_name = _name_field(_require(ext, "broker_name"), "broker_name")
    broker_id = _int_field(_require(ext, "broker_id"), "broker_id", lo=1, hi=I64[1])
    broker_addr = _addr_field(_require(ext, "broker_addr"), "broker_addr")
    term = _int_field(_require(ext, "term"), "term", lo=0, hi=I64[1])
    data_version = _int_field(_require(ext, "data_version"), "data_version", lo=0, hi=I64[1])
    # Optional (RocketMQ 5's heartbeatTimeoutMillis): brokers before 2026-11-25 do not send it, and get the name
    # server's broker_expired_ms. Bounded as that setting is.
    timeout = ext.get("heartbeat_timeout_ms")
    heartbeat_timeout_ms = (_int_field(timeout, "heartbeat_timeout_ms", lo=1, hi=HEARTBEAT_TIMEOUT_MAX_MS)
                            if timeout is not None else None)
    # Optional: brokers before 2026-11-29 do not send it, and their registrations are taken in arrival order.
    sequence = ext.get("registration_sequence")
    registration_sequence = (_int_field(sequence, "registration_sequence", lo=0, hi=I64[1])
                             if sequence is not None else None)
    configs = cache.lookup((broker_name, broker_id), body) if cache is not None else None
    if configs is None:
        configs = decode_topic_configs(body)
    return Registration(cluster_name, broker_name, broker_id, broker_addr, role, term, data_version, configs,
                        heartbeat_timeout_ms, registration_sequence)


def parse_unregister_broker(ext: Mapping[str, Any]) -> tuple[str, str, int, str | None]:
    """``(cluster_name, broker_name, broker_id, broker_addr or None)``."""
    addr = ext.get("broker_addr")
    return (_name_field(_require(ext, "cluster_name"), "cluster_name"),
            _name_field(_require(ext, "broker_name"), "broker_name"),
            _int_field(_require(ext, "broker_id"), "broker_id", lo=1, hi=I64[1]),
            _addr_field(addr, "broker_addr") if addr is not None else None)
