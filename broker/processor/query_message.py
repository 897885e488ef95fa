"""VIEW_MESSAGE_BY_ID and QUERY_MESSAGE (by key): lookups through the store's IndexFile and commit log.

Both answer with raw commit-log records as the body, like PULL_MESSAGE, so one decoder serves all three.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker.processor.base import I64, RequestRejected, get_int, get_str, get_topic_name, invalid
from remoting.codec import Frame, make_response
from remoting.codes import ResponseCode
from remoting.message import MAX_PROPERTIES_SIZE, MessageFormatError, decode_record, parse_msg_id

if TYPE_CHECKING:
    from broker.node import BrokerNode

MAX_QUERY_NUM = 64


class QueryMessageProcessor:
    def __init__(self, node: BrokerNode) -> None:
        self.node = node

    async def view_message_by_id(self, request: Frame, conn: Any) -> Frame:
        ext = request.ext
        host = None
        if ext.get("msg_id") is not None:
            msg_id = get_str(ext, "msg_id")
            try:
                host, phy_offset = parse_msg_id(msg_id)
            except MessageFormatError as e:
                raise invalid("msg_id", f"is not a message id: {e}") from None
            asked = f"no message {msg_id} (commit-log offset {phy_offset})"
        else:
            phy_offset = get_int(ext, "offset", lo=0)
            asked = f"no message at commit-log offset {phy_offset}"
        # A lookup that finds nothing is QUERY_NOT_FOUND, as QUERY_MESSAGE's: RocketMQ answers SYSTEM_ERROR here,
        # which says the broker failed and which clients retry, for what is a final answer about the id.
        store = self.node.store
        record = self.node.read_record(phy_offset)
        if record is None:
            raise _not_found(phy_offset, f"{asked} on this broker node (its commit log holds offsets "
                                         f"{store.min_phy_offset}..{store.max_phy_offset})")
        view = decode_record(record, check_crc=False)
        # An id is the store host and the offset; the offset alone names a message in every group's log. The
        # record keeps the host it was stored by (the leader then, whatever the node's address is now).
        if host is not None and tuple(view.store_host) != host:
            raise _not_found(phy_offset, f"{asked} on this broker node: the message at that offset was stored by "
                                         f"{view.store_host[0]}:{view.store_host[1]}, the id names "
                                         f"{host[0]}:{host[1]} (a node of another broker group?)")
        # QUERY_MESSAGE and pulls hide what a topic deletion removed; so does a lookup by id.
        if store.deleted_with_topic(view.topic, phy_offset):
            raise _not_found(phy_offset, f"{asked} on this broker node: its topic {view.topic!r} was deleted "
                                         f"after it was stored")
        return make_response(request, ResponseCode.SUCCESS, body=record)

    async def query_message(self, request: Frame, conn: Any) -> Frame:
        ext = request.ext
        # An unknown topic is an empty answer (RocketMQ's queryMessage does not look the topic up), but a name no
        # topic can have, or a key longer than the properties that would hold it, is the caller's mistake.
        topic = get_topic_name(ext)
        key = get_str(ext, "key")
        if len(key) > MAX_PROPERTIES_SIZE:
            raise invalid("key", f"is {len(key)} characters long; no stored key is longer than the "
                                 f"{MAX_PROPERTIES_SIZE} bytes of a message's properties")
        max_num = min(get_int(ext, "max_num", default=32, lo=1, hi=2 ** 31 - 1), MAX_QUERY_NUM)
        begin = get_int(ext, "begin_timestamp", default=0, lo=0, hi=I64[1])
        end = get_int(ext, "end_timestamp", default=I64[1], lo=0, hi=I64[1])
        if end < begin:
            raise invalid("end_timestamp", f"must be >= begin_timestamp {begin}, got {end}")
        records = self.node.query_records(topic, key, max_num, begin, end)
        if not records:
            return make_response(request, ResponseCode.QUERY_NOT_FOUND,
                                 remark=f"no message with key {key[:80]!r}{'...' if len(key) > 80 else ''} in topic "
                                        f"{topic!r} between {begin} and {end}")
        return make_response(request, ResponseCode.SUCCESS, ext={"count": len(records)}, body=b"".join(records))


def _not_found(phy_offset: int, remark: str) -> RequestRejected:
    return RequestRejected(ResponseCode.QUERY_NOT_FOUND, remark, ext={"phy_offset": phy_offset})
