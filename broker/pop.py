"""POP consumption (RocketMQ 5): checkpoints, receipt handles, pop offsets and the revive task.

A POP hands a consumer up to ``max_msg_nums`` messages of a queue and makes them *invisible* for
``invisible_time_ms``; each must be acked (ACK_MESSAGE) before then, or have its invisible time changed
(CHANGE_MESSAGE_INVISIBLETIME), else the leader's revive task makes it visible again. The rules this module keeps:

* **One replicated table, one write per change.** Everything POP remembers lives in the group's Raft metadata table
  ``broker.pop`` (``POP_TABLE``), changed only by the leader and mirrored by every node, as consumer offsets are:

  - ``o\\x01<group>\\x01<topic>\\x01<queue_id>`` -> the group's pop offset of the queue: where its next POP reads;
  - ``c\\x01<group>\\x01<topic>\\x01<queue_id>\\x01<start_offset>\\x01<pop_time_ms>`` -> a checkpoint: the queue
    offsets one POP handed out and not yet acked, and their invisible time (``CheckPoint.to_wire``).

  A POP moves the pop offset and records its checkpoint in *one* metadata write, replicated before the answer: a
  new leader therefore never hands out again what was popped (no pop offset behind a checkpoint), and knows every
  message still invisible (no pop offset ahead of a missing checkpoint, which would lose them). An ACK removes its
  offset from the checkpoint (the checkpoint goes with its last offset); a CHANGE moves one offset into a new
  checkpoint with the new deadline; each is one write. RocketMQ writes checkpoints and acks to a revive topic and
  pairs them up again in its revive service; raftmq's Raft-replicated table says the same in fewer moving parts.
* **Deadlines are wall-clock.** ``pop_time_ms + invisible_time_ms``, taken by the leader that popped; a new leader
  judges them by its own clock (RocketMQ's rule too: brokers are assumed NTP-synced).
* **Revive on the ready leader.** Every ``pop_revive_interval_ms`` the leader takes each checkpoint whose deadline
  passed, stores each of its messages again with ``reconsume_times`` + 1 in the group's POP retry topic
  ``%RETRY%<group>_<topic>`` (RocketMQ 5's name; the next POPs of ``<topic>`` read it too), or, once the stored
  copy's ``reconsume_times`` reached the subscription group's ``retry_max_times``, in its dead-letter topic
  ``%DLQ%<group>`` (as a send-back does), and only then removes the checkpoint. A leader killed between the two
  revives it again: a duplicate, never a loss (at-least-once, as RocketMQ).
  Why a retry topic per (group, topic) rather than the push consumers' ``%RETRY%<group>``: a POP names one topic,
  with its own filter, and reads its retry topic with it. Sharing one per group would make a POP of topic A read
  (and have to skip, past its pop offset, for good) the revived messages of topic B. A name such as ``a_b_c`` can
  come from group ``a`` and topic ``b_c`` or from ``a_b`` and ``c``; each revived message carries the topic it was
  first popped from (RETRY_TOPIC), and a POP passes over those of another topic.
* **One change at a time per queue.** Pops, acks, changes and revives of one (group, topic, queue) are serialised
  by a lock of the leader (``PopService.queue_lock``): each reads the table, decides and writes, and a concurrent
  one must see its write.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import trio

from broker.processor.base import RequestRejected
from broker.schedule import stored_again
from broker.subscription_group import DEFAULT_RETRY_MAX_TIMES, DEFAULT_RETRY_QUEUE_NUMS
from broker.topic_config import PERM_READ_WRITE, PERM_WRITE, TopicConfig
from dledger import DLedgerError
from remoting.errors import RaftMQError
from remoting.message import (MAX_TOPIC_LENGTH, PROPERTY_DELAY, PROPERTY_ORIGIN_MESSAGE_ID, PROPERTY_REAL_QUEUE_ID,
                              PROPERTY_REAL_TOPIC, PROPERTY_RETRY_TOPIC, PROPERTY_UNIQ_KEY, RETRY_GROUP_TOPIC_PREFIX,
                              MessageFormatError, MessageInput, create_msg_id, decode_record, dlq_topic,
                              encode_batch)

if TYPE_CHECKING:
    from broker.node import BrokerNode

log = logging.getLogger(__name__)

__all__ = ["POP_TABLE", "CheckPoint", "ReceiptHandle", "ReceiptHandleError", "PopService", "pop_retry_topic",
           "pop_offset_key", "expired_checkpoints", "checkpoints_of_queue"]

POP_TABLE = "broker.pop"
DLQ_QUEUE_NUMS = 1  # RocketMQ's DLQ_NUMS_PER_GROUP, as a send-back's
_OFFSET_PREFIX = "o\x01"
_CK_PREFIX = "c\x01"


def pop_retry_topic(group: str, topic: str) -> str:
    """RocketMQ 5's POP retry topic of ``group`` consuming ``topic``: ``%RETRY%<group>_<topic>``."""
    return f"{RETRY_GROUP_TOPIC_PREFIX}{group}_{topic}"


