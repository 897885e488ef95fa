"""Message trace (RocketMQ's msg trace): who sent a message, where it was stored, who consumed it and how it went.

A producer, push consumer or lite pull consumer opened with ``enable_msg_trace=True`` records a *trace context*
for each message it sends or hands to its handler or its caller, and sends them, batched, to the trace topic
(``trace_topic``, RocketMQ's ``RMQ_SYS_TRACE_TOPIC`` by default) through an inner producer of its own, so ``raftmq
admin query-msg-trace --msg-id ID`` finds them by the traced message's id (``AdminClient.query_msg_trace``). The rules:

- **What is recorded.** A send that returned a ``SendResult`` (``send``, auto-batched or not, a reply, each message
  of ``send_batch``, the half of ``send_in_transaction``, the request message of ``request``) records a ``Pub``
  context: producer group, topic, msg id, tags, keys, store host, body length, cost, message type, offset msg id,
  success (``SEND_OK``) and client host; ``send_in_transaction`` adds an ``EndTransaction`` one with the local
  transaction's outcome. A request's Pub is its send's, once that send succeeded: its own ids, the send's cost (not
  the wait for the reply), whether a reply came or not. A send that raised records nothing, as RocketMQ's hook (its
  caller never learnt the id a trace would be found by), nor does a request whose send raised. ``send_oneway``
  records one with success true (handed to the connection: nothing comes back) and no store host, its id given to
  the message before it goes. A transaction check-back the producer answers records an ``EndTransaction`` context
  with ``from_transaction_check`` true (RocketMQ's ``checkTransactionState``): the state its listener's ``check``
  answered, the half's msg id (also the transaction id) and store host, the producer group; recorded as the answer
  is sent, delivered or not, as RocketMQ's. A handler call of a push consumer (concurrent, batch or orderly) records
  a ``SubBefore`` context per message as it starts (consumer group, request id, msg id, reconsume times, keys,
  client host) and a ``SubAfter`` one as it ends (cost, success, ``ConsumeReturnType`` code: a failed message's is
  TIME_OUT if its call ran past the consume timeout, else EXCEPTION if the handler raised, FAILED if it asked to be
  called again (``ReconsumeLater``, ``RECONSUME_LATER``), RETURN_NULL if it returned what is no ``ConsumeStatus``,
  as RocketMQ's consume services for a listener that threw, returned RECONSUME_LATER, returned null); a call cancelled
  (its queue taken away) leaves its SubBefore alone, as the message is delivered again. Messages handed to the
  caller's own code are *held* rather than handled (``ConsumeHook.hold_started`` / ``hold_ended``): the iterator
  form's ``async for`` records a SubBefore as ``__anext__`` hands a message out and a SubAfter (success, cost: the
  time the caller held it) once it is acknowledged (the next ``__anext__``, ``ack_pending``, the block ended
  normally); one never acknowledged (its queue taken away meanwhile, the block left by an exception) leaves its
  SubBefore alone, as a cancelled call does. A lite pull consumer's ``poll`` records, per queue of what it
  returns, a SubBefore and then a SubAfter (success) per message before it returns, as RocketMQ's
  DefaultLitePullConsumer runs its consume hook in ``poll``. The consumer's tracer is a subscriber of its
  ``ConsumeHook`` (``client/consume_hook.py``), as the running info's statistics are: both are told of the same
  calls, with the same count of messages consumed (a batch's head, up to ``ack_index``; a handler of one message
  fails its message whatever ``ack_index`` it raised); holds are the tracer's alone, the statistics counting what
  was consumed through ``handed_out`` as before. Messages of the trace topic itself are never traced, nor is
  anything the inner producer sends.
- **The path stays fast.** Recording is ``TraceDispatcher.append``: no wait, no I/O. Its queue is bounded
  (``max_queued``): when full, the context is dropped and counted (``statistics().dropped``), never waited for.
  Off (the default), a producer is the plain ``Producer`` (``request`` and a check's answer included), and a
  consumer's hook has no trace subscriber: its handler calls pay an empty loop for it, and the messages the
  iterator or ``poll`` hands out one attribute test (``ConsumeHook.holds_heard``).
- **Batching.** A background task sends trace messages of at most ``batch_size`` contexts, ``max_message_bytes`` of
  text and ``MAX_KEYS_BYTES`` of keys: one as soon as ``batch_size`` contexts wait, one of fewer only once the
  oldest of them has waited ``flush_interval_ms`` (what arrives while a message is sent waits its turn, so a busy
  client's contexts go ``batch_size`` to a message); closing the client flushes the rest (shielded, at most
  ``CLOSE_FLUSH_S``). A trace message that cannot be sent is counted (``statistics().failed_contexts``) and logged
  the first and every 100th time, not retried beyond its producer's own retries: traces are best effort, as
  RocketMQ's, and a trace topic missing fails every one.
- **Where it goes.** A trace message's KEYS are the msg ids it traces and their messages' keys, so the brokers'
  index finds it by either (``query_message``); its producer group is ``_INNER_TRACE_PRODUCER-<trace_topic>``.

The body is RocketMQ's ``TraceDataEncoder`` text, so a RocketMQ user reading the topic recognises it: each context
is its fields joined by ``CONTENT_SEPARATOR`` (char 1) and ended by ``FIELD_SEPARATOR`` (char 2), one after another.
Field orders (index: field), with a missing tag or key written ``null`` as Java writes it:

    Pub             0 Pub, 1 timestamp, 2 region id, 3 producer group, 4 topic, 5 msg id, 6 tags, 7 keys,
                    8 store host, 9 body length, 10 cost ms, 11 message type, 12 offset msg id, 13 success,
                    14 client host
    SubBefore       0 SubBefore, 1 timestamp, 2 region id, 3 consumer group, 4 request id, 5 msg id,
                    6 retry times, 7 keys, 8 client host (raftmq's; RocketMQ's decoder reads 0..7)
    SubAfter        0 SubAfter, 1 request id, 2 msg id, 3 cost ms, 4 success, 5 keys, 6 context code,
                    7 timestamp, 8 consumer group, 9 client host (raftmq's; RocketMQ's decoder reads 0..8)
    EndTransaction  0 EndTransaction, 1 timestamp, 2 region id, 3 producer group, 4 topic, 5 msg id, 6 tags,
                    7 keys, 8 store host, 9 message type, 10 transaction id, 11 transaction state,
                    12 from transaction check

The decoder takes RocketMQ's older, shorter Pub (13, 14 fields) and SubAfter (6 to 8 fields) lines too, and skips
context types it does not know.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from client.listener import FailureCause
from client.message import Message, MessageExt, new_uniq_key
from remoting.errors import RaftMQError
from remoting.message import KEY_SEPARATOR, TIMER_PROPERTIES, MessageFormatError, parse_msg_id, topic_problem

if TYPE_CHECKING:
    from client.instance import ClientConfig
    from client.listener import ReconsumeLater
    from client.consume_hook import ConsumeCall, ConsumeHook

__all__ = ["TRACE_TOPIC", "TRACE_PRODUCER_GROUP_PREFIX", "CONTENT_SEPARATOR", "FIELD_SEPARATOR", "DEFAULT_REGION_ID",
           "TraceType", "TraceMessageType", "ConsumeReturnType", "TraceContext", "TraceStatistics", "TraceDispatcher",
           "ConsumeTracer", "encode_trace_context", "decode_trace_data", "trace_keys",
           "trace_producer_group", "open_trace_dispatcher", "pub_context", "end_transaction_context",
           "store_host_of"]

log = logging.getLogger(__name__)

TRACE_TOPIC = "RMQ_SYS_TRACE_TOPIC"  # RocketMQ's TopicValidator.RMQ_SYS_TRACE_TOPIC
TRACE_PRODUCER_GROUP_PREFIX = "_INNER_TRACE_PRODUCER"  # RocketMQ's TraceConstants.GROUP_NAME_PREFIX
CONTENT_SEPARATOR = "\x01"  # between the fields of a context (RocketMQ's CONTENT_SPLITOR)
FIELD_SEPARATOR = "\x02"  # after each context (RocketMQ's FIELD_SPLITOR)
DEFAULT_REGION_ID = "DefaultRegion"  # RocketMQ's brokers' default regionId; raftmq's have none
_NULL = "null"  # how Java's StringBuilder writes an absent tag or key

# A trace message's KEYS (the msg ids and keys it traces): well within a record's 32767 bytes of properties.
MAX_KEYS_BYTES = 16 * 1024
MAX_KEY_BYTES = 1024  # one key of a trace message at most (a traced id or key past it is not indexed)
# Closing a traced client sends what is still queued, for at most this long.
CLOSE_FLUSH_S = 3.0


class TraceType(enum.Enum):
    """RocketMQ's TraceType (the names are the wire's)."""

    PUB = "Pub"
    SUB_BEFORE = "SubBefore"
    SUB_AFTER = "SubAfter"
    END_TRANSACTION = "EndTransaction"


class TraceMessageType(enum.IntEnum):
    """RocketMQ's MessageType: its ordinal is what a Pub and EndTransaction context carry."""

    NORMAL = 0  # Normal_Msg
    TRANS_HALF = 1  # Trans_Msg_Half
    TRANS_COMMIT = 2  # Trans_msg_Commit
    DELAY = 3  # Delay_Msg
    ORDER = 4  # Order_Msg


