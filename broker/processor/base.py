"""What every processor shares: request field parsing that names the bad field, and one exception that carries
a response code and remark out of deep validation code.

A processor raises ``RequestRejected(code, remark)`` at the first problem; ``BrokerDispatcher`` turns it into the
response. Field helpers produce ``INVALID_REQUEST`` with a remark like ``"request field 'queue_id' must be an
integer within 0..1023, got 'x'"`` so a client (or a human with a packet capture) knows exactly what to fix.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from broker.topic_config import TopicConfigError, validate_group_name, validate_topic_name
from dledger import (AppendTimeoutError, BatchRejectedError, DLedgerError, GroupBusyError, LeaderChangedError,
                     NotLeaderError, RecordTooLargeError)
from remoting.codec import BodyFormatError, Frame, cut_remark, decode_body, make_response
from remoting.codes import ResponseCode
from remoting.errors import RaftMQError
from remoting.message import I32, I64

log = logging.getLogger(__name__)


class RequestRejected(Exception):
    def __init__(self, code: int, remark: str, ext: Mapping[str, Any] | None = None) -> None:
        super().__init__(remark)
        self.code = code
        self.remark = remark
        self.ext = dict(ext or {})


def invalid(field: str, problem: str) -> RequestRejected:
    """INVALID_REQUEST naming ``field`` in the remark and in ext ``field`` (``InvalidRequestError.field``)."""
    return RequestRejected(ResponseCode.INVALID_REQUEST, f"request field {field!r} {problem}", ext={"field": field})


# The largest CBOR body a broker decodes (a heartbeat, a lock batch, a group's config): a lock batch of 20k queues
# takes 0.94 MB. decode_body bounds what a body expands to, but a body of plain values within that bound still
# decodes at ~20-50 ms a MiB on the trio thread, which also ticks Raft: 16 MiB of them stalled a leader 0.8 s, past
# its followers' election timeout, and three deposed it. Message bodies are never decoded and are not bound by it.
MAX_DATA_BODY_BYTES = 4 << 20


def request_data(request: Frame) -> Any:
    """What a request carries as one CBOR item: its body, or (a small request may inline it, as heartbeats do) its
    ext. Garbage in the body, a CBOR tag (a bignum) or nesting past ``MAX_BODY_DEPTH`` is INVALID_REQUEST naming
    ``body`` (``remoting.codec.decode_body``, the header's rules), and so is a body past ``MAX_DATA_BODY_BYTES``;
    the caller checks the shape."""
    if not request.body:
        return request.ext
    if len(request.body) > MAX_DATA_BODY_BYTES:
        raise invalid("body", f"is {len(request.body)} bytes, more than the {MAX_DATA_BODY_BYTES} a broker decodes "
                              f"as a request's data")
    try:
        return decode_body(request.body)
    except BodyFormatError as e:
        raise invalid("body", f"is not plain CBOR data: {e}") from None


def topic_not_exist(node: Any, topic: str) -> RequestRejected:
    return RequestRejected(ResponseCode.TOPIC_NOT_EXIST,
                           f"topic {topic!r} does not exist on broker {node.config.broker_name}", ext={"topic": topic})


def topic_not_writable(node: Any, topic: str, config: Any) -> RequestRejected:
    """NO_PERMISSION for a send (or a reply) to ``topic``, whose ``config`` does not take writes on this node."""
    return RequestRejected(ResponseCode.NO_PERMISSION, f"topic {topic!r} is not writable on broker "
                                                       f"{node.config.broker_name} (perm={config.perm})")


def legal_topic(field: str, topic: str) -> str:
    """``topic`` if it is a legal topic name (whether or not the node has such a topic); else INVALID_REQUEST
    naming ``field``."""
    try:
        validate_topic_name(topic)
    except TopicConfigError as e:
        raise invalid(field, str(e).split(" ", 1)[1]) from None
    return topic


def get_topic_name(ext: Mapping[str, Any]) -> str:
    """``topic``: a legal topic name, whether or not the node has such a topic."""
    return legal_topic("topic", get_str(ext, "topic"))


def existing_topic_config(node: Any, topic: str) -> Any:
    """The config of ``topic``, named by a request. A name that is not stored is checked before it is called
    unknown: an illegal one is the caller's mistake (INVALID_REQUEST naming ``topic``), a legal one
    TOPIC_NOT_EXIST. A stored topic is found whatever its name: an older version let a trailing newline through,
    and such a topic must still be readable and deletable."""
    config = node.topic(topic)
    if config is None:
        raise topic_not_exist(node, get_topic_name({"topic": topic}))
    return config


def get_topic_queue(node: Any, ext: Mapping[str, Any]) -> tuple[str, int]:
    """``topic`` and ``queue_id`` of a request about one existing queue (offsets, min/max, search): one below the
    topic's queue counts, or one that holds messages. Lowering read_queue_nums leaves a queue's messages stored
    and its consumers holding it until they rebalance; their last commits there were refused, and once the
    count was raised again the group consumed that stretch a second time."""
    topic = get_str(ext, "topic")
    queue_id = get_int(ext, "queue_id", lo=0, hi=I32[1])
    config = existing_topic_config(node, topic)
    queue_nums = max(config.read_queue_nums, config.write_queue_nums)
    if queue_id >= queue_nums and queue_id not in node.store.queue_ids(topic):
        raise invalid("queue_id", f"must be below {queue_nums} for topic {topic!r} (or name a queue that holds "
                                  f"messages), got {queue_id}")
    return topic, queue_id


# A field sent as null is absent (RocketMQ's nullable header fields): an optional one takes its default, a required
# one "is required", as get_bool has always done.
def get_str(ext: Mapping[str, Any], name: str, *, default: str | None = None, allow_empty: bool = False) -> str:
    value = ext.get(name)
    if value is None:
        if default is None:
            raise invalid(name, "is required")
        value = default
    if not isinstance(value, str) or (not value and not allow_empty):
        raise invalid(name, f"must be a non-empty string, got {value!r}")
    return value


def get_existing_topic(node: Any, ext: Mapping[str, Any], *, required: bool = True) -> str:
    """``topic``: the name of a topic this node has; "" when not ``required`` and absent or empty."""
    topic = get_str(ext, "topic", default=None if required else "", allow_empty=not required)
    if topic:
        existing_topic_config(node, topic)
    return topic


# Group names already judged legal: every send and pull names its group, and a producer or consumer group keeps its
# name, so one set lookup replaces the charset regex on the hot path. Bounded, as the names come from peers.
_LEGAL_GROUPS: set[str] = set()
_LEGAL_GROUPS_MAX = 4096


def get_group(ext: Mapping[str, Any], name: str = "consumer_group", *, default: str | None = None) -> str:
    """A group name: non-empty, RocketMQ's charset (it is also part of replicated offset keys)."""
    value = get_str(ext, name, default=default)
    if value in _LEGAL_GROUPS:
        return value
    try:
        validate_group_name(value, name)
    except TopicConfigError as e:
        raise invalid(name, str(e).split(" ", 1)[1]) from None
    if len(_LEGAL_GROUPS) < _LEGAL_GROUPS_MAX:
        _LEGAL_GROUPS.add(value)
    return value


def get_int(ext: Mapping[str, Any], name: str, *, default: int | None = None, lo: int = I64[0],
            hi: int = I64[1]) -> int:
    value = ext.get(name)
    if type(value) is int and lo <= value <= hi:  # the usual case in one test (a bool's type is bool, not int)
        return value
    if value is None:
        if default is None:
            raise invalid(name, "is required")
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise invalid(name, f"must be an integer within {lo}..{hi}, got {value!r}")
    return value


def get_bool(ext: Mapping[str, Any], name: str, *, default: bool = False) -> bool:
    value = ext.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"must be true or false, got {value!r}")
    return value


