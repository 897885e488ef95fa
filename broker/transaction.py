"""Transactional messages: RocketMQ's TransactionalMessageService, the heart of its EndTransactionProcessor and its
TransactionalMessageCheckService, on a Raft group.

Rules this module keeps:

* **Half message.** A single send whose properties hold TRAN_MSG=true (and PGROUP, the producer group, and
  UNIQ_KEY, the transaction id) is stored, as sent, in ``RMQ_SYS_TRANS_HALF_TOPIC`` queue 0 with sys flag
  PREPARED and its real topic and queue in REAL_TOPIC / REAL_QID (``half_destination``; the schedule service's
  helpers). No consumer reads that topic. A transactional message may not be delayed, nor sent in a batch, nor
  carry TRAN_PREPARED_QUEUE_OFFSET (the broker's, below).
* **Done means an op record.** A half is ended by an op record in ``RMQ_SYS_TRANS_OP_HALF_TOPIC`` queue 0: tag
  ``d``, body the half's queue offset in decimal (RocketMQ's), property TRAN_OUTCOME saying why: ``commit``,
  ``rollback``, ``discard`` (checked ``transaction_check_max`` times) or ``recheck`` (re-stored for a check, below).
  A COMMIT appends the real message *and* its op record in one batch, one Raft entry: a leader kill leaves both
  or neither. A ROLLBACK appends the op record only. UNKNOWN appends nothing. A COMMIT of a half whose real topic
  was deleted since it was sent (gone, or deleted and created again) is a ROLLBACK, answered TOPIC_NOT_EXIST: its
  message went with the topic, and stored it would land behind the deletion's cut, served as the first message of
  a topic created again under the name; a check round rolls such a half back by its op record rather than re-store
  it for a check (the copy would sit past the cut, and a COMMIT of it pass the check above).
* **Each half ends once.** The leader holds, per term, the outcome of every half at or above the check progress
  (read from the op queue when its term starts, then kept as it appends), and refuses to act on a half that is
  being ended, or whose ending append had an unknown outcome (a timeout: the entry may still commit) until its op
  record shows up or the term changes. A repeated END_TRANSACTION is answered with the outcome already decided
  (TRANSACTION_SHOULD_COMMIT / TRANSACTION_SHOULD_ROLLBACK) and changes nothing; RocketMQ only checks that the
  half still exists, so two ENDs racing a check could both commit.
* **Check-back.** Every ``transaction_check_interval_ms`` the ready leader scans the half queue from the
  replicated progress (``broker.transaction_offset``: ``half`` → next half queue offset not settled, ``op`` → op
  queue offset from which every op of a half at or above it is found). A half with an op record is settled; the
  scan stops at the first unsettled half younger than ``transaction_timeout_ms``. An older one is re-stored at the
  end of the half queue with TRANSACTION_CHECK_TIMES + 1, in one batch with the op record (``recheck``) of the old
  copy, so exactly one live copy exists whatever fails. The copy carries TRAN_PREPARED_QUEUE_OFFSET (RocketMQ's
  property): the half queue offset of the half its transaction's copies descend from, the sent one (a copy of a
  copy keeps it; a half without it is its own first). Then one connected producer of its group is sent
  CHECK_TRANSACTION_STATE naming the new copy. At ``transaction_check_max`` checks it is moved to
  ``TRANS_CHECK_MAX_TIME_TOPIC`` instead (with op ``discard``), where an operator finds it. Checks count whether
  or not a producer of the group is connected, as RocketMQ's. The progress is replicated after the batch: a leader
  killed in between makes its successor rescan halves that the op records already show settled.
* **A late END for a re-stored half** (the producer answered after the broker re-stored it for a check) goes to
  the newest copy *of that half*: the last half past it with its TRAN_PREPARED_QUEUE_OFFSET, found once the half
  queue holds every copy re-stored so far. An unsettled copy is ended, a settled one answers the outcome decided
  (the answer to the check may have come first). Not by UNIQ_KEY: a producer sets it (a forwarded message carries
  one, a half send retried after a lost answer stores two halves with one), so the last half with the END's
  transaction id could be another transaction's, even another group's, and was settled in its stead. The copy's
  PGROUP and transaction id are checked as the named half's were. A half re-stored by a broker before this
  property existed has no copy that says it descends from it: its late END is answered TRANSACTION_STATE_UNKNOW
  and changes nothing (the live copy's check asks the producer again) rather than guess by transaction id.
* **The ready leader only.** END_TRANSACTION waits for this node's no-op to be applied (``wait_ready_leader``, at
  most a second, then NOT_LEADER, which the producer retries) before it looks the half up: a leader just elected
  has not yet applied what earlier terms committed, and an acknowledged half not in its store yet was answered
  NO_MESSAGE, which ends no retry, and the producer's decision was dropped.
* **When a committed transaction is checked anyway.** A round checks only halves with no op record that no append
  is ending: an END that reached the leader before the round started, applied or still replicating, is never
  checked back. One that comes after its half is older than ``transaction_timeout_ms`` may find a round re-stored
  it first (a slow ``execute``, a stall): then, as in RocketMQ, the listener's ``check`` runs for a transaction its
  ``execute`` committed. Harmless: whichever END comes first decides, the other changes nothing, the message is
  stored once (``tests/unit/broker/test_transaction_check_race.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from broker.processor.base import RequestRejected, invalid
from broker.schedule import restored_message, stored_again, with_real_destination
from broker.service_rounds import alone_entry_bytes, entry_limit, entry_room, log_unexpected_round_failure
from broker.store.results import GetMessageStatus
from broker.topic_config import PERM_READ, TopicConfig
from dledger import BatchRejectedError, GroupBusyError, LeaderChangedError, RecordTooLargeError
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError
from remoting.message import (PROPERTY_DELAY, PROPERTY_PRODUCER_GROUP, PROPERTY_REAL_QUEUE_ID, PROPERTY_REAL_TOPIC,
                              PROPERTY_TAGS, PROPERTY_TRANSACTION_CHECK_TIMES, PROPERTY_TRANSACTION_PREPARED,
                              PROPERTY_UNIQ_KEY, TRANS_CHECK_MAX_TIME_TOPIC, TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC,
                              TRANSACTION_COMMIT_TYPE, TRANSACTION_PREPARED_TYPE, TRANSACTION_ROLLBACK_TYPE,
                              TRANSACTION_TYPE_MASK,
                              MessageFormatError, MessageInput, MessageView, decode_record, encode_batch,
                              group_problem)

if TYPE_CHECKING:
    from broker.node import BrokerNode
    from broker.store import MessageStore

log = logging.getLogger(__name__)

__all__ = ["TRANSACTION_TABLE", "PROPERTY_TRANSACTION_OUTCOME", "PROPERTY_TRANSACTION_PREPARED_QUEUE_OFFSET",
           "EndOutcome", "TransactionalMessageService", "prepared_sys_flag"]

TRANSACTION_TABLE = "broker.transaction_offset"
PROPERTY_TRANSACTION_OUTCOME = "TRAN_OUTCOME"
# On a re-stored copy: the half queue offset of the half its transaction's copies descend from (RocketMQ's name).
PROPERTY_TRANSACTION_PREPARED_QUEUE_OFFSET = "TRAN_PREPARED_QUEUE_OFFSET"
OP_TAG = "d"  # RocketMQ's TransactionalMessageUtil.REMOVE_TAG
COMMIT, ROLLBACK, DISCARD, RECHECK = "commit", "rollback", "discard", "recheck"
CHECKS_PER_BATCH = 32  # halves re-stored (or discarded) in one append
READ_MAX_MESSAGES = 64
# Properties a committed message does not keep (RocketMQ's endMessageTransaction clears the destination and the
# lineage; a committed message sent again as a half would otherwise pass for a copy of another half).
_NOT_DELIVERED = (PROPERTY_REAL_TOPIC, PROPERTY_REAL_QUEUE_ID, PROPERTY_PRODUCER_GROUP,
                  PROPERTY_TRANSACTION_PREPARED_QUEUE_OFFSET)
_CATCH_UP_TIMEOUT_S = 1.0
_BACKOFF_MAX_S = 60.0


def _first_half(view: MessageView, half_offset: int) -> int:
    """The half queue offset of the half that ``view``, stored at ``half_offset`` of the half queue, was copied from
    (through any number of copies): its TRAN_PREPARED_QUEUE_OFFSET, or ``half_offset`` for a half sent by a producer
    (or re-stored by a broker that did not write the property)."""
    value = view.properties.get(PROPERTY_TRANSACTION_PREPARED_QUEUE_OFFSET)
    if type(value) is str and value.isascii() and value.isdecimal() and int(value) < half_offset:
        return int(value)
    return half_offset


def prepared_sys_flag(sys_flag: int) -> int:
    """``sys_flag`` with the transaction type PREPARED: what a half message is stored with."""
    return sys_flag & ~TRANSACTION_TYPE_MASK | TRANSACTION_PREPARED_TYPE


@dataclass(frozen=True)
class EndOutcome:
    """What an END_TRANSACTION did: ``code`` SUCCESS (acted on, or UNKNOWN: nothing to do), or the outcome decided
    before (TRANSACTION_SHOULD_COMMIT / _ROLLBACK, TRANSACTION_STATE_UNKNOW when no longer known)."""

    code: int
    outcome: str
    remark: str = ""
    msg_id: str | None = None  # of the committed message
    queue_id: int | None = None
    queue_offset: int | None = None


def _read_queue(store: MessageStore, topic: str, offset: int, max_bytes: int) -> Iterator[tuple[memoryview, int]]:
    """Every record of ``topic`` queue 0 from ``offset`` on, with its queue offset; a range retention removed is
    stepped over."""
    while True:
        result = store.get_messages(topic, 0, offset, READ_MAX_MESSAGES, max_bytes)
        yield from zip(result.messages, result.queue_offsets)
        if result.next_begin_offset <= offset:
            return
        if result.status in (GetMessageStatus.OFFSET_TOO_SMALL, GetMessageStatus.OFFSET_FOUND_NULL):
            log.warning("transaction records removed before they were settled topic=%s from=%d to=%d", topic,
                        offset, result.next_begin_offset)
        offset = result.next_begin_offset


class _Settling:
    """The outcome of one settling append, for the request that waits on it."""

    __slots__ = ("done", "result", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: Any = None
        self.error: Exception | None = None


_NOTHING_APPLIED = (RequestRejected, GroupBusyError, RecordTooLargeError, MessageFormatError, BatchRejectedError,
                    LeaderChangedError)


class TransactionalMessageService:
    def __init__(self, node: BrokerNode) -> None:
        self.node = node
        config = node.config
        self.timeout_ms = config.transaction_timeout_ms
        self.check_max = config.transaction_check_max
        self.interval_ms = config.transaction_check_interval_ms
        self._term: int | None = None
        self._term_lock = trio.Lock()
        self._half_progress = 0
        self._op_cursor = 0
        self._done: dict[int, tuple[int, str]] = {}  # half queue offset -> (op queue offset, outcome)
        self._busy: set[int] = set()  # halves an append is ending (or re-storing) right now
        self._uncertain: set[int] = set()  # halves whose ending append may or may not have committed
        self._restored_end = 0  # commit log offset past the last copy a check round re-stored
        self._next_producer = 0
        self.committed = 0
        self.rolled_back = 0
        self.checks = 0
        self.discarded = 0

    # --- the send path -------------------------------------------------------------------------------------
    def half_destination(self, topic: str, queue_id: int,
                         properties: Mapping[str, Any]) -> tuple[str, int, dict[str, Any]]:
        """Where a sent message with TRAN_MSG is stored: the half queue. Bad transactional properties are
        INVALID_REQUEST naming ``properties``."""
        problem = None
        group = properties.get(PROPERTY_PRODUCER_GROUP)
        if properties[PROPERTY_TRANSACTION_PREPARED] != "true":
            problem = f"{PROPERTY_TRANSACTION_PREPARED!r} must be 'true' in a transactional message"
        elif PROPERTY_DELAY in properties:
            problem = f"a transactional message ({PROPERTY_TRANSACTION_PREPARED}) may not be delayed ({PROPERTY_DELAY})"
        elif type(group) is not str or group_problem(group):
            problem = f"{PROPERTY_PRODUCER_GROUP!r} must name the producer group of a transactional message, got " \
                      f"{group!r}"
        elif type(properties.get(PROPERTY_UNIQ_KEY)) is not str or not properties[PROPERTY_UNIQ_KEY]:
            problem = f"{PROPERTY_UNIQ_KEY!r} (the transaction id) is required in a transactional message"
        elif PROPERTY_TRANSACTION_PREPARED_QUEUE_OFFSET in properties:
            # The broker's mark of a copy: sent with it, a half would pass for a copy of the half it names.
            problem = f"{PROPERTY_TRANSACTION_PREPARED_QUEUE_OFFSET!r} is set by the broker on the copies it " \
                      f"re-stores for a check; a producer may not send it, got " \
                      f"{properties[PROPERTY_TRANSACTION_PREPARED_QUEUE_OFFSET]!r}"
        if problem:
            raise invalid("properties", problem)
        stored = with_real_destination(properties, topic, queue_id)
        # A half starts at no check: the count is the broker's (the check round discards a half at
        # transaction_check_max). A producer's, a committed message's republished as a transaction, had it
        # discarded at the first round, its producer never asked.
        stored.pop(PROPERTY_TRANSACTION_CHECK_TIMES, None)
        return TRANS_HALF_TOPIC, 0, stored

    # --- the leader's view of what is settled -------------------------------------------------------------
    async def _ready(self) -> None:
        """Return on a ready leader whose view of settled halves is complete."""
        node = self.node
        await node.wait_ready_leader()
        term = node.group.term
        if self._term != term:
            async with self._term_lock:
                if self._term != term:
                    await self._start_term(term)
        self._read_ops()

    async def _start_term(self, term: int) -> None:
        # Every op record of an earlier term is in the commit log before this term's no-op: once dispatch has
        # passed the end seen now, the op queue holds them all.
        store = self.node.store
        end = store.max_phy_offset
        with trio.move_on_after(_CATCH_UP_TIMEOUT_S):
            await store.wait_dispatched(end)
        if store.dispatched_phy_offset < end:
            raise RequestRejected(ResponseCode.SYSTEM_BUSY, f"broker {self.node.config.broker_name} is still "
                                                            f"dispatching what its group stored before it led; retry")
        progress = self.node.group.metadata(TRANSACTION_TABLE)
        self._half_progress = int(progress.get("half", 0))
        self._op_cursor = int(progress.get("op", 0))
        self._done.clear()
        self._busy.clear()
        self._uncertain.clear()
        self._term = term
        log.info("transaction check progress restored term=%d half=%d op=%d", term, self._half_progress,
                 self._op_cursor)

    def _read_ops(self) -> None:
        half_progress = self._half_progress
        for raw, op_offset in _read_queue(self.node.store, TRANS_OP_HALF_TOPIC, self._op_cursor,
                                          self.node.max_message_size):
            view = decode_record(raw, check_crc=False)
            self._op_cursor = op_offset + 1
            try:
                half = int(bytes(view.body))
            except ValueError:
                log.error("op record without a half offset skipped op_offset=%d", op_offset)
                continue
            if half >= half_progress:
                self._done.setdefault(half, (op_offset, view.properties.get(PROPERTY_TRANSACTION_OUTCOME, COMMIT)))
                self._uncertain.discard(half)

    def _settled(self, half: int, op_offset: int, outcome: str) -> None:
        self._done[half] = (op_offset, outcome)
        self._uncertain.discard(half)

    def _refuse_if_in_flight(self, half: int) -> None:
        if half in self._busy or half in self._uncertain:
            why = "is being ended right now" if half in self._busy else "had an ending whose outcome is not known yet"
            raise RequestRejected(ResponseCode.SYSTEM_BUSY, f"the half message at queue offset {half} {why}; retry")

    # --- END_TRANSACTION -----------------------------------------------------------------------------------
    async def _half_at(self, half_offset: int, commit_log_offset: int) -> MessageView:
        """The half message stored at ``half_offset`` of the half queue, which must start at ``commit_log_offset``
        (so that an offset inside some message's body can never pass for a half)."""
        store = self.node.store
        if store.dispatched_phy_offset <= commit_log_offset < store.max_phy_offset:
            # Acknowledged once applied, a half is in the half queue once dispatched: an END sent at once can come
            # first.
            with trio.move_on_after(_CATCH_UP_TIMEOUT_S):
                await store.wait_dispatched(commit_log_offset + 1)
        result = store.get_messages(TRANS_HALF_TOPIC, 0, half_offset, 1, self.node.max_message_size)
        view = decode_record(result.messages[0], check_crc=False) if result.messages else None
        if view is None or result.queue_offsets[0] != half_offset or view.phy_offset != commit_log_offset:
            raise RequestRejected(ResponseCode.NO_MESSAGE,
                                  f"no half message at commit_log_offset {commit_log_offset} and "
                                  f"tran_state_table_offset {half_offset} on broker {self.node.config.broker_name}",
                                  ext={"field": "commit_log_offset"})
        return view

    async def end(self, producer_group: str, half_offset: int, commit_log_offset: int, state: int,
                  transaction_id: str) -> EndOutcome:
        """END_TRANSACTION on the leader: ``state`` is TRANSACTION_COMMIT_TYPE, TRANSACTION_ROLLBACK_TYPE or
        TRANSACTION_NOT_TYPE (unknown: nothing is done)."""
        # Ready first: a leader just elected applies what earlier terms committed after its election, and a half
        # acknowledged then is not in its store yet (NO_MESSAGE, which no producer retries, was the answer).
        await self._ready()
        view = await self._half_at(half_offset, commit_log_offset)
        # From here to the append nothing waits: what this leader knows of the half cannot change in between.
        await self._ready()
        self._check_owner(view, producer_group, transaction_id, commit_log_offset)
        if state not in (TRANSACTION_COMMIT_TYPE, TRANSACTION_ROLLBACK_TYPE):
            return EndOutcome(ResponseCode.SUCCESS, "unknown", "state unknown: the broker checks back later")
        self._refuse_if_in_flight(half_offset)
        decided = self._done.get(half_offset)
        if decided is not None and decided[1] == RECHECK or decided is None and half_offset < self._half_progress:
            # Re-stored for a check after this half was sent (or settled long ago): its newest copy says.
            found = await self._newest_copy(half_offset, view)
            if found is None and decided is not None:
                return EndOutcome(ResponseCode.TRANSACTION_STATE_UNKNOW, "settled",
                                  f"the half message at tran_state_table_offset {half_offset} was re-stored for a "
                                  f"check by a broker that did not mark which half its copy came from; nothing was "
                                  f"done: the check of the copy asks the producer again")
            if found is None:
                return EndOutcome(ResponseCode.TRANSACTION_STATE_UNKNOW, "settled",
                                  f"the half message at tran_state_table_offset {half_offset} was settled before "
                                  f"the broker's check progress; its outcome is no longer held, nothing was done")
            half_offset, view = found
            # Its copies keep its properties; checked all the same, as the half named was.
            self._check_owner(view, producer_group, transaction_id, view.phy_offset)
            self._refuse_if_in_flight(half_offset)
            decided = self._done.get(half_offset)
        if decided is not None:
            return self._decided_before(half_offset, decided[1], state)
        return await self._append_end(half_offset, view, state)

    @staticmethod
    def _check_owner(view: MessageView, producer_group: str, transaction_id: str, commit_log_offset: int) -> None:
        """Refuse an END of ``producer_group`` (naming ``transaction_id``, if any) for a half of another group or
        another transaction."""
        group = view.properties.get(PROPERTY_PRODUCER_GROUP)
        if group != producer_group:
            raise RequestRejected(ResponseCode.TRANSACTION_STATE_GROUP_WRONG,
                                  f"the half message at commit_log_offset {commit_log_offset} belongs to producer "
                                  f"group {group!r}, not to producer_group {producer_group!r}",
                                  ext={"field": "producer_group"})
        uniq = view.properties.get(PROPERTY_UNIQ_KEY)
        if transaction_id and transaction_id != uniq:
            raise invalid("transaction_id", f"{transaction_id!r} is not the transaction id of the half message at "
                                            f"commit_log_offset {commit_log_offset} ({uniq!r})")

    def _decided_before(self, half_offset: int, outcome: str, state: int) -> EndOutcome:
        asked = "COMMIT" if state == TRANSACTION_COMMIT_TYPE else "ROLLBACK"
        committed = outcome == COMMIT
        code = ResponseCode.TRANSACTION_SHOULD_COMMIT if committed else ResponseCode.TRANSACTION_SHOULD_ROLLBACK
        done = {COMMIT: "committed", ROLLBACK: "rolled back"}.get(
            outcome, f"discarded to {TRANS_CHECK_MAX_TIME_TOPIC} after {self.check_max} checks")
        return EndOutcome(code, "already " + outcome, f"the transaction of the half message at "
                                                      f"tran_state_table_offset {half_offset} was already {done}; "
                                                      f"this {asked} changed nothing")

    async def _newest_copy(self, half_offset: int, view: MessageView) -> tuple[int, MessageView] | None:
        """The newest copy of the half ``view`` stored at ``half_offset``, at or past the progress, settled or not:
        the last half past it that descends from the same first half (TRAN_PREPARED_QUEUE_OFFSET, ``_first_half``),
        which holds the transaction's outcome once either END (the producer's own, or its answer to the check) came.
        Copies of one half form one line (each half is settled once, by at most one ``recheck``), so the last one
        descends from this very half. By UNIQ_KEY, which producers set, the last half with the transaction id was
        found, another transaction's (of any group) as well as this one's.

        A copy is appended in the batch whose op record settles its predecessor, but reaches the half queue only
        once dispatched: an END right after that batch found no copy, answered that nothing was done, and the
        producer's decision was dropped (the commit then rested on the answer to the check). So the half queue is
        caught up with the last re-store first, and what this leader knows is read again after that wait."""
        first = _first_half(view, half_offset)
        store = self.node.store
        with trio.move_on_after(_CATCH_UP_TIMEOUT_S):
            # Again after each wait: a round may have re-stored more meanwhile.
            while store.dispatched_phy_offset < self._restored_end:
                await store.wait_dispatched(self._restored_end)
                await self._ready()
        if store.dispatched_phy_offset < self._restored_end:
            raise RequestRejected(ResponseCode.SYSTEM_BUSY, f"broker {self.node.config.broker_name} is still "
                                                            f"dispatching the halves it re-stored; retry")
        found = None
        for raw, offset in _read_queue(store, TRANS_HALF_TOPIC, max(self._half_progress, half_offset + 1),
                                       self.node.max_message_size):
            copy = decode_record(raw, check_crc=False)
            if _first_half(copy, offset) == first:
                found = (offset, copy)
        return found

    async def _append_end(self, half_offset: int, view: MessageView, state: int) -> EndOutcome:
        outcome = COMMIT if state == TRANSACTION_COMMIT_TYPE else ROLLBACK
        topic = self.node.deleted_real_topic(view) if outcome == COMMIT else None
        gone = topic is not None
        if gone:
            outcome = ROLLBACK  # settled, so no check asks again for a message that cannot be delivered
        messages = [self._op_record(half_offset, outcome)]
        if outcome == COMMIT:
            try:
                real = restored_message(view, _NOT_DELIVERED, prepared_transaction_offset=view.phy_offset,
                                        sys_flag=view.sys_flag & ~TRANSACTION_TYPE_MASK | TRANSACTION_COMMIT_TYPE)
            except MessageFormatError as e:
                raise RequestRejected(ResponseCode.MESSAGE_ILLEGAL, f"the half message at commit_log_offset "
                                                                    f"{view.phy_offset} cannot be committed: {e}") \
                    from None
            messages.insert(0, real)
        self._busy.add(half_offset)
        stored = await self._append_settling([half_offset], messages)
        self._settled(half_offset, stored[-1].queue_offset, outcome)
        if outcome == COMMIT:
            self.committed += 1
            first = stored[0]
            return EndOutcome(ResponseCode.SUCCESS, "committed", msg_id=first.msg_id, queue_id=first.queue_id,
                              queue_offset=first.queue_offset)
        self.rolled_back += 1
        if gone:
            log.info("transaction commit of a deleted topic rolled back topic=%s half_offset=%d", topic, half_offset)
            return EndOutcome(ResponseCode.TOPIC_NOT_EXIST, "rolled back",
                              f"topic {topic!r} was deleted after the half message at tran_state_table_offset "
                              f"{half_offset} was sent: its message went with it, the transaction is rolled back")
        return EndOutcome(ResponseCode.SUCCESS, "rolled back")

    async def _append_settling(self, halves: list[int], messages: list[MessageInput]) -> Any:
        """Append ``messages`` (which settle ``halves``, marked busy by the caller when it chose them, before it
        waited for anything) as one batch, and unmark them. An append whose outcome is unknown leaves them
        uncertain: nothing acts on them until their op records show up (or the term, and with it this view,
        changes).

        The append runs in the node's nursery, not in the request's task: an END whose producer hung up is
        cancelled with its connection, and a record cancelled while still queued is never proposed, so no op
        record ever came to clear its half, and every check after it stopped for the rest of the term."""
        node = self.node
        try:
            batch = encode_batch(messages, node.store_host, max_message_size=node.max_message_size)
        except BaseException:
            self._busy.difference_update(halves)
            raise
        settling = _Settling()
        nursery = getattr(node, "_nursery", None)
        if nursery is None:
            await self._settle(batch, halves, settling)
        else:
            nursery.start_soon(self._settle, batch, halves, settling)
            await settling.done.wait()
        if settling.error is not None:
            raise settling.error
        return settling.result

    async def _settle(self, batch: bytes, halves: list[int], settling: _Settling) -> None:
        try:
            settling.result = await self.node.append_messages(batch)
        except Exception as e:
            # These applied nothing; any other failure (a timeout, an outcome unknown) may still commit.
            if not isinstance(e, _NOTHING_APPLIED):
                self._uncertain.update(halves)
            settling.error = e
        except BaseException:  # the node stopping
            self._uncertain.update(halves)
            settling.error = RequestRejected(ResponseCode.SYSTEM_BUSY, f"broker {self.node.config.broker_name} "
                                                                       f"is stopping; retry")
            raise
        finally:
            self._busy.difference_update(halves)
            settling.done.set()

    def _op_record(self, half_offset: int, outcome: str) -> MessageInput:
        return MessageInput(topic=TRANS_OP_HALF_TOPIC, queue_id=0, body=str(half_offset).encode("ascii"),
                            properties={PROPERTY_TAGS: OP_TAG, PROPERTY_TRANSACTION_OUTCOME: outcome},
                            born_timestamp=int(time.time() * 1000), born_host=self.node.store_host)

    # --- check-back ----------------------------------------------------------------------------------------
    def progress(self) -> dict[str, int]:
        """Replicated progress: ``half`` (next half queue offset not settled) and ``op``."""
        return {k: int(v) for k, v in self.node.group.metadata(TRANSACTION_TABLE).items()}

    async def serve(self) -> None:
        group = self.node.group
        interval_s = self.interval_ms / 1000
        failures = 0
        while True:
            # A failed round is tried again after interval * 2^failures (at most a minute, or the interval): one that
            # fails every time must not log, and retry, at every interval (10 ms at the least).
            await trio.sleep(min(interval_s * 2 ** min(failures, 16), max(interval_s, _BACKOFF_MAX_S)))
            if not group.is_ready_leader:
                failures = 0
                continue
            try:
                # Until a round finds nothing: one may end short of CHECKS_PER_BATCH because its entry was full.
                while await self.check_round() and group.is_ready_leader:
                    await trio.sleep(0)
                failures = 0
            except (RequestRejected, RaftMQError) as e:
                # Nothing settled, or settled without the progress replicated: the next round (here or on the next
                # leader) starts again from the replicated progress, and the op records tell what is settled.
                failures += 1
                log.info("transaction check round failed failures=%d error=%s", failures, getattr(e, "remark", e))
            except Exception:
                # Every leader would meet the same half after it (as one that could not be re-stored once did).
                failures += 1
                log_unexpected_round_failure(log, "transaction check", failures)

    async def check_round(self, now_ms: int | None = None) -> int:
        """One scan: re-store (and check) or discard the unsettled halves older than ``transaction_timeout_ms``, at
        most ``CHECKS_PER_BATCH`` and what fits one DLedger entry (``entry_room``: a half's keys cost 12 bytes each
        there, so 32 halves within the message limit could make an entry past it, and a round that fails so fails
        every time), then replicate the progress; returns how many halves were checked or discarded. A half and its
        op record share an entry (a leader lost between them would leave the half settled without its copy):
        measured together, the first pair of a round up to ``entry_limit``, the next ones up to ``entry_room``."""
        await self._ready()
        node = self.node
        now = int(time.time() * 1000) if now_ms is None else now_ms
        limit = entry_limit(node)
        room = entry_room(node)
        entry = 0
        progress = self._half_progress
        messages: list[MessageInput] = []
        halves: list[tuple[int, str]] = []  # (half queue offset, outcome of its op record)
        ops: list[int] = []  # index in messages of each half's op record
        checked: list[tuple[int, str, str]] = []  # (index in messages, producer group, transaction id)
        for raw, offset in _read_queue(node.store, TRANS_HALF_TOPIC, progress, node.max_message_size):
            if offset in self._done:
                progress = offset + 1
                continue
            if offset in self._busy or offset in self._uncertain or len(halves) >= CHECKS_PER_BATCH:
                break
            view = decode_record(raw, check_crc=False)
            if view.store_timestamp + self.timeout_ms > now:
                break
            props = dict(view.properties)
            real = node.deleted_real_topic(view)
            if real is not None:
                # Its topic was deleted while it waited: rolled back here, by its op record alone. Re-stored for a
                # check, the copy sat past the deletion's cut, and a COMMIT of it landed in a topic created again.
                log.info("half message of a deleted topic rolled back topic=%s transaction_id=%s producer_group=%s",
                         real, props.get(PROPERTY_UNIQ_KEY), props.get(PROPERTY_PRODUCER_GROUP))
                op = self._op_record(offset, ROLLBACK)
                cost = alone_entry_bytes(node, op)
                if halves and entry + cost > room:
                    break
                entry += cost
                ops.append(len(messages))
                messages.append(op)
                halves.append((offset, ROLLBACK))
                self._busy.add(offset)
                progress = offset + 1
                continue
            times = props.get(PROPERTY_TRANSACTION_CHECK_TIMES, "0")
            times = int(times) if times.isdecimal() else 0
            if times >= self.check_max:
                # Kept as stored (its REAL_TOPIC, PGROUP and check count say what it was) for an operator.
                topic, queue_id, outcome = TRANS_CHECK_MAX_TIME_TOPIC, 0, DISCARD
                log.warning("half message discarded after %d checks topic=%s transaction_id=%s producer_group=%s",
                            times, props.get(PROPERTY_REAL_TOPIC), props.get(PROPERTY_UNIQ_KEY),
                            props.get(PROPERTY_PRODUCER_GROUP))
            else:
                topic, queue_id, outcome = TRANS_HALF_TOPIC, 0, RECHECK
                props[PROPERTY_TRANSACTION_CHECK_TIMES] = str(times + 1)
                props[PROPERTY_TRANSACTION_PREPARED_QUEUE_OFFSET] = str(_first_half(view, offset))
            again: MessageInput | None = stored_again(view, topic, queue_id, props)
            op = self._op_record(offset, outcome)
            cost, problem = self._entry_bytes(again, op, limit)
            if outcome == RECHECK and problem is not None:
                # The count (and first half) it would carry make it too big to store (properties just under
                # RocketMQ's 32,767 bytes): re-stored anyway, the batch failed, the broker stopped, and every next
                # leader with it.
                log.error("half message cannot be re-stored for another check, discarded (%s) topic=%s "
                          "transaction_id=%s producer_group=%s", problem, props.get(PROPERTY_REAL_TOPIC),
                          props.get(PROPERTY_UNIQ_KEY), props.get(PROPERTY_PRODUCER_GROUP))
                topic, queue_id, outcome = TRANS_CHECK_MAX_TIME_TOPIC, 0, DISCARD
                again = stored_again(view, topic, queue_id, dict(view.properties))
                op = self._op_record(offset, outcome)
                cost, problem = self._entry_bytes(again, op, limit)
            if problem is not None:
                # Not even as it was stored: a half within an op record's size of the limit (or one stored before
                # the limit was lowered) cannot share an entry with its op record. Settled by its op record alone
                # rather than fail every round; it stays readable in the half topic.
                log.error("half message cannot be stored again, discarded and left in %s (%s) queue_offset=%d "
                          "topic=%s transaction_id=%s producer_group=%s", TRANS_HALF_TOPIC, problem, offset,
                          props.get(PROPERTY_REAL_TOPIC), props.get(PROPERTY_UNIQ_KEY),
                          props.get(PROPERTY_PRODUCER_GROUP))
                again, cost = None, alone_entry_bytes(node, op)
            if halves and entry + cost > room:
                break  # the next round goes on from here
            entry += cost
            if outcome == RECHECK:
                checked.append((len(messages), props.get(PROPERTY_PRODUCER_GROUP, ""),
                                props.get(PROPERTY_UNIQ_KEY, "")))
            if again is not None:
                messages.append(again)
            ops.append(len(messages))
            messages.append(op)
            halves.append((offset, outcome))
            self._busy.add(offset)  # an END for it now waits (SYSTEM_BUSY) until this batch settled it
            progress = offset + 1
        if messages:
            try:
                if any(outcome == DISCARD for _, outcome in halves):
                    await node.ensure_topic(TopicConfig(TRANS_CHECK_MAX_TIME_TOPIC, 1, 1, PERM_READ))
            except BaseException:
                self._busy.difference_update(half for half, _ in halves)
                raise
            stored = await self._append_settling([half for half, _ in halves], messages)
            for (half, outcome), op_index in zip(halves, ops):
                self._settled(half, stored[op_index].queue_offset, outcome)
            if checked:
                last = stored[checked[-1][0]]
                self._restored_end = max(self._restored_end, last.phy_offset + last.size)
            for index, group, transaction_id in checked:
                self._send_check(stored[index], group, transaction_id)
            self.checks += len(checked)
            rolled = sum(1 for _, outcome in halves if outcome == ROLLBACK)
            self.rolled_back += rolled
            self.discarded += len(halves) - len(checked) - rolled
        if progress != self._half_progress:
            await self._advance(progress)
        return len(halves)

    def _entry_bytes(self, message: MessageInput, op: MessageInput, limit: int) -> tuple[int, str | None]:
        """The entry bytes ``message`` and its ``op`` record take appended alone, together, and why they cannot be
        stored (None if they can): past the format's limits, or past ``limit`` (``entry_limit``)."""
        try:
            cost = alone_entry_bytes(self.node, message, op)
        except MessageFormatError as e:
            return 0, str(e)
        if cost > limit:
            return cost, (f"with its op record it makes a DLedger entry of {cost} bytes, more than max_entry_bytes "
                          f"{limit}")
        return cost, None

    async def _advance(self, progress: int) -> None:
        """Move the check progress to ``progress`` (every half below it settled) and replicate it with the op
        queue offset from which the ops of the halves still above it are found."""
        self._half_progress = progress
        for half in [h for h in self._done if h < progress]:
            del self._done[half]
        op = min([op for op, _ in self._done.values()] + [self._op_cursor])
        if not self.node.is_leader():
            raise self.node.not_leader()
        await self.node.group.put_metadata(TRANSACTION_TABLE, {"half": progress, "op": op},
                                           timeout_s=self.node.config.send_timeout_ms / 1000)

    def _send_check(self, copy: Any, producer_group: str, transaction_id: str) -> None:
        """CHECK_TRANSACTION_STATE (oneway, as RocketMQ's) about the re-stored ``copy`` to one connected producer of
        ``producer_group``, taken in turn; its answer is an END_TRANSACTION naming the copy."""
        node = self.node
        channels = [ch for ch in node.clients.producer_groups.get(producer_group, {}).values() if not ch.conn.closed]
        if not channels:
            log.info("transaction not checked: no producer of its group is connected producer_group=%s "
                     "transaction_id=%s", producer_group, transaction_id)
            return
        raw = node.read_record(copy.phy_offset)
        if raw is None:
            return
        channel = channels[self._next_producer % len(channels)]
        self._next_producer += 1
        frame = make_request(RequestCode.CHECK_TRANSACTION_STATE, oneway=True, body=raw, ext={
            "producer_group": producer_group, "tran_state_table_offset": copy.queue_offset,
            "commit_log_offset": copy.phy_offset, "msg_id": copy.msg_id, "transaction_id": transaction_id,
            "broker_name": node.config.broker_name})
        node.notify_soon(channel.conn, frame)

    def statistics(self) -> dict[str, int]:
        """For GET_BROKER_RUNTIME_INFO."""
        progress = self.progress()
        return {"transactions_committed": self.committed, "transactions_rolled_back": self.rolled_back,
                "transaction_checks": self.checks, "transactions_discarded": self.discarded,
                "transaction_half_offset": progress.get("half", 0),
                "transaction_half_max_offset": self.node.store.get_max_offset_in_queue(TRANS_HALF_TOPIC, 0)}