class ConsumeReturnType(enum.IntEnum):
    """RocketMQ's ConsumeReturnType: its ordinal is a SubAfter context's code."""

    SUCCESS = 0
    TIME_OUT = 1
    EXCEPTION = 2
    RETURN_NULL = 3
    FAILED = 4


# A failed call's ConsumeReturnType by how it failed, as RocketMQ's consume services set it.
_RETURN_TYPES = {FailureCause.ASKED: ConsumeReturnType.FAILED, FailureCause.RAISED: ConsumeReturnType.EXCEPTION,
                 FailureCause.NO_STATUS: ConsumeReturnType.RETURN_NULL}

# RocketMQ's LocalTransactionState names, by client.transaction.TransactionState value.
_TRANSACTION_STATES = {"COMMIT": "COMMIT_MESSAGE", "ROLLBACK": "ROLLBACK_MESSAGE", "UNKNOWN": "UNKNOW"}


@dataclasses.dataclass(frozen=True, slots=True)
class TraceContext:
    """One trace context, for one message (RocketMQ's TraceContext with its one TraceBean). Which fields a type
    carries is the module docstring's table; the others keep their defaults. ``timestamp_ms`` is when the send or
    handler call started (SubAfter: ended), ``success`` None where the type says nothing of it."""

    trace_type: TraceType
    timestamp_ms: int
    group: str
    msg_id: str
    region_id: str = DEFAULT_REGION_ID
    topic: str = ""
    tags: str = ""
    keys: str = ""  # the message's KEYS as sent: space-separated
    store_host: str = ""
    client_host: str = ""
    body_length: int = 0
    cost_ms: int = 0
    msg_type: TraceMessageType = TraceMessageType.NORMAL
    offset_msg_id: str = ""
    success: bool | None = None
    request_id: str = ""  # pairs a handler call's SubBefore and SubAfter
    retry_times: int = 0
    context_code: int = 0
    transaction_id: str = ""
    transaction_state: str = ""  # RocketMQ's LocalTransactionState name
    from_transaction_check: bool = False


