"""The public value types of the client: what a user sends, what a send returns, what a consumer receives.

RocketMQ keeps tags, keys and the producer-side unique id in the message *properties* (``TAGS``, ``KEYS``,
``UNIQ_KEY``); we do the same so a message travels unchanged through the store and back. ``Message`` is the
user's view with ``tags``/``keys`` as attributes; ``Message.wire_properties()`` folds them into the map.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import logging
import math
import os
import struct
import time
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

from remoting.message import (BATCH_HEAD, COMPRESSED_FLAG, COMPRESSION_TYPE_MASK, COMPRESSION_ZLIB_TYPE, I32, I64,
                              KEY_SEPARATOR, MAX_PROPERTIES_SIZE, PROPERTY_DELAY,
                              PROPERTY_KEYS, PROPERTY_PRODUCER_GROUP, PROPERTY_TAGS, PROPERTY_TIMER_DELAY_MS,
                              PROPERTY_TIMER_DELIVER_MS, PROPERTY_TRANSACTION_PREPARED, TIMER_PROPERTIES,
                              PROPERTY_UNIQ_KEY, SYSTEM_PROPERTIES, MessageFormatError, check_topic, create_msg_id,
                              decode_properties, encode_properties, encode_uniform_batch, split_keys)
from remoting.message import (PROPERTY_CLUSTER, PROPERTY_CORRELATION_ID, PROPERTY_MESSAGE_REPLY_TO_CLIENT,
                              PROPERTY_MESSAGE_TTL, PROPERTY_MESSAGE_TYPE, REPLY_MESSAGE_FLAG, reply_topic)

__all__ = [
    "Message", "MessageQueue", "MessageExt", "SendStatus", "SendResult", "PullStatus", "PullResult",
    "PROPERTY_TAGS", "PROPERTY_KEYS", "PROPERTY_UNIQ_KEY", "new_uniq_key", "decompressed_body", "MAX_INFLATED_BODY",
    "DEFAULT_MAX_INFLATED_BODY", "create_reply_message", "is_reply_message", "PROPERTY_CORRELATION_ID",
    "PROPERTY_MESSAGE_REPLY_TO_CLIENT", "PROPERTY_MESSAGE_TTL", "PROPERTY_MESSAGE_TYPE", "PROPERTY_CLUSTER",
    "REPLY_MESSAGE_FLAG",
]

log = logging.getLogger(__name__)

# Unique ids follow RocketMQ's MessageClientIDSetter in spirit: a per-process prefix (random + pid) and a
# time + counter suffix, hex-encoded, so ids from concurrent producers never collide and sort by time.
_UNIQ_PREFIX = os.urandom(4).hex().upper() + f"{os.getpid() & 0xFFFF:04X}"
_uniq_counter = itertools.count()


_UNIQ_PROPERTY_HEAD = PROPERTY_UNIQ_KEY.encode("ascii") + b"\x01"
_UNIQ_SUFFIX = struct.Struct(">IH")  # milliseconds, counter


def new_uniq_key() -> str:
    suffix = _UNIQ_SUFFIX.pack(int(time.time() * 1000) & 0xFFFFFFFF, next(_uniq_counter) & 0xFFFF)
    return _UNIQ_PREFIX + suffix.hex().upper()


# What the UNIQ_KEY a send adds takes of the properties' MAX_PROPERTIES_SIZE bytes.
_UNIQ_PROPERTY_SIZE = len(_UNIQ_PROPERTY_HEAD) + len(_UNIQ_PREFIX) + 2 * _UNIQ_SUFFIX.size + 1


# RocketMQ's system property names (SYSTEM_PROPERTIES) a user may still set in Message.properties, because this
# client takes them there on purpose: UNIQ_KEY (a message's own id, kept by send; the trace producer sets it), the
# delivery times (Message.deliver_time_ms / delay_ms store them there) and a request's and reply's names
# (create_reply_message builds the reply from them, and takes a Message built by hand from a request's
# properties). The rest are refused: RETRY_TOPIC set by hand showed the handler of its retry another topic, and
# under ACL made its send-back need permissions on that topic; TAGS, KEYS, DELAY, TRAN_MSG and PGROUP say which
# attribute or call to use instead.
_USER_SETTABLE = frozenset({PROPERTY_UNIQ_KEY, *TIMER_PROPERTIES, PROPERTY_CORRELATION_ID,
                            PROPERTY_MESSAGE_REPLY_TO_CLIENT, PROPERTY_MESSAGE_TTL, PROPERTY_MESSAGE_TYPE,
                            PROPERTY_CLUSTER})
_RESERVED_PROPERTIES = SYSTEM_PROPERTIES - _USER_SETTABLE


def _property_size(field: str, text: str) -> int:
    """Bytes ``text`` takes in encoded properties, with its separator; raises naming ``field`` for text the broker
    refuses there."""
    if "\x01" in text or "\x02" in text:
        raise ValueError(f"Message.{field} must not contain the separator bytes \\x01 and \\x02, got {text!r}")
    if text.isascii():
        return len(text) + 1
    try:
        return len(text.encode("utf-8")) + 1
    except UnicodeEncodeError as e:
        raise ValueError(f"Message.{field} is not valid text ({e.reason} at position {e.start}), "
                         f"got {text!r}") from None


def _check_wire_properties(message: Message) -> None:
    """The rules of ``encode_properties``, which the broker applies, on what ``wire_properties`` would hold: a
    single or oneway send carries its properties in the request header, where a lone surrogate failed as a
    ProtocolError naming the header ('ext'), and a separator byte or more than MAX_PROPERTIES_SIZE bytes was the
    broker's to refuse, which for a oneway send means dropped without a word (send_batch raised a bare
    UnicodeEncodeError)."""
    props = message.properties
    size = 0 if PROPERTY_UNIQ_KEY in props else _UNIQ_PROPERTY_SIZE
    for name, value in props.items():
        if not name:
            raise ValueError("Message.properties must not have an empty name")
        field = f"properties[{name!r}]"
        size += _property_size(field, name) + _property_size(field, value)
    if message.tags:
        size += len(PROPERTY_TAGS) + 1 + _property_size("tags", message.tags)
    if message.delay_level:
        size += len(PROPERTY_DELAY) + 2 + len(str(message.delay_level))
    keys = message.keys
    if keys:
        size += len(PROPERTY_KEYS) + 1 + (_property_size("keys", keys) if isinstance(keys, str) else
                                          sum(_property_size("keys", k) for k in keys))
    if size > MAX_PROPERTIES_SIZE:
        raise ValueError(f"Message properties (tags, keys and the unique id included) take {size} bytes encoded, "
                         f"more than {MAX_PROPERTIES_SIZE}")


I64_MAX = I64[1]  # offsets and millisecond times are Java longs on the wire
I32_MAX = I32[1]  # ... and counts and durations Java ints


def check_int_arg(name: str, value: Any, lo: int, hi: int) -> None:
    """An integer argument of a client call, checked before anything is sent (a str there failed on a
    comparison, '<' not supported, or went to the broker)."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer within {lo}..{hi}, got {value!r}")


