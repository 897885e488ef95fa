"""END_TRANSACTION (37): a producer ends the transaction of a half message it sent, after its local transaction or
when the broker checked back (RocketMQ's EndTransactionProcessor; the rules are in ``broker/transaction.py``).

ext, RocketMQ's EndTransactionRequestHeader in snake_case: ``producer_group``, ``tran_state_table_offset`` (the
half's queue offset in RMQ_SYS_TRANS_HALF_TOPIC), ``commit_log_offset`` (the half's), ``commit_or_rollback``
(8 COMMIT, 12 ROLLBACK, 0 unknown: RocketMQ's MessageSysFlag values), ``from_transaction_check``, ``msg_id`` and
``transaction_id`` (the half's UNIQ_KEY; checked against it when given). Ready leader only: NOT_LEADER from a
follower, and from a leader whose no-op is not applied within a second (until then an acknowledged half of an
earlier term may not be in its store: NO_MESSAGE would be wrong, and final). Answers:
SUCCESS (ext ``outcome``: ``committed`` with the message's ``msg_id``, ``queue_id``, ``queue_offset``; ``rolled
back``; ``unknown``), TOPIC_NOT_EXIST (ext ``outcome`` ``rolled back``) for a COMMIT of a half whose topic was
deleted since it was sent, TRANSACTION_SHOULD_COMMIT / TRANSACTION_SHOULD_ROLLBACK when it was ended before (nothing
changes), TRANSACTION_STATE_UNKNOW when it was settled so long ago that the outcome is no longer held (or was
re-stored for a check by a broker that did not mark its copies' first half), NO_MESSAGE
when no half message is at those offsets, TRANSACTION_STATE_GROUP_WRONG for another group's half, SYSTEM_BUSY
while the same half is being ended (or the copy a check re-stored is not in the half queue yet), INVALID_REQUEST
naming a missing or malformed field.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from broker.processor.base import answer_from_task, get_bool, get_group, get_int, get_str, invalid
from remoting.codec import Frame, make_response
from remoting.message import TRANSACTION_COMMIT_TYPE, TRANSACTION_NOT_TYPE, TRANSACTION_ROLLBACK_TYPE

if TYPE_CHECKING:
    from broker.node import BrokerNode

log = logging.getLogger(__name__)

_STATES = {TRANSACTION_COMMIT_TYPE: "COMMIT", TRANSACTION_ROLLBACK_TYPE: "ROLLBACK", TRANSACTION_NOT_TYPE: "UNKNOWN"}


class EndTransactionProcessor:
    def __init__(self, node: BrokerNode) -> None:
        self.node = node

    async def end_transaction(self, request: Frame, conn: Any) -> Frame | None:
        if getattr(conn, "nursery", None) is None:
            return await self._end(request)
        # Answered from a task, as a send: the producer's sends on this connection do not wait for this Raft commit.
        conn.nursery.start_soon(answer_from_task, self.node, request, conn, functools.partial(self._end, request))
        return None

    async def _end(self, request: Frame) -> Frame:
        node = self.node
        await node.wait_ready_leader()  # NOT_LEADER, retried by the producer, rather than a NO_MESSAGE it believes
        ext = request.ext
        producer_group = get_group(ext, "producer_group")
        half_offset = get_int(ext, "tran_state_table_offset", lo=0)
        commit_log_offset = get_int(ext, "commit_log_offset", lo=0)
        state = get_int(ext, "commit_or_rollback")
        if state not in _STATES:
            raise invalid("commit_or_rollback", f"must be {TRANSACTION_COMMIT_TYPE} (COMMIT), "
                                                f"{TRANSACTION_ROLLBACK_TYPE} (ROLLBACK) or {TRANSACTION_NOT_TYPE} "
                                                f"(UNKNOWN), got {state}")
        from_check = get_bool(ext, "from_transaction_check")
        get_str(ext, "msg_id", default="", allow_empty=True)
        transaction_id = get_str(ext, "transaction_id", default="", allow_empty=True)
        done = await node.transactions.end(producer_group, half_offset, commit_log_offset, state, transaction_id)
        log.debug("end transaction producer_group=%s half_offset=%d state=%s from_check=%s outcome=%s",
                  producer_group, half_offset, _STATES[state], from_check, done.outcome)
        answer: dict[str, Any] = {"outcome": done.outcome}
        if done.msg_id is not None:
            answer.update(msg_id=done.msg_id, queue_id=done.queue_id, queue_offset=done.queue_offset)
        return make_response(request, done.code, remark=done.remark or None, ext=answer)