# -- encoding --------------------------------------------------------------------------------------------------


def _text(value: str, name: str) -> str:
    if CONTENT_SEPARATOR in value or FIELD_SEPARATOR in value:
        raise ValueError(f"trace context field {name} {value[:40]!r} holds a separator character (\\x01 or \\x02)")
    return value


def _or_null(value: str, name: str) -> str:
    return _text(value, name) if value else _NULL


def _bool(value: bool | None) -> str:
    return "true" if value else "false"


def encode_trace_context(ctx: TraceContext) -> str:
    """The TraceDataEncoder text of ``ctx``, its FIELD_SEPARATOR included; ValueError if a field holds a
    separator character (no name, id or property can: their own rules refuse them)."""
    t = ctx.trace_type
    if t is TraceType.PUB:
        fields = [t.value, str(ctx.timestamp_ms), _text(ctx.region_id, "region_id"), _text(ctx.group, "group"),
                  _text(ctx.topic, "topic"), _text(ctx.msg_id, "msg_id"), _or_null(ctx.tags, "tags"),
                  _or_null(ctx.keys, "keys"), _text(ctx.store_host, "store_host"), str(ctx.body_length),
                  str(ctx.cost_ms), str(int(ctx.msg_type)), _text(ctx.offset_msg_id, "offset_msg_id"),
                  _bool(ctx.success), _text(ctx.client_host, "client_host")]
    elif t is TraceType.SUB_BEFORE:
        fields = [t.value, str(ctx.timestamp_ms), _text(ctx.region_id, "region_id"), _text(ctx.group, "group"),
                  _text(ctx.request_id, "request_id"), _text(ctx.msg_id, "msg_id"), str(ctx.retry_times),
                  _or_null(ctx.keys, "keys"), _text(ctx.client_host, "client_host")]
    elif t is TraceType.SUB_AFTER:
        fields = [t.value, _text(ctx.request_id, "request_id"), _text(ctx.msg_id, "msg_id"), str(ctx.cost_ms),
                  _bool(ctx.success), _or_null(ctx.keys, "keys"), str(ctx.context_code), str(ctx.timestamp_ms),
                  _text(ctx.group, "group"), _text(ctx.client_host, "client_host")]
    elif t is TraceType.END_TRANSACTION:
        fields = [t.value, str(ctx.timestamp_ms), _text(ctx.region_id, "region_id"), _text(ctx.group, "group"),
                  _text(ctx.topic, "topic"), _text(ctx.msg_id, "msg_id"), _or_null(ctx.tags, "tags"),
                  _or_null(ctx.keys, "keys"), _text(ctx.store_host, "store_host"), str(int(ctx.msg_type)),
                  _text(ctx.transaction_id, "transaction_id"), _text(ctx.transaction_state, "transaction_state"),
                  _bool(ctx.from_transaction_check)]
    else:
        raise TypeError(f"trace_type must be a TraceType, got {t!r}")
    return CONTENT_SEPARATOR.join(fields) + FIELD_SEPARATOR


