"""QUERY_CONSUMER_OFFSET and UPDATE_CONSUMER_OFFSET.

Updates are accepted by the leader only (NOT_LEADER elsewhere, with ``leader_addr``) and replicated in batches
(``broker/offset_manager.py``). Queries are answered by any node; a group that never committed an offset for
the queue gets QUERY_NOT_FOUND, as RocketMQ, and the client then starts from its ``consume_from_where``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker.processor.base import get_group, get_int, get_topic_queue
from remoting.codec import Frame, make_response
from remoting.codes import ResponseCode

if TYPE_CHECKING:
    from broker.node import BrokerNode


class ConsumerManageProcessor:
    def __init__(self, node: BrokerNode) -> None:
        self.node = node

    def _key(self, request: Frame) -> tuple[str, str, int]:
        ext = request.ext
        group = get_group(ext)
        topic, queue_id = get_topic_queue(self.node, ext)
        return group, topic, queue_id

    async def query_consumer_offset(self, request: Frame, conn: Any) -> Frame:
        group, topic, queue_id = self._key(request)
        offset = self.node.offsets.query(group, topic, queue_id)
        if offset is None:
            return make_response(request, ResponseCode.QUERY_NOT_FOUND,
                                 remark=f"consumer group {group!r} has no offset for {topic}:{queue_id}",
                                 ext={"offset": -1})
        return make_response(request, ResponseCode.SUCCESS, ext={"offset": offset})

    async def update_consumer_offset(self, request: Frame, conn: Any) -> Frame | None:
        if not self.node.is_leader():
            raise self.node.not_leader()
        group, topic, queue_id = self._key(request)
        offset = get_int(request.ext, "commit_offset", lo=0)
        self.node.offsets.commit(group, topic, queue_id, offset)
        return None if request.is_oneway else make_response(request, ResponseCode.SUCCESS)
