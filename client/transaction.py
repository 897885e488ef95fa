"""What a transactional producer's user sees (RocketMQ's TransactionListener, LocalTransactionState and
TransactionSendResult), and the pure parts of its protocol: the END_TRANSACTION ext, and reading the broker's
CHECK_TRANSACTION_STATE. The flow (send the half, run ``execute``, end) is ``Producer.send_in_transaction``.

    class Orders:
        async def execute(self, msg: Message, arg) -> TransactionState:
            return TransactionState.COMMIT if await db.insert(arg) else TransactionState.ROLLBACK

        async def check(self, msg: MessageExt) -> TransactionState:
            return TransactionState.COMMIT if await db.exists(msg.keys[0]) else TransactionState.UNKNOWN

    async with open_producer(namesrv, producer_group="orders", transaction_listener=Orders()) as producer:
        result = await producer.send_in_transaction(Message("Orders", body, keys="o-1"), arg=order)
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Protocol

from client.message import MAX_INFLATED_BODY, Message, MessageExt, SendResult, decompressed_body
from remoting.message import (COMPRESSED_FLAG, PROPERTY_REAL_QUEUE_ID, PROPERTY_REAL_TOPIC, TRANSACTION_COMMIT_TYPE,
                              TRANSACTION_NOT_TYPE, TRANSACTION_ROLLBACK_TYPE, MessageFormatError, decode_record,
                              group_problem, parse_msg_id)

__all__ = ["TransactionState", "TransactionListener", "TransactionSendResult", "end_transaction_ext",
           "read_check_request"]


class TransactionState(enum.Enum):
    """The outcome of a local transaction (RocketMQ's LocalTransactionState)."""

    COMMIT = "COMMIT"
    ROLLBACK = "ROLLBACK"
    UNKNOWN = "UNKNOWN"  # not decided yet: the broker asks ``check`` again later


# END_TRANSACTION's commit_or_rollback: RocketMQ's MessageSysFlag transaction types.
_STATE_FLAGS = {TransactionState.COMMIT: TRANSACTION_COMMIT_TYPE, TransactionState.ROLLBACK: TRANSACTION_ROLLBACK_TYPE,
                TransactionState.UNKNOWN: TRANSACTION_NOT_TYPE}


class TransactionListener(Protocol):
    """What ``open_producer(..., transaction_listener=...)`` takes. An exception raised by either method counts
    as UNKNOWN, as in RocketMQ."""

    async def execute(self, msg: Message, arg: Any) -> TransactionState:
        """Run the local transaction of ``msg``, whose half message the broker has stored."""

    async def check(self, msg: MessageExt) -> TransactionState:
        """Tell the broker how the local transaction of ``msg`` ended (``msg.msg_id`` is its transaction id); asked
        when no decision reached the broker within its ``transaction_timeout_ms``, possibly of another producer
        process of the same group than the one that sent it. So also of one ``execute`` decided if its END came
        late: whichever of the two answers reaches the broker first decides, the other changes nothing."""


@dataclasses.dataclass(frozen=True, slots=True)
class TransactionSendResult(SendResult):
    """The half message's ``SendResult`` (its ``message_queue`` the queue the message goes to, ``queue_offset``
    and ``offset_msg_id`` the half's) plus what ``execute`` decided. ``transaction_id`` is ``msg_id``, the id the
    consumers see once committed."""

    local_transaction_state: TransactionState = TransactionState.UNKNOWN
    transaction_id: str = ""


def end_transaction_ext(producer_group: str, transaction_id: str, offset_msg_id: str, half_queue_offset: int,
                        state: TransactionState, *, from_check: bool) -> dict[str, Any]:
    """The ext of an END_TRANSACTION of the half message stored as ``offset_msg_id`` at ``half_queue_offset``."""
    _, commit_log_offset = parse_msg_id(offset_msg_id)
    return {"producer_group": producer_group, "tran_state_table_offset": half_queue_offset,
            "commit_log_offset": commit_log_offset, "commit_or_rollback": _STATE_FLAGS[state],
            "from_transaction_check": from_check, "msg_id": offset_msg_id, "transaction_id": transaction_id}


def read_check_request(ext: Mapping[str, Any], body: bytes, max_inflated: int = MAX_INFLATED_BODY,
                       max_inflated_key: str | None = None) -> tuple[str, str, int, MessageExt]:
    """``(producer_group, broker_name, half queue offset, message)`` of a CHECK_TRANSACTION_STATE: the message as
    its consumers would get it (its real topic and queue), its ``offset_msg_id`` the half's, a compressed body
    inflated up to ``max_inflated`` bytes (``decompressed_body``; the producer's own ``max_message_size_bytes``,
    named ``max_inflated_key``: no half of its group's producers is larger, unless they allow more). Raises
    ValueError saying what is malformed."""
    group, broker_name, queue_offset = ext.get("producer_group"), ext.get("broker_name"), \
        ext.get("tran_state_table_offset")
    if type(group) is not str or group_problem(group):
        raise ValueError(f"producer_group {group!r} is not a producer group")
    if type(broker_name) is not str or not broker_name:
        raise ValueError(f"broker_name {broker_name!r} names no broker group")
    if type(queue_offset) is not int or queue_offset < 0:
        raise ValueError(f"tran_state_table_offset {queue_offset!r} is not a queue offset")
    try:
        view = decode_record(body)
    except (MessageFormatError, ValueError) as e:
        raise ValueError(f"the body is not a half message record: {e}") from None
    real_topic, real_queue = view.properties.get(PROPERTY_REAL_TOPIC), view.properties.get(PROPERTY_REAL_QUEUE_ID)
    if not real_topic or not (real_queue or "").isdecimal():
        raise ValueError(f"the half message names no real topic and queue ({real_topic!r}, {real_queue!r})")
    body, sys_flag = view.body, view.sys_flag
    if sys_flag & COMPRESSED_FLAG:  # check gets the body execute got, as RocketMQ's decoder inflates it for check
        body, sys_flag = decompressed_body(body, sys_flag, real_topic, broker_name, int(real_queue), queue_offset,
                                           max_inflated, max_inflated_key)
    message = MessageExt(real_topic, body, int(real_queue), queue_offset, broker_name, view.properties,
                         view.phy_offset, view.born_timestamp, view.store_timestamp, view.store_host,
                         view.reconsume_times, sys_flag, view.flag)
    try:  # the answer names the half by these: one that cannot be made (a negative offset, a bad port) ended the
        parse_msg_id(message.offset_msg_id)  # producer's task group when the answer was built
    except (MessageFormatError, ValueError) as e:
        raise ValueError(f"the half message record cannot be named: {e}") from None
    return group, broker_name, queue_offset, message