def _int(line: list[str], i: int) -> int:
    try:
        return int(line[i])
    except ValueError:
        raise ValueError(f"{line[0]} context field {i} must be an integer, got {line[i][:40]!r}") from None


def _parse_bool(line: list[str], i: int) -> bool:
    value = line[i]
    if value not in ("true", "false"):
        raise ValueError(f"{line[0]} context field {i} must be true or false, got {value[:40]!r}")
    return value == "true"


def _msg_type(line: list[str], i: int) -> TraceMessageType:
    value = _int(line, i)
    try:
        return TraceMessageType(value)
    except ValueError:
        raise ValueError(f"{line[0]} context field {i} is no message type (0..4), got {value}") from None


def _unnull(value: str) -> str:
    return "" if value == _NULL else value


# The fields each known type needs at least (RocketMQ's oldest lines).
_MIN_FIELDS = {TraceType.PUB.value: 13, TraceType.SUB_BEFORE.value: 8, TraceType.SUB_AFTER.value: 6,
               TraceType.END_TRANSACTION.value: 13}


def decode_trace_data(data: str) -> list[TraceContext]:
    """The contexts of a trace message's body text (``encode_trace_context``'s, or a RocketMQ client's, older
    shorter lines too); contexts of an unknown type are skipped. ValueError naming the field that is malformed."""
    contexts = []
    for raw in data.split(FIELD_SEPARATOR):
        if not raw.strip():
            continue  # after the last context; RocketMQ writes one separator after each
        line = raw.split(CONTENT_SEPARATOR)
        kind = line[0]
        need = _MIN_FIELDS.get(kind)
        if need is None:
            continue
        if len(line) < need:
            raise ValueError(f"{kind} context has {len(line)} fields, at least {need} expected")
        if kind == TraceType.PUB.value:
            long_form = len(line) >= 14  # 13: no offset msg id (RocketMQ before 4.4)
            contexts.append(TraceContext(
                TraceType.PUB, _int(line, 1), line[3], line[5], region_id=line[2], topic=line[4],
                tags=_unnull(line[6]), keys=_unnull(line[7]), store_host=line[8], body_length=_int(line, 9),
                cost_ms=_int(line, 10), msg_type=_msg_type(line, 11),
                offset_msg_id=line[12] if long_form else "",
                success=_parse_bool(line, 13 if long_form else 12),
                client_host=line[14] if len(line) >= 15 else ""))
        elif kind == TraceType.SUB_BEFORE.value:
            contexts.append(TraceContext(
                TraceType.SUB_BEFORE, _int(line, 1), line[3], line[5], region_id=line[2], request_id=line[4],
                retry_times=_int(line, 6), keys=_unnull(line[7]), client_host=line[8] if len(line) >= 9 else ""))
        elif kind == TraceType.SUB_AFTER.value:
            contexts.append(TraceContext(
                TraceType.SUB_AFTER, _int(line, 7) if len(line) >= 8 else 0, line[8] if len(line) >= 9 else "",
                line[2], request_id=line[1], cost_ms=_int(line, 3), success=_parse_bool(line, 4),
                keys=_unnull(line[5]), context_code=_int(line, 6) if len(line) >= 7 else 0,
                client_host=line[9] if len(line) >= 10 else ""))
        else:
            contexts.append(TraceContext(
                TraceType.END_TRANSACTION, _int(line, 1), line[3], line[5], region_id=line[2], topic=line[4],
                tags=_unnull(line[6]), keys=_unnull(line[7]), store_host=line[8], msg_type=_msg_type(line, 9),
                transaction_id=line[10], transaction_state=line[11],
                from_transaction_check=_parse_bool(line, 12)))
    return contexts


