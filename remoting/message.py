"""Message layouts shared by clients, the wire and the store: the batch layout and the commit-log record.

Two layouts, each defined once here next to its ``struct.Struct`` and mirrored in ``docs/store-format.md``.
All integers are big-endian, as RocketMQ writes them.

**Batch** (what a producer sends as a SEND_BATCH_MESSAGE body and the broker hands its Raft group as one record)::

    0        4        8                 12       16
    | magic  | count  | store_host ip   | port   |      BATCH_HEAD, 16 bytes
    then `count` entries, each:
    | entry_size 4 | queue_id 4 | flag 4 | sys_flag 4 | born_timestamp 8 | born ip 4 | born port 4 |
    | reconsume_times 4 | prepared_transaction_offset 8 |                         ENTRY_HEAD, 44 bytes
    | body_len 4 | body | topic_len 1 | topic | properties_len 2 | properties |   the record tail

**Commit-log record**::

    | total_size 4 | magic 4 | body_crc 4 | queue_id 4 | flag 4 | queue_offset 8 | phy_offset 8 |
    | sys_flag 4 | born_timestamp 8 | born ip 4 | born port 4 | store_timestamp 8 | store ip 4 | store port 4 |
    | reconsume_times 4 | prepared_transaction_offset 8 |                         RECORD_HEAD, 84 bytes
    | body_len 4 | body | topic_len 1 | topic | properties_len 2 | properties |   the record tail

The record tail is byte-for-byte the batch entry's tail, so the store appends a batch with one ``pack_into`` of
the 84-byte head and one slice copy per message, never re-encoding bodies or properties. ``body_crc`` is the
crc32c of the body. Properties are RocketMQ's encoding: ``name \\x01 value \\x02`` per pair, UTF-8; names and
values may not contain those two separator bytes. A message id is RocketMQ's offset message id: store host ip
(4) + port (4) + phy_offset (8), upper-case hex.

This module is pure ``struct``: no I/O, no trio; the store and the client both import it.
"""

from __future__ import annotations

import dataclasses
import re
import socket
import struct
from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache

from crc32c import crc32c

__all__ = [
    "MessageInput", "MessageView", "MessageFormatError",
    "encode_batch", "encode_single_batch", "decode_batch", "validate_batch", "scan_batch", "batch_count",
    "scan_producer_batch", "batch_index_keys",
    "CheckedBatch",
    "batch_store_host",
    "encode_record", "decode_record", "iter_records", "decode_records", "record_size", "record_properties",
    "encode_properties", "decode_properties", "encode_uniform_batch", "create_msg_id", "parse_msg_id", "tags_code",
    "create_msg_ids", "ip_bytes", "MAX_TAG_EXPRESSION_LENGTH", "I32", "I64",
    "check_topic", "TOPIC_CHARS", "TOPIC_RE", "group_problem", "topic_problem", "GROUP_MAX_LENGTH",
    "CLIENT_ID_MAX_LENGTH",
    "BATCH_HEAD", "ENTRY_HEAD", "RECORD_HEAD", "BATCH_MAGIC", "MESSAGE_MAGIC", "BLANK_MAGIC",
    "MAX_TOPIC_LENGTH", "MAX_PROPERTIES_SIZE", "DEFAULT_MAX_MESSAGE_SIZE",
    "PROPERTY_TAGS", "PROPERTY_KEYS", "PROPERTY_UNIQ_KEY", "KEY_SEPARATOR", "split_keys",
    "PROPERTY_DELAY", "PROPERTY_REAL_TOPIC", "PROPERTY_REAL_QUEUE_ID", "PROPERTY_RETRY_TOPIC",
    "PROPERTY_ORIGIN_MESSAGE_ID", "SCHEDULE_TOPIC", "RETRY_GROUP_TOPIC_PREFIX", "DLQ_GROUP_TOPIC_PREFIX",
    "PROPERTY_TIMER_DELIVER_MS", "PROPERTY_TIMER_DELAY_MS", "PROPERTY_TIMER_DELAY_SEC", "TIMER_PROPERTIES",
    "retry_topic", "dlq_topic", "pop_retry_topic", "split_pop_retry_topic", "POP_RETRY_SEPARATOR",
    "RETRY_GROUP_MAX_LENGTH", "REAL_TOPIC_HOLDERS", "SYSTEM_PROPERTIES",
    "destination_topic", "first_topic", "property_block_problem",
    "PROPERTY_TRANSACTION_PREPARED", "PROPERTY_PRODUCER_GROUP", "PROPERTY_TRANSACTION_CHECK_TIMES",
    "TRANS_HALF_TOPIC", "TRANS_OP_HALF_TOPIC", "TRANS_CHECK_MAX_TIME_TOPIC",
    "TRANSACTION_NOT_TYPE", "TRANSACTION_PREPARED_TYPE", "TRANSACTION_COMMIT_TYPE", "TRANSACTION_ROLLBACK_TYPE",
    "TRANSACTION_TYPE_MASK", "COMPRESSED_FLAG", "COMPRESSION_TYPE_MASK", "COMPRESSION_ZLIB_TYPE",
]

BATCH_MAGIC = 0x524D4231  # "RMB1"
MESSAGE_MAGIC = 0xDAA320A7  # RocketMQ's MESSAGE_MAGIC_CODE (-626843481 as a Java int)
BLANK_MAGIC = 0xCBD43194  # RocketMQ's BLANK_MAGIC_CODE: the end-of-segment filler

BATCH_HEAD = struct.Struct(">II4sI")
# entry_size, queue_id, flag, sys_flag, born_timestamp, born_ip, born_port, reconsume_times, prepared_tx_offset
ENTRY_HEAD = struct.Struct(">iiiiq4sIiq")
# total_size, magic, body_crc, queue_id, flag, queue_offset, phy_offset, sys_flag, born_timestamp, born_ip,
# born_port, store_timestamp, store_ip, store_port, reconsume_times, prepared_transaction_offset
RECORD_HEAD = struct.Struct(">iIIiiqqiq4sIq4sIiq")
BODY_LEN = struct.Struct(">i")
PROPS_LEN = struct.Struct(">H")
MSG_ID = struct.Struct(">4sIq")

