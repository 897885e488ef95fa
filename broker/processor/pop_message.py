"""POP_MESSAGE (200050), ACK_MESSAGE (200051), CHANGE_MESSAGE_INVISIBLETIME (200053), BATCH_ACK_MESSAGE (200151):
RocketMQ 5's POP consumption.

Served by the ready leader only (followers answer NOT_LEADER): every one of them reads and changes the replicated
POP table (``broker/pop.py``, which holds the rules of checkpoints, handles and revive). Fields (ext):

* POP: ``consumer_group``, ``topic``, ``queue_id`` (-1, the default: every readable queue of the topic, from a
  random one on), ``max_msg_nums`` (1..32, default 32), ``invisible_time_ms`` (``pop_invisible_time_min_ms`` ..
  ``pop_invisible_time_max_ms``), ``poll_time_ms`` (0 default: answer at once; else wait that long, at most
  ``long_polling_timeout_ms``, for a message), ``init_mode`` (where a group with no offset for a queue starts:
  0 its min offset, 1 its max offset, the default, as RocketMQ's ConsumeInitMode), ``expression_type`` (TAG or
  SQL92) and ``subscription`` (the expression; default ``*``). Each POP also reads the group's POP retry topic
  ``%RETRY%<group>+<topic>``, first one time in five (RocketMQ's popFromRetryProbability), else after the topic's
  queues. Answer SUCCESS with the raw records as the body (as a pull's) and ext ``receipt_handles`` (one per
  record, in order), ``pop_time_ms`` and ``invisible_time_ms``; or PULL_NOT_FOUND when nothing was visible (after
  ``poll_time_ms``).
* ACK: ``consumer_group``, ``topic`` (the consumer's, also for a message read from its retry topic),
  ``receipt_handle``. SUCCESS, with ext ``acked`` false when the message was acked already (an ack retried).
* CHANGE: the same plus ``invisible_time_ms``; SUCCESS with ext ``receipt_handle`` (the new one: the old one is
  superseded), ``pop_time_ms``, ``invisible_time_ms``.
* BATCH_ACK: ext ``consumer_group``, body a CBOR list of 1..``MAX_BATCH_ACK`` receipt handles (strings; the list
  and each string of definite length, nothing after the list: ``broker.pop.batch_ack_texts``), of any topics and
  queues of the group (a handle names its topic; RocketMQ 5's gRPC AckMessage carries many entries too).
  The queues' locks are taken in one order (``PopService.locks_of``) and every ack goes in one replicated write
  before the answer: SUCCESS, the body a CBOR list with one map per handle, in order, saying what ACK_MESSAGE would
  have answered for it alone: ``{"code": 0, "acked": bool}``, or ``{"code": <response code>, "remark": str}`` for a
  handle refused (INVALID_REQUEST, TOPIC_NOT_EXIST) or whose message comes back (NO_MESSAGE). A body that is no such
  list is INVALID_REQUEST naming ``body``, and nothing is acked.

Refusals: unknown group (auto-create off) SUBSCRIPTION_GROUP_NOT_EXIST, stopped group NO_PERMISSION, unknown topic
TOPIC_NOT_EXIST, a POP retry topic popped as a topic NO_PERMISSION (as a pull of it), a field out of range or a
malformed receipt handle, or one issued by another broker group or for another topic or group, or naming a queue
the topic does not have, INVALID_REQUEST naming the field; a handle whose invisible time is over (its message is
being made visible again; also when its revive took it while the request waited), or superseded by a CHANGE, or
(CHANGE) whose message was acked, NO_MESSAGE with ext ``field`` ``receipt_handle``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
from typing import TYPE_CHECKING, Any

import cbor2
import trio

from broker.filter import SubscriptionParseError, TagFilter, parse_tag_expression
from broker.pop import (BatchAckBodyError, CheckPoint, CheckpointIndex, ReceiptHandle, ReceiptHandleError,
                        batch_ack_texts, now_ms, plan_ack, plan_acks, plan_change, pop_offset_key,
                        pop_retry_topic_problem, superseded_by)
from broker.processor.base import (I32, RequestRejected, error_response, existing_topic_config, get_group, get_int,
                                   get_str, invalid, unexpected_response)
from broker.processor.pull_message import check_pullable, sql92_not_supported
from broker.property_filter import get_messages_by_sql, has_sql_match_between, parse_sql_expression
from dledger import DLedgerError
from remoting.codec import Frame, make_response
from remoting.codes import ResponseCode
from remoting.errors import RaftMQError
from remoting.message import pop_retry_topic, split_pop_retry_topic
from remoting.sql_filter import SQL92, TAG, SqlFilter

if TYPE_CHECKING:
    from broker.node import BrokerNode

log = logging.getLogger(__name__)

MAX_POP_NUMS = 32  # RocketMQ's limit of one POP
INIT_MODE_MIN, INIT_MODE_MAX = 0, 1  # RocketMQ's ConsumeInitMode
RETRY_FIRST_PERCENT = 20  # RocketMQ's popFromRetryProbability
# The store statuses after which the pop offset moves to next_begin_offset: units were read (matched or not), or
# retention removed what the offset pointed at.
_MOVED = frozenset({"FOUND", "NO_MATCHED_MESSAGE", "MESSAGE_WAS_REMOVING", "OFFSET_FOUND_NULL"})


@dataclasses.dataclass(frozen=True)
class PopArgs:
    consumer_group: str
    topic: str
    queue_id: int
    max_msg_nums: int
    invisible_time_ms: int
    poll_time_ms: int
    init_mode: int
    tag_filter: TagFilter
    sql_filter: SqlFilter | None


@dataclasses.dataclass(frozen=True)
class _Queue:
    topic: str  # the topic read: the consumer's, or its POP retry topic
    queue_id: int
    retry: bool


class PopMessageProcessor:
    def __init__(self, node: BrokerNode) -> None:
        self.node = node

    # --- POP_MESSAGE ---------------------------------------------------------------------------------------------
    async def pop_message(self, request: Frame, conn: Any) -> Frame | None:
        node = self.node
        await node.wait_ready_leader()
        args = self._parse_pop(request)
        response, waits = await self._pop(request, args)
        if response is not None:
            return response
        if not args.poll_time_ms or not waits:  # no waiting asked for, or no readable queue to wait on
            return self._not_found(request, args)
        deadline = trio.current_time() + min(args.poll_time_ms, node.config.long_polling_timeout_ms) / 1000
        self._hold(request, args, conn, waits, deadline)
        return None

    def _parse_pop(self, request: Frame) -> PopArgs:
        node = self.node
        ext = request.ext
        config = node.config
        group = get_group(ext)
        topic = get_str(ext, "topic")
        queue_id = get_int(ext, "queue_id", default=-1, lo=-1, hi=I32[1])
        max_msg_nums = get_int(ext, "max_msg_nums", default=MAX_POP_NUMS, lo=1, hi=MAX_POP_NUMS)
        invisible_time_ms = get_int(ext, "invisible_time_ms", lo=config.pop_invisible_time_min_ms,
                                    hi=config.pop_invisible_time_max_ms)
        poll_time_ms = get_int(ext, "poll_time_ms", default=0, lo=0, hi=I32[1])
        init_mode = get_int(ext, "init_mode", default=INIT_MODE_MAX, lo=INIT_MODE_MIN, hi=INIT_MODE_MAX)
        check_pullable(node, topic, max(queue_id, 0))
        problem = pop_retry_topic_problem(group, topic)
        if problem:
            raise invalid("topic", problem)
        node.subscription_groups.check_pull(group)
        expression = ext.get("subscription")
        expression_type = ext.get("expression_type")
        sql_filter: SqlFilter | None = None
        try:
            if expression_type in (None, "", TAG):
                tag_filter = parse_tag_expression(expression)
            elif expression_type == SQL92:
                if not config.enable_property_filter:
                    raise sql92_not_supported(node)
                tag_filter = parse_tag_expression(None)
                sql_filter = parse_sql_expression(expression)
            else:
                raise invalid("expression_type", f"must be {TAG} or {SQL92}, got {str(expression_type)[:40]!r}")
        except SubscriptionParseError as e:
            raise RequestRejected(ResponseCode.SUBSCRIPTION_PARSE_FAILED, str(e)) from None
        return PopArgs(group, topic, queue_id, max_msg_nums, invisible_time_ms, poll_time_ms, init_mode, tag_filter,
                       sql_filter)

    def _queues(self, args: PopArgs) -> list[_Queue]:
        node = self.node
        config = node.topic(args.topic)
        if args.queue_id >= 0:
            normal = [_Queue(args.topic, args.queue_id, False)]
        else:
            count = config.read_queue_nums if config is not None else 0
            first = random.randrange(count) if count else 0
            normal = [_Queue(args.topic, (first + i) % count, False) for i in range(count)]
        retry_name = pop_retry_topic(args.consumer_group, args.topic)
        retry_config = node.topic(retry_name)
        retry = ([_Queue(retry_name, q, True) for q in range(retry_config.read_queue_nums)]
                 if retry_config is not None and retry_config.readable else [])
        if random.randrange(100) < RETRY_FIRST_PERCENT:
            return retry + normal
        return normal + retry

    async def _pop(self, request: Frame, args: PopArgs) -> tuple[Frame | None, list[tuple[_Queue, int]]]:
        """The answer with what was popped; or None and the (queue, offset) pairs to wait on when nothing was."""
        node = self.node
        pop_time = now_ms()
        records: list[bytes] = []
        handles: list[str] = []
        waits: list[tuple[_Queue, int]] = []
        for queue in self._queues(args):
            want = args.max_msg_nums - len(records)
            if want <= 0:
                break
            got, next_offset = await self._pop_queue(args, queue, want, pop_time)
            for raw, handle in got:
                records.append(raw)
                handles.append(handle)
            waits.append((queue, next_offset))
        if not records:
            return None, waits
        body = b"".join(records)
        node.pulled_messages += len(records)
        node.pull_stats.add(args.consumer_group, args.topic, len(records), len(body),
                            known=args.consumer_group in node.subscription_groups.table)  # as pull_message's
        return make_response(request, ResponseCode.SUCCESS, body=body, ext={
            "receipt_handles": handles, "pop_time_ms": pop_time, "invisible_time_ms": args.invisible_time_ms}), []

    async def _pop_queue(self, args: PopArgs, queue: _Queue, want: int,
                         pop_time: int) -> tuple[list[tuple[bytes, str]], int]:
        """Pop up to ``want`` visible messages of one queue: ((record, receipt handle) pairs, the pop offset after)."""
        node = self.node
        pop = node.pop
        store = node.store
        group = args.consumer_group
        async with pop.queue_lock(group, queue.topic, queue.queue_id):
            if node.topic(queue.topic) is None:
                # Deleted since this POP was judged (it waited for the lock, or read other queues first): a pop
                # offset written now would outlive the delete, and skip messages of a topic created again.
                return [], 0
            stored = pop.pop_offset(group, queue.topic, queue.queue_id)
            start = stored
            if start is None:
                # A group that consumed the queue otherwise before (push, pull) goes on from its committed offset.
                start = node.offsets.query(group, queue.topic, queue.queue_id)
            lo = store.get_min_offset_in_queue(queue.topic, queue.queue_id)
            hi = store.get_max_offset_in_queue(queue.topic, queue.queue_id)
            if start is None:
                start = lo if queue.retry or args.init_mode == INIT_MODE_MIN else hi
            start = max(start, lo)
            if start > hi and node.queues_complete():
                start = hi  # the queue was deleted and created again: its offsets started over
            max_bytes = node.config.max_transfer_bytes
            if queue.retry or args.tag_filter.matches_all and args.sql_filter is None:
                result = store.get_messages(queue.topic, queue.queue_id, start, want, max_bytes)
            elif args.sql_filter is not None:
                result = get_messages_by_sql(store, queue.topic, queue.queue_id, start, want, max_bytes,
                                             args.sql_filter)
            else:
                result = store.get_messages(queue.topic, queue.queue_id, start, want, max_bytes,
                                            tag_filter=args.tag_filter.codes)
            status = result.status.name
            next_offset = result.next_begin_offset if status in _MOVED else start
            picked: list[tuple[bytes, int]] = []
            if status == "FOUND":
                # Everything in a POP retry topic is this (group, topic)'s: its name is nobody else's (broker/pop.py).
                picked = [(bytes(raw), offset) for raw, offset in zip(result.messages, result.queue_offsets)]
            items: dict[str, Any] = {}
            if next_offset != stored:
                items[pop_offset_key(group, queue.topic, queue.queue_id)] = next_offset
            ck = None
            if picked:
                ck = CheckPoint(group, queue.topic, queue.queue_id, picked[0][1], pop_time, args.invisible_time_ms,
                                tuple(offset for _raw, offset in picked))
                items[ck.key] = ck.to_wire()
            if not await pop.write(items):
                # Its group or topic is being deleted (PopService.forgetting): no checkpoint holds these messages,
                # so none is handed out, and no consumer offset is committed for the delete to miss.
                return [], start
            if next_offset != stored:
                # The consumer offset follows, as RocketMQ's POP commits it: consume stats show the group's lag.
                node.offsets.commit(group, queue.topic, queue.queue_id, next_offset)
        broker_name = node.config.broker_name
        assert ck is not None or not picked
        return [(raw, ck.handle(broker_name, offset).encode()) for raw, offset in picked], next_offset  # type: ignore

    def _not_found(self, request: Frame, args: PopArgs) -> Frame:
        return make_response(request, ResponseCode.PULL_NOT_FOUND,
                             remark=f"no visible message of topic {args.topic!r} for consumer group "
                                    f"{args.consumer_group!r}")

    def _hold(self, request: Frame, args: PopArgs, conn: Any, waits: list[tuple[_Queue, int]],
              deadline: float, *, rehold: bool = False) -> None:
        """Wait on every queue the POP read (RocketMQ's long polling of a POP): the first arrival, or the deadline,
        runs the POP again; the other waits are withdrawn. The holds name the POP's group (only its narrowing wakes
        them) and count as one held request (``rehold``: none, the POP was counted when first held)."""
        node = self.node
        held: list[Any] = []
        answered = False

        async def resume(timed_out: bool, _offset: int) -> None:
            nonlocal answered
            if answered:
                return
            answered = True
            for req in held:
                node.hold.withdraw(req)
            response: Frame | None
            try:
                if timed_out:
                    response = self._not_found(request, args)
                else:
                    await node.wait_ready_leader()
                    # Judged again: the group may have been stopped or the topic deleted while the POP waited.
                    args_now = self._parse_pop(request)
                    response, waits_now = await self._pop(request, args_now)
                    left = deadline - trio.current_time()
                    if response is None and left > 0 and waits_now:
                        self._hold(request, args_now, conn, waits_now, deadline, rehold=True)  # another POP took them
                        return
                    if response is None:
                        response = self._not_found(request, args)
            except (RequestRejected, DLedgerError) as e:
                response = error_response(node, request, e)
            except Exception:
                response = unexpected_response(request)
            if response is None:
                return
            try:
                await conn.send_response(response)
            except RaftMQError as e:
                log.debug("held pop answer not delivered topic=%s error=%s", args.topic, e)

        timeout_s = max(0.0, deadline - trio.current_time())
        store = node.store
        for i, (queue, offset) in enumerate(waits):
            matches = None
            if not queue.retry and args.sql_filter is not None:
                matches = functools.partial(has_sql_match_between, store, queue.topic, queue.queue_id,
                                            sql=args.sql_filter)
            elif not queue.retry and not args.tag_filter.matches_all:
                matches = functools.partial(store.has_tags_code_between, queue.topic, queue.queue_id,
                                            codes=args.tag_filter.codes)
            held.append(node.hold.hold(queue.topic, queue.queue_id, offset, timeout_s, resume, matches, conn=conn,
                                       consumer_group=args.consumer_group, rehold=rehold or i > 0))

    # --- ACK_MESSAGE and CHANGE_MESSAGE_INVISIBLETIME ----------------------------------------------------------
    def _handle(self, ext: Any) -> tuple[str, str, ReceiptHandle]:
        """(consumer_group, topic, receipt handle) of an ACK or CHANGE, the handle judged against both."""
        group = get_group(ext)
        topic = get_str(ext, "topic")
        existing_topic_config(self.node, topic)
        return group, topic, self._receipt_handle(group, topic, ext.get("receipt_handle"))

    def _receipt_handle(self, group: str, topic: str | None, text: Any) -> ReceiptHandle:
        """``text`` read as a receipt handle ``group`` may use for ``topic`` (the consumer's; None: the one the handle
        names, read directly or through its POP retry topic, which must exist)."""
        node = self.node
        try:
            handle = ReceiptHandle.decode(text)
        except ReceiptHandleError as e:
            raise invalid("receipt_handle", str(e)) from None
        mine = node.config.broker_name
        if handle.broker_name != mine:
            raise invalid("receipt_handle", f"was issued by broker group {handle.broker_name!r}, not by {mine!r}: "
                                            f"ack it (or change it) there")
        if handle.consumer_group != group:
            raise invalid("receipt_handle", f"was issued to consumer group {handle.consumer_group!r}, not to "
                                            f"{group!r}: only the group a message was popped for acks it")
        if topic is None:
            pop_retry = split_pop_retry_topic(handle.topic)
            if pop_retry is not None and pop_retry[0] != group:
                raise invalid("receipt_handle", f"is for a message of topic {handle.topic!r}, the POP retry topic of "
                                                f"consumer group {pop_retry[0]!r}, not of {group!r}")
            topic = pop_retry[1] if pop_retry is not None else handle.topic
            existing_topic_config(node, topic)
        if handle.topic not in (topic, pop_retry_topic(group, topic)):
            raise invalid("receipt_handle", f"is for a message of topic {handle.topic!r}, not of topic {topic!r} as "
                                            f"consumed by consumer group {group!r}")
        # Checked before its lock is taken: the lock table is keyed by what a client's handle names.
        config = node.topic(handle.topic)
        queues = config.read_queue_nums if config is not None else 0
        if handle.queue_id >= queues:
            raise invalid("receipt_handle", f"names queue {handle.queue_id} of topic {handle.topic!r}, which has "
                                            f"{queues} read queues on broker {mine!r}")
        return handle

    def _expired(self, handle: ReceiptHandle, now: int) -> RequestRejected:
        return RequestRejected(ResponseCode.NO_MESSAGE,
                               f"request field 'receipt_handle' expired {now - handle.deadline_ms} ms ago (popped at "
                               f"{handle.pop_time_ms}, invisible for {handle.invisible_time_ms} ms): its message "
                               f"{handle.topic}:{handle.queue_id}:{handle.queue_offset} is visible again and will be "
                               f"delivered again", ext={"field": "receipt_handle"})

    def _gone(self, handle: ReceiptHandle, newer: CheckPoint | None) -> RequestRejected | None:
        """Why ``handle`` (not current: its checkpoint no longer holds its message) cannot be acked or changed, or
        None when its message was acked; ``newer`` is the checkpoint that supersedes it, if any (``superseded_by``).
        Judged under the queue's lock: a revive that took the checkpoint while the request waited for the lock reads
        as the expiry it was."""
        if newer is not None:
            return self._superseded(handle, newer)
        now = now_ms()
        if handle.deadline_ms <= now:
            return self._expired(handle, now)
        return None

    def _superseded(self, handle: ReceiptHandle, newer: CheckPoint) -> RequestRejected:
        return RequestRejected(ResponseCode.NO_MESSAGE,
                               f"request field 'receipt_handle' is superseded: the invisible time of message "
                               f"{handle.topic}:{handle.queue_id}:{handle.queue_offset} was changed at "
                               f"{newer.pop_time_ms}; use the receipt handle that change returned",
                               ext={"field": "receipt_handle"})

    def _live_handle(self, ext: Any) -> tuple[str, ReceiptHandle, int]:
        """(group, handle, now) of an ACK's or a CHANGE's receipt handle, refused if its invisible time is over."""
        group, _topic, handle = self._handle(ext)
        now = now_ms()
        if handle.deadline_ms <= now:
            raise self._expired(handle, now)
        return group, handle, now

    async def ack_message(self, request: Frame, conn: Any) -> Frame:
        node = self.node
        await node.wait_ready_leader()
        group, handle, _now = self._live_handle(request.ext)
        pop = node.pop
        async with pop.queue_lock(group, handle.topic, handle.queue_id):
            items, current = plan_ack(pop.table(), handle)
            if not current:
                gone = self._gone(handle, superseded_by(pop.table(), handle))
                if gone is not None:
                    raise gone
                return make_response(request, ResponseCode.SUCCESS, ext={"acked": False})
            await pop.write(items)
        return make_response(request, ResponseCode.SUCCESS, ext={"acked": True})

    async def change_invisible_time(self, request: Frame, conn: Any) -> Frame:
        node = self.node
        await node.wait_ready_leader()
        invisible_time_ms = get_int(request.ext, "invisible_time_ms", lo=node.config.pop_invisible_time_min_ms,
                                    hi=node.config.pop_invisible_time_max_ms)
        group, handle, now = self._live_handle(request.ext)
        pop = node.pop
        async with pop.queue_lock(group, handle.topic, handle.queue_id):
            planned = plan_change(pop.table(), handle, invisible_time_ms, now)
            if planned is None:
                gone = self._gone(handle, superseded_by(pop.table(), handle))
                if gone is not None:
                    raise gone
                raise RequestRejected(ResponseCode.NO_MESSAGE,
                                      f"request field 'receipt_handle' names message {handle.topic}:{handle.queue_id}:"
                                      f"{handle.queue_offset}, acked already: its invisible time cannot change",
                                      ext={"field": "receipt_handle"})
            items, ck = planned
            await pop.write(items)
        new = ck.handle(node.config.broker_name, handle.queue_offset)
        return make_response(request, ResponseCode.SUCCESS, ext={
            "receipt_handle": new.encode(), "pop_time_ms": ck.pop_time_ms, "invisible_time_ms": ck.invisible_time_ms})

    async def batch_ack_message(self, request: Frame, conn: Any) -> Frame:
        node = self.node
        await node.wait_ready_leader()
        group = get_group(request.ext)
        texts = self._batch_handles(request)
        entries: list[dict[str, Any] | None] = [None] * len(texts)
        waiting: list[tuple[int, ReceiptHandle]] = []  # (index, handle) of those judged under their queues' locks
        now = now_ms()
        for i, text in enumerate(texts):
            try:
                handle = self._receipt_handle(group, None, text)
                if handle.deadline_ms <= now:
                    raise self._expired(handle, now)
            except RequestRejected as e:
                entries[i] = {"code": int(e.code), "remark": e.remark}
                continue
            waiting.append((i, handle))
        pop = node.pop
        if waiting:
            async with pop.locks_of(group, {(handle.topic, handle.queue_id) for _i, handle in waiting}):
                table = pop.table()
                items, current = plan_acks(table, [handle for _i, handle in waiting])
                # The handles not current (all of a retried batch) are judged in one pass over the table, not a
                # scan each.
                stale = [handle for (_i, handle), acked in zip(waiting, current) if not acked]
                index = CheckpointIndex(table, group, stale) if stale else None
                for (i, handle), acked in zip(waiting, current):
                    gone = None if acked or index is None else self._gone(handle, index.superseded_by(handle))
                    entries[i] = ({"code": int(ResponseCode.SUCCESS), "acked": acked} if gone is None
                                  else {"code": int(gone.code), "remark": gone.remark})
                await pop.write(items)
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps(entries))

    @staticmethod
    def _batch_handles(request: Frame) -> list[str]:
        try:
            return batch_ack_texts(request.body)
        except BatchAckBodyError as e:
            raise invalid("body", str(e)) from None