def trace_keys(contexts: Iterable[TraceContext]) -> list[str]:
    """The KEYS of a trace message of ``contexts``: each msg id, then its message's keys, once each in order (the
    brokers index every key: the trace is found by the msg id, or by a key of the traced message).

    A msg id is the message's UNIQ_KEY property, which any producer may set to anything: one holding the key
    separator, or longer than ``MAX_KEY_BYTES``, is left out (the trace is still sent, found by the message's other
    keys), since it would make the trace message itself unsendable."""
    keys: dict[str, None] = {}
    for ctx in contexts:
        if ctx.msg_id and KEY_SEPARATOR not in ctx.msg_id and len(ctx.msg_id.encode()) <= MAX_KEY_BYTES:
            keys[ctx.msg_id] = None
        for key in ctx.keys.split(KEY_SEPARATOR) if ctx.keys else ():
            if key and len(key.encode()) <= MAX_KEY_BYTES:
                keys[key] = None
    return list(keys)


def trace_producer_group(trace_topic: str) -> str:
    """The inner trace producer's group (RocketMQ's ``_INNER_TRACE_PRODUCER-<topic>``)."""
    return f"{TRACE_PRODUCER_GROUP_PREFIX}-{trace_topic}"


def store_host_of(offset_msg_id: str) -> str:
    """``host:port`` of the node that stored a message, from its offset msg id ("" if it names none)."""
    try:
        (host, port), _ = parse_msg_id(offset_msg_id)
    except (MessageFormatError, ValueError):
        return ""
    return f"{host}:{port}"


def _message_type(message: Message) -> TraceMessageType:
    if message.delay_level or any(name in message.properties for name in TIMER_PROPERTIES):
        return TraceMessageType.DELAY
    return TraceMessageType.NORMAL


def _keys_text(message: Message | MessageExt) -> str:
    keys = message.keys
    if not keys:
        return ""
    return keys if isinstance(keys, str) else KEY_SEPARATOR.join(keys)


def pub_context(group: str, client_host: str, message: Message, msg_id: str, offset_msg_id: str, success: bool,
                started_ms: int, cost_ms: int, msg_type: TraceMessageType | None = None) -> TraceContext:
    """The Pub context of one message sent (``offset_msg_id`` "" when no node answered: a oneway send)."""
    return TraceContext(TraceType.PUB, started_ms, group, msg_id, topic=message.topic, tags=message.tags or "",
                        keys=_keys_text(message), store_host=store_host_of(offset_msg_id) if offset_msg_id else "",
                        client_host=client_host, body_length=len(message.body), cost_ms=cost_ms,
                        msg_type=_message_type(message) if msg_type is None else msg_type,
                        offset_msg_id=offset_msg_id, success=success)


def end_transaction_context(group: str, message: Message | MessageExt, msg_id: str, offset_msg_id: str,
                            transaction_id: str, state: str, *, from_check: bool = False) -> TraceContext:
    """The EndTransaction context of a transaction ended with ``state`` (``TransactionState.value``): ``msg_id``
    and ``offset_msg_id`` are the half's (its send's result; a check-back's message, ``from_check``)."""
    return TraceContext(TraceType.END_TRANSACTION, int(time.time() * 1000), group, msg_id,
                        topic=message.topic, tags=message.tags or "", keys=_keys_text(message),
                        store_host=store_host_of(offset_msg_id), msg_type=TraceMessageType.TRANS_COMMIT,
                        transaction_id=transaction_id, transaction_state=_TRANSACTION_STATES.get(state, state),
                        from_transaction_check=from_check)


