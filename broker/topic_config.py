"""Topic configs: RocketMQ's TopicConfig and TopicConfigManager, as replicated state.

A topic config changes only through the group's Raft log (create/update/delete are proposed as metadata commands
and applied on every node), so every node of a group holds the same table and a new leader already knows every
topic. This module is the pure part: the dataclass, the name rules, the table with its ``data_version`` and the
apply functions; ``broker/node.py`` wires it to replication and re-registers with the name servers after a change.

Name rules are RocketMQ's (``TopicValidator``): ``[%|a-zA-Z0-9_-]``, at most 127 characters, and a few reserved
system names that a producer may not send to; besides, RocketMQ 5's POP retry topics ``%RETRY%<group>+<topic>``
(``remoting.message.split_pop_retry_topic``), which the broker alone writes. Auto-created topics get RocketMQ's
defaults: 4 read and 4 write queues, permission read|write (6).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import cbor2

from remoting.message import MAX_TOPIC_LENGTH, TOPIC_RE, group_problem, split_pop_retry_topic

log = logging.getLogger(__name__)

PERM_PRIORITY = 0x8
PERM_READ = 0x4
PERM_WRITE = 0x2
PERM_INHERIT = 0x1
PERM_READ_WRITE = PERM_READ | PERM_WRITE

TOPIC_MAX_LENGTH = MAX_TOPIC_LENGTH
MAX_QUEUE_NUMS = 1024
SYS_FLAG_MAX = 2 ** 31 - 1  # RocketMQ's topicSysFlag is a Java int; the name servers take 0..this
DEFAULT_TOPIC_QUEUE_NUMS = 4
# The template topic clients send to when they want a topic auto-created (RocketMQ's AUTO_CREATE_TOPIC_KEY).
AUTO_CREATE_TOPIC_KEY = "TBW102"
# The default trace topic (RocketMQ's RMQ_SYS_TRACE_TOPIC): the system's, created by the brokers
# (trace_topic_enable) or on a traced producer's first send, never through the admin API.
TRACE_TOPIC = "RMQ_SYS_TRACE_TOPIC"
# The names kept for the system (RocketMQ's TopicValidator.SYSTEM_TOPIC_SET): nobody creates or updates them.
SYSTEM_TOPICS = frozenset({
    AUTO_CREATE_TOPIC_KEY, "SCHEDULE_TOPIC_XXXX", "BenchmarkTest", "RMQ_SYS_TRANS_HALF_TOPIC", TRACE_TOPIC,
    "RMQ_SYS_TRANS_OP_HALF_TOPIC", "TRANS_CHECK_MAX_TIME_TOPIC", "SELF_TEST_TOPIC", "OFFSET_MOVED_EVENT",
})
# Topics a producer may not send to directly (they exist for the broker's own use): every system name but the
# trace topic, which traced clients send their traces to (RocketMQ's NOT_ALLOWED_SEND_TOPIC_SET leaves it out too).
NOT_ALLOWED_SEND_TOPICS = SYSTEM_TOPICS - {TRACE_TOPIC}
SYSTEM_TOPIC_PREFIX = "rmq_sys_"
_FILTER_TYPES = ("SINGLE_TAG", "MULTI_TAG")


class TopicConfigError(ValueError):
    """A topic name or config field is invalid; the message names the field and the value."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


def validate_topic_name(topic: Any) -> str:
    """Return ``topic`` if it is a legal topic name, else raise ``TopicConfigError`` naming the problem."""
    if not isinstance(topic, str) or not topic:
        raise TopicConfigError(f"topic must be a non-empty string, got {topic!r}", field="topic")
    if len(topic) > TOPIC_MAX_LENGTH:
        raise TopicConfigError(
            f"topic {topic[:40]!r}... is {len(topic)} characters long; at most {TOPIC_MAX_LENGTH} are allowed",
            field="topic")
    if not TOPIC_RE.fullmatch(topic) and split_pop_retry_topic(topic) is None:
        raise TopicConfigError(
            f"topic {topic!r} contains illegal characters; allowed are letters, digits, '%', '|', '_' and '-' "
            f"(and one '+' in a POP retry topic's name, %RETRY%<group>+<topic>)", field="topic")
    return topic