def reply(request: Frame, code: int, remark: str, ext: dict[str, Any] | None = None) -> Frame | None:
    if request.is_oneway:
        log.info("oneway request refused code=%d response_code=%d remark=%s", request.code, code, cut_remark(remark))
        return None
    return make_response(request, code, remark=remark, ext=ext)


def unexpected_response(request: Frame) -> Frame:
    """An answer sent outside the dispatcher (callback or task) gets the dispatcher's treatment of a bug: logged
    with its traceback, answered SYSTEM_ERROR, the connection lives on. Call it from an ``except`` block."""
    log.exception("request failed unexpectedly code=%d", request.code)
    return make_response(request, ResponseCode.SYSTEM_ERROR, remark="unexpected broker error; see the broker log")


async def answer_from_task(node: Any, request: Frame, conn: Any, work: Callable[[], Awaitable[Frame]]) -> None:
    """Run ``work`` (which returns the response) in a task of the connection and send what it answers, a refusal
    mapped as the dispatcher maps it: the connection's reader goes on with its next request meanwhile, instead of
    waiting for a Raft commit."""
    try:
        response: Frame | None = await work()
    except (RequestRejected, DLedgerError) as e:
        response = error_response(node, request, e)
    except Exception:
        response = unexpected_response(request)
    if response is None or request.is_oneway:
        return
    try:
        await conn.send_response(response)
    except RaftMQError as e:
        log.debug("answer not delivered code=%d error=%s", request.code, e)


def error_response(node: Any, request: Frame, exc: RequestRejected | DLedgerError) -> Frame | None:
    """The one place where a refusal becomes a response code (also used by answers sent from tasks)."""
    if isinstance(exc, RequestRejected):
        return reply(request, exc.code, exc.remark, exc.ext)
    if isinstance(exc, (NotLeaderError, LeaderChangedError, BatchRejectedError)):
        rejected = node.not_leader()
        return reply(request, ResponseCode.NOT_LEADER, f"{exc} ({rejected.remark})", rejected.ext)
    if isinstance(exc, GroupBusyError):
        return reply(request, ResponseCode.SYSTEM_BUSY, str(exc))
    if isinstance(exc, AppendTimeoutError):
        return reply(request, ResponseCode.FLUSH_SLAVE_TIMEOUT, str(exc))
    if isinstance(exc, RecordTooLargeError):
        return reply(request, ResponseCode.MESSAGE_ILLEGAL, str(exc))
    return reply(request, ResponseCode.SYSTEM_ERROR, f"replication failed: {exc}")