# -- the dispatcher --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class TraceStatistics:
    recorded: int  # contexts appended to the queue
    dropped: int  # contexts refused because the queue was full
    queued: int  # contexts waiting to be sent now
    sent_messages: int  # trace messages the brokers took
    sent_contexts: int  # contexts in them
    failed_contexts: int  # contexts in trace messages that could not be sent (logged)


class TraceDispatcher:
    """RocketMQ's AsyncTraceDispatcher: a bounded queue of contexts and the task that sends them in trace messages
    through ``send`` (the inner producer's). The rules are in the module docstring."""

    def __init__(self, trace_topic: str, send: Callable[[Message], Awaitable[Any]], *, max_queued: int = 2048,
                 batch_size: int = 100, max_message_bytes: int = 128 * 1024, flush_interval_ms: int = 500) -> None:
        problem = topic_problem(trace_topic)
        if problem:
            raise ValueError(f"trace_topic {trace_topic!r} {problem}")
        for name, value, low in (("max_queued", max_queued, 1), ("batch_size", batch_size, 1),
                                 ("max_message_bytes", max_message_bytes, 1024),
                                 ("flush_interval_ms", flush_interval_ms, 0)):
            if type(value) is not int or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.trace_topic = trace_topic
        self._send = send
        self._max_queued = max_queued
        self._batch_size = batch_size
        self._max_message_bytes = max_message_bytes
        self._interval_s = flush_interval_ms / 1000
        # Each context with when it arrived (trio's clock): the oldest's wait decides when a short batch goes.
        self._queue: deque[tuple[float, TraceContext]] = deque()
        self._arrived = trio.Event()  # set once something waits in the queue
        self._full = trio.Event()  # set once batch_size contexts wait
        self._recorded = 0
        self._dropped = 0
        self._sent_messages = 0
        self._sent_contexts = 0
        self._failed_messages = 0
        self._failed_contexts = 0

    def append(self, ctx: TraceContext) -> bool:
        """Queue ``ctx`` to be sent; False (counted in ``dropped``) when the queue is full. Never waits."""
        queue = self._queue
        if len(queue) >= self._max_queued:
            self._dropped += 1
            if self._dropped % 1000 == 1:
                log.warning("message trace queue full, contexts dropped (said the first and every 1000th time) "
                            "trace_topic=%s max_queued=%d dropped=%d", self.trace_topic, self._max_queued,
                            self._dropped)
            return False
        queue.append((trio.current_time(), ctx))
        self._recorded += 1
        self._arrived.set()
        if len(queue) >= self._batch_size:
            self._full.set()
        return True

    def statistics(self) -> TraceStatistics:
        return TraceStatistics(self._recorded, self._dropped, len(self._queue), self._sent_messages,
                               self._sent_contexts, self._failed_contexts)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Send what is queued until cancelled: a trace message as soon as ``batch_size`` contexts wait, fewer only
        once the oldest of them has waited ``flush_interval_ms`` (``flush`` sends what is left after)."""
        task_status.started()
        queue = self._queue
        while True:
            await self._arrived.wait()
            with trio.move_on_at(queue[0][0] + self._interval_s):
                await self._full.wait()
            # What arrived during a send waits its turn: sent at once, however little, it made a trace message of
            # every few contexts under load (as many messages as the traced client's own).
            while queue and (len(queue) >= self._batch_size
                             or trio.current_time() - queue[0][0] >= self._interval_s):
                await self._send_next()

    async def flush(self) -> None:
        """Send every context queued now (and those queued meanwhile), in trace messages. A context leaves the
        queue once its message was sent or given up, so a flush cancelled mid-send leaves it for the next one."""
        while self._queue:
            await self._send_next()

    async def _send_next(self) -> None:
        """Send the trace message the head of the queue makes, then take its contexts off the queue."""
        queue = self._queue
        contexts, body = self._next_message()
        try:
            # Built here, not before the try: contexts come from messages anyone may have sent, and what no
            # check above foresaw must cost their traces, never the producer or consumer this task serves.
            message = Message(self.trace_topic, body.encode(), keys=trace_keys(contexts) or None)
            await self._send(message)
        except (RaftMQError, ValueError) as e:  # ValueError: MessageFormatError, a Message refused
            self._failed_messages += 1
            self._failed_contexts += len(contexts)
            # Not every time: a trace topic missing fails each trace message, a few a second for as long as the
            # client runs.
            if self._failed_messages % 100 == 1:
                log.warning("trace message not sent, its contexts are lost (said the first and every 100th time) "
                            "trace_topic=%s contexts=%d failed_messages=%d failed_contexts=%d error=%s",
                            self.trace_topic, len(contexts), self._failed_messages, self._failed_contexts, e)
        else:
            self._sent_messages += 1
            self._sent_contexts += len(contexts)
        for _ in contexts:
            queue.popleft()
        if len(queue) < self._batch_size:
            self._full = trio.Event()
        if not queue:
            self._arrived = trio.Event()

    def _next_message(self) -> tuple[list[TraceContext], str]:
        """The contexts at the head of the queue one trace message takes (at least one), and its body text."""
        contexts: list[TraceContext] = []
        lines: list[str] = []
        size = keys_size = 0
        for _, ctx in self._queue:
            line = encode_trace_context(ctx)
            ctx_keys = sum(len(k.encode()) + 1 for k in trace_keys((ctx,)))
            if contexts and (len(contexts) >= self._batch_size or size + len(line) > self._max_message_bytes
                             or keys_size + ctx_keys > MAX_KEYS_BYTES):
                break
            if ctx_keys > MAX_KEYS_BYTES:
                # Its message's keys alone are too many for one trace message: found by its msg id only.
                ctx = dataclasses.replace(ctx, keys="")
                line = encode_trace_context(ctx)
                ctx_keys = sum(len(k.encode()) + 1 for k in trace_keys((ctx,)))
            contexts.append(ctx)
            lines.append(line)
            size += len(line)
            keys_size += ctx_keys
        return contexts, "".join(lines)


@contextlib.asynccontextmanager
async def open_trace_dispatcher(config: ClientConfig, trace_topic: str) -> AsyncIterator[TraceDispatcher]:
    """A ``TraceDispatcher`` sending through an inner producer (group ``trace_producer_group``, never traced
    itself) with ``config``'s name servers, identity and connection settings; on exit what is queued is sent
    (``CLOSE_FLUSH_S`` at most) and the producer closed."""
    # Here, not at the top: the producer module imports this one.
    from client.instance import ClientConfig as _ClientConfig
    from client.instance import open_client_nursery
    from client.producer import ProducerConfig, open_producer_from_config

    shared = {f.name: getattr(config, f.name) for f in dataclasses.fields(_ClientConfig)}
    producer_config = ProducerConfig(**shared, producer_group=trace_producer_group(trace_topic),
                                     enable_msg_trace=False, trace_topic=trace_topic,
                                     max_message_size_bytes=1024 * 1024)
    async with open_producer_from_config(producer_config) as producer:
        dispatcher = TraceDispatcher(trace_topic, producer.send)
        try:
            # The client's nursery, not a plain one: what the caller's block raises comes out as it was raised,
            # as from an untraced client, not wrapped in an ExceptionGroup.
            async with open_client_nursery() as nursery:
                await nursery.start(dispatcher.serve)
                try:
                    yield dispatcher
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.move_on_after(CLOSE_FLUSH_S) as scope:
                scope.shield = True
                await dispatcher.flush()
            if dispatcher.statistics().queued:
                log.warning("message trace contexts not sent before close trace_topic=%s contexts=%d", trace_topic,
                            dispatcher.statistics().queued)


# -- the push consumer's side ----------------------------------------------------------------------------------


class _Call:
    __slots__ = ("request_id", "started", "msgs", "positions")

    def __init__(self, request_id: str, started: float, msgs: tuple[MessageExt, ...],
                 positions: tuple[int, ...] | None) -> None:
        self.request_id = request_id
        self.started = started
        self.msgs = msgs  # those traced
        self.positions = positions  # their indexes in the call's messages; None: all were traced, in order


class ConsumeTracer:
    """A consumer's SubBefore and SubAfter contexts (RocketMQ's ConsumeMessageTraceHookImpl): ``before`` as a
    handler call starts or messages are handed to the caller, ``after`` with how the call ended or once the caller
    is done with them. A consumer's ``ConsumeHook`` (client/consume_hook.py) tells it through ``call_started`` and
    ``call_ended`` (handler calls), ``call_started`` and ``hold_ended`` (holds: the iterator's, a lite pull poll's);
    ``subscribe_to`` subscribes it to all four."""

    def __init__(self, dispatcher: TraceDispatcher, consumer_group: str, client_host: str) -> None:
        self.dispatcher = dispatcher
        self._group = consumer_group
        self._client_host = client_host

    def subscribe_to(self, hook: ConsumeHook) -> None:
        """Hear ``hook``'s handler calls and holds from now on (a consumer opened with ``enable_msg_trace``)."""
        hook.subscribe(call_started=self.call_started, call_ended=self.call_ended, hold_started=self.call_started,
                       hold_ended=self.hold_ended)

    def call_started(self, call: ConsumeCall) -> None:
        """``ConsumeHook.call_started``'s and ``hold_started``'s subscriber."""
        call.trace = self.before(call.msgs)

    def call_ended(self, call: ConsumeCall, failure: ReconsumeLater | None, ok: int) -> None:
        """``ConsumeHook.call_ended``'s subscriber: ``ok`` (the hook's count) says which messages succeeded."""
        self.after(call.trace, failure, call.timeout_s, acked=ok)

    def hold_ended(self, call: ConsumeCall) -> None:
        """``ConsumeHook.hold_ended``'s subscriber: the caller consumed the messages it held, all of them."""
        self.after(call.trace, None)

    def before(self, msgs: Sequence[MessageExt]) -> _Call | None:
        """Record a SubBefore per message (those of the trace topic excepted); None if none was."""
        trace_topic = self.dispatcher.trace_topic
        traced = tuple(m for m in msgs if m.topic != trace_topic)
        if not traced:
            return None
        # Where the traced ones were: a batch's ack_index counts the call's messages, the trace topic's too.
        positions = None if len(traced) == len(msgs) else tuple(
            i for i, m in enumerate(msgs) if m.topic != trace_topic)
        call = _Call(new_uniq_key(), time.monotonic(), traced, positions)
        now = int(time.time() * 1000)
        for m in traced:
            self.dispatcher.append(TraceContext(TraceType.SUB_BEFORE, now, self._group, m.msg_id,
                                                request_id=call.request_id, retry_times=m.reconsume_times,
                                                keys=KEY_SEPARATOR.join(m.keys), client_host=self._client_host))
        return call

    def after(self, call: _Call | None, failure: ReconsumeLater | None, timeout_s: float = math.inf, *,
              acked: int | None = None) -> None:
        """Record a SubAfter per message of ``call``: the first ``acked`` of the call's messages succeeded, the
        rest failed (``acked`` None: all unless ``failure``, else those up to its ``ack_index``, a batch handler's
        answer), with the code ``failure.cause`` names (TIME_OUT first: the module's rules); the call's cost shared
        among its messages, as RocketMQ's."""
        if call is None:
            return
        elapsed = time.monotonic() - call.started
        cost_ms = int(elapsed * 1000 / len(call.msgs))
        head: float  # the call's messages before this index succeeded
        if failure is None:
            code, head = ConsumeReturnType.SUCCESS, math.inf
        else:
            # TIME_OUT first, where RocketMQ tells a listener that threw first: its listener runs on past the
            # timeout, so what it threw was its own, while a call here is cancelled at its timeout, and a handler
            # that raised past it most likely made an error of the cancellation.
            code = ConsumeReturnType.TIME_OUT if elapsed >= timeout_s else _RETURN_TYPES[failure.cause]
            head = acked if acked is not None else (0 if failure.ack_index is None else failure.ack_index + 1)
        now = int(time.time() * 1000)
        positions = call.positions
        for i, m in enumerate(call.msgs):
            ok = (i if positions is None else positions[i]) < head
            self.dispatcher.append(TraceContext(
                TraceType.SUB_AFTER, now, self._group, m.msg_id, request_id=call.request_id, cost_ms=cost_ms,
                success=ok, keys=KEY_SEPARATOR.join(m.keys),
                context_code=int(ConsumeReturnType.SUCCESS if ok else code), client_host=self._client_host))