@functools.lru_cache(maxsize=1024)
def batch_entry_overhead(topic: str) -> int:
    """What the batch layout adds to each message's body and encoded properties (its entry header and the topic),
    measured on an empty entry rather than restating the layout; a batch body takes ``BATCH_HEAD.size`` more."""
    return len(encode_uniform_batch(check_topic(topic), 0, [(b"", b"", 0)], 0, (bytes(4), 0),
                                    (bytes(4), 0))) - BATCH_HEAD.size


def check_seconds(name: str, value: Any, *, allow_zero: bool = False) -> None:
    """A duration argument in seconds: a finite number, positive (or zero where ``allow_zero``)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value < math.inf
            or not (value >= 0 if allow_zero else value > 0)):
        raise ValueError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} number of seconds, "
                         f"got {value!r}")


def check_queue(name: str, mq: Any) -> MessageQueue:
    """A ``MessageQueue`` argument of a client call, checked before anything is sent: the dataclass takes any
    values, and a queue_id of -1 made the broker pick a queue itself (a pinned send stored elsewhere), a str or
    bool one was refused by the broker, an empty broker name named no group."""
    if not isinstance(mq, MessageQueue):
        raise TypeError(f"{name} must be a MessageQueue, got {mq!r}")
    try:
        check_topic(mq.topic)
    except MessageFormatError as e:
        raise ValueError(f"{name} {mq!r}: {e}") from None
    if not isinstance(mq.broker_name, str) or not mq.broker_name:
        raise ValueError(f"{name} {mq!r}: broker_name must be a non-empty string, got {mq.broker_name!r}")
    if isinstance(mq.queue_id, bool) or not isinstance(mq.queue_id, int) or not 0 <= mq.queue_id <= I32_MAX:
        raise ValueError(f"{name} {mq!r}: queue_id must be an integer within 0..{I32_MAX}, got {mq.queue_id!r}")
    return mq


def _check_str(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"Message.{name} must be a string, got {value!r}")


@dataclasses.dataclass(slots=True)
class Message:
    """A message to send. ``body`` is bytes; ``properties`` are user string properties, none of the names RocketMQ
    reserves but UNIQ_KEY, the delivery times and request-reply's (ValueError naming it). ``delay_level`` (1-based
    into the broker's ``message_delay_level``, "1s 5s 10s 30s 1m ..." by default; 0: none) delivers the message
    to its topic that long after the broker stored it (RocketMQ's setDelayTimeLevel); not in ``send_batch``.
    ``deliver_time_ms`` (ms since the epoch) or ``delay_ms`` (from the broker's receipt) deliver it at that time
    instead, no earlier, at most about the shortest level late, up to the broker's limit of 3 days ahead (RocketMQ
    5's setDeliverTimeMs / setDelayTimeMs, properties TIMER_DELIVER_MS / TIMER_DELAY_MS); one of the three at
    most; a time already past is no delay; not in ``send_batch`` nor ``send_in_transaction``."""

    topic: str
    body: bytes
    tags: str | None = None
    keys: str | list[str] | None = None
    properties: dict[str, str] = dataclasses.field(default_factory=dict)
    flag: int = 0
    delay_level: int = 0
    # Keywords here, attributes too (the properties defined after the class): kept where RocketMQ keeps them, in
    # the properties, so that every send path (single, oneway, auto-batch, send-back) carries them as it carries
    # any property, and one truth can never disagree with another.
    deliver_time_ms: dataclasses.InitVar[int | None] = None
    delay_ms: dataclasses.InitVar[int | None] = None

    def __post_init__(self, deliver_time_ms: int | None, delay_ms: int | None) -> None:
        if deliver_time_ms is not None:
            self.deliver_time_ms = deliver_time_ms
        if delay_ms is not None:
            self.delay_ms = delay_ms
        self.validate()

    def validate(self) -> None:
        """Raise TypeError/ValueError naming the first bad field. Run when the message is made and again by every
        send: a message is mutable, and a field changed afterwards failed deep inside (an AssertionError for a
        topic set to None, a TypeError from str.join for keys) or, for properties set to None, was dropped."""
        if (type(self.topic) is str and self.topic and type(self.body) is bytes and self.tags is None
                and self.keys is None and type(self.properties) is dict and not self.properties
                and self.flag == 0 and type(self.flag) is int and self.delay_level == 0
                and type(self.delay_level) is int):
            return  # the usual message (a topic and a body): nothing below can fail
        _check_str("topic", self.topic)
        if not self.topic:
            raise ValueError("Message.topic must not be empty")
        if isinstance(self.body, (bytearray, memoryview)):
            self.body = bytes(self.body)
        if not isinstance(self.body, bytes):
            raise TypeError(f"Message.body must be bytes, got {type(self.body).__name__}")
        if self.tags is not None:
            _check_str("tags", self.tags)
            # Subscriptions split expressions on '||' and strip each tag: a message tagged "A " or "A||B" could
            # only ever reach '*' subscribers, never one naming its tag.
            if self.tags != self.tags.strip() or "|" in self.tags or self.tags == "*":
                raise ValueError(f"Message.tags {self.tags!r} cannot be named by a tag expression (no '|', no "
                                 f"leading or trailing whitespace, not '*')")
        if self.keys is not None and not isinstance(self.keys, str) and not (
                isinstance(self.keys, (list, tuple)) and all(isinstance(k, str) for k in self.keys)):
            raise TypeError(f"Message.keys must be a string or a list of strings, got {self.keys!r}")
        if isinstance(self.keys, (list, tuple)) and any(KEY_SEPARATOR in k for k in self.keys):
            # Keys travel joined by the separator: ["order 1"] was indexed as keys "order" and "1".
            raise ValueError(f"Message.keys list items must not contain the key separator {KEY_SEPARATOR!r}, got "
                             f"{self.keys!r}")
        if not isinstance(self.properties, Mapping):
            raise TypeError(f"Message.properties must map str to str, got {self.properties!r}")
        # A Java int on the wire: the single send's flag went to the broker unchecked and was refused there.
        if type(self.flag) is not int or not I32[0] <= self.flag <= I32[1]:
            raise ValueError(f"Message.flag must be an integer within {I32[0]}..{I32[1]}, got {self.flag!r}")
        if type(self.delay_level) is not int or not 0 <= self.delay_level <= I32[1]:
            raise ValueError(f"Message.delay_level must be an integer within 0..{I32[1]} (0: not delayed), got "
                             f"{self.delay_level!r}")
        for k, v in self.properties.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"Message.properties must map str to str, got {k!r}: {v!r}")
        for name, how in ((PROPERTY_TAGS, "give Message.tags"), (PROPERTY_KEYS, "give Message.keys"),
                          (PROPERTY_DELAY, "give Message.delay_level"),
                          (PROPERTY_TRANSACTION_PREPARED, "send it with Producer.send_in_transaction"),
                          (PROPERTY_PRODUCER_GROUP, "send it with Producer.send_in_transaction")):
            # As RocketMQ's putUserProperty refuses system names: the attribute silently replaced the property, and
            # a property skipped the attribute's checks (TRAN_MSG by hand made a half message nothing would end).
            if name in self.properties:
                raise ValueError(f"Message.properties must not set {name!r}: {how} instead")
        if not _RESERVED_PROPERTIES.isdisjoint(self.properties):
            name = next(name for name in self.properties if name in _RESERVED_PROPERTIES)
            raise ValueError(f"Message.properties must not set {name!r}: RocketMQ reserves the name for the broker "
                             f"and the client (as its putUserProperty refuses it)")
        if self.properties:
            _check_timer(self)
        _check_wire_properties(self)

    def wire_properties(self) -> dict[str, str]:
        props = dict(self.properties)
        if self.tags:
            props[PROPERTY_TAGS] = self.tags
        if self.keys:
            props[PROPERTY_KEYS] = (self.keys if isinstance(self.keys, str)
                                    else KEY_SEPARATOR.join(self.keys))
        if self.delay_level:
            props[PROPERTY_DELAY] = str(self.delay_level)
        return props

    def batch_item(self) -> tuple[tuple[bytes, bytes, int], str]:
        """``((body, encoded properties, flag), unique id)`` for the batch layout (``encode_uniform_batch``),
        with a fresh UNIQ_KEY unless the message has one, for a message ``validate`` passed; raises
        ``MessageFormatError`` for properties the layout cannot carry."""
        flag = self.flag
        if not (self.properties or self.tags or self.keys):
            # The common message: nothing but the id we make here (hex, no separator byte to check for).
            uniq = new_uniq_key()
            return (self.body, _UNIQ_PROPERTY_HEAD + uniq.encode("ascii") + b"\x02", flag), uniq
        props = self.wire_properties()
        for name in TIMER_PROPERTIES:
            # It waits in the schedule topic, not in the batch's queue; and the broker only times single sends.
            if name in props:
                raise MessageFormatError("delay", f"a message with a delivery time ({name}) is sent alone, not "
                                                  f"in a batch")
        uniq = props.setdefault(PROPERTY_UNIQ_KEY, new_uniq_key())
        return (self.body, encode_properties(props), flag), uniq


_MAX_TIMER_MS = 10 ** 18 - 1  # the broker reads up to 18 digits (a Java long's, less one)


def _timer_ms(message: Message, name: str) -> int | None:
    value = message.properties.get(name)
    return int(value) if value is not None and value.isascii() and value.isdecimal() else None


def _set_timer_ms(message: Message, name: str, field: str, value: int | None) -> None:
    if value is not None and (type(value) is not int or not 0 <= value <= _MAX_TIMER_MS):
        raise ValueError(f"Message.{field} must be None or an integer within 0..{_MAX_TIMER_MS}, got {value!r}")
    if not isinstance(message.properties, Mapping):
        raise TypeError(f"Message.properties must map str to str, got {message.properties!r}")
    # A new dict: the one given may be shared with other messages, which must not get this time.
    props = {k: v for k, v in message.properties.items() if k != name}
    if value is not None:
        props[name] = str(value)
    message.properties = props


# RocketMQ 5's getDeliverTimeMs / setDeliverTimeMs and getDelayTimeMs / setDelayTimeMs (None: not set).
Message.deliver_time_ms = property(  # type: ignore[assignment]
    lambda self: _timer_ms(self, PROPERTY_TIMER_DELIVER_MS),
    lambda self, value: _set_timer_ms(self, PROPERTY_TIMER_DELIVER_MS, "deliver_time_ms", value),
    doc="When the broker delivers the message, in ms since the epoch (property TIMER_DELIVER_MS); None: not set.")
Message.delay_ms = property(  # type: ignore[assignment]
    lambda self: _timer_ms(self, PROPERTY_TIMER_DELAY_MS),
    lambda self, value: _set_timer_ms(self, PROPERTY_TIMER_DELAY_MS, "delay_ms", value),
    doc="How long after its receipt the broker delivers the message, in ms (property TIMER_DELAY_MS); None: not set.")


_TIMER_SEC, _TIMER_MS, _TIMER_AT = TIMER_PROPERTIES


def _check_timer(message: Message) -> None:
    """A delivery time as the broker reads it (broker/schedule.py): one timer property at most, a decimal integer,
    and not with a delay level, which the broker would prefer, dropping the time (RocketMQ's checkIfTimerMessage)."""
    props = message.properties
    if _TIMER_AT not in props and _TIMER_MS not in props and _TIMER_SEC not in props:
        return  # most messages with properties: ~50 ns
    names = [name for name in TIMER_PROPERTIES if name in props]
    if len(names) > 1:
        raise ValueError(f"Message.properties set {' and '.join(names)}: a message has one delivery time "
                         f"(Message.deliver_time_ms or Message.delay_ms)")
    if message.delay_level:
        raise ValueError(f"Message.delay_level {message.delay_level} and a delivery time ({names[0]}) exclude each "
                         f"other: give one")
    value = props[names[0]]
    if not value.isascii() or not value.isdecimal() or len(value) > 18:
        raise ValueError(f"Message.properties[{names[0]!r}] must be a decimal integer of at most 18 digits (ms, or "
                         f"s for TIMER_DELAY_SEC), got {value!r}")


def create_reply_message(request: Message | MessageExt, body: bytes) -> Message:
    """The reply to ``request`` (a message a consumer got from ``Producer.request``), carrying ``body``; send it
    with any producer's ``send`` (RocketMQ's MessageUtil.createReplyMessage). Its topic is the reply topic of the
    cluster that stored the request (property CLUSTER), and it carries the request's CORRELATION_ID,
    REPLY_TO_CLIENT and TTL, with MSG_TYPE=reply: the broker that takes it pushes it to the requester, which
    matches it to its request by the correlation id. A message that is no request (CLUSTER, REPLY_TO_CLIENT or
    CORRELATION_ID missing) raises ValueError naming the property."""
    if not isinstance(request, (Message, MessageExt)):
        raise TypeError(f"create_reply_message needs the request message (Message or MessageExt), got {request!r}")
    props = request.properties
    copied = {}
    for name in (PROPERTY_CLUSTER, PROPERTY_MESSAGE_REPLY_TO_CLIENT, PROPERTY_CORRELATION_ID):
        value = props.get(name)
        if not isinstance(value, str) or not value:
            raise ValueError(f"create_reply_message: the request message has no {name} property, so it was not sent "
                             f"by Producer.request and nothing waits for a reply (topic {request.topic!r})")
        copied[name] = value
    topic = reply_topic(copied.pop(PROPERTY_CLUSTER))
    try:
        check_topic(topic)
    except MessageFormatError as e:
        raise ValueError(f"create_reply_message: the request's cluster has no usable reply topic: {e}") from None
    ttl = props.get(PROPERTY_MESSAGE_TTL)
    if isinstance(ttl, str) and ttl:
        copied[PROPERTY_MESSAGE_TTL] = ttl
    copied[PROPERTY_MESSAGE_TYPE] = REPLY_MESSAGE_FLAG
    return Message(topic, body, properties=copied)


def is_reply_message(message: Message) -> bool:
    """Whether ``message`` is a reply (MSG_TYPE=reply, as ``create_reply_message`` makes it): a producer sends it
    with SEND_REPLY_MESSAGE, so that the broker pushes it to its requester."""
    props = message.properties  # every send asks: most messages have no properties at all
    return bool(props) and props.get(PROPERTY_MESSAGE_TYPE) == REPLY_MESSAGE_FLAG


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class MessageQueue:
    """One queue of a topic on one broker group: the unit of routing, rebalancing and offsets."""

    topic: str
    broker_name: str
    queue_id: int

    def __str__(self) -> str:
        return f"{self.topic}@{self.broker_name}:{self.queue_id}"


class SendStatus(enum.Enum):
    SEND_OK = "SEND_OK"
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"
    FLUSH_SLAVE_TIMEOUT = "FLUSH_SLAVE_TIMEOUT"
    SLAVE_NOT_AVAILABLE = "SLAVE_NOT_AVAILABLE"


@dataclasses.dataclass(frozen=True, slots=True)
class SendResult:
    send_status: SendStatus
    msg_id: str            # the producer-side unique id (UNIQ_KEY), as RocketMQ's SendResult.msgId
    offset_msg_id: str     # the broker's id (store host + physical offset)
    message_queue: MessageQueue
    queue_offset: int
    # For a batch: one unique id per message, in order; offsets are consecutive from queue_offset.
    msg_ids: tuple[str, ...] = ()


class _NewSendResult:
    """Builds a ``SendResult`` for the producer's hot path, one per acknowledged send, as ``_PulledMessageExt``
    builds a ``MessageExt`` (0.2 µs instead of the frozen dataclass's 0.5 µs, 0.7 with keywords); the result
    is indistinguishable from ``SendResult(...)`` with the same arguments, and a test checks it."""

    __slots__ = SendResult.__slots__

    def __init__(self, send_status: SendStatus, msg_id: str, offset_msg_id: str, message_queue: MessageQueue,
                 queue_offset: int, msg_ids: tuple[str, ...]) -> None:
        self.send_status = send_status
        self.msg_id = msg_id
        self.offset_msg_id = offset_msg_id
        self.message_queue = message_queue
        self.queue_offset = queue_offset
        self.msg_ids = msg_ids
        self.__class__ = SendResult  # type: ignore[assignment]


class RecordProperties(Mapping[str, str]):
    """A consumed message's properties, decoded from their record bytes on first use: most consumers never
    read them, and a pull decodes hundreds of records. Reads like the ``dict`` it wraps."""

    __slots__ = ("_raw", "_map")

    def __init__(self, raw: bytes) -> None:
        self._raw = raw
        self._map: dict[str, str] | None = None

    def _decoded(self) -> dict[str, str]:
        m = self._map
        if m is None:
            m = self._map = decode_properties(self._raw) if self._raw else {}
        return m

    def __getitem__(self, name: str) -> str:
        return self._decoded()[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self._decoded().get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._decoded()

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())

    def __len__(self) -> int:
        return len(self._decoded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RecordProperties):
            other = other._decoded()
        return self._decoded() == other

    __hash__ = None  # type: ignore[assignment]  # like the dict it stands for

    def __repr__(self) -> str:
        return repr(self._decoded())

    def __reduce__(self) -> tuple:
        return dict, (self._decoded(),)


@dataclasses.dataclass(frozen=True, slots=True)
class MessageExt:
    """A consumed message, decoded from its commit-log record."""

    topic: str
    body: bytes
    queue_id: int
    queue_offset: int
    broker_name: str
    properties: Mapping[str, str]
    phy_offset: int
    born_timestamp: int
    store_timestamp: int
    store_host: tuple[str, int]
    reconsume_times: int = 0
    sys_flag: int = 0
    flag: int = 0

    @property
    def msg_id(self) -> str:
        """The producer's unique id (UNIQ_KEY), as RocketMQ's ``MessageExt.getMsgId`` for client-set ids."""
        return self.properties.get(PROPERTY_UNIQ_KEY) or self.offset_msg_id

    @property
    def offset_msg_id(self) -> str:
        """The broker's id: store host + physical offset (computed on demand; most consumers never ask)."""
        return create_msg_id(self.store_host, self.phy_offset)

    @property
    def tags(self) -> str | None:
        return self.properties.get(PROPERTY_TAGS)

    @property
    def keys(self) -> list[str]:
        return split_keys(self.properties.get(PROPERTY_KEYS))

    @property
    def message_queue(self) -> MessageQueue:
        return MessageQueue(self.topic, self.broker_name, self.queue_id)


class _PulledMessageExt:
    """Builds a ``MessageExt`` for the consumer's hot path: a frozen dataclass's ``__init__`` pays one
    ``object.__setattr__`` per field (about 2.5 us for 13 fields, as much as decoding the record), so this
    plain class with the very same slots fills them with ordinary stores and then becomes a ``MessageExt``
    (``__class__`` assignment between classes of identical slot layout). The result is indistinguishable from
    ``MessageExt(...)`` with the same arguments; a test checks it field by field."""

    __slots__ = MessageExt.__slots__

    def __init__(self, topic: str, body: bytes, queue_id: int, queue_offset: int, broker_name: str,
                 properties: Mapping[str, str], phy_offset: int, born_timestamp: int, store_timestamp: int,
                 store_host: tuple[str, int], reconsume_times: int, sys_flag: int, flag: int) -> None:
        self.topic = topic
        self.body = body
        self.queue_id = queue_id
        self.queue_offset = queue_offset
        self.broker_name = broker_name
        self.properties = properties
        self.phy_offset = phy_offset
        self.born_timestamp = born_timestamp
        self.store_timestamp = store_timestamp
        self.store_host = store_host
        self.reconsume_times = reconsume_times
        self.sys_flag = sys_flag
        self.flag = flag
        self.__class__ = MessageExt  # type: ignore[assignment]


# The largest body any reader inflates: the largest a producer may be configured to send (max_message_size_bytes's
# bound; its limit is on the body before compression). A body that would inflate further was not made by a raftmq
# producer, and without a bound a few KiB of zeros could take a reader's memory.
MAX_INFLATED_BODY = 256 * 1024 * 1024
# A consumer's own bound (its max_inflated_body_size_bytes, up to MAX_INFLATED_BODY): the producer's default
# max_message_size_bytes. At 256 MiB a producer's few-KiB bombs cost every consumer 256 MiB a message, and a pull
# brings 32 of them before any flow control counts their bodies; a group that sends more raises it.
DEFAULT_MAX_INFLATED_BODY = 4 * 1024 * 1024
# What one zlib call inflates at most, and so about what inflating holds past max_size (a call's output twice).
_INFLATE_STEP = 1024 * 1024


def decompressed_body(body: bytes, sys_flag: int, topic: str, broker_name: str, queue_id: int, queue_offset: int,
                      max_size: int = MAX_INFLATED_BODY, max_size_key: str | None = None) -> tuple[bytes, int]:
    """``(body, sys_flag)`` of a record whose sys_flag has COMPRESSED_FLAG, as its consumer gets them (RocketMQ's
    MessageDecoder): the body its producer sent, and sys_flag without the compression bits, since they describe
    the body and it is no longer compressed (RocketMQ's decoder leaves them set). A body that cannot be inflated
    (damaged, a codec this client lacks: RocketMQ 5's LZ4 or zstd, or more than ``max_size`` bytes inflated, the
    reader's bound, named ``max_size_key`` in its config if it has one) is logged as an error naming the message and
    comes back as stored, its flag kept, so the consumer goes on and the message says what its body holds. (There
    RocketMQ's decoder gave up on the whole pulled batch, and the consumer skipped it without a word.) Inflating
    stops past ``max_size`` bytes: a bomb costs that much memory, a MiB more and a copy of the stored body."""
    # Checked here, not per message on the hot path (only compressed bodies come here): max_length 0 means no bound.
    if type(max_size) is not int or not 1 <= max_size <= MAX_INFLATED_BODY:
        raise ValueError(f"max_size must be an integer within 1..{MAX_INFLATED_BODY}, got {max_size!r}")
    codec = sys_flag & COMPRESSION_TYPE_MASK
    if codec and codec != COMPRESSION_ZLIB_TYPE:
        problem = f"compression type {codec >> 8} is not zlib (3, or 0 as raftmq writes it)"
    else:
        inflater = zlib.decompressobj()
        try:
            # Up to one byte more than the bound, which tells a body of exactly max_size bytes from a larger one (a
            # full output buffer alone does not: zlib may have taken all the input and still hold output). In steps:
            # a call's output buffer briefly holds what it returns twice (its blocks, then the bytes they are joined
            # into), so one call bounded by max_size took twice the bound for a bomb. A body of a step or less (most
            # compressed ones) is still one call; a tail is only left when a step's output is full.
            limit = max_size + 1
            want = min(limit, _INFLATE_STEP)
            part = inflater.decompress(body, want)
            parts = [part]
            size = len(part)
            while not inflater.eof and size < limit and (inflater.unconsumed_tail or len(part) == want):
                want = min(limit - size, _INFLATE_STEP)
                part = inflater.decompress(inflater.unconsumed_tail, want)
                parts.append(part)
                size += len(part)
            if size > max_size:
                if max_size_key is not None and max_size < MAX_INFLATED_BODY:
                    problem = (f"it inflates past {max_size} bytes, this client's {max_size_key} (raise it, up to "
                               f"{MAX_INFLATED_BODY}, to take such bodies)")
                else:
                    problem = f"it inflates past {max_size} bytes, the most a producer may send"
            elif not inflater.eof:
                problem = "the compressed data is truncated"
            else:
                return b"".join(parts), sys_flag & ~(COMPRESSED_FLAG | COMPRESSION_TYPE_MASK)  # one part: itself
        except zlib.error as e:
            problem = str(e)
    log.error("the compressed body of a message cannot be decompressed; it is delivered as stored, its sys_flag "
              "bit 0x1 set topic=%s broker_name=%s queue_id=%d queue_offset=%d body_size=%d error=%s", topic,
              broker_name, queue_id, queue_offset, len(body), problem)
    return body, sys_flag


class PullStatus(enum.Enum):
    FOUND = "FOUND"
    NO_NEW_MSG = "NO_NEW_MSG"
    NO_MATCHED_MSG = "NO_MATCHED_MSG"
    OFFSET_ILLEGAL = "OFFSET_ILLEGAL"


@dataclasses.dataclass(frozen=True, slots=True)
class PullResult:
    status: PullStatus
    next_begin_offset: int
    min_offset: int
    max_offset: int
    messages: tuple[MessageExt, ...] = ()
