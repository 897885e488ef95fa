"""CONSUMER_SEND_MSG_BACK (36): a consumer hands a message it failed to consume back to the broker that stored it.

RocketMQ's SendMessageProcessor.consumerSendMsgBack, on the leader. The request names the failed message by its
commit-log offset (``offset``; ext as RocketMQ's ConsumerSendMsgBackRequestHeader: ``offset``, ``group``,
``delay_level``, ``origin_msg_id``, ``origin_topic``, ``max_reconsume_times``). The broker reads the message from
its own store and appends a copy with ``reconsume_times`` + 1 and properties RETRY_TOPIC (the topic it was first
consumed from, kept from the first failure on: read only from a retry copy, ``remoting.message.first_topic``) and
ORIGIN_MESSAGE_ID:

* while the stored copy's ``reconsume_times`` is below ``max_reconsume_times`` (and ``delay_level`` >= 0), to the
  group's retry topic ``%RETRY%<group>``, delayed by ``delay_level`` or, when 0, by level 3 + reconsume_times
  (RocketMQ's backoff: 10 s, 30 s, 1 m, ... with the default levels), capped at the last level;
* else (or with ``delay_level`` -1) at once to the group's dead-letter topic ``%DLQ%<group>``;
* a message whose properties, near the limit, cannot take the ones added (RETRY_TOPIC, ORIGIN_MESSAGE_ID, the
  schedule's), or whose stored block cannot be written again from its decoded properties (an empty name, a value
  with \x01: taken from a batch before the broker refused such blocks), goes at once to the dead-letter topic as it
  was stored, its properties block copied (answered ``dead``), as POP's revive does: refused, its consumer retried
  it locally without end and its queue's offset never passed it.

The group's subscription group (``broker/subscription_group.py``, auto-created here as by a pull) gives the limit
when the request carries no ``max_reconsume_times`` (its ``retry_max_times``, 16 by default; raftmq's consumers
always send theirs, RocketMQ's clients before 3.4.9 did not) and the retry topic's queue count (``retry_queue_nums``,
1 by default) when a send-back first creates it; a retried message goes to one of its queues at random (the
writable ones it has, should it have been created with fewer). An unknown group with
``auto_create_subscription_group`` false is refused SUBSCRIPTION_GROUP_NOT_EXIST. The retry topic is read|write
(every member of the group subscribes to it); the DLQ has one queue, write-only, so no consumer reads it by
accident; lookups by key or id (``raftmq admin``) do not need read permission.

A node whose ``broker_permission`` lacks write refuses it with NO_PERMISSION, as RocketMQ does: it is a write. So
does a retry or dead-letter topic whose ``perm`` an admin set without write (RocketMQ's "the topic[%RETRY%G] sending
message is forbidden"), as a send to it is refused: the push consumer keeps a message whose send-back is refused and
consumes it again after ``reconsume_delay_ms`` (``client/consume_service.py``). RocketMQ checks only the retry
topic's perm; the dead letters are checked here too, since raftmq's send path holds every topic's perm, and a refusal
loses nothing (the message stays with its consumer until the topic takes writes again).
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any

from broker.processor.base import (I32, RequestRejected, get_group, get_int, get_str, invalid, legal_topic,
                                   topic_not_writable)
from broker.schedule import schedule_properties, stored_again
from broker.topic_config import PERM_READ_WRITE, PERM_WRITE, TopicConfig
from remoting.codec import Frame, make_response
from remoting.codes import ResponseCode
from remoting.message import (PROPERTY_DELAY, PROPERTY_ORIGIN_MESSAGE_ID,
                              PROPERTY_REAL_QUEUE_ID, PROPERTY_REAL_TOPIC, PROPERTY_RETRY_TOPIC, PROPERTY_UNIQ_KEY,
                              RETRY_GROUP_MAX_LENGTH, SCHEDULE_TOPIC, TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC,
                              MessageFormatError, MessageView, create_msg_id, decode_record, dlq_topic,
                              encode_batch, first_topic, record_properties, retry_topic)

if TYPE_CHECKING:
    from broker.node import BrokerNode

log = logging.getLogger(__name__)

DLQ_QUEUE_NUMS = 1  # RocketMQ's DLQ_NUMS_PER_GROUP
_FIRST_RETRY_LEVEL = 3  # RocketMQ: delay level 3 + reconsume_times when the consumer names none
# Where the broker keeps records no consumer is handed (transactions, delayed messages not due yet).
_BROKER_RECORD_TOPICS = frozenset({TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC, SCHEDULE_TOPIC})


class SendBackProcessor:
    def __init__(self, node: BrokerNode) -> None:
        self.node = node

    async def consumer_send_msg_back(self, request: Frame, conn: Any) -> Frame:
        node = self.node
        if not node.is_leader():
            raise node.not_leader()
        if not node.writable:
            # As RocketMQ's consumerSendMsgBack: it stores a message, which a group out of write traffic must not.
            # The consumer keeps the message and consumes it again later (client.push_consumer.send_back).
            raise node.write_forbidden(request.ext.get("origin_topic") or None)
        ext = request.ext
        group = get_group(ext, "group")
        if len(group) > RETRY_GROUP_MAX_LENGTH:
            raise invalid("group", f"{group[:40]!r}... is too long for its retry and dead-letter topics (at most "
                                   f"{RETRY_GROUP_MAX_LENGTH} characters)")
        offset = get_int(ext, "offset", lo=0)
        delay_level = get_int(ext, "delay_level", default=0, lo=-1, hi=I32[1])
        max_reconsume_times = ext.get("max_reconsume_times")
        if max_reconsume_times is not None:  # checked before the group is looked up (and maybe created)
            max_reconsume_times = get_int(ext, "max_reconsume_times", lo=0, hi=I32[1])
        origin_msg_id = get_str(ext, "origin_msg_id", default="", allow_empty=True)
        origin_topic = get_str(ext, "origin_topic", default="", allow_empty=True)
        if origin_topic:
            legal_topic("origin_topic", origin_topic)
        store = node.store
        found = self._look(offset) if store.min_phy_offset <= offset < store.max_phy_offset else None
        view, as_stored = found if found is not None else (None, b"")
        if view is None or store.deleted_with_topic(view.topic, offset):
            raise RequestRejected(ResponseCode.NO_MESSAGE,
                                  f"no message starts at commit-log offset {offset} on broker "
                                  f"{node.config.broker_name} (its commit log holds offsets "
                                  f"{store.min_phy_offset}..{store.max_phy_offset}); nothing was sent back",
                                  ext={"field": "offset"})
        if view.topic in _BROKER_RECORD_TOPICS:
            # No consumer was handed this record: a half message waiting for its END_TRANSACTION, a transaction's
            # outcome, a delayed message not due yet. Sent back, its copy would be consumed early or unsettled.
            raise invalid("offset", f"{offset} holds a record of the broker's own topic {view.topic!r}, not a "
                                    f"consumed message; nothing was sent back")
        stored_props = dict(view.properties)
        # A retry copy's RETRY_TOPIC only: on another record it is whatever its producer wrote (a broker that
        # took it from producers stored it), and trusted it sent the retry to that topic's handler.
        first = first_topic(view.topic, stored_props)
        if origin_topic and origin_topic not in (view.topic, first):
            # A stale or wrong offset would otherwise retry (or bury in the DLQ) some other topic's message.
            raise invalid("offset", f"{offset} holds a message of topic {view.topic!r}, not of origin_topic "
                                    f"{origin_topic!r}")
        sub_group = await node.subscription_groups.ensure(group)
        if max_reconsume_times is None:
            max_reconsume_times = sub_group.retry_max_times
        reconsume_times = view.reconsume_times
        dead = reconsume_times >= max_reconsume_times or delay_level < 0
        for name in (PROPERTY_DELAY, PROPERTY_REAL_TOPIC, PROPERTY_REAL_QUEUE_ID):
            stored_props.pop(name, None)
        props = dict(stored_props)
        props[PROPERTY_RETRY_TOPIC] = first
        props[PROPERTY_ORIGIN_MESSAGE_ID] = (origin_msg_id or props.get(PROPERTY_UNIQ_KEY)
                                             or create_msg_id(view.store_host, view.phy_offset))
        try:
            target, batch = await self._copy(view, group, dead, props, delay_level, sub_group.retry_queue_nums)
        except MessageFormatError as e:
            # Properties near the limit, tipped over by the ones added here: refused, the consumer retried it locally
            # without end and its queue's offset never passed it. To the dead letters as stored instead (as POP's
            # revive does), where an operator finds it: its properties block copied, not decoded and written again,
            # which fails for a block a broker took from a batch before it refused those encode_properties does not
            # write (an empty name, a value with \x01).
            try:
                dead = True
                target, batch = await self._copy(view, group, dead, as_stored, delay_level, 0)
            except MessageFormatError:
                raise RequestRejected(ResponseCode.MESSAGE_ILLEGAL, f"the message at offset {offset} cannot be "
                                                                    f"sent back: {e}") from None
            log.warning("message cannot be sent back with the retry properties; to the dead-letter topic as stored "
                        "group=%s offset=%d error=%s", group, offset, e)
        (stored,) = await node.append_messages(batch)
        return make_response(request, ResponseCode.SUCCESS, ext={
            "topic": target, "msg_id": stored.msg_id, "reconsume_times": reconsume_times + 1, "dead": dead})

    def _look(self, offset: int) -> tuple[MessageView, bytes] | None:
        """The record at ``offset`` decoded, and its properties block as stored; None if no record starts there.
        Bytes, not the store's view of them: a send-back awaits, and a view held meanwhile would pin the segment."""
        raw = self.node.store.look_record_by_offset(offset)
        if raw is None:
            return None
        return decode_record(raw, check_crc=False), record_properties(raw)

    async def _copy(self, view: Any, group: str, dead: bool, props: dict[str, str] | bytes, delay_level: int,
                    retry_queue_nums: int) -> tuple[str, bytes]:
        """The topic a send-back of ``view`` goes to (the group's retry or dead-letter topic, created if need be) and
        the batch that stores its copy with ``props`` (a retry through the schedule topic, delayed; bytes: a
        record's block, for a dead letter as stored); raises MessageFormatError for a copy the format cannot
        hold."""
        node = self.node
        target = dlq_topic(group) if dead else retry_topic(group)
        queue_nums = DLQ_QUEUE_NUMS if dead else retry_queue_nums
        created = await node.ensure_topic(TopicConfig(target, queue_nums, queue_nums,
                                                      PERM_WRITE if dead else PERM_READ_WRITE))
        if not created.writable:
            # An admin took write off the topic: the copy is refused as a send to it is (stored, it went into a topic
            # that takes no writes), and the consumer keeps the message, consuming it again later.
            raise topic_not_writable(node, target, created)
        topic, queue_id = target, 0 if dead else random.randrange(min(queue_nums, created.write_queue_nums))
        if not dead:
            levels = len(node.config.delay_levels_ms)
            level = min(delay_level or _FIRST_RETRY_LEVEL + view.reconsume_times, levels)
            topic, queue_id, props = SCHEDULE_TOPIC, level - 1, schedule_properties(target, queue_id, props, level)
        message = stored_again(view, topic, queue_id, props, reconsume_times=view.reconsume_times + 1,
                               prepared_transaction_offset=0)
        return target, encode_batch([message], node.store_host, max_message_size=node.max_message_size)
