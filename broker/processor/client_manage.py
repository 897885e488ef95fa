"""HEART_BEAT, UNREGISTER_CLIENT, GET_CONSUMER_LIST_BY_GROUP, GET_CONSUMER_CONNECTION_LIST and
GET_PRODUCER_CONNECTION_LIST: who is connected, per group.

The heartbeat's producer and consumer data may come as a CBOR body (RocketMQ sends HeartbeatData as the body)
or, for small heartbeats, inline in ``ext``; the schema is the same (docs/protocol.md, "Broker requests").
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import cbor2

from broker.consumer_manager import HeartbeatError, client_id_problem, parse_heartbeat
from broker.processor.base import RequestRejected, get_group, get_str, invalid, request_data
from remoting.codec import Frame, make_response
from remoting.codes import ResponseCode

if TYPE_CHECKING:
    from broker.node import BrokerNode

log = logging.getLogger(__name__)


class ClientManageProcessor:
    def __init__(self, node: BrokerNode) -> None:
        self.node = node

    async def heartbeat(self, request: Frame, conn: Any) -> Frame:
        data = request_data(request)
        try:
            heartbeat = parse_heartbeat(data)
        except HeartbeatError as e:
            raise RequestRejected(ResponseCode.INVALID_REQUEST, f"heartbeat: {e}", ext={"field": e.field}) from None
        self.node.clients.heartbeat(heartbeat, conn)
        return make_response(request, ResponseCode.SUCCESS)

    async def unregister_client(self, request: Frame, conn: Any) -> Frame:
        ext = request.ext
        client_id = get_str(ext, "client_id")
        problem = client_id_problem(client_id)
        if problem:  # no heartbeat could have registered it
            raise invalid("client_id", problem)
        # Either group may be absent or empty (RocketMQ's optional header fields); one that is named is held to
        # the rule the heartbeat that joined it was.
        producer_group, consumer_group = (get_group(ext, name) if ext.get(name) not in (None, "") else None
                                          for name in ("producer_group", "consumer_group"))
        self.node.clients.unregister(client_id, producer_group, consumer_group)
        return make_response(request, ResponseCode.SUCCESS)

    async def get_consumer_list_by_group(self, request: Frame, conn: Any) -> Frame:
        group = get_group(request.ext)
        ids = self.node.clients.consumer_ids(group)
        # An empty list is an answer, not an error: a member that has not sent its heartbeat here yet simply
        # sees no peers and rebalances again on its next round.
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps({"consumer_id_list": ids}))

    async def get_consumer_connection_list(self, request: Frame, conn: Any) -> Frame:
        """RocketMQ's consumerConnection: the group's members on this node and what they subscribe to."""
        group = get_group(request.ext)
        info = self.node.clients.consumer_groups.get(group)
        if info is None or not info.channels:
            raise RequestRejected(ResponseCode.CONSUMER_NOT_ONLINE,
                                  f"consumer group {group!r} has no member online on broker node "
                                  f"{self.node.broker_addr}")
        now = self.node.clients.now()
        body = {"consume_type": info.consume_type, "message_model": info.message_model,
                "consume_from_where": info.consume_from_where,
                "subscriptions": [{"topic": sub.topic, "expression": sub.expression}
                                  for _topic, sub in sorted(info.subscriptions.items())],
                "connections": [{"client_id": ch.client_id, "client_addr": getattr(ch.conn, "remote_address", ""),
                                 "last_heartbeat_age_ms": int(max(0.0, now - ch.last_update_s) * 1000),
                                 "subscriptions": [{"topic": topic, "expression": expression}
                                                   for topic, expression in sorted(ch.subscriptions.items())]}
                                for _id, ch in sorted(info.channels.items())]}
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps(body))

    async def get_producer_connection_list(self, request: Frame, conn: Any) -> Frame:
        """RocketMQ's producerConnection: the producers of a group whose heartbeats reach this node. Transactional
        producers must be online for the broker's check-backs, which is what this is mostly asked for."""
        group = get_group(request.ext, "producer_group")
        channels = self.node.clients.producer_groups.get(group)
        if not channels:
            raise RequestRejected(ResponseCode.SYSTEM_ERROR,
                                  f"producer group {group!r} has no producer online on broker node "
                                  f"{self.node.broker_addr}")
        now = self.node.clients.now()
        body = {"connections": [{"client_id": ch.client_id, "client_addr": getattr(ch.conn, "remote_address", ""),
                                 "last_heartbeat_age_ms": int(max(0.0, now - ch.last_update_s) * 1000)}
                                for _id, ch in sorted(channels.items())]}
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps(body))