def validate_group_name(group: str, field: str = "consumer_group") -> str:
    """RocketMQ's group-name rule (the topic charset, at most 255 characters)."""
    problem = group_problem(group)
    if problem:
        raise TopicConfigError(f"{field} {group[:40]!r} {problem}", field=field)
    return group


def is_system_topic(topic: str) -> bool:
    """RocketMQ 5's ``TopicValidator.isSystemTopic`` for the ``rmq_sys_`` prefix: the broker's own topics
    (``rmq_sys_TOPIC_DELETE_LOG`` records topic deletions); nobody creates or sends to them."""
    return topic.startswith(SYSTEM_TOPIC_PREFIX)


def check_sendable_topic(topic: str) -> None:
    if topic in NOT_ALLOWED_SEND_TOPICS or is_system_topic(topic):
        raise TopicConfigError(f"topic {topic!r} is reserved for the broker; producers may not send to it",
                               field="topic")
    pop_retry = split_pop_retry_topic(topic)
    if pop_retry is not None:
        # Only the broker's revive writes it: a message sent there would reach the group's POPs as a redelivery.
        raise TopicConfigError(f"topic {topic!r} is reserved for the broker (the POP retry topic of consumer group "
                               f"{pop_retry[0]!r} for topic {pop_retry[1]!r}); producers may not send to it",
                               field="topic")


def is_reserved_topic(topic: str) -> bool:
    """Whether ``topic`` is a system name nobody creates or updates through the admin API (RocketMQ's
    ``isSystemTopic``): the sendable trace topic included."""
    return topic in SYSTEM_TOPICS or is_system_topic(topic)


@dataclasses.dataclass(frozen=True)
class TopicConfig:
    topic_name: str
    read_queue_nums: int = DEFAULT_TOPIC_QUEUE_NUMS
    write_queue_nums: int = DEFAULT_TOPIC_QUEUE_NUMS
    perm: int = PERM_READ_WRITE
    topic_filter_type: str = "SINGLE_TAG"
    topic_sys_flag: int = 0
    order: bool = False

    @property
    def readable(self) -> bool:
        return bool(self.perm & PERM_READ)

    @property
    def writable(self) -> bool:
        return bool(self.perm & PERM_WRITE)

    def to_wire(self) -> dict[str, Any]:
        # dataclasses.asdict's deep copy, for fields that are all plain values, was 20 us a config: the table's
        # wire forms, rebuilt for every registration, took 0.8 s at 40k topics.
        return {name: getattr(self, name) for name in _WIRE_FIELDS}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], *, stored: bool = False) -> TopicConfig:
        """Build and validate a config from a request's ext or a replicated command (snake_case keys).

        ``stored``: the config is already in the replicated topic table, so its name is taken if it is a
        non-empty string and its ``topic_sys_flag`` if it is an integer. Older versions let a name with a trailing
        newline (``re.match`` with "$") and any ``topic_sys_flag`` through, and every node must still load a
        table holding one: such a topic is kept out of registrations (``registration_problem``) and can be
        updated or deleted."""
        if not isinstance(data, Mapping):
            raise TopicConfigError(f"topic config must be a map, got {type(data).__name__}", field="topic_config")
        topic = data.get("topic_name", data.get("topic"))
        if not (stored and isinstance(topic, str) and topic):
            validate_topic_name(topic)
        kwargs: dict[str, Any] = {"topic_name": topic}
        for name in ("read_queue_nums", "write_queue_nums", "perm", "topic_sys_flag"):
            if name in data and data[name] is not None:
                value = data[name]
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TopicConfigError(f"{name} must be an integer, got {value!r}", field=name)
                kwargs[name] = value
        for name in ("read_queue_nums", "write_queue_nums"):
            value = kwargs.get(name, DEFAULT_TOPIC_QUEUE_NUMS)
            if not 1 <= value <= MAX_QUEUE_NUMS:
                raise TopicConfigError(f"{name} must be within 1..{MAX_QUEUE_NUMS}, got {value}", field=name)
        read, write = (kwargs.get(n, DEFAULT_TOPIC_QUEUE_NUMS) for n in ("read_queue_nums", "write_queue_nums"))
        if write > read and not stored:
            # Consumers read queues below read_queue_nums only: what is sent to the others is never consumed.
            # (Shrinking goes write first, then read; growing read first, then write: never more write queues.)
            raise TopicConfigError(f"write_queue_nums {write} must not exceed read_queue_nums {read}: messages "
                                   f"sent to queues {read}..{write - 1} would never be consumed",
                                   field="write_queue_nums")
        perm = kwargs.get("perm", PERM_READ_WRITE)
        if not 0 <= perm <= 0xF:
            raise TopicConfigError(f"perm must be a combination of 8|4|2|1 (0..15), got {perm}", field="perm")
        sys_flag = kwargs.get("topic_sys_flag", 0)
        if not (stored or 0 <= sys_flag <= SYS_FLAG_MAX):
            raise TopicConfigError(f"topic_sys_flag must be within 0..{SYS_FLAG_MAX}, got {sys_flag}",
                                   field="topic_sys_flag")
        if "topic_filter_type" in data and data["topic_filter_type"] is not None:
            if data["topic_filter_type"] not in _FILTER_TYPES:
                raise TopicConfigError(f"topic_filter_type must be one of {', '.join(_FILTER_TYPES)}, got "
                                       f"{data['topic_filter_type']!r}", field="topic_filter_type")
            kwargs["topic_filter_type"] = data["topic_filter_type"]
        if "order" in data and data["order"] is not None:
            if not isinstance(data["order"], bool):
                raise TopicConfigError(f"order must be true or false, got {data['order']!r}", field="order")
            kwargs["order"] = data["order"]
        return cls(**kwargs)


