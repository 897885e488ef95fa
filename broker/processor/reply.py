"""SEND_REPLY_MESSAGE / SEND_REPLY_MESSAGE_V2 (324/325): a reply to a request message, stored, then pushed to the
producer that is waiting for it (RocketMQ 4.6's ReplyMessageProcessor).

A requester (``Producer.request``) sends an ordinary message stamped with REPLY_TO_CLIENT (its client id),
CORRELATION_ID, TTL (its timeout) and CLUSTER (the cluster of the group it sends to). Whoever consumes it answers
with ``client.message.create_reply_message``: a message to ``<cluster>_REPLY_TOPIC`` with MSG_TYPE=reply, which
its producer sends with this code. On the leader (a follower answers NOT_LEADER, as to a send):

1. The request is checked as a send is (broker permission, the send processor's encoding: size, properties),
   plus what makes it a reply: the topic is this node's cluster's reply topic (another one is TOPIC_NOT_EXIST:
   the replier's route was for another cluster), the properties name REPLY_TO_CLIENT and CORRELATION_ID, and carry
   no delay, timer or transaction (a reply is pushed now; INVALID_REQUEST naming ``properties``).
2. It is stored in the reply topic. RocketMQ stores it only with storeReplyMessageEnable, whose default is true;
   here always: a reply is then in the commit log like any message (lookups by key or id, an audit trail), and
   what is pushed is the stored record, offsets and store time included. RocketMQ pushes first and stores after;
   storing first means a reply the store refused (a leader that just stepped down) is never pushed, so the copy
   the replier sends again to the new leader is the only one the requester sees.
3. The record goes to the requester as PUSH_REPLY_MESSAGE_TO_CLIENT over the connection its producer heartbeats
   came on (``ClientManager.find_producer_connection``: clients heartbeat every node of every group they know,
   so the leader has it), and the node waits up to 3 s for the client's answer, as RocketMQ's callClient.

The answer is a send's (``msg_id``, ``queue_id``, ``queue_offset``) when the push was taken. When no connection of
the requester is known here (it is gone, or its first heartbeat has not reached this node) or the push failed,
it is SYSTEM_ERROR with RocketMQ's remark ("push reply message fail, channel of <id> not found."), the reply
stored all the same and its send result in ext, as RocketMQ answers. SYSTEM_ERROR is retriable, so the replier's
producer sends it again, stored and pushed again: a requester that has connected meanwhile gets it, one that had
an earlier copy drops this one as a reply nothing waits for.

The reply topic (1 queue, read|write, as RocketMQ's TopicConfigManager makes it) is created by every leader as
soon as it is ready (``serve``, once per term), so the name servers route it to every group of the cluster before
a replier asks; and here, should a reply come first (or it was deleted since). Any queue id a replier names is
taken modulo the topic's one queue: see ``_store_and_push``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from broker.consumer_manager import client_id_problem
from broker.processor.base import (I32, RequestRejected, answer_from_task, get_group, get_int, get_topic_name,
                                   invalid, topic_not_writable)
from broker.topic_config import PERM_READ_WRITE, TopicConfig, TopicConfigError, validate_topic_name
from dledger import DLedgerError
from remoting.codec import Frame, make_request, make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError
from remoting.message import (PROPERTY_CORRELATION_ID, PROPERTY_DELAY, PROPERTY_MESSAGE_REPLY_TO_CLIENT,
                              PROPERTY_TRANSACTION_PREPARED, TIMER_PROPERTIES, reply_topic)

if TYPE_CHECKING:
    from broker.node import BrokerNode
    from broker.processor.send_message import SendMessageProcessor

log = logging.getLogger(__name__)

REPLY_QUEUE_NUMS = 1  # RocketMQ's reply topic: one read and one write queue
PUSH_TIMEOUT_S = 3.0  # RocketMQ's Broker2Client.callClient
_TOPIC_CHECK_INTERVAL_S = 0.05  # how soon after an election the reply topic is there
# Properties that would store a reply somewhere else than its topic, for later: it is pushed now.
_NOT_IN_A_REPLY = (PROPERTY_DELAY, PROPERTY_TRANSACTION_PREPARED, *TIMER_PROPERTIES)


class ReplyMessageProcessor:
    def __init__(self, node: BrokerNode, send: SendMessageProcessor) -> None:
        self.node = node
        self._send = send
        self._round_robin = 0
        self.pushed = 0
        self.push_failures = 0

    @property
    def reply_topic(self) -> str:
        return reply_topic(self.node.config.cluster_name)

    def reply_topic_config(self) -> TopicConfig:
        return TopicConfig(self.reply_topic, REPLY_QUEUE_NUMS, REPLY_QUEUE_NUMS, PERM_READ_WRITE)

    async def process(self, request: Frame, conn: Any) -> Frame | None:
        node = self.node
        if not node.is_leader():
            raise node.not_leader()
        if getattr(conn, "nursery", None) is None:
            return await self._store_and_push(request, conn)
        # The store waits for the Raft commit and the push for the requester: the replier's connection reads on
        # meanwhile, as it does while its sends wait.
        conn.nursery.start_soon(answer_from_task, node, request, conn,
                                functools.partial(self._store_and_push, request, conn))
        return None

    async def _store_and_push(self, request: Frame, conn: Any) -> Frame:
        node = self.node
        ext = request.ext
        if not node.writable:
            raise node.write_forbidden(ext.get("topic"))
        topic = get_topic_name(ext)
        own = self.reply_topic
        if topic != own:
            raise RequestRejected(ResponseCode.TOPIC_NOT_EXIST,
                                  f"topic {topic!r} is not the reply topic of cluster {node.config.cluster_name!r}, "
                                  f"which broker {node.config.broker_name} belongs to (its reply topic is {own!r})",
                                  ext={"topic": topic})
        get_group(ext, "producer_group", default="DEFAULT_PRODUCER")
        properties = ext.get("properties")
        if not isinstance(properties, Mapping):
            raise invalid("properties", f"of a reply must be a map naming {PROPERTY_MESSAGE_REPLY_TO_CLIENT} and "
                                        f"{PROPERTY_CORRELATION_ID}, got {type(properties).__name__}")
        for name in (PROPERTY_MESSAGE_REPLY_TO_CLIENT, PROPERTY_CORRELATION_ID):
            value = properties.get(name)
            if not isinstance(value, str) or not value:
                raise invalid("properties", f"of a reply must name {name} (create_reply_message copies it from the "
                                            f"request), got {value!r}")
        client_id = properties[PROPERTY_MESSAGE_REPLY_TO_CLIENT]
        problem = client_id_problem(client_id)
        if problem:  # no heartbeat could have registered it
            raise invalid("properties", f"{PROPERTY_MESSAGE_REPLY_TO_CLIENT} {problem}")
        for name in _NOT_IN_A_REPLY:
            if name in properties:
                raise invalid("properties", f"of a reply must not set {name}: a reply is pushed to its requester "
                                            f"at once, never delayed nor part of a transaction")
        config = await node.ensure_topic(self.reply_topic_config(), "created (reply topic)")
        if not config.writable:
            raise topic_not_writable(node, topic, config)
        queue_id = get_int(ext, "queue_id", default=-1, lo=-1, hi=I32[1])
        if queue_id < 0:
            queue_id = self._round_robin
            self._round_robin += 1
        # Any queue will do (nothing consumes the reply topic), and a replier that sent before the topic was
        # registered routed it as a stand-in route does an unknown topic, over default_topic_queue_nums queues: a
        # queue id past the topic's is taken modulo, where a send is refused (that would fail every such reply
        # until the replier's next route refresh).
        queue_id %= config.write_queue_nums
        # The message itself (size, properties, hosts) is checked and encoded as the send processor does a send's.
        batch = self._send._encode_single(request, topic, queue_id, node.max_message_size, conn)
        messages = await node.append_messages(batch)
        response = self._send._success(request, messages)
        failure = await self._push(client_id, messages[0], properties[PROPERTY_CORRELATION_ID])
        if failure is None:
            return response
        return make_response(request, ResponseCode.SYSTEM_ERROR, remark=failure, ext=response.ext)

    async def _push(self, client_id: str, stored: Any, correlation_id: str) -> str | None:
        """Push the stored reply to ``client_id``; the remark of the failure, or None."""
        node = self.node
        conn = node.clients.find_producer_connection(client_id)
        if conn is None:
            self.push_failures += 1
            # RocketMQ's remark. INFO, not WARNING: a requester that timed out and closed is an everyday cause.
            remark = f"push reply message fail, channel of <{client_id}> not found."
            log.info("reply not pushed: the requester is not connected here client_id=%s correlation_id=%s",
                     client_id, correlation_id)
            return remark
        raw = node.read_record(stored.phy_offset)
        if raw is None:  # appended a moment ago: only a deletion racing it takes it away
            self.push_failures += 1
            return f"push reply message to <{client_id}> fail: the stored reply at {stored.phy_offset} is gone"
        frame = make_request(RequestCode.PUSH_REPLY_MESSAGE_TO_CLIENT,
                             ext={"broker_name": node.config.broker_name}, body=raw)
        try:
            answer = await conn.invoke(frame, timeout_s=PUSH_TIMEOUT_S)
        except RaftMQError as e:
            self.push_failures += 1
            log.info("reply not pushed client_id=%s correlation_id=%s error=%s", client_id, correlation_id, e)
            return f"push reply message to <{client_id}> fail: {e}"
        if answer.code != ResponseCode.SUCCESS:
            self.push_failures += 1
            log.warning("requester refused a reply client_id=%s correlation_id=%s code=%d remark=%s", client_id,
                        correlation_id, answer.code, answer.remark)
            return f"push reply message to <{client_id}> fail: it answered code {answer.code}: {answer.remark}"
        self.pushed += 1
        return None

    async def serve(self) -> None:
        """Create the cluster's reply topic on a leader once it is ready, as RocketMQ's brokers do at start: once
        per term, so a deleted one (or one refused for want of room, max_topic_count) is not taken back behind the
        operator's back; the first reply creates it then, if there is room."""
        node = self.node
        group = node.group
        topic = self.reply_topic
        try:
            validate_topic_name(topic)
        except TopicConfigError as e:
            # A cluster name of more than 115 characters: no reply topic can exist, so requests get no reply.
            log.warning("cluster %r has no reply topic, request-reply is unavailable: %s", node.config.cluster_name,
                        e)
            return
        done_term = None
        while True:
            await trio.sleep(_TOPIC_CHECK_INTERVAL_S)
            if not group.is_ready_leader or group.term == done_term:
                continue
            done_term = group.term
            if node.topics.get(topic) is not None:
                continue
            try:
                await node.ensure_topic(self.reply_topic_config(), "created (reply topic)")
            except (RequestRejected, DLedgerError, RaftMQError) as e:
                log.info("reply topic not created topic=%s error=%s", topic, getattr(e, "remark", e))
