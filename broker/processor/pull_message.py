"""PULL_MESSAGE with long polling, served by every node (followers read their own byte-identical store).

The pull path is RocketMQ's ``PullMessageProcessor``: validate, optionally commit the consumer's offset (sys_flag
bit 0x1, leader only), read up to ``max_msg_nums`` messages matching the tag filter, and answer with the raw
commit-log records as the body. A pull whose ``expression_type`` is SQL92 (or, without a subscription of its own,
whose group's is) reads its messages through ``broker/property_filter.py`` instead, with the same limits and
answers, and only on a node with ``enable_property_filter``; elsewhere it is refused as RocketMQ refuses it,
SYSTEM_ERROR "The broker does not support consumer to filter message by SQL92".

The pull's consumer group must be allowed to consume by its subscription group (``broker/subscription_group.py``):
a stopped one (``consume_enable`` false) is refused NO_PERMISSION "subscription group no permission, G", an unknown
one with ``auto_create_subscription_group`` false SUBSCRIPTION_GROUP_NOT_EXIST; a held pull is judged again when it
resumes, and a group's stop wakes that group's held pulls at once (a pull is held naming its group).

When nothing is there yet and the client allows suspension (sys_flag bit 0x2), the request is held by
``PullRequestHoldService`` for ``min(suspend_timeout_millis, long_polling_timeout_ms)`` and executed again when a
message for that queue is dispatched or the time is up.

Status mapping (store → response), as RocketMQ:
FOUND → SUCCESS; NO_MESSAGE_IN_QUEUE / OFFSET_OVERFLOW_ONE → PULL_NOT_FOUND (or held); NO_MATCHED_MESSAGE →
PULL_RETRY_IMMEDIATELY with the advanced ``next_begin_offset``, or, when the scan reached the queue's end and the
pull may wait, held from there (only a unit the filter wants wakes it: ``broker/long_polling.py``);
OFFSET_TOO_SMALL / OFFSET_OVERFLOW_BADLY / NO_MATCHED_LOGIC_QUEUE → PULL_OFFSET_MOVED on the leader, with
``next_begin_offset`` corrected; a follower answers PULL_RETRY_IMMEDIATELY instead and suggests the master,
because a follower that is only behind must not tell a consumer to move its offset. So does a leader for an offset
beyond the end until its queues are complete (``BrokerNode.queues_complete``: its no-op applied, dispatch caught
up): just elected, it may not have applied or dispatched what the old leader acknowledged, and RocketMQ's
correction (back to 0 while min_offset is 0) would deliver the whole queue again.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import trio

from broker.filter import SubscriptionParseError, TagFilter, parse_tag_expression
from broker.property_filter import get_messages_by_sql, has_sql_match_between, parse_sql_expression
from broker.processor.base import (I32, RequestRejected, error_response, existing_topic_config, get_group, get_int,
                                   get_str, invalid)
from broker.topic_config import PERM_READ
from remoting.codec import Frame, make_response
from remoting.codes import ResponseCode
from remoting.errors import RaftMQError
from remoting.message import TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC, split_pop_retry_topic
from remoting.sql_filter import SQL92, TAG, SqlFilter

if TYPE_CHECKING:
    from broker.node import BrokerNode

log = logging.getLogger(__name__)

FLAG_COMMIT_OFFSET = 0x1
FLAG_SUSPEND = 0x2
FLAG_SUBSCRIPTION = 0x4
MASTER_ID = 0


def check_pullable(node: BrokerNode, topic: str, queue_id: int) -> None:
    """Raise the refusal a pull of (topic, queue_id) gets: a node whose ``broker_permission`` lacks read (2, write
    only; RocketMQ's "pulling message is forbidden"), a POP retry topic (also as a POP's topic), a topic that does
    not exist or is not readable, or a queue_id at or beyond its read_queue_nums. Checked again when a held pull
    resumes, and by the node after a topic or permission change to release the held pulls it now refuses."""
    if not node.config.broker_permission & PERM_READ:
        raise RequestRejected(ResponseCode.NO_PERMISSION,
                              f"broker {node.config.broker_name} (node {node.broker_addr}) is not readable "
                              f"(broker_permission {node.config.broker_permission}): pulling messages from it is "
                              f"forbidden", ext={"broker_name": node.config.broker_name, "topic": topic})
    pop_retry = split_pop_retry_topic(topic)
    if pop_retry is not None:
        # Only that group's POPs of that topic read it (they are not checked here): pulled, or popped as a topic, it
        # would hand that group's redeliveries to whoever asks.
        raise RequestRejected(ResponseCode.NO_PERMISSION,
                              f"topic {topic!r} is the POP retry topic of consumer group {pop_retry[0]!r} for topic "
                              f"{pop_retry[1]!r}: only that group's POPs of {pop_retry[1]!r} read it; no consumer "
                              f"may pull, pop or subscribe to it", ext={"topic": topic})
    try:
        config = existing_topic_config(node, topic)
    except RequestRejected:
        if topic in (TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC):
            # Stored without a topic config, read by the broker alone: "does not exist" would mislead.
            raise RequestRejected(ResponseCode.NO_PERMISSION,
                                  f"topic {topic!r} holds the broker's transaction records (half messages wait there "
                                  f"for their END_TRANSACTION); no consumer may pull or subscribe to it") from None
        raise
    if not config.readable:
        raise RequestRejected(ResponseCode.NO_PERMISSION,
                              f"topic {topic!r} is not readable on broker {node.config.broker_name} "
                              f"(perm={config.perm})")
    if queue_id >= config.read_queue_nums:
        raise invalid("queue_id", f"must be below topic {topic!r}'s read_queue_nums {config.read_queue_nums}, "
                                  f"got {queue_id}")


def sql92_not_supported(node: BrokerNode) -> RequestRejected:
    """RocketMQ's answer (code and remark) to a SQL92 pull, or CHECK_CLIENT_CONFIG of a SQL92 subscription, on a
    node without ``enable_property_filter``; the remark names the broker, the node and the key to set."""
    return RequestRejected(ResponseCode.SYSTEM_ERROR,
                           f"The broker does not support consumer to filter message by {SQL92}: broker "
                           f"{node.config.broker_name} (node {node.broker_addr}) has enable_property_filter = false",
                           ext={"field": "expression_type"})


class PullMessageProcessor:
    def __init__(self, node: BrokerNode) -> None:
        self.node = node

    async def process(self, request: Frame, conn: Any) -> Frame | None:
        args = self._parse(request)
        response, hold_from = self._pull(request, args, allow_suspend=True)
        if response is not None:
            return response
        # Nothing yet: hold the request; the hold service re-runs the pull and sends the response itself.
        timeout_s = min(args["suspend_timeout_millis"], self.node.config.long_polling_timeout_ms) / 1000
        deadline = trio.current_time() + timeout_s

        async def resume(timed_out: bool, offset: int) -> None:
            try:
                # The topic may have been deleted or its read queues lowered, or the group stopped, while the pull
                # was held: the answer is then the one a fresh pull gets, not "no new message".
                check_pullable(self.node, args["topic"], args["queue_id"])
                self.node.subscription_groups.check_pull(args["consumer_group"])
                if args.get("sql_filter") is not None and not self.node.config.enable_property_filter:
                    raise sql92_not_supported(self.node)  # turned off meanwhile (UPDATE_BROKER_CONFIG)
            except RequestRejected as e:
                again = error_response(self.node, request, e)
            else:
                # Woken before its time with nothing past its offset: released by its group's narrowing that does
                # not refuse it (broker/subscription_group.py). Held again for the time it has left.
                left = deadline - trio.current_time()
                rehold = (not timed_out and left > 0
                          and self.node.store.get_max_offset_in_queue(args["topic"], args["queue_id"]) <= offset)
                # From where the hold got to: the units it passed carry no tags code the filter wants.
                again, hold_from = self._pull(request, {**args, "queue_offset": offset}, allow_suspend=rehold)
                if again is None:
                    self.node.hold.hold(args["topic"], args["queue_id"], hold_from, left, resume, matches, conn=conn,
                                        consumer_group=args["consumer_group"], rehold=True)
                    return
            if again is None:
                return
            try:
                await conn.send_response(again)
            except RaftMQError as e:
                log.debug("held pull answer not delivered topic=%s error=%s", args["topic"], e)

        tag_filter: TagFilter = args["tag_filter"]
        sql_filter: SqlFilter | None = args.get("sql_filter")
        if sql_filter is not None:
            matches = functools.partial(has_sql_match_between, self.node.store, args["topic"], args["queue_id"],
                                        sql=sql_filter)
        else:
            matches = None if tag_filter.matches_all else functools.partial(
                self.node.store.has_tags_code_between, args["topic"], args["queue_id"], codes=tag_filter.codes)
        self.node.hold.hold(args["topic"], args["queue_id"], hold_from, timeout_s, resume, matches, conn=conn,
                            consumer_group=args["consumer_group"])
        return None

    def _parse(self, request: Frame) -> dict[str, Any]:
        ext = request.ext
        topic = get_str(ext, "topic")
        args: dict[str, Any] = {
            "consumer_group": get_group(ext),
            "topic": topic,
            "queue_id": get_int(ext, "queue_id", lo=0, hi=I32[1]),
            "queue_offset": get_int(ext, "queue_offset", lo=0),
            "max_msg_nums": get_int(ext, "max_msg_nums", default=32, lo=1, hi=I32[1]),
            "sys_flag": get_int(ext, "sys_flag", default=0, lo=0, hi=I32[1]),
            "commit_offset": get_int(ext, "commit_offset", default=-1, lo=-1),
            "suspend_timeout_millis": get_int(ext, "suspend_timeout_millis", default=0, lo=0, hi=I32[1]),
        }
        node = self.node
        check_pullable(node, topic, args["queue_id"])
        node.subscription_groups.check_pull(args["consumer_group"])  # stopped, unknown, or no broadcasting
        expression = ext.get("subscription")
        tag_filter: TagFilter
        sql_filter: SqlFilter | None = None
        if expression is None and not args["sys_flag"] & FLAG_SUBSCRIPTION:
            sub = node.clients.find_subscription(args["consumer_group"], topic)
            tag_filter = sub.filter if sub is not None else parse_tag_expression(None)
            if sub is not None and sub.sql_filter is not None:
                sql_filter = self._sql_filter(sub.expression)
        elif ext.get("expression_type") in (None, "", TAG):
            try:
                tag_filter = parse_tag_expression(expression)
            except SubscriptionParseError as e:
                raise RequestRejected(ResponseCode.SUBSCRIPTION_PARSE_FAILED, str(e)) from None
        else:
            tag_filter = parse_tag_expression(None)
            sql_filter = self._sql_filter(expression, ext.get("expression_type"))
        args["tag_filter"] = tag_filter
        args["sql_filter"] = sql_filter
        if args["sys_flag"] & FLAG_COMMIT_OFFSET and args["commit_offset"] >= 0 and node.is_leader():
            node.offsets.commit(args["consumer_group"], topic, args["queue_id"], args["commit_offset"])
        return args

    def _sql_filter(self, expression: Any, expression_type: Any = SQL92) -> SqlFilter:
        """A SQL92 pull's compiled expression, or its refusal: by a node without ``enable_property_filter`` (as
        RocketMQ's, SYSTEM_ERROR), of an unknown expression type, or of an expression that does not parse."""
        if expression_type != SQL92:
            raise invalid("expression_type", f"must be {TAG} or {SQL92}, got {str(expression_type)[:40]!r}")
        if not self.node.config.enable_property_filter:
            raise sql92_not_supported(self.node)
        try:
            return parse_sql_expression(expression)
        except SubscriptionParseError as e:
            raise RequestRejected(ResponseCode.SUBSCRIPTION_PARSE_FAILED, str(e)) from None

    def _pull(self, request: Frame, args: dict[str, Any], *, allow_suspend: bool) -> tuple[Frame | None, int]:
        """The response, or (None, the offset to hold the pull from) when it is to wait for messages."""
        node = self.node
        config = node.config
        max_nums = min(args["max_msg_nums"], config.max_transfer_count)
        tag_filter: TagFilter = args["tag_filter"]
        sql_filter: SqlFilter | None = args.get("sql_filter")
        if sql_filter is None:
            result = node.store.get_messages(args["topic"], args["queue_id"], args["queue_offset"], max_nums,
                                             config.max_transfer_bytes,
                                             tag_filter=None if tag_filter.matches_all else tag_filter.codes)
        else:
            result = get_messages_by_sql(node.store, args["topic"], args["queue_id"], args["queue_offset"],
                                         max_nums, config.max_transfer_bytes, sql_filter)
        status = result.status.name if hasattr(result.status, "name") else str(result.status)
        leader = node.is_leader()
        ext = {"next_begin_offset": result.next_begin_offset, "min_offset": result.min_offset,
               "max_offset": result.max_offset,
               "suggest_which_broker_id": MASTER_ID if leader else node.broker_id}
        if status == "FOUND":
            node.pulled_messages += len(result.messages)
            body = b"".join(result.messages)
            group = args["consumer_group"]
            # A group the table lacks (a made-up name, or one whose config is not replicated here yet) is counted
            # apart, bounded, until its config comes (broker/pull_stats.py).
            node.pull_stats.add(group, args["topic"], len(result.messages), len(body),
                                known=group in node.subscription_groups.table)
            return make_response(request, ResponseCode.SUCCESS, ext=ext, body=body), 0
        if status in ("NO_MESSAGE_IN_QUEUE", "NO_MATCHED_LOGIC_QUEUE") and args["queue_offset"] > 0:
            # An empty (or never written) queue and a consumer past 0: its offset is beyond the end.
            status = "OFFSET_OVERFLOW_BADLY"
            ext["next_begin_offset"] = 0
        if status in ("MESSAGE_WAS_REMOVING", "OFFSET_FOUND_NULL"):
            # Retention removed what the offset pointed at: continue from next_begin_offset.
            return make_response(request, ResponseCode.PULL_RETRY_IMMEDIATELY,
                                 remark=f"messages at {args['topic']}:{args['queue_id']} offset "
                                        f"{args['queue_offset']} were removed by retention", ext=ext), 0
        may_wait = allow_suspend and args["sys_flag"] & FLAG_SUSPEND and args["suspend_timeout_millis"] > 0
        if status == "NO_MATCHED_MESSAGE":
            if may_wait and result.next_begin_offset >= result.max_offset:
                # Scanned to the end and nothing matched: wait there. Answered, the consumer pulled again at
                # once, and again after each unwanted arrival: a round trip per message it does not want.
                return None, result.next_begin_offset
            # Messages were scanned but none matched the tags: move on at once from next_begin_offset.
            return make_response(request, ResponseCode.PULL_RETRY_IMMEDIATELY,
                                 remark=f"no message matching {(sql_filter or tag_filter).expression!r} in the "
                                        f"scanned range",
                                 ext=ext), 0
        if status in ("NO_MESSAGE_IN_QUEUE", "NO_MATCHED_LOGIC_QUEUE", "OFFSET_OVERFLOW_ONE"):
            if may_wait:
                return None, args["queue_offset"]
            return make_response(request, ResponseCode.PULL_NOT_FOUND,
                                 remark=f"no new message in {args['topic']}:{args['queue_id']} at offset "
                                        f"{args['queue_offset']} (max_offset {result.max_offset})", ext=ext), 0
        # The offset is outside the queue: too small (deleted by retention) or beyond the end.
        too_small = args["queue_offset"] < result.min_offset
        where = "below min_offset" if too_small else "beyond max_offset"
        remark = (f"queue_offset {args['queue_offset']} of {args['topic']}:{args['queue_id']} is {where} "
                  f"(min_offset {result.min_offset}, max_offset {result.max_offset})")
        if leader and (too_small or node.queues_complete()):
            return make_response(request, ResponseCode.PULL_OFFSET_MOVED, ext=ext,
                                 remark=f"{remark}; next_begin_offset {result.next_begin_offset}"), 0
        # The answers below leave the offset where it was: a remark naming the store's correction as
        # next_begin_offset contradicted the ext field of the same name.
        if leader:
            # Beyond the end of a leader that may not hold every acknowledged message yet (just elected, or its
            # dispatch behind its log): moving the consumer back (to 0 while min_offset is 0) would deliver the
            # whole queue again. Not now; ask again.
            ext["next_begin_offset"] = args["queue_offset"]
            return make_response(request, ResponseCode.PULL_RETRY_IMMEDIATELY,
                                 remark=remark + "; this leader is still applying or dispatching acknowledged "
                                                 "messages, ask again shortly", ext=ext), 0
        # Nor does a follower move it, not even in the answer's next_begin_offset: the pull consumer's caller (as
        # RocketMQ's) goes on from there after NO_MATCHED_MSG, and the store's correction (0 while min_offset is
        # 0) sent one whose leader was unreachable back to the start of the queue.
        ext["next_begin_offset"] = args["queue_offset"]
        ext["suggest_which_broker_id"] = MASTER_ID
        return make_response(request, ResponseCode.PULL_RETRY_IMMEDIATELY, remark=remark + "; this replica may "
                             "be behind, ask the master", ext=ext), 0