_WIRE_FIELDS = tuple(field.name for field in dataclasses.fields(TopicConfig))
# What a registration says of a topic (``RegistrationSnapshot.body``, broker/registration.py): the CBOR map of
# these fields under its name. Its bytes with every integer at 0, which CBOR encodes in one byte as any below 24.
REGISTRATION_FIELDS = ("read_queue_nums", "write_queue_nums", "perm", "topic_sys_flag", "order")
_REGISTRATION_ENTRY_BYTES = len(cbor2.dumps({**dict.fromkeys(REGISTRATION_FIELDS, 0), "order": False}))


def cbor_head_size(n: int) -> int:
    """The bytes of a CBOR item's head whose argument is ``n`` (an integer, or a string's or map's length):
    RFC 8949 3.1, as cbor2 encodes it; a negative integer's argument is -1 - n."""
    if n < 0:
        n = -1 - n
    return 1 if n < 24 else 2 if n < 1 << 8 else 3 if n < 1 << 16 else 5 if n < 1 << 32 else 9


def registration_entry_size(config: TopicConfig) -> int:
    """The bytes ``RegistrationSnapshot.body`` spends on ``config``: its name and its map, counted without encoding
    them. The node's ``broker_permission`` ANDed into perm changes nothing (perm stays below 24, one byte)."""
    name = len(config.topic_name.encode("utf-8", "surrogatepass"))
    return (cbor_head_size(name) + name + _REGISTRATION_ENTRY_BYTES - 4 + cbor_head_size(config.read_queue_nums)
            + cbor_head_size(config.write_queue_nums) + cbor_head_size(config.perm)
            + cbor_head_size(config.topic_sys_flag))


def registration_problem(config: TopicConfig) -> str | None:
    """Why the name servers would refuse a registration naming ``config`` (they refuse all of it, which takes
    the group out of every route once its last good registration expires), or None. Only a topic stored by an
    older version can have one: ``from_wire`` refuses both on new input."""
    try:
        validate_topic_name(config.topic_name)
    except TopicConfigError:
        return "an illegal name"
    if not 0 <= config.topic_sys_flag <= SYS_FLAG_MAX:
        return f"topic_sys_flag {config.topic_sys_flag} outside 0..{SYS_FLAG_MAX}"
    return None