def pop_retry_topic_problem(group: str, topic: str) -> str | None:
    name = pop_retry_topic(group, topic)
    if len(name) > MAX_TOPIC_LENGTH:
        return (f"with consumer group {group[:40]!r} names a POP retry topic of {len(name)} characters "
                f"(%RETRY%<group>_<topic>); at most {MAX_TOPIC_LENGTH} are allowed")
    return None


def pop_offset_key(group: str, topic: str, queue_id: int) -> str:
    return f"{_OFFSET_PREFIX}{group}\x01{topic}\x01{queue_id}"


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclasses.dataclass(frozen=True)
class CheckPoint:
    """The queue offsets one POP of (group, topic, queue_id) handed out and that are not acked yet. ``topic`` is the
    topic read: the consumer's, or its POP retry topic."""

    consumer_group: str
    topic: str
    queue_id: int
    start_offset: int  # the first offset the POP handed out: with pop_time_ms, the checkpoint's identity
    pop_time_ms: int
    invisible_time_ms: int
    offsets: tuple[int, ...]

    @property
    def key(self) -> str:
        return (f"{_CK_PREFIX}{self.consumer_group}\x01{self.topic}\x01{self.queue_id}\x01{self.start_offset}"
                f"\x01{self.pop_time_ms}")

    @property
    def deadline_ms(self) -> int:
        return self.pop_time_ms + self.invisible_time_ms

    def to_wire(self) -> dict[str, Any]:
        return {"g": self.consumer_group, "t": self.topic, "q": self.queue_id, "s": self.start_offset,
                "p": self.pop_time_ms, "i": self.invisible_time_ms, "o": list(self.offsets)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> CheckPoint:
        return cls(str(data["g"]), str(data["t"]), int(data["q"]), int(data["s"]), int(data["p"]), int(data["i"]),
                   tuple(int(o) for o in data["o"]))

    def without(self, offset: int) -> CheckPoint | None:
        """This checkpoint once ``offset`` is acked (or moved to another): None when nothing is left."""
        rest = tuple(o for o in self.offsets if o != offset)
        return dataclasses.replace(self, offsets=rest) if rest else None

    def handle(self, broker_name: str, queue_offset: int) -> ReceiptHandle:
        return ReceiptHandle(broker_name, self.topic, self.queue_id, queue_offset, self.start_offset,
                             self.pop_time_ms, self.invisible_time_ms)


class ReceiptHandleError(ValueError):
    """A receipt handle that cannot be read; the message says what is wrong with it."""


_HANDLE_VERSION = "1"
_HANDLE_FIELDS = 8


@dataclasses.dataclass(frozen=True)
class ReceiptHandle:
    """What a consumer hands back to ack a popped message or change its invisible time (RocketMQ's "extra info"):
    enough to find its checkpoint. Its text form, fields separated by one space (no topic, group or broker name
    holds one), is ``1 <broker_name> <topic> <queue_id> <queue_offset> <start_offset> <pop_time_ms>
    <invisible_time_ms>``: a version, the broker group that popped it, the topic read (the consumer's, or its POP
    retry topic), the message's queue and offset, and its checkpoint's start offset, pop time and invisible time."""

    broker_name: str
    topic: str
    queue_id: int
    queue_offset: int
    start_offset: int
    pop_time_ms: int
    invisible_time_ms: int

    @property
    def deadline_ms(self) -> int:
        return self.pop_time_ms + self.invisible_time_ms

    def checkpoint_key(self, group: str) -> str:
        return (f"{_CK_PREFIX}{group}\x01{self.topic}\x01{self.queue_id}\x01{self.start_offset}"
                f"\x01{self.pop_time_ms}")

    def encode(self) -> str:
        return " ".join((_HANDLE_VERSION, self.broker_name, self.topic, str(self.queue_id), str(self.queue_offset),
                         str(self.start_offset), str(self.pop_time_ms), str(self.invisible_time_ms)))

    @classmethod
    def decode(cls, text: Any) -> ReceiptHandle:
        if not isinstance(text, str) or not text:
            raise ReceiptHandleError(f"must be a non-empty string, got {text!r:.60}")
        parts = text.split(" ")
        if len(parts) != _HANDLE_FIELDS:
            raise ReceiptHandleError(f"must have {_HANDLE_FIELDS} space-separated fields, got {len(parts)} in "
                                     f"{text[:120]!r}")
        version, broker_name, topic, *numbers = parts
        if version != _HANDLE_VERSION:
            raise ReceiptHandleError(f"has version {version[:20]!r}; this broker reads version {_HANDLE_VERSION}")
        if not broker_name or not topic:
            raise ReceiptHandleError(f"names no broker or no topic: {text[:120]!r}")
        values = []
        for name, raw in zip(("queue_id", "queue_offset", "start_offset", "pop_time_ms", "invisible_time_ms"),
                             numbers):
            # isdecimal, not int(): int() takes "+1", "1_0" and non-ASCII digits, which would make one handle
            # have many spellings.
            if not raw.isascii() or not raw.isdecimal() or len(raw) > 19:
                raise ReceiptHandleError(f"field {name} must be a non-negative integer, got {raw[:40]!r}")
            values.append(int(raw))
        queue_id, queue_offset, start_offset, pop_time_ms, invisible_time_ms = values
        if queue_offset < start_offset:
            raise ReceiptHandleError(f"names queue offset {queue_offset} below its checkpoint's start offset "
                                     f"{start_offset}")
        return cls(broker_name, topic, queue_id, queue_offset, start_offset, pop_time_ms, invisible_time_ms)


# --- reading the table ---------------------------------------------------------------------------------------------
def checkpoints(table: Mapping[str, Any]) -> Iterable[CheckPoint]:
    for key, value in table.items():
        if key.startswith(_CK_PREFIX):
            yield CheckPoint.from_wire(value)


def expired_checkpoints(table: Mapping[str, Any], now: int) -> list[CheckPoint]:
    """The checkpoints whose deadline is at or before ``now`` (ms), oldest deadline first."""
    return sorted((ck for ck in checkpoints(table) if ck.deadline_ms <= now), key=lambda ck: ck.deadline_ms)


def checkpoints_of_queue(table: Mapping[str, Any], group: str, topic: str, queue_id: int) -> list[CheckPoint]:
    prefix = f"{_CK_PREFIX}{group}\x01{topic}\x01{queue_id}\x01"
    return [CheckPoint.from_wire(v) for k, v in table.items() if k.startswith(prefix)]


def plan_ack(table: Mapping[str, Any], group: str, handle: ReceiptHandle) -> tuple[dict[str, Any], bool]:
    """The table change that acks ``handle``'s message, and whether the handle was current. Not current: its
    message was acked already (nothing to change), or moved to a newer checkpoint by a CHANGE (``superseded``
    then holds that checkpoint)."""
    raw = table.get(handle.checkpoint_key(group))
    ck = CheckPoint.from_wire(raw) if raw is not None else None
    if ck is None or handle.queue_offset not in ck.offsets:
        return {}, False
    rest = ck.without(handle.queue_offset)
    return {ck.key: rest.to_wire() if rest is not None else None}, True


def superseded_by(table: Mapping[str, Any], group: str, handle: ReceiptHandle) -> CheckPoint | None:
    """The checkpoint other than ``handle``'s that holds its message (a CHANGE moved it there), if any."""
    mine = handle.checkpoint_key(group)
    for ck in checkpoints_of_queue(table, group, handle.topic, handle.queue_id):
        if ck.key != mine and handle.queue_offset in ck.offsets:
            return ck
    return None


def plan_change(table: Mapping[str, Any], group: str, handle: ReceiptHandle, invisible_time_ms: int,
                now: int) -> tuple[dict[str, Any], CheckPoint] | None:
    """The table change that makes ``handle``'s message invisible for ``invisible_time_ms`` from ``now``: out of its
    checkpoint, into a new one of its own. None when the handle is not current (see ``plan_ack``)."""
    items, current = plan_ack(table, group, handle)
    if not current:
        return None
    pop_time = now
    new = CheckPoint(group, handle.topic, handle.queue_id, handle.queue_offset, pop_time, invisible_time_ms,
                     (handle.queue_offset,))
    while new.key in table or new.key in items:  # another change of the same message within the same ms
        pop_time += 1
        new = dataclasses.replace(new, pop_time_ms=pop_time)
    items[new.key] = new.to_wire()
    return items, new


class PopService:
    """The leader's side of POP: the per-queue locks, the reads of the replicated table, and the revive task."""

    def __init__(self, node: BrokerNode) -> None:
        self.node = node
        self._locks: dict[tuple[str, str, int], trio.Lock] = {}
        self._table: dict[str, Any] = {}
        self._generation = -1
        self.revived = 0  # messages stored again in a POP retry topic by this node
        self.dead = 0  # ... in a dead-letter topic

    def queue_lock(self, group: str, topic: str, queue_id: int) -> trio.Lock:
        key = (group, topic, queue_id)
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = trio.Lock()
        return lock

    def table(self) -> dict[str, Any]:
        """This node's applied copy of ``POP_TABLE``, copied again only once it changed."""
        generation = self.node.group.metadata_generation(POP_TABLE)
        if generation != self._generation:
            self._table = self.node.group.metadata(POP_TABLE)
            self._generation = generation
        return self._table

    def pop_offset(self, group: str, topic: str, queue_id: int) -> int | None:
        value = self.table().get(pop_offset_key(group, topic, queue_id))
        return int(value) if value is not None else None

    async def write(self, items: dict[str, Any]) -> None:
        if items:
            await self.node._replicate(POP_TABLE, items)

    # --- revive ------------------------------------------------------------------------------------------------
    async def serve(self) -> None:
        """Revive expired checkpoints every ``pop_revive_interval_ms`` while this node is the ready leader."""
        while True:
            await trio.sleep(self.node.config.pop_revive_interval_ms / 1000)
            if not self.node.group.is_ready_leader:
                continue
            try:
                await self.revive_expired()
            except (RequestRejected, DLedgerError, RaftMQError) as e:
                log.info("pop revive round stopped, retried next round error=%s", e)

    async def revive_expired(self, now: int | None = None) -> int:
        """Revive every checkpoint expired at ``now`` (ms; default the clock); returns the messages stored again."""
        stored = 0
        for ck in expired_checkpoints(self.table(), now_ms() if now is None else now):
            async with self.queue_lock(ck.consumer_group, ck.topic, ck.queue_id):
                raw = self.table().get(ck.key)
                if raw is None:
                    continue  # acked meanwhile
                current = CheckPoint.from_wire(raw)
                if current.deadline_ms > (now_ms() if now is None else now):
                    continue
                stored += await self._revive(current)
        return stored

    async def _revive(self, ck: CheckPoint) -> int:
        node = self.node
        sub_group = node.subscription_groups.get(ck.consumer_group)
        max_times = sub_group.retry_max_times if sub_group is not None else DEFAULT_RETRY_MAX_TIMES
        retry_queue_nums = sub_group.retry_queue_nums if sub_group is not None else DEFAULT_RETRY_QUEUE_NUMS
        messages: list[MessageInput] = []
        dead = 0
        retry_prefix = pop_retry_topic(ck.consumer_group, "")
        for offset in ck.offsets:
            view = self._message(ck.topic, ck.queue_id, offset)
            if view is None:
                log.info("popped message gone before its revive (retention) topic=%s queue_id=%d offset=%d",
                         ck.topic, ck.queue_id, offset)
                continue
            props = dict(view.properties)
            # The topic the group pops: the checkpoint's, unless that is the group's POP retry topic (a message
            # popped from %RETRY%G, a push consumers' retry topic, keeps that as its topic).
            first_topic = ck.topic
            if ck.topic.startswith(retry_prefix) and props.get(PROPERTY_RETRY_TOPIC):
                first_topic = props[PROPERTY_RETRY_TOPIC]
            props[PROPERTY_RETRY_TOPIC] = first_topic
            props[PROPERTY_ORIGIN_MESSAGE_ID] = (props.get(PROPERTY_ORIGIN_MESSAGE_ID) or props.get(PROPERTY_UNIQ_KEY)
                                                 or create_msg_id(view.store_host, view.phy_offset))
            for name in (PROPERTY_DELAY, PROPERTY_REAL_TOPIC, PROPERTY_REAL_QUEUE_ID):
                props.pop(name, None)
            if view.reconsume_times >= max_times:
                target = await node.ensure_topic(TopicConfig(dlq_topic(ck.consumer_group), DLQ_QUEUE_NUMS,
                                                             DLQ_QUEUE_NUMS, PERM_WRITE))
                queue_id = 0
                dead += 1
            else:
                target = await node.ensure_topic(TopicConfig(pop_retry_topic(ck.consumer_group, first_topic),
                                                             retry_queue_nums, retry_queue_nums, PERM_READ_WRITE))
                queue_id = random.randrange(max(1, target.write_queue_nums))
            messages.append(stored_again(view, target.topic_name, queue_id, props,
                                         reconsume_times=view.reconsume_times + 1, prepared_transaction_offset=0))
        if messages:
            try:
                batch = encode_batch(messages, node.store_host, max_message_size=node.max_message_size)
            except MessageFormatError as e:
                # Cannot happen for a message stored once already, short of a broker bug; dropping the checkpoint
                # would lose the messages, keeping it retries every round: keep it, loudly.
                log.error("popped messages cannot be stored again, kept invisible topic=%s queue_id=%d error=%s",
                          ck.topic, ck.queue_id, e)
                return 0
            await node.append_messages(batch)
        await self.write({ck.key: None})
        self.revived += len(messages) - dead
        self.dead += dead
        log.debug("pop checkpoint revived group=%s topic=%s queue_id=%d retried=%d dead=%d", ck.consumer_group,
                  ck.topic, ck.queue_id, len(messages) - dead, dead)
        return len(messages)

    def _message(self, topic: str, queue_id: int, offset: int) -> Any:
        result = self.node.store.get_messages(topic, queue_id, offset, 1, 1 << 30)
        if not result.messages or result.queue_offsets[0] != offset:
            return None
        return decode_record(result.messages[0], check_crc=False)