MAX_TOPIC_LENGTH = 127  # RocketMQ's TOPIC_MAX_LENGTH
MAX_PROPERTIES_SIZE = 32767  # RocketMQ stores the properties length as a Java short
DEFAULT_MAX_MESSAGE_SIZE = 4 * 1024 * 1024
PROPERTY_TAGS = "TAGS"
PROPERTY_KEYS = "KEYS"
PROPERTY_UNIQ_KEY = "UNIQ_KEY"
KEY_SEPARATOR = " "
# Delayed messages and consumer retries (RocketMQ's MessageConst names, so a RocketMQ user reads them as before).
PROPERTY_DELAY = "DELAY"  # the delay level, 1-based into the broker's message_delay_level
PROPERTY_REAL_TOPIC = "REAL_TOPIC"  # where a scheduled message goes once due
PROPERTY_REAL_QUEUE_ID = "REAL_QID"
PROPERTY_RETRY_TOPIC = "RETRY_TOPIC"  # the topic a sent-back message was first consumed from
PROPERTY_ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"  # queue (level - 1) holds the messages of one delay level
# Timer messages (RocketMQ 5's Message.setDeliverTimeMs / setDelayTimeMs / setDelayTimeSec): delivered at a time of
# the producer's choosing rather than after a level's delay; they hop through the delay levels (broker/schedule.py).
PROPERTY_TIMER_DELIVER_MS = "TIMER_DELIVER_MS"  # absolute: ms since the epoch
PROPERTY_TIMER_DELAY_MS = "TIMER_DELAY_MS"  # relative to the broker's receipt, in ms
PROPERTY_TIMER_DELAY_SEC = "TIMER_DELAY_SEC"  # ... in seconds
TIMER_PROPERTIES = (PROPERTY_TIMER_DELAY_SEC, PROPERTY_TIMER_DELAY_MS, PROPERTY_TIMER_DELIVER_MS)  # RocketMQ's order
RETRY_GROUP_TOPIC_PREFIX = "%RETRY%"
# Transactional messages (RocketMQ's names): a half message carries TRAN_MSG=true and its producer group, waits in
# the half topic, and is ended by an op record in the op topic; one checked too often goes to the check-max topic.
PROPERTY_TRANSACTION_PREPARED = "TRAN_MSG"
PROPERTY_PRODUCER_GROUP = "PGROUP"
PROPERTY_TRANSACTION_CHECK_TIMES = "TRANSACTION_CHECK_TIMES"
TRANS_HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
TRANS_OP_HALF_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
TRANS_CHECK_MAX_TIME_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"
# RocketMQ's MessageSysFlag transaction type, bits 2-3 of sys_flag; END_TRANSACTION's commit_or_rollback too.
TRANSACTION_NOT_TYPE = 0x0
TRANSACTION_PREPARED_TYPE = 0x4
TRANSACTION_COMMIT_TYPE = 0x8
TRANSACTION_ROLLBACK_TYPE = 0xC
TRANSACTION_TYPE_MASK = 0xC
# RocketMQ's MessageSysFlag.COMPRESSED_FLAG, bit 0 of sys_flag: the body was compressed by its producer (a single
# send's body of at least compress_msg_body_over_howmuch bytes, client/producer.py) and is stored and replicated
# so; body_crc is of those stored bytes. Only consumers inflate it; the broker never looks. Bits 8-10 name the
# codec in RocketMQ 5 (0, as raftmq and RocketMQ 4 write it, and 0x300 are zlib; 0x100 LZ4, 0x200 zstd).
COMPRESSED_FLAG = 0x1
COMPRESSION_TYPE_MASK = 0x700
COMPRESSION_ZLIB_TYPE = 0x300
# Request-reply (RocketMQ 4.6's DefaultMQProducer.request; MessageConst's names): the requester stamps a request
# with its client id, a correlation id, its timeout and its broker group's cluster; the replier's message
# (MSG_TYPE=reply) goes to that cluster's reply topic, and the broker pushes it to the requester's connection.
PROPERTY_CORRELATION_ID = "CORRELATION_ID"
PROPERTY_MESSAGE_REPLY_TO_CLIENT = "REPLY_TO_CLIENT"
PROPERTY_MESSAGE_TTL = "TTL"  # the requester's timeout, ms
PROPERTY_MESSAGE_TYPE = "MSG_TYPE"
PROPERTY_CLUSTER = "CLUSTER"
PROPERTY_REPLY_MESSAGE_ARRIVE_TIME = "ARRIVE_TIME"  # set by the requester on a reply it received, ms
REPLY_MESSAGE_FLAG = "reply"  # MSG_TYPE of a reply (RocketMQ's MixAll.REPLY_MESSAGE_FLAG)
REPLY_TOPIC_SUFFIX = "_REPLY_TOPIC"
DLQ_GROUP_TOPIC_PREFIX = "%DLQ%"
# The longest consumer group whose retry and dead-letter topic names are both legal: a clustering consumer
# subscribes to %RETRY%<group>, and the broker creates both topics on its first send-back.
RETRY_GROUP_MAX_LENGTH = MAX_TOPIC_LENGTH - max(len(RETRY_GROUP_TOPIC_PREFIX), len(DLQ_GROUP_TOPIC_PREFIX))
# The broker's topics whose records it wrote itself with REAL_TOPIC / REAL_QID naming where they go (or went): a
# delayed or timer message waiting for its time, a half message waiting for its END_TRANSACTION, a half discarded
# after its last check. No producer may send to them (broker/topic_config.py), so only there is REAL_TOPIC the
# broker's word; anywhere else it is whatever a sender wrote.
REAL_TOPIC_HOLDERS = frozenset({SCHEDULE_TOPIC, TRANS_HALF_TOPIC, TRANS_CHECK_MAX_TIME_TOPIC})
# The properties the broker reads back from what it stored to decide where a record goes or whose it is (REAL_TOPIC,
# a retry copy's RETRY_TOPIC) are trusted only on the records the broker wrote them on (destination_topic,
# first_topic), not refused from producers: RocketMQ's broker takes them, its consumer's fallback send-back (a
# producer send to %RETRY%<group> when CONSUMER_SEND_MSG_BACK fails) copies a delivered message's properties,
# REAL_TOPIC and REAL_QID of every delayed or retried one included, and a tool republishing a delivered message
# does the same. (Refused for a while: every such send was MESSAGE_ILLEGAL.)
# RocketMQ's MessageConst.STRING_HASH_SET (5.x), the names its putUserProperty refuses, plus TIMER_DELAY_MS (our
# Message.delay_ms) and TRANSACTION_CHECK_TIMES, which it leaves out: a client keeps from users all but the ones it
# takes through properties on purpose (client/message.py).
SYSTEM_PROPERTIES = frozenset({
    "TRACE_ON", "MSG_REGION", PROPERTY_KEYS, PROPERTY_TAGS, "WAIT", PROPERTY_DELAY, PROPERTY_RETRY_TOPIC,
    PROPERTY_REAL_TOPIC, PROPERTY_REAL_QUEUE_ID, PROPERTY_TRANSACTION_PREPARED, PROPERTY_PRODUCER_GROUP, "MIN_OFFSET",
    "MAX_OFFSET", "BUYER_ID", PROPERTY_ORIGIN_MESSAGE_ID, "TRANSFER_FLAG", "CORRECTION_FLAG", "MQ2_FLAG",
    "RECONSUME_TIME", PROPERTY_UNIQ_KEY, "MAX_RECONSUME_TIMES", "CONSUME_START_TIME", "POP_CK", "POP_CK_OFFSET",
    "1ST_POP_TIME", "TRAN_PREPARED_QUEUE_OFFSET", "DUP_INFO", "EXTEND_UNIQ_INFO", "INSTANCE_ID",
    PROPERTY_CORRELATION_ID, PROPERTY_MESSAGE_REPLY_TO_CLIENT, PROPERTY_MESSAGE_TTL, PROPERTY_REPLY_MESSAGE_ARRIVE_TIME,
    "PUSH_REPLY_TIME", PROPERTY_CLUSTER, PROPERTY_MESSAGE_TYPE, "INNER_MULTI_QUEUE_OFFSET", PROPERTY_TIMER_DELAY_SEC,
    PROPERTY_TIMER_DELIVER_MS, PROPERTY_TIMER_DELAY_MS, "TIMER_ENQUEUE_MS", "TIMER_DEQUEUE_MS", "TIMER_ROLL_TIMES",
    "TIMER_OUT_MS", "TIMER_DEL_UNIQKEY", "TIMER_DELAY_LEVEL", "__BORNHOST", "BORN_TIMESTAMP",
    PROPERTY_TRANSACTION_CHECK_TIMES,
})