class TopicConfigTable:
    """The topics of one broker group. Mutated only by the ``apply_*`` methods and ``restore``, which run in
    Raft-log order on every node; ``data_version`` counts changes so the name server can tell a stale registration.

    What is derived per topic (may producers send to it, its wire form, would a name server refuse it, its bytes
    in a registration) is kept beside each config and judged only when that config comes in: a broker group holds
    up to ``max_topic_count`` (50,000) topics, and judging them all again for every change or registration took a
    second at 40,000 topics, on the trio thread."""

    def __init__(self, configs: Iterable[TopicConfig] = ()) -> None:
        self._configs: dict[str, TopicConfig] = {}
        # The topics a producer may send to, judged as each config comes in, so the send path can trust a hit
        # without checking the name per message. A name refused on new input can still be stored: an older version
        # took reserved names (TBW102, SCHEDULE_TOPIC_XXXX, rmq_sys_*) from UPDATE_AND_CREATE_TOPIC, and a name
        # with a trailing newline.
        self._sendable: dict[str, TopicConfig] = {}
        self._wire: dict[str, dict[str, Any]] = {}  # topic -> config.to_wire()
        self._problems: dict[str, str] = {}  # topic -> registration_problem(config), where there is one
        # registration_topics' answer, until the next change.
        self._registration: tuple[Mapping[str, dict[str, Any]], Mapping[str, str]] | None = None
        # registration_entry_size of every topic registered (none with a problem), and their sum: the body's size
        # is known at every change, without encoding the table (node._check_topic_room asks it at every create).
        self._entry_sizes: dict[str, int] = {}
        self._entry_bytes = 0
        for config in configs:
            self._put(config)
        self.data_version = 0
        self._listeners: list[Any] = []

    def add_change_listener(self, callback: Any) -> None:
        """``callback()`` runs after every applied change (on whichever thread applied it)."""
        self._listeners.append(callback)

    def get(self, topic: str) -> TopicConfig | None:
        return self._configs.get(topic)

    def sendable(self, topic: str) -> TopicConfig | None:
        """The config of ``topic`` if it is stored under a name producers may send to; None if it is not stored,
        or is stored under a reserved or illegal name (the caller's own checks then say which)."""
        return self._sendable.get(topic)

    def __contains__(self, topic: str) -> bool:
        return topic in self._configs

    def __len__(self) -> int:
        return len(self._configs)

    def all(self) -> list[TopicConfig]:
        return list(self._configs.values())

    def to_wire(self) -> dict[str, dict[str, Any]]:
        """Every config's wire form by topic name, sorted: the caller's to keep or change."""
        return {name: dict(wire) for name, wire in sorted(self._wire.items())}

    def registration_topics(self) -> tuple[Mapping[str, dict[str, Any]], Mapping[str, str]]:
        """What a registration says of the table: the wire form of every topic a name server takes, and the topics
        it would refuse (``registration_problem``: only a topic stored by an older version has one) with their
        problem. Built at most once per change and shared until the next: read-only, and a new object after
        every change (``RegistrationService`` keeps the body it encoded from it while it is the same object)."""
        if self._registration is None:
            problems = dict(self._problems)
            wires = {n: w for n, w in self._wire.items() if n not in problems} if problems else dict(self._wire)
            self._registration = (wires, problems)
        return self._registration

    @property
    def registration_body_bytes(self) -> int:
        """The size of the registration body of ``registration_topics`` (``RegistrationSnapshot.body``)."""
        return cbor_head_size(len(self._entry_sizes)) + self._entry_bytes

    def registration_body_bytes_with(self, config: TopicConfig) -> int:
        """What ``registration_body_bytes`` would be once ``config`` is applied (created, or replacing its topic's)."""
        name = config.topic_name
        old = self._entry_sizes.get(name)
        new = registration_entry_size(config) if registration_problem(config) is None else None
        count = len(self._entry_sizes) + (new is not None) - (old is not None)
        return cbor_head_size(count) + self._entry_bytes + (new or 0) - (old or 0)

    def apply_update(self, config: TopicConfig) -> bool:
        """Create or replace; returns False when nothing changed (replays and repeated auto-creates)."""
        if self._configs.get(config.topic_name) == config:
            return False
        self._put(config)
        self._changed("update", config.topic_name)
        return True

    def apply_delete(self, topic: str) -> bool:
        if not self._drop(topic):
            return False
        self._changed("delete", topic)
        return True

    def apply_stored(self, data_version: int, changed: Mapping[str, Mapping[str, Any]], deleted: Iterable[str]) \
            -> None:
        """Mirror a change of the replicated topic table: the stored wire forms of ``changed`` (topic -> config)
        replace or join the table, the topics of ``deleted`` leave it, and ``data_version`` is the table's. Only
        the configs given are parsed, and all of them before anything changes: one that does not parse raises
        ``TopicConfigError`` and leaves the table as it was."""
        configs = [TopicConfig.from_wire(wire, stored=True) for wire in changed.values()]
        deleted = list(deleted)
        for topic in deleted:
            self._drop(topic)
        for config in configs:
            self._put(config)
        self.data_version = int(data_version)
        names = [c.topic_name for c in configs] + list(deleted)
        self._notify("mirror", names[0] if len(names) == 1 else f"<{len(names)} topics>")

    def snapshot(self) -> dict[str, Any]:
        return {"data_version": self.data_version, "topics": [dict(w) for w in self._wire.values()]}

    def restore(self, snap: Mapping[str, Any]) -> None:
        """Replace the whole table (every config parsed again; ``apply_stored`` mirrors a change)."""
        configs = [TopicConfig.from_wire(t, stored=True) for t in snap.get("topics", ())]
        self._configs, self._sendable, self._wire, self._problems = {}, {}, {}, {}
        self._entry_sizes, self._entry_bytes = {}, 0
        for config in configs:
            self._put(config)
        self.data_version = int(snap.get("data_version", 0))
        self._notify("restore", "*")

    def _put(self, config: TopicConfig) -> None:
        name = config.topic_name
        self._configs[name] = config
        if _sendable_name(name):
            self._sendable[name] = config
        else:
            self._sendable.pop(name, None)
        self._wire[name] = config.to_wire()
        problem = registration_problem(config)
        self._entry_bytes -= self._entry_sizes.pop(name, 0)
        if problem is None:
            self._problems.pop(name, None)
            size = self._entry_sizes[name] = registration_entry_size(config)
            self._entry_bytes += size
        else:
            self._problems[name] = problem
        self._registration = None

    def _drop(self, topic: str) -> bool:
        if self._configs.pop(topic, None) is None:
            return False
        self._sendable.pop(topic, None)
        self._wire.pop(topic, None)
        self._problems.pop(topic, None)
        self._entry_bytes -= self._entry_sizes.pop(topic, 0)
        self._registration = None
        return True

    def _changed(self, what: str, topic: str) -> None:
        self.data_version += 1
        self._notify(what, topic)

    def _notify(self, what: str, topic: str) -> None:
        log.info("topic config %s topic=%s data_version=%d", what, topic, self.data_version)
        for callback in self._listeners:
            callback()


def _sendable_name(topic: str) -> bool:
    try:
        validate_topic_name(topic)
        check_sendable_topic(topic)
    except TopicConfigError:
        return False
    return True


def auto_create_config(topic: str, default_queue_nums: int = DEFAULT_TOPIC_QUEUE_NUMS) -> TopicConfig:
    """RocketMQ's auto-created topic: ``default_queue_nums`` read and write queues, perm read|write."""
    validate_topic_name(topic)
    return TopicConfig(topic_name=topic, read_queue_nums=default_queue_nums, write_queue_nums=default_queue_nums,
                       perm=PERM_READ_WRITE)
