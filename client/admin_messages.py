"""The admin client's message lookups: by key (``query_message``), by the broker's offset id or the producer's unique id
(``view_message``), and a message's trace (``query_msg_trace``), read from any node of the groups that hold them.
Mixed into ``AdminClient`` (``client/admin.py``)."""

from __future__ import annotations

import logging
from typing import Any


from client.admin_base import AdminBase
from client.admin_types import ClusterInfo
# The answer readers, under the names the admin client has always used.
from client.admin_types import reading as _reading
from client.errors import ClientError
from client.message import I64_MAX, MessageExt, check_int_arg
from client.pull_consumer import to_message_ext
from client.trace import TRACE_TOPIC, TraceContext, TraceType, decode_trace_data
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError
from remoting.message import KEY_SEPARATOR, MessageFormatError, iter_records, parse_msg_id, topic_problem

MAX_QUERY_NUM = 64  # the broker's cap on the messages of one QUERY_MESSAGE (RocketMQ's maxNum bound)
# VIEW_MESSAGE_BY_ID's answers: QUERY_NOT_FOUND, no such message; SYSTEM_ERROR, how older brokers said so
# (RocketMQ's answer).
_VIEW_ANSWERS = (ResponseCode.SUCCESS, ResponseCode.QUERY_NOT_FOUND, ResponseCode.SYSTEM_ERROR)


log = logging.getLogger(__name__)