def retry_topic(group: str) -> str:
    """A consumer group's retry topic: its members subscribe to it, the broker fills it with sent-back messages."""
    return RETRY_GROUP_TOPIC_PREFIX + group


# RocketMQ 5's KeyBuilder.POP_RETRY_SEPARATOR_V2. Outside the topic and group charset, so a POP retry topic name
# can be neither a user's topic nor a push consumers' ``%RETRY%<group>``, and splits back into one (group, topic)
# only: v1's ``%RETRY%<group>_<topic>`` was all three (``%RETRY%a_b`` is group a's POP retry of topic b and group
# a_b's push retry topic; ``a_b_c`` is (a, b_c) or (a_b, c)).
POP_RETRY_SEPARATOR = "+"


def pop_retry_topic(group: str, topic: str) -> str:
    """RocketMQ 5's POP retry topic (v2) of ``group`` consuming ``topic``: ``%RETRY%<group>+<topic>``, written only by
    the broker's revive and read only by the group's POPs of ``topic`` (``broker/pop.py``)."""
    return f"{RETRY_GROUP_TOPIC_PREFIX}{group}{POP_RETRY_SEPARATOR}{topic}"


def split_pop_retry_topic(name: str) -> tuple[str, str] | None:
    """(group, topic) of a POP retry topic name, None for any other name: the prefix, a legal group, '+', a legal
    topic, at most MAX_TOPIC_LENGTH characters in all."""
    if not name.startswith(RETRY_GROUP_TOPIC_PREFIX) or len(name) > MAX_TOPIC_LENGTH:
        return None
    group, sep, topic = name[len(RETRY_GROUP_TOPIC_PREFIX):].partition(POP_RETRY_SEPARATOR)
    if not sep or not group or not topic or not TOPIC_RE.fullmatch(group) or not TOPIC_RE.fullmatch(topic):
        return None
    return group, topic


def dlq_topic(group: str) -> str:
    """A consumer group's dead-letter topic."""
    return DLQ_GROUP_TOPIC_PREFIX + group


def destination_topic(topic: str, properties: Mapping[str, str]) -> str:
    """The topic a stored record is bound for: its REAL_TOPIC if it waits in one of the broker's REAL_TOPIC_HOLDERS
    (and names one), else the topic it is stored in."""
    if topic in REAL_TOPIC_HOLDERS:
        return properties.get(PROPERTY_REAL_TOPIC) or topic
    return topic


def first_topic(topic: str, properties: Mapping[str, str]) -> str:
    """The topic a stored record was first consumed from: the RETRY_TOPIC of a retry copy (a record bound for a
    ``%RETRY%`` topic, ``destination_topic``), else the topic it is bound for. Only a retry copy's RETRY_TOPIC was
    written by the broker (or by a consumer sending back); on any other record it is a sender's word, and read
    there it showed a handler another topic and made send-back need permissions on it."""
    destination = destination_topic(topic, properties)
    if destination.startswith(RETRY_GROUP_TOPIC_PREFIX):
        return properties.get(PROPERTY_RETRY_TOPIC) or destination
    return destination


def reply_topic(cluster: str) -> str:
    """A cluster's reply topic (RocketMQ's MixAll.getReplyTopic): every group leader of the cluster creates it."""
    return cluster + REPLY_TOPIC_SUFFIX


def split_keys(raw: str | None) -> list[str]:
    """The keys of a KEYS property value: space-separated, empty pieces dropped, as the IndexFile indexes them
    (``broker/store/dispatch.py`` splits the same way on bytes), so a key a message reports is a key it can be
    found by."""
    return [k for k in raw.split(KEY_SEPARATOR) if k] if raw else []


_KEYS_PAIR = PROPERTY_KEYS.encode("ascii") + b"\x01"
_UNIQ_PAIR = PROPERTY_UNIQ_KEY.encode("ascii") + b"\x01"


def _pair_value(props: bytes, pair: bytes) -> bytes:
    """The value of the pair named ``pair`` (``name\x01``) in a block of ``name\x01value\x02`` pairs, b"" when
    absent. A name starts the block or follows a \x02, so a longer name ending in it (``MYKEYS``) is not it."""
    if props.startswith(pair):
        at = len(pair)
    else:
        at = props.find(b"\x02" + pair)
        if at < 0:
            return b""
        at += 1 + len(pair)
    end = props.find(b"\x02", at)
    return props[at:end] if end >= 0 else props[at:]


def batch_index_keys(batch: bytes | memoryview) -> int:
    """The IndexFile entries the messages of ``batch`` (valid: ``scan_batch``) make: one per non-empty UNIQ_KEY
    and one per non-empty key of KEYS split on single spaces, the store's rule (``broker.store.dispatch_info``,
    whose entries the state machine builds into each DLedger entry at 12 bytes a key). Exact for properties whose
    names do not repeat, as ``scan_producer_batch`` holds a producer's. A walk of the headers with C-level searches and
    counts, nothing hashed: the broker's send path asks it only of batches whose properties could hold many keys
    (``scan_producer_batch``'s ``properties_bytes``)."""
    batch = bytes(batch)
    unpack = _ENTRY_SIZE_AND_BODY_LEN.unpack_from
    unpack_h = PROPS_LEN.unpack_from
    head = ENTRY_HEAD.size + BODY_LEN.size
    pos = BATCH_HEAD.size
    n = 0
    for _ in range(batch_count(batch)):
        entry_size, body_len = unpack(batch, pos)
        p = pos + head + body_len
        p += 1 + batch[p]
        props_len = unpack_h(batch, p)[0]
        if props_len:
            props = batch[p + 2:p + 2 + props_len]
            if _pair_value(props, _UNIQ_PAIR):
                n += 1
            keys = _pair_value(props, _KEYS_PAIR)
            if keys:
                spaces = keys.count(b" ")
                if spaces == 0 or (keys[0] != 32 and keys[-1] != 32 and b"  " not in keys):
                    n += spaces + 1
                else:  # empty pieces (leading, trailing or doubled spaces) make no entry
                    pieces = keys.split(b" ")
                    n += len(pieces) - pieces.count(b"")
        pos += entry_size
    return n


# RocketMQ's topic charset (TopicValidator), the one rule of every check of a topic or group name: client,
# broker and name server. Use ``TOPIC_RE.fullmatch``: ``re.match`` with "$" lets a trailing newline through.
TOPIC_CHARS = "%|a-zA-Z0-9_-"
TOPIC_RE = re.compile(f"[{TOPIC_CHARS}]+")
_TAIL_FIXED = BODY_LEN.size + 1 + PROPS_LEN.size  # body_len + topic_len + properties_len


