"""HEART_BEAT, UNREGISTER_CLIENT, GET_CONSUMER_LIST_BY_GROUP, GET_CONSUMER_CONNECTION_LIST and
GET_PRODUCER_CONNECTION_LIST: who is connected, per group; CHECK_CLIENT_CONFIG: can this node serve a
subscription; and GET_CONSUMER_RUNNING_INFO: an admin's question relayed to one online consumer.

The heartbeat's producer and consumer data may come as a CBOR body (RocketMQ sends HeartbeatData as the body)
or, for small heartbeats, inline in ``ext``; the schema is the same (docs/protocol.md, "Broker requests").
CHECK_CLIENT_CONFIG's map comes the same way, its subscription parsed as a heartbeat's. A heartbeat also starts
the auto-creation of each of its consumer groups' subscription group config (``broker/subscription_group.py``).

GET_CONSUMER_RUNNING_INFO is RocketMQ's: the admin names a group and a member's client id, and the node sends the
request on to that member over the connection its heartbeats come on (only a node the member heartbeats to can:
a client accepts no connection), waits up to ``timeout_ms`` for the answer and hands its body back as it came.
A member that is not online here is CONSUMER_NOT_ONLINE; one that does not answer in time, whose connection
closes meanwhile, or that answers with an error (a client that does not serve the request) is SYSTEM_ERROR, the
remark naming the member and what happened.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import cbor2

from broker.consumer_manager import (ExpressionParseError, HeartbeatError, client_id_problem, parse_heartbeat,
                                     parse_subscription_data)
from broker.processor.base import RequestRejected, get_bool, get_group, get_int, get_str, invalid, request_data
from broker.processor.pull_message import sql92_not_supported
from remoting.codec import Frame, make_request, make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError, RequestTimeoutError
from remoting.sql_filter import SQL92

if TYPE_CHECKING:
    from broker.node import BrokerNode

log = logging.getLogger(__name__)

# GET_CONSUMER_RUNNING_INFO: how long the member is waited for unless the request says (RocketMQ's admin waits 5 s
# too), and the longest a request may ask for (the admin's own request must outlast it).
RUNNING_INFO_TIMEOUT_MS = 5_000
RUNNING_INFO_MAX_TIMEOUT_MS = 60_000


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
        if self.node.is_leader():
            for consumer in heartbeat.consumers:
                self.node.subscription_groups.heartbeat_seen(consumer.consumer_group)
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

    async def get_consumer_running_info(self, request: Frame, conn: Any) -> Frame:
        """RocketMQ's getConsumerRunningInfo: ext ``consumer_group``, ``client_id``, ``jstack`` (default false: the
        member's task dump too) and ``timeout_ms``; answered with the member's own answer body (client/running_info.py
        draws it, docs/protocol.md lists its fields)."""
        node = self.node
        group = get_group(request.ext)
        client_id = get_str(request.ext, "client_id")
        problem = client_id_problem(client_id)
        if problem:
            raise invalid("client_id", problem)
        jstack = get_bool(request.ext, "jstack")
        timeout_ms = get_int(request.ext, "timeout_ms", default=RUNNING_INFO_TIMEOUT_MS, lo=1,
                             hi=RUNNING_INFO_MAX_TIMEOUT_MS)
        member = node.clients.find_consumer_connection(group, client_id)
        if member is None:
            online = node.clients.consumer_ids(group)
            raise RequestRejected(ResponseCode.CONSUMER_NOT_ONLINE,
                                  f"the consumer <{client_id}> of group {group!r} is not online on broker node "
                                  f"{node.broker_addr} (members online here: {', '.join(online[:5]) or 'none'}"
                                  f"{', ...' if len(online) > 5 else ''})", ext={"consumer_group": group})
        ask = make_request(RequestCode.GET_CONSUMER_RUNNING_INFO,
                           ext={"consumer_group": group, "client_id": client_id, "jstack": jstack})
        try:
            answer = await member.invoke(ask, timeout_s=timeout_ms / 1000)
        except RequestTimeoutError:
            raise RequestRejected(ResponseCode.SYSTEM_ERROR,
                                  f"the consumer <{client_id}> of group {group!r} did not answer within {timeout_ms} "
                                  f"ms") from None
        except RaftMQError as e:  # its connection closed meanwhile, or the request could not be sent
            raise RequestRejected(ResponseCode.SYSTEM_ERROR,
                                  f"the consumer <{client_id}> of group {group!r} could not be asked: {e}") from None
        if answer.code != ResponseCode.SUCCESS:
            raise RequestRejected(ResponseCode.SYSTEM_ERROR,
                                  f"the consumer <{client_id}> of group {group!r} answered code {answer.code}: "
                                  f"{answer.remark or 'no remark'}")
        return make_response(request, ResponseCode.SUCCESS, body=answer.body)