class MessageAdmin(AdminBase):
    """``AdminClient``'s message lookups."""

    async def query_message(self, topic: str, key: str, *, max_num: int = 32, begin_ms: int = 0,
                            end_ms: int | None = None) -> list[MessageExt]:
        """RocketMQ's queryMessage: messages of ``topic`` whose KEYS hold ``key`` (or whose unique id is
        ``key``), stored between ``begin_ms`` and ``end_ms``, from every group of the topic; newest first, at
        most ``max_num`` (1..64)."""
        if not key:
            raise ValueError("query_message needs a key")
        check_int_arg("max_num", max_num, 1, MAX_QUERY_NUM)
        end_ms = I64_MAX if end_ms is None else end_ms
        check_int_arg("begin_ms", begin_ms, 0, I64_MAX)
        check_int_arg("end_ms", end_ms, 0, I64_MAX)
        if not 0 <= begin_ms <= end_ms:
            raise ValueError(f"the time range must satisfy 0 <= begin_ms <= end_ms, got {begin_ms}..{end_ms}")
        frames = await self._read_from_route(topic, RequestCode.QUERY_MESSAGE,
                                             {"topic": topic, "key": key, "max_num": max_num,
                                              "begin_timestamp": begin_ms, "end_timestamp": end_ms},
                                             ok=(ResponseCode.SUCCESS, ResponseCode.QUERY_NOT_FOUND))
        found = []
        for name, frame in frames.items():
            if frame.code == ResponseCode.SUCCESS:
                with _reading("QUERY_MESSAGE", f"broker group {name!r}"):
                    found += [to_message_ext(view, name) for view in iter_records(frame.body)]
        found.sort(key=lambda m: (-m.store_timestamp, m.broker_name, m.phy_offset))
        return found[:max_num]

    async def query_msg_trace(self, msg_id: str, *, trace_topic: str = TRACE_TOPIC) -> list[TraceContext]:
        """RocketMQ's queryMsgTraceById: the trace contexts of message ``msg_id`` (the producer's unique id,
        ``SendResult.msg_id``) that traced clients sent to ``trace_topic`` (``client/trace.py``), oldest first:
        its Pub, then each handler call's SubBefore and SubAfter. Found by key, at most ``MAX_QUERY_NUM`` trace
        messages; a trace message that cannot be decoded is logged and skipped. Empty if none holds one."""
        if not isinstance(msg_id, str) or not msg_id or KEY_SEPARATOR in msg_id:
            raise ValueError(f"query_msg_trace needs a msg id (a key: no spaces), got {msg_id!r}")
        problem = topic_problem(trace_topic)
        if problem:
            raise ValueError(f"trace_topic {trace_topic!r} {problem}")
        found = await self.query_message(trace_topic, msg_id, max_num=MAX_QUERY_NUM)
        contexts: dict[TraceContext, None] = {}  # a trace message sent twice (a retried send) counts once
        for message in found:
            try:
                decoded = decode_trace_data(message.body.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                log.warning("trace message skipped, it cannot be decoded trace_topic=%s msg_id=%s error=%s",
                            trace_topic, message.msg_id, e)
                continue
            contexts.update(dict.fromkeys(ctx for ctx in decoded if ctx.msg_id == msg_id))
        order = {TraceType.PUB: 0, TraceType.END_TRANSACTION: 1, TraceType.SUB_BEFORE: 2, TraceType.SUB_AFTER: 3}
        return sorted(contexts, key=lambda c: (c.timestamp_ms, order[c.trace_type]))

    async def view_message(self, msg_id: str, *, topic: str | None = None) -> MessageExt:
        """RocketMQ's viewMessage / queryMsgById. ``msg_id`` is the broker's offset message id (32 hex digits:
        ``SendResult.offset_msg_id``, ``MessageExt.offset_msg_id``), read from any node of the group that
        stored it (every group is asked when the node that stored it is registered no more); or, with ``topic``,
        the producer's unique id (``SendResult.msg_id``), found through the index. A message sent more than once
        under one unique id (a retried send) is found once: the newest."""
        try:
            (host, port), phy_offset = parse_msg_id(msg_id)
        except MessageFormatError:
            if topic is None:
                raise ValueError(f"msg_id {msg_id!r} is not an offset message id (32 hex digits); to look up a "
                                 f"producer's unique id, give its topic") from None
            found = await self.query_message(topic, msg_id, max_num=MAX_QUERY_NUM)
            for message in found:
                if message.msg_id == msg_id:
                    return message
            raise ClientError(f"no message with unique id {msg_id!r} in topic {topic!r}", topic=topic) from None
        store_addr = f"{host}:{port}"
        info = await self.cluster_info()
        # The id names the node that led the group when the message was stored; every member holds it.
        name = next((n for n, nodes in sorted(info.broker_addrs.items()) if store_addr in nodes.values()), None)
        if name is None:
            name, frame = await self._view_stored_by_unregistered(info, msg_id, store_addr)
        else:
            frame = await self._read_from_group(info, name, RequestCode.VIEW_MESSAGE_BY_ID, {"offset": phy_offset},
                                                ok=_VIEW_ANSWERS, until_found=True)
        with _reading("VIEW_MESSAGE_BY_ID", f"broker group {name!r}"):
            views = list(iter_records(frame.body)) if frame.code == ResponseCode.SUCCESS else []
        if not views:
            raise ClientError(f"no message {msg_id!r} on broker group {name!r}: {frame.remark or 'empty answer'}",
                              msg_id=msg_id, broker_name=name)
        if topic is not None and views[0].topic != topic:
            raise ClientError(f"message {msg_id!r} is of topic {views[0].topic!r}, not {topic!r}", msg_id=msg_id,
                              topic=topic)
        return to_message_ext(views[0], name)

    async def _view_stored_by_unregistered(self, info: ClusterInfo, msg_id: str, store_addr: str) -> tuple[str, Any]:
        """``(group, VIEW_MESSAGE_BY_ID answer)`` for an id whose storing node no name server lists: a leader
        killed (a node is unregistered when its connections close) or moved to another address. Its group's other
        members hold the message (before, the lookup was refused while they served it). Every group is asked with
        the whole id, which a node answers only with a record stored at that offset by that host."""
        misses = []
        for name in sorted(info.broker_addrs):
            try:
                frame = await self._read_from_group(info, name, RequestCode.VIEW_MESSAGE_BY_ID, {"msg_id": msg_id},
                                                    ok=_VIEW_ANSWERS, until_found=True)
            except RaftMQError as e:
                misses.append(f"{name}: {e}")
                continue
            if frame.code == ResponseCode.SUCCESS:
                return name, frame
            misses.append(f"{name}: {frame.remark or 'not found'}")
        raise ClientError(f"msg_id {msg_id!r} was stored by {store_addr}, which is no node of a group the name "
                          f"servers know, and no group holds it ({'; '.join(misses) or 'no group is registered'})",
                          msg_id=msg_id)