class MessageFormatError(ValueError):
    """A message or batch is malformed; ``field`` names what was wrong (``topic``, ``body``, ``properties``,
    ``batch``, ``born_host`` ...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True, slots=True)
class MessageInput:
    """One message as a producer hands it over; ``properties`` carries TAGS, KEYS and UNIQ_KEY. As ``bytes``,
    ``properties`` is a stored record's block (``record_properties``), written again as it is: a message the broker
    stores again as it was, whose block ``encode_properties`` may not write (``property_block_problem``)."""

    topic: str
    queue_id: int
    body: bytes
    properties: Mapping[str, str] | bytes = dataclasses.field(default_factory=dict)
    flag: int = 0
    sys_flag: int = 0
    born_timestamp: int = 0
    born_host: tuple[str, int] = ("127.0.0.1", 0)
    reconsume_times: int = 0
    prepared_transaction_offset: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class MessageView:
    """One decoded commit-log record."""

    topic: str
    queue_id: int
    queue_offset: int
    phy_offset: int
    size: int
    flag: int
    sys_flag: int
    born_timestamp: int
    born_host: tuple[str, int]
    store_timestamp: int
    store_host: tuple[str, int]
    reconsume_times: int
    prepared_transaction_offset: int
    body_crc: int
    body: bytes
    properties: dict[str, str]

    @property
    def msg_id(self) -> str:
        return create_msg_id(self.store_host, self.phy_offset)

    @property
    def tags(self) -> str | None:
        return self.properties.get(PROPERTY_TAGS)

    @property
    def keys(self) -> list[str]:
        return split_keys(self.properties.get(PROPERTY_KEYS))

    @property
    def uniq_key(self) -> str | None:
        return self.properties.get(PROPERTY_UNIQ_KEY)


@lru_cache(maxsize=4096)
def ip_bytes(ip: str, field: str = "host") -> bytes:
    try:
        return socket.inet_pton(socket.AF_INET, ip)
    except (OSError, TypeError):
        raise MessageFormatError(field, f"{field} must be an IPv4 address, got {ip!r}") from None


def _host_bytes(host: tuple[str, int], field: str) -> tuple[bytes, int]:
    try:
        ip, port = host
    except (TypeError, ValueError):
        raise MessageFormatError(field, f"{field} must be (ip, port), got {host!r}") from None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise MessageFormatError(field, f"{field} port must be within 0..65535, got {port!r}")
    return ip_bytes(ip, field), port


@lru_cache(maxsize=4096)
def check_topic(topic: str) -> bytes:
    """The UTF-8 topic if it is legal (RocketMQ's charset ``%|a-zA-Z0-9_-``, 1..127 chars, or a POP retry topic's
    name: ``split_pop_retry_topic``), else raise."""
    if not isinstance(topic, str) or not topic:
        raise MessageFormatError("topic", f"topic must be a non-empty string, got {topic!r}")
    if len(topic) > MAX_TOPIC_LENGTH:
        raise MessageFormatError("topic", f"topic is {len(topic)} chars long, more than {MAX_TOPIC_LENGTH}")
    if not TOPIC_RE.fullmatch(topic) and split_pop_retry_topic(topic) is None:
        raise MessageFormatError("topic", f"topic {topic!r} contains characters outside %|a-zA-Z0-9_- (a '+' only in "
                                          f"a POP retry topic, %RETRY%<group>+<topic>)")
    return topic.encode("ascii")


GROUP_MAX_LENGTH = 255
# A client id (RocketMQ's ``ip@instance``; ours ``ip@pid#instance_name#n``) as a broker takes it in HEART_BEAT and
# UNREGISTER_CLIENT: it is kept per group, listed to every member and logged, so it is bounded like a group name.
CLIENT_ID_MAX_LENGTH = 255


@lru_cache(maxsize=4096)
def topic_problem(value: object) -> str | None:
    """What is wrong with a topic a config names (``check_topic``'s rule), None when it is legal: the clients' and
    the brokers' checks of their trace topics."""
    try:
        check_topic(value)
    except MessageFormatError as e:
        return f"must be a topic name ({e})"
    return None


def group_problem(group: str) -> str | None:
    """What is wrong with a producer or consumer group name (RocketMQ's ``Validators.checkGroup``: the topic
    charset, at most 255 characters), None when it is legal: the broker's check of every request naming a group,
    and the clients' check of their config (so a bad name fails when a client opens, not in every heartbeat)."""
    if not group:
        return "must not be empty"
    if len(group) > GROUP_MAX_LENGTH:
        return f"is {len(group)} characters long; at most {GROUP_MAX_LENGTH} are allowed"
    if not TOPIC_RE.fullmatch(group):
        return "contains illegal characters; allowed are letters, digits, '%', '|', '_' and '-'"
    return None


def encode_properties(properties: Mapping[str, str]) -> bytes:
    parts = []
    for name, value in properties.items():
        if not isinstance(name, str) or not isinstance(value, str) or not name:
            raise MessageFormatError("properties", f"property {name!r}={value!r} must map a non-empty str to a str")
        if "\x01" in name or "\x02" in name or "\x01" in value or "\x02" in value:
            raise MessageFormatError("properties", f"property {name!r} contains a \\x01 or \\x02 separator byte")
        parts.append(f"{name}\x01{value}\x02")
    data = "".join(parts).encode("utf-8")
    if len(data) > MAX_PROPERTIES_SIZE:
        raise MessageFormatError("properties",
                                 f"properties take {len(data)} bytes encoded, more than {MAX_PROPERTIES_SIZE}")
    return data


def property_block_problem(data: bytes) -> str | None:
    """Why ``data`` (UTF-8 properties bytes) is not a block ``encode_properties`` writes (None if it is): the one
    rule of a well-formed block, whatever path a message came by. A block it does not write (an empty name, a pair
    without \\x01 or with two, a name twice) reads back as other properties (``decode_properties``), which
    ``encode_properties`` refuses or writes otherwise: every path that stores the message again (send-back, POP
    revive, delayed delivery) failed on it, or changed it."""
    try:
        again = encode_properties(decode_properties(data))
    except MessageFormatError as e:
        return str(e)
    if again != data:
        return "they are not name\\x01value\\x02 pairs with a non-empty name each, no name twice"
    return None


def decode_properties(data: bytes | memoryview) -> dict[str, str]:
    # A broker refuses properties that are not UTF-8 (scan_batch); bytes stored before it did, or damaged on
    # disk (the CRC covers only the body), read with U+FFFD in their place, as RocketMQ's Java decoding does,
    # rather than make the record unreadable for every consumer.
    out: dict[str, str] = {}
    for pair in bytes(data).decode("utf-8", "replace").split("\x02"):
        if pair:
            name, _, value = pair.partition("\x01")
            out[name] = value
    return out


def _int_field(value: object, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise MessageFormatError(name, f"{name} must be an integer within {lo}..{hi}, got {value!r}")
    return value


# Java's int and long, the types of RocketMQ's header and record fields: every process checks against these.
I32 = (-(2 ** 31), 2 ** 31 - 1)
I64 = (-(2 ** 63), 2 ** 63 - 1)


def encode_batch(messages: Sequence[MessageInput], store_host: tuple[str, int], *,
                 max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> bytes:
    """The batch layout of ``messages``; raises ``MessageFormatError`` naming the first bad field."""
    if not messages:
        raise MessageFormatError("batch", "a batch must hold at least one message")
    store_ip, store_port = _host_bytes(store_host, "store_host")
    out = bytearray(BATCH_HEAD.pack(BATCH_MAGIC, len(messages), store_ip, store_port))
    for m in messages:
        topic = check_topic(m.topic)
        body = m.body
        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise MessageFormatError("body", f"body must be bytes, got {type(body).__name__}")
        if len(body) > max_message_size:
            raise MessageFormatError("body", f"body of {len(body)} bytes exceeds max_message_size {max_message_size}")
        props = _input_properties(m)
        born_ip, born_port = _host_bytes(m.born_host, "born_host")
        entry_size = ENTRY_HEAD.size + _TAIL_FIXED + len(body) + len(topic) + len(props)
        out += ENTRY_HEAD.pack(entry_size, _int_field(m.queue_id, "queue_id", 0, I32[1]),
                               _int_field(m.flag, "flag", *I32), _int_field(m.sys_flag, "sys_flag", *I32),
                               _int_field(m.born_timestamp, "born_timestamp", *I64), born_ip, born_port,
                               _int_field(m.reconsume_times, "reconsume_times", *I32),
                               _int_field(m.prepared_transaction_offset, "prepared_transaction_offset", *I64))
        out += BODY_LEN.pack(len(body))
        out += body
        out.append(len(topic))
        out += topic
        out += PROPS_LEN.pack(len(props))
        out += props
    return bytes(out)


def _input_properties(message: MessageInput) -> bytes:
    properties = message.properties
    if type(properties) is not bytes:
        return encode_properties(properties) if properties else b""
    if len(properties) > MAX_PROPERTIES_SIZE:  # a record's block never is; checked as the layout needs it
        raise MessageFormatError("properties", f"properties take {len(properties)} bytes, more than "
                                               f"{MAX_PROPERTIES_SIZE}")
    return properties


# A one-message batch's fixed part in one pack: BATCH_HEAD, ENTRY_HEAD and the body length, as drawn above.
_SINGLE_HEAD = struct.Struct(">" + BATCH_HEAD.format[1:] + ENTRY_HEAD.format[1:] + BODY_LEN.format[1:])


def encode_single_batch(topic: bytes, queue_id: int, body: bytes, props: bytes, flag: int, sys_flag: int,
                        born_timestamp: int, born_ip: bytes, born_port: int, reconsume_times: int,
                        store_ip: bytes, store_port: int) -> bytes:
    """The batch layout of one message, byte for byte what ``encode_batch`` writes, for a caller (the broker's
    single send) that has already checked every field: ``topic`` from ``check_topic``, ``props`` from
    ``encode_properties``, integers in their ranges, 4-byte IPs. Skips the per-field checks and objects."""
    head = _SINGLE_HEAD.pack(BATCH_MAGIC, 1, store_ip, store_port,
                             ENTRY_HEAD.size + _TAIL_FIXED + len(body) + len(topic) + len(props), queue_id, flag,
                             sys_flag, born_timestamp, born_ip, born_port, reconsume_times, 0, len(body))
    return b"".join((head, body, len(topic).to_bytes(1, "big"), topic, PROPS_LEN.pack(len(props)), props))


_ENTRY_AND_BODY_LEN = struct.Struct(">" + ENTRY_HEAD.format[1:] + BODY_LEN.format[1:])


def encode_uniform_batch(topic: bytes, queue_id: int, items: Sequence[tuple[bytes, bytes, int]],
                         born_timestamp: int, born_host: tuple[bytes, int], store_host: tuple[bytes, int]) -> bytes:
    """The batch layout of messages sharing topic, queue, born timestamp and hosts (a producer's batch), byte
    for byte what ``encode_batch`` writes. ``items`` are ``(body, properties, flag)`` the caller has checked:
    ``topic`` from ``check_topic``, properties from ``encode_properties``, flags within int32, bodies within the
    size limit, hosts as (4-byte IP, port). One pack per message instead of a checked object per field."""
    born_ip, born_port = born_host
    parts = [BATCH_HEAD.pack(BATCH_MAGIC, len(items), store_host[0], store_host[1])]
    topic_tail = bytes((len(topic),)) + topic
    fixed = ENTRY_HEAD.size + _TAIL_FIXED + len(topic)
    pack = _ENTRY_AND_BODY_LEN.pack
    props_len = PROPS_LEN.pack
    for body, props, flag in items:
        parts += (pack(fixed + len(body) + len(props), queue_id, flag, 0, born_timestamp, born_ip, born_port, 0, 0,
                       len(body)), body, topic_tail, props_len(len(props)), props)
    return b"".join(parts)


def batch_count(batch: bytes | memoryview) -> int:
    return BATCH_HEAD.unpack_from(batch, 0)[1]


def batch_store_host(batch: bytes | memoryview) -> tuple[str, int]:
    _, _, ip, port = BATCH_HEAD.unpack_from(batch, 0)
    return socket.inet_ntop(socket.AF_INET, ip), port


class CheckedBatch(bytes):
    """Batch bytes this process has already checked (``scan_batch``) or built field by field
    (``encode_single_batch``), with their message ``count``: the store takes the count instead of scanning the
    batch again. Only code in this process can make one, so bytes from the network never skip the check."""

    count: int

    def __new__(cls, data: bytes | bytearray | memoryview, count: int) -> CheckedBatch:
        self = super().__new__(cls, data)
        self.count = count
        return self


def validate_batch(batch: bytes | memoryview, *, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> int:
    """Check the whole batch structure (sizes, topics, properties length) without decoding bodies; returns the
    message count or raises ``MessageFormatError``. The store calls this before writing any byte."""
    return scan_batch(batch, max_message_size=max_message_size)[0]


def scan_batch(batch: bytes | memoryview, *, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
               topic: bytes | None = None, queue_id: int | None = None,
               from_producer: bool = False) -> tuple[int, bool]:
    """``validate_batch`` that also holds every message to one ``topic`` (a mismatch is a MessageFormatError
    with field ``batch_topic``) and tells whether every message already names ``queue_id``: one pass for a
    broker taking a SEND_BATCH_MESSAGE. Returns ``(count, all_in_queue)``; ``scan_producer_batch`` also sums the
    properties' lengths.

    ``from_producer``: also refuse what a single send refuses of a producer, a negative ``born_timestamp`` or
    ``reconsume_times`` (field named so, with the message index), a DELAY property (field ``delay``), a
    transaction type in ``sys_flag`` (field ``transaction``), properties not ending with ``\x02`` as every pair
    does (field ``properties``: recovery would take such a record, last in the log, for a torn tail), properties
    ``encode_properties`` would not write (field ``properties``, ``property_block_problem``: the single send's
    rule). Only for bytes a producer just sent: the store's and replication's checks of written batches leave it off, so
    records stored before this rule (or by an older broker) stay readable and replicable."""
    count, all_in_queue, _ = _scan_batch(batch, max_message_size, topic, queue_id, from_producer)
    return count, all_in_queue


def scan_producer_batch(batch: bytes | memoryview, *, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
                        topic: bytes | None = None, queue_id: int | None = None) -> tuple[int, bool, int]:
    """``scan_batch`` with ``from_producer``, in the same pass summing the messages' properties lengths: returns
    ``(count, all_in_queue, properties_bytes)``. Half of ``properties_bytes`` bounds the batch's index keys
    (``batch_index_keys``): a key of KEYS takes two bytes at least (itself and a separator), a UNIQ_KEY pair eleven,
    so a broker counts them exactly only for a batch whose bound is high, and its usual batch pays one addition a
    message."""
    return _scan_batch(batch, max_message_size, topic, queue_id, True)


def _scan_batch(batch: bytes | memoryview, max_message_size: int, topic: bytes | None, queue_id: int | None,
                from_producer: bool) -> tuple[int, bool, int]:
    if not isinstance(batch, bytes):
        batch = bytes(batch)
    n = len(batch)
    if n < BATCH_HEAD.size:
        raise MessageFormatError("batch", f"batch of {n} bytes is shorter than its {BATCH_HEAD.size}-byte header")
    magic, count, _, _ = BATCH_HEAD.unpack_from(batch, 0)
    if magic != BATCH_MAGIC:
        raise MessageFormatError("batch", f"batch magic is {magic:#x}, expected {BATCH_MAGIC:#x}")
    if count <= 0:
        raise MessageFormatError("batch", "a batch must hold at least one message")
    pos = BATCH_HEAD.size
    # Signed sign bytes for a producer's batch, unsigned for a written one (see _ENTRY_CHECKED).
    unpack_head = (_ENTRY_CHECKED if from_producer else _ENTRY_CHECKED_STORED).unpack_from
    unpack_h = PROPS_LEN.unpack_from
    head = ENTRY_HEAD.size
    good_topics = _GOOD_TOPICS
    producer_block = _PRODUCER_BLOCK.fullmatch
    all_in_queue = True
    properties_bytes = 0
    for i in range(count):
        if pos + head + _TAIL_FIXED > n:
            raise MessageFormatError("batch", f"batch ends inside message {i} header")
        entry_size, qid, sys_low, born_sign, reconsume_sign, body_len = unpack_head(batch, pos)
        end = pos + entry_size
        if entry_size < head + _TAIL_FIXED or end > n:
            raise MessageFormatError("batch", f"message {i} size {entry_size} does not fit the batch")
        if qid | born_sign | reconsume_sign < 0:  # any of them negative: one compare on the hot path
            _negative_field(batch, pos, i)
        if sys_low & TRANSACTION_TYPE_MASK and from_producer:
            # A half message waits in the half topic for its own END_TRANSACTION; a batch is one queue (RocketMQ's
            # CommitLog refuses a transactional batch the same way).
            raise MessageFormatError("transaction", f"message {i} of the batch is transactional (sys_flag "
                                                    f"{sys_low & TRANSACTION_TYPE_MASK:#x}); transactional messages "
                                                    f"are sent one by one (send_in_transaction)")
        if qid != queue_id:
            all_in_queue = False
        if body_len < 0 or body_len > max_message_size:
            raise MessageFormatError("body", f"message {i} body of {body_len} bytes exceeds max_message_size "
                                             f"{max_message_size}")
        t = pos + head + 4 + body_len
        if t + 3 > end:
            raise MessageFormatError("batch", f"message {i} body length {body_len} overruns its entry")
        p = t + 1 + batch[t]
        if p + 2 > end:
            raise MessageFormatError("batch", f"message {i} topic length overruns its entry")
        entry_topic = batch[t + 1:p]
        if entry_topic not in good_topics:
            _check_topic_bytes(entry_topic, i)
            if len(good_topics) < 100_000:
                good_topics.add(entry_topic)
        if topic is not None and entry_topic != topic:
            raise MessageFormatError("batch_topic", f"message {i} of the batch is for topic "
                                                    f"{entry_topic.decode('ascii')!r}, but the request names "
                                                    f"topic {topic.decode('ascii')!r}; a batch goes to one topic")
        props_len = unpack_h(batch, p)[0]
        if props_len > MAX_PROPERTIES_SIZE:
            raise MessageFormatError("properties", f"message {i} properties take {props_len} bytes, more than "
                                                   f"{MAX_PROPERTIES_SIZE}")
        if p + 2 + props_len != end:
            raise MessageFormatError("batch", f"message {i} entry size {entry_size} disagrees with its fields")
        # Properties are stored as sent and read as UTF-8: bytes that are not would come back altered (U+FFFD,
        # see decode_properties), so they are refused here. ASCII, the usual case, is checked in C.
        if props_len:
            properties_bytes += props_len
            props = batch[p + 2:end]
            # RocketMQ's encoding ends every pair with \x02, and the commit log's recovery reads a record whose last
            # byte is 0 with nothing after it as a torn tail: stored, such a record could be cut after a crash.
            if from_producer and props[-1] != 2:
                raise MessageFormatError("properties", f"message {i} properties end with byte {props[-1]:#04x}, not "
                                                       f"\\x02: each name\\x01value pair ends with \\x02")
            if not props.isascii():
                try:
                    props.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise MessageFormatError("properties", f"message {i} properties are not UTF-8 ({e.reason} at "
                                                           f"byte {e.start})") from None
            # One C pass for the usual block: pairs as encode_properties writes them, with no DELAY (a delayed
            # message waits in its level's queue, not in the batch's, as RocketMQ's MessageBatch refuses it). A name
            # twice needs a split to see; anything else goes to _refuse_properties, which says what it is.
            if from_producer and (producer_block(props) is None
                                  or (props.count(2) > 1 and _names_repeat(props))):
                _refuse_properties(props, i)
        pos = end
    if pos != n:
        raise MessageFormatError("batch", f"batch has {n - pos} trailing bytes after {count} messages")
    return count, all_in_queue, properties_bytes


def _producer_block(refused: Sequence[str]) -> re.Pattern[bytes]:
    """A fullmatch of name\\x01value\\x02 pairs, none of whose names is in ``refused``."""
    names = b"|".join(re.escape(name.encode("ascii")) for name in refused)
    return re.compile(rb"(?:(?!(?:" + names + rb")\x01)[^\x01\x02]+\x01[^\x01\x02]*\x02)*")


_PRODUCER_BLOCK = _producer_block((PROPERTY_DELAY,))


def _names_repeat(props: bytes) -> bool:
    # Names are non-empty (the pattern held), so the empty piece after the last \x02 repeats none of them.
    pieces = props.split(b"\x02")
    return len({piece.partition(b"\x01")[0] for piece in pieces}) != len(pieces)


def _refuse_properties(props: bytes, index: int) -> None:
    """Raise the MessageFormatError for message ``index``'s ``props``, which failed scan_batch's fast check."""
    problem = property_block_problem(props)
    if problem is not None:
        raise MessageFormatError("properties", f"message {index} properties are malformed: {problem}")
    if PROPERTY_DELAY not in decode_properties(props):  # the fast check and this one disagree: a defect
        raise AssertionError(f"message {index} properties failed the batch check for no reason found: {props!r}")
    raise MessageFormatError("delay", f"message {index} of the batch is delayed (property {PROPERTY_DELAY}); delayed "
                                      f"messages are sent one by one")
_GOOD_TOPICS: set[bytes] = set()  # topics already found legal: the check is then one set lookup
# What scan_batch reads of an entry in one unpack: ENTRY_HEAD's entry_size and queue_id, the low byte of sys_flag
# (offset 15: its transaction type bits), the first (sign) byte of born_timestamp (offset 16) and of reconsume_times
# (offset 32), and the body length after the head (offset 44).
# The sign bytes are signed for a producer's batch, so a negative field reads negative, and unsigned (never
# negative, never refused) for the store's check of written batches. A byte, not the whole field: a small int
# costs no allocation; and one unpack instead of two pays for the two ORs of the check.
_ENTRY_CHECKED = struct.Struct(">ii7xBb15xb11xi")
_ENTRY_CHECKED_STORED = struct.Struct(">ii7xBB15xB11xi")
_ENTRY_SIZE_AND_BODY_LEN = struct.Struct(">i40xi")  # ENTRY_HEAD's entry_size, then the body length after the head
assert _ENTRY_CHECKED.size == _ENTRY_SIZE_AND_BODY_LEN.size == ENTRY_HEAD.size + BODY_LEN.size


def _negative_field(batch: bytes, pos: int, index: int) -> None:
    _, queue_id, _, _, born_timestamp, _, _, reconsume_times, _ = ENTRY_HEAD.unpack_from(batch, pos)
    for name, value in (("queue_id", queue_id), ("born_timestamp", born_timestamp),
                        ("reconsume_times", reconsume_times)):
        if value < 0:
            raise MessageFormatError(name, f"message {index} {name} must be >= 0, got {value}")


def _check_topic_bytes(topic: bytes, index: int = 0) -> None:
    try:
        text = topic.decode("ascii")
    except UnicodeDecodeError:
        raise MessageFormatError("topic", f"message {index} topic {topic!r} is not ASCII") from None
    try:
        check_topic(text)
    except MessageFormatError as e:
        raise MessageFormatError("topic", f"message {index}: {e}") from None


def decode_batch(batch: bytes | memoryview) -> tuple[tuple[str, int], list[MessageInput]]:
    """``(store_host, messages)`` of a batch (validated first)."""
    count = validate_batch(batch, max_message_size=2 ** 31 - 1)
    mv = memoryview(batch)
    store_host = batch_store_host(mv)
    out = []
    pos = BATCH_HEAD.size
    for _ in range(count):
        (entry_size, queue_id, flag, sys_flag, born_ts, born_ip, born_port, reconsume,
         prepared) = ENTRY_HEAD.unpack_from(mv, pos)
        body, topic, props = _split_tail(mv, pos + ENTRY_HEAD.size)
        out.append(MessageInput(topic, queue_id, body, decode_properties(props), flag, sys_flag, born_ts,
                                (socket.inet_ntop(socket.AF_INET, born_ip), born_port), reconsume, prepared))
        pos += entry_size
    return store_host, out


def _split_tail(mv: memoryview, pos: int) -> tuple[bytes, str, memoryview]:
    body_len = BODY_LEN.unpack_from(mv, pos)[0]
    b = pos + 4
    t = b + body_len
    topic_len = mv[t]
    p = t + 1 + topic_len
    props_len = PROPS_LEN.unpack_from(mv, p)[0]
    try:
        topic = str(mv[t + 1:p], "ascii")
    except UnicodeDecodeError:
        raise MessageFormatError("topic", f"topic {bytes(mv[t + 1:p])!r} is not ASCII") from None
    return bytes(mv[b:t]), topic, mv[p + 2:p + 2 + props_len]


def record_properties(data: bytes | memoryview) -> bytes:
    """The properties block of the record ``data`` starts with (a valid one: the store's), as stored, not decoded:
    what a message stored again as it was carries (``MessageInput.properties`` as bytes). A block a broker took
    from a batch before scan_batch refused the ones ``encode_properties`` does not write reads back as properties
    that cannot be encoded again."""
    mv = memoryview(data)
    return bytes(_split_tail(mv[:RECORD_HEAD.unpack_from(mv, 0)[0]], RECORD_HEAD.size)[2])


def record_size(body_len: int, topic_len: int, properties_len: int) -> int:
    return RECORD_HEAD.size + _TAIL_FIXED + body_len + topic_len + properties_len


def encode_record(buf: bytearray | memoryview, offset: int, message: MessageInput, *, queue_offset: int,
                  phy_offset: int, store_timestamp: int, store_host: tuple[str, int]) -> int:
    """Write one record of ``message`` at ``buf[offset:]``; returns its size. The store's hot path copies
    batch tails instead; this is the reference the tests and tools use."""
    topic = check_topic(message.topic)
    props = _input_properties(message)
    body = bytes(message.body)
    size = record_size(len(body), len(topic), len(props))
    born_ip, born_port = _host_bytes(message.born_host, "born_host")
    store_ip, store_port = _host_bytes(store_host, "store_host")
    RECORD_HEAD.pack_into(buf, offset, size, MESSAGE_MAGIC, crc32c(body), message.queue_id, message.flag,
                          queue_offset, phy_offset, message.sys_flag, message.born_timestamp, born_ip, born_port,
                          store_timestamp, store_ip, store_port, message.reconsume_times,
                          message.prepared_transaction_offset)
    pos = offset + RECORD_HEAD.size
    tail = BODY_LEN.pack(len(body)) + body + bytes([len(topic)]) + topic + PROPS_LEN.pack(len(props)) + props
    buf[pos:pos + len(tail)] = tail
    return size


def decode_record(data: bytes | memoryview, offset: int = 0, *, check_crc: bool = True) -> MessageView:
    """Decode the record at ``data[offset:]``; raises ``MessageFormatError`` if it is not a whole, valid one."""
    mv = memoryview(data)
    if offset + RECORD_HEAD.size + _TAIL_FIXED > len(mv):
        raise MessageFormatError("record", f"record at {offset} is truncated")
    (size, magic, body_crc, queue_id, flag, queue_offset, phy_offset, sys_flag, born_ts, born_ip, born_port,
     store_ts, store_ip, store_port, reconsume, prepared) = RECORD_HEAD.unpack_from(mv, offset)
    if magic != MESSAGE_MAGIC:
        raise MessageFormatError("record", f"record at {offset} has magic {magic:#x}, not a message")
    if size < RECORD_HEAD.size + _TAIL_FIXED or offset + size > len(mv):
        raise MessageFormatError("record", f"record at {offset} has a bad size {size}")
    body_len = BODY_LEN.unpack_from(mv, offset + RECORD_HEAD.size)[0]
    if body_len < 0 or RECORD_HEAD.size + _TAIL_FIXED + body_len > size:
        raise MessageFormatError("record", f"record at {offset} has a bad body length {body_len}")
    t = offset + RECORD_HEAD.size + 4 + body_len
    p = t + 1 + mv[t]
    if p + 2 > offset + size or p + 2 + PROPS_LEN.unpack_from(mv, p)[0] != offset + size:
        raise MessageFormatError("record", f"record at {offset} has fields that disagree with its size {size}")
    body, topic_raw, props = _split_tail(mv[:offset + size], offset + RECORD_HEAD.size)
    if check_crc and crc32c(body) != body_crc:
        raise MessageFormatError("record", f"record at {offset} fails its body CRC")
    properties = decode_properties(props)
    return MessageView(topic_raw, queue_id, queue_offset, phy_offset, size, flag, sys_flag, born_ts,
                       (socket.inet_ntop(socket.AF_INET, born_ip), born_port), store_ts,
                       (socket.inet_ntop(socket.AF_INET, store_ip), store_port), reconsume, prepared, body_crc,
                       body, properties)


def iter_records(data: bytes | memoryview, *, check_crc: bool = True) -> Iterator[MessageView]:
    """Decode consecutive records (a pulled message set is a concatenation of raw records)."""
    mv = memoryview(data)
    pos = 0
    while pos < len(mv):
        view = decode_record(mv, pos, check_crc=check_crc)
        yield view
        pos += view.size


# decode_records: the 84-byte head and the body length in one unpack.
_HEAD_AND_BODY_LEN = struct.Struct(RECORD_HEAD.format + BODY_LEN.format[1:])
_MIN_RECORD = RECORD_HEAD.size + _TAIL_FIXED
_HOSTS: dict[tuple[bytes, int], tuple[str, int]] = {}  # store hosts already seen: one lookup, no inet_ntop
_TOPICS: dict[bytes, str] = {}  # topics already decoded


def decode_records(data: bytes, *, check_crc: bool = True) -> list[tuple]:
    """The records of a pulled message set as plain tuples, for a consumer's hot path; same checks and errors as
    ``iter_records`` but no ``MessageView`` and no per-field work a consumer never sees (born host, record size,
    body CRC field). Each tuple is ``(topic, body, queue_id, queue_offset, properties_raw, phy_offset,
    born_timestamp, store_timestamp, store_host, reconsume_times, sys_flag, flag)``; ``properties_raw`` is
    the encoded properties (``bytes``), for ``decode_properties`` when someone asks."""
    if not isinstance(data, bytes):
        data = bytes(data)
    n = len(data)
    out = []
    append = out.append
    unpack_head = _HEAD_AND_BODY_LEN.unpack_from
    unpack_h = PROPS_LEN.unpack_from
    hosts = _HOSTS
    topics = _TOPICS
    head = RECORD_HEAD.size + 4
    pos = 0
    while pos < n:
        if pos + _MIN_RECORD > n:
            raise MessageFormatError("record", f"record at {pos} is truncated")
        (size, magic, body_crc, queue_id, flag, queue_offset, phy_offset, sys_flag, born_ts, _, _,
         store_ts, store_ip, store_port, reconsume, _, body_len) = unpack_head(data, pos)
        if magic != MESSAGE_MAGIC:
            raise MessageFormatError("record", f"record at {pos} has magic {magic:#x}, not a message")
        end = pos + size
        if size < _MIN_RECORD or end > n:
            raise MessageFormatError("record", f"record at {pos} has a bad size {size}")
        if body_len < 0 or _MIN_RECORD + body_len > size:
            raise MessageFormatError("record", f"record at {pos} has a bad body length {body_len}")
        b = pos + head
        t = b + body_len
        p = t + 1 + data[t]
        if p + 2 > end or p + 2 + unpack_h(data, p)[0] != end:
            raise MessageFormatError("record", f"record at {pos} has fields that disagree with its size {size}")
        raw_topic = data[t + 1:p]
        topic = topics.get(raw_topic)
        if topic is None:
            try:
                topic = raw_topic.decode("ascii")
            except UnicodeDecodeError:
                raise MessageFormatError("topic", f"topic {raw_topic!r} is not ASCII") from None
            if len(topics) < 10_000:
                topics[raw_topic] = topic
        body = data[b:t]
        if check_crc and crc32c(body) != body_crc:
            raise MessageFormatError("record", f"record at {pos} fails its body CRC")
        props = data[p + 2:end]
        host = hosts.get((store_ip, store_port))
        if host is None:
            host = (socket.inet_ntop(socket.AF_INET, store_ip), store_port)
            if len(hosts) < 10_000:
                hosts[(store_ip, store_port)] = host
        append((topic, body, queue_id, queue_offset, props, phy_offset, born_ts, store_ts, host, reconsume,
                sys_flag, flag))
        pos = end
    return out


def create_msg_id(store_host: tuple[str, int], phy_offset: int) -> str:
    ip, port = _host_bytes(store_host, "store_host")
    return MSG_ID.pack(ip, port, phy_offset).hex().upper()


def create_msg_ids(store_host: tuple[str, int], phy_offsets: Sequence[int]) -> list[str]:
    """``create_msg_id`` of each offset: the host part is encoded once, each offset formatted straight to hex
    (a batch's answer carries one id per message)."""
    if not phy_offsets:
        return []
    if min(phy_offsets) < 0:
        return [create_msg_id(store_host, p) for p in phy_offsets]
    prefix = create_msg_id(store_host, 0)[:16]
    return [f"{prefix}{p:016X}" for p in phy_offsets]


def parse_msg_id(msg_id: str) -> tuple[tuple[str, int], int]:
    """``((store ip, port), phy_offset)`` of an offset message id."""
    try:
        raw = bytes.fromhex(msg_id)
    except (ValueError, TypeError):
        raise MessageFormatError("msg_id", f"msg_id {msg_id!r} is not hex") from None
    if len(raw) != MSG_ID.size:
        raise MessageFormatError("msg_id", f"msg_id {msg_id!r} must be {MSG_ID.size * 2} hex digits")
    ip, port, phy = MSG_ID.unpack(raw)
    # The layout has room for what no broker writes: a port past 65535 and (the offset is signed) a negative offset.
    if port > 65535 or phy < 0:
        raise MessageFormatError("msg_id", f"msg_id {msg_id!r} names port {port} and commit-log offset {phy}; "
                                           f"a message id holds a port within 0..65535 and an offset >= 0")
    return (socket.inet_ntop(socket.AF_INET, ip), port), phy


# The longest tag expression a broker takes in a pull or a heartbeat; the client refuses a longer subscription
# when it is made, not in every pull.
MAX_TAG_EXPRESSION_LENGTH = 4096


# Tags up to this long are remembered by tags_code (and the dispatch's own cache): a tag may be 32 KB, and caches
# bounded by their count alone held gigabytes of distinct long tags a producer chose (4,000 tags of 30 KB: +244 MiB).
CACHED_TAG_MAX_LENGTH = 256


def tags_code(tags: str | None) -> int:
    """RocketMQ's tags code: Java's ``String.hashCode`` of the tag (0 for no tag), as a signed 64-bit value."""
    if not tags:
        return 0
    if len(tags) <= CACHED_TAG_MAX_LENGTH:
        return _cached_tags_code(tags)
    return _java_string_hash(tags)


@lru_cache(maxsize=65536)
def _cached_tags_code(tags: str) -> int:
    return _java_string_hash(tags)


def _java_string_hash(tags: str) -> int:
    h = 0
    for ch in tags.encode("utf-16-be").decode("utf-16-be"):
        cp = ord(ch)
        if cp > 0xFFFF:  # Java hashes UTF-16 code units: split astral characters into surrogates
            cp -= 0x10000
            h = (31 * h + (0xD800 + (cp >> 10))) & 0xFFFFFFFF
            cp = 0xDC00 + (cp & 0x3FF)
        h = (31 * h + cp) & 0xFFFFFFFF
    return h - (1 << 32) if h >= (1 << 31) else h
