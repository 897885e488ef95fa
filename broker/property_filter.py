"""SQL92 subscriptions on the broker: RocketMQ's property filter (``enablePropertyFilter``).

A tag pull is filtered on the tags codes of the ConsumeQueue without touching a message. A SQL92 expression is
about properties, which only the commit-log record holds, so each candidate message is read and its properties
evaluated (RocketMQ's ``ExpressionMessageFilter.isMatchedByCommitLog``; its bloom filter over the ConsumeQueue
extension, an optional shortcut, is not built here). That costs what a tag pull does not, which is why a broker
serves SQL92 only when ``enable_property_filter`` says so, and why none of this is on the tag path: a pull without
an SQL92 expression goes straight to ``MessageStore.get_messages`` with its tags codes, as before.

The rules follow the tag filter's, so a consumer sees no difference but the selection:

- a pull scans at most ``max(max_msg_nums, SQL_FILTER_SCAN_UNITS)`` units of its queue (the store's bound for a tag
  pull) and answers at most ``max_msg_nums`` matching messages and ``max_transfer_bytes`` (at least one);
- messages that do not match are passed over: ``next_begin_offset`` is past the last unit scanned, and a scan that
  matched nothing answers NO_MATCHED_MESSAGE from there (held, when the pull may wait and the scan reached the
  queue's end);
- what the store answers before any message was read (an empty queue, an offset out of range, a removed file) is
  answered as it is: the pull processor's rules for those are the same for both filters.

A held SQL92 pull wakes only for a new message that matches (``has_sql_match_between``, as a tag pull wakes only
for a tags code it wants); a burst too long to read at once wakes it, and the pull scans.

The expression's grammar and evaluation are ``remoting.sql_filter``'s, shared with the client.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from broker.filter import SubscriptionParseError
from broker.store.results import GetMessageResult, GetMessageStatus
from remoting.message import BODY_LEN, PROPS_LEN, RECORD_HEAD, decode_properties
from remoting.sql_filter import SqlFilter, SqlFilterError, compile_sql

if TYPE_CHECKING:
    from broker.store.message_store import MessageStore

__all__ = ["SQL_FILTER_SCAN_UNITS", "SQL_HOLD_SCAN_UNITS", "get_messages_by_sql", "has_sql_match_between",
           "parse_sql_expression", "record_properties"]

# Units one pull scans at least: RocketMQ's 16,000 bytes of ConsumeQueue, the store's bound for a tag pull.
SQL_FILTER_SCAN_UNITS = 800
# Units a held pull's wake-up check reads at most; past that it wakes the pull, which scans them itself.
SQL_HOLD_SCAN_UNITS = 800

_FOUND = GetMessageStatus.FOUND
_BODY_LEN_AT = RECORD_HEAD.size


def parse_sql_expression(expression: object) -> SqlFilter:
    """The compiled ``expression`` (cached); SubscriptionParseError naming the problem and its position."""
    try:
        return compile_sql(expression)
    except SqlFilterError as e:
        raise SubscriptionParseError(str(e)) from None


def record_properties(record: memoryview) -> dict[str, str]:
    """The properties of one raw commit-log record (layout in ``remoting.message``); none if it cannot be read,
    which a SQL92 expression then sees as every property missing."""
    try:
        body_len = BODY_LEN.unpack_from(record, _BODY_LEN_AT)[0]
        topic_at = _BODY_LEN_AT + BODY_LEN.size + body_len
        props_at = topic_at + 1 + record[topic_at]
        props_len = PROPS_LEN.unpack_from(record, props_at)[0]
    except (struct.error, IndexError):
        return {}
    return decode_properties(record[props_at + PROPS_LEN.size:props_at + PROPS_LEN.size + props_len])


def get_messages_by_sql(store: MessageStore, topic: str, queue_id: int, offset: int, max_nums: int, max_bytes: int,
                        sql: SqlFilter) -> GetMessageResult:
    """Up to ``max_nums`` messages (``max_bytes``, at least one) from queue ``offset`` whose properties match
    ``sql``, scanning at most ``max(max_nums, SQL_FILTER_SCAN_UNITS)`` units (see the module rules)."""
    matches = sql.matches
    scan_left = max(max_nums, SQL_FILTER_SCAN_UNITS)
    messages: list[memoryview] = []
    queue_offsets: list[int] = []
    total = 0
    position = offset
    min_offset = max_offset = 0
    read_any = False
    while scan_left > 0:
        result = store.get_messages(topic, queue_id, position, scan_left, max_bytes)
        if result.status is not _FOUND:
            if not read_any:
                return result  # nothing read at the pull's offset: the store's answer is the pull's
            break  # the queue's end (or a removed stretch) further on: answer what the scan found before it
        read_any = True
        min_offset, max_offset = result.min_offset, result.max_offset
        next_position = result.next_begin_offset
        full = False
        for record, queue_offset in zip(result.messages, result.queue_offsets):
            if not matches(record_properties(record)):
                continue
            if messages and total + len(record) > max_bytes:
                next_position, full = queue_offset, True  # taken by the next pull
                break
            messages.append(record)
            queue_offsets.append(queue_offset)
            total += len(record)
            if len(messages) >= max_nums:
                next_position, full = queue_offset + 1, True
                break
        scan_left -= next_position - position
        position = next_position
        if full:
            break
    status = _FOUND if messages else GetMessageStatus.NO_MATCHED_MESSAGE
    return GetMessageResult(status, position, min_offset, max_offset, messages, queue_offsets, total)


def has_sql_match_between(store: MessageStore, topic: str, queue_id: int, begin: int, end: int, *, sql: SqlFilter,
                          max_bytes: int = 1 << 20) -> bool:
    """Whether a message of the queue in ``[begin, end)`` matches ``sql``: whether a held pull with it could find
    anything there. True where that cannot be told cheaply (more than SQL_HOLD_SCAN_UNITS units, or units the
    store cannot read): the pull then scans, and says what happened."""
    if end - begin > SQL_HOLD_SCAN_UNITS:
        return True
    matches = sql.matches
    position = begin
    while position < end:
        result = store.get_messages(topic, queue_id, position, end - position, max_bytes)
        if result.status is not _FOUND:
            return True
        for record, queue_offset in zip(result.messages, result.queue_offsets):
            if queue_offset >= end:
                return False
            if matches(record_properties(record)):
                return True
        if result.next_begin_offset <= position:
            return True  # no progress: let the pull find out why
        position = result.next_begin_offset
    return False
