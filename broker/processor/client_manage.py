"""HEART_BEAT, UNREGISTER_CLIENT, GET_CONSUMER_LIST_BY_GROUP, GET_CONSUMER_CONNECTION_LIST and
GET_PRODUCER_CONNECTION_LIST: who is connected, per group; and CHECK_CLIENT_CONFIG: can this node serve a
subscription.

The heartbeat's producer and consumer data may come as a CBOR body (RocketMQ sends HeartbeatData as the body)
or, for small heartbeats, inline in ``ext``; the schema is the same (docs/protocol.md, "Broker requests").
CHECK_CLIENT_CONFIG's map comes the same way, its subscription parsed as a heartbeat's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import cbor2

from broker.consumer_manager import (ExpressionParseError, HeartbeatError, client_id_problem, parse_heartbeat,
                                     parse_subscription_data)
from broker.processor.base import RequestRejected, get_group, get_str, invalid, request_data
from broker.processor.pull_message import sql92_not_supported
from remoting.codec import Frame, make_response
from remoting.codes import ResponseCode
from remoting.sql_filter import SQL92

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

    async def check_client_config(self, request: Frame, conn: Any) -> Frame:
        """RocketMQ's checkClientConfig: would this node serve ``subscription`` to the group's pulls? A consumer
        asks before it consumes a SQL92 subscription, so a broker that cannot filter by it fails the consumer's
        start instead of refusing its every pull. Any node answers, for itself: enable_property_filter is per
        node. Nothing is registered; the refusals are the pull's (SYSTEM_ERROR, SUBSCRIPTION_PARSE_FAILED)."""
        data = request_data(request)
        if not isinstance(data, Mapping):
            raise invalid("body", f"must be a CBOR map, got {type(data).__name__}")
        client_id = get_str(data, "client_id")
        problem = client_id_problem(client_id)
        if problem:
            raise invalid("client_id", problem)
        group = get_group(data)
        raw = data.get("subscription")
        if raw is None:
            raise invalid("subscription", "is required")
        parse_error: ExpressionParseError | None = None
        try:
            expression_type = parse_subscription_data(raw, "subscription.", field="subscription").expression_type
        except ExpressionParseError as e:
            parse_error, expression_type = e, e.expression_type
        except HeartbeatError as e:
            raise RequestRejected(ResponseCode.INVALID_REQUEST, f"check client config: {e}",
                                  ext={"field": e.field}) from None
        # The type first, as RocketMQ: a node that cannot filter by SQL92 says so, whatever the expression.
        if expression_type == SQL92 and not self.node.config.enable_property_filter:
            refusal = sql92_not_supported(self.node)
        elif parse_error is not None:
            refusal = RequestRejected(ResponseCode.SUBSCRIPTION_PARSE_FAILED, str(parse_error),
                                      ext={"field": "expression"})
        else:
            return make_response(request, ResponseCode.SUCCESS)
        log.info("client config refused client_id=%s consumer_group=%s code=%d remark=%s", client_id, group,
                 refusal.code, refusal.remark)
        raise refusal

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
