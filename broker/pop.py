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
  checkpoint with the new deadline, marked with the POP that handed the message out and the pop times of the
  chain's earlier CHANGEs (only such a checkpoint answers an ack of a handle of its chain "superseded"; every
  checkpoint is marked "v", and one without it, written before, is judged as then); each is one write. A BATCH_ACK
  acks up to 1,024 messages, of any queues of the group, in one write too (``plan_acks``): a Raft round per
  request, not per message, is what bounds a consumer's rate. RocketMQ writes checkpoints and acks to a revive
  topic and pairs them up again in its revive service; raftmq's Raft-replicated table says the same in fewer moving
  parts.
* **Deadlines are wall-clock.** ``pop_time_ms + invisible_time_ms``, taken by the leader that popped; a new leader
  judges them by its own clock (RocketMQ's rule too: brokers are assumed NTP-synced).
* **Revive on the ready leader.** Every ``pop_revive_interval_ms`` the leader takes each checkpoint whose deadline
  passed, stores each of its messages again with ``reconsume_times`` + 1 in the group's POP retry topic
  ``%RETRY%<group>+<topic>`` (RocketMQ 5's v2 name, ``remoting.message.pop_retry_topic``; the next POPs of
  ``<topic>`` read it too), or, once the stored copy's ``reconsume_times`` reached the subscription group's
  ``retry_max_times``, in its dead-letter topic ``%DLQ%<group>`` (as a send-back does), and only then removes the
  checkpoint. A leader killed between the two revives it again: a duplicate, never a loss (at-least-once, as
  RocketMQ). A round starts once dispatch has caught up with the commit log (at most ``REVIVE_DISPATCH_WAIT_S``,
  else the next round), and a message its queue does not hold yet keeps its checkpoint (``RevivePendingError``):
  only one retention removed is skipped. A leader just elected over another's pops read the messages it had not
  dispatched yet as removed, dropped the checkpoint, and they were never delivered again. Why a retry topic per
  (group, topic) rather than the push consumers' ``%RETRY%<group>``: a POP names one topic, with its own filter,
  and reads its retry topic with it; sharing one per group would make a POP of topic A read (and skip for good,
  past its pop offset) the revived messages of topic B. The '+' is outside the names'
  charset, so the name is nobody else's (v1's ``%RETRY%<group>_<topic>`` was also a push group's retry topic, and
  ``a_b_c`` two (group, topic) pairs'); no client may send to it, pull it or pop it as a topic.
* **One checkpoint never holds up the others.** Each is revived in its own try: one that fails (its retry topic
  cannot be created, max_topic_count) is logged once and retried with a growing back-off while the round goes on.
  A message that cannot be stored again with the properties revive adds (RETRY_TOPIC, ORIGIN_MESSAGE_ID: a message
  near the properties limit) goes to the dead-letter topic as it was stored, and does not hold up its checkpoint.
* **Admin moves follow.** A POP reads its pop offset before the group's committed offset, so an offset reset (or a
  clone) sets the pop offsets of the queues it moves (RocketMQ 5's resetPopOffset; the checkpoints stay: what was
  handed out is acked or revived as before), a deleted topic takes the pop offsets and checkpoints of its queues
  and its POP retry topics with it, and a deleted group (clean_offset) its own and its POP retry topics: a retry
  topic outliving the pop offsets that say how far it was read would be read again from its first message by the
  next POP of the group's name.
* **Nothing comes back after a delete.** A delete runs inside ``PopService.forgetting``: from its start, every write
  of a key of the group (or of the topic and its POP retry topics) is left out (``write`` says so: a POP then hands
  nothing out, as nothing records it) and revive skips its checkpoints; then it waits for the POPs, acks, changes
  and revives already holding or waiting for one of their queue locks, each in turn, holding none itself (the delete
  takes the node's topic and offset locks after, and revive may take the topic lock under its queue lock). Only then
  does the delete remove the keys, from a table no write is still heading for: a POP or ack that read the table
  before the delete can no longer write a key back after it. A POP that waited out the delete reads the group
  afresh, or finds its topic gone (checked under the queue lock) and reads nothing.
* **One change at a time per queue.** Pops, acks, changes, revives and resets of one (group, topic, queue) are
  serialised by a lock of the leader (``PopService.queue_lock``): each reads the table, decides and writes, and a
  concurrent one must see its write. A lock lives while someone holds or waits for it: the keys come from clients'
  receipt handles, and a table of every key ever named would only grow. Whoever needs several (a batch ack, an
  offset reset) takes them in (topic, queue_id) order (``PopService.locks_of``); everyone else holds one at a time,
  so no two ever wait for each other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import trio

from broker.processor.base import RequestRejected
from broker.schedule import stored_again
from broker.service_rounds import alone_entry_bytes, entry_limit, entry_room, log_unexpected_round_failure
from broker.store.results import GetMessageStatus
from broker.subscription_group import DEFAULT_RETRY_MAX_TIMES, DEFAULT_RETRY_QUEUE_NUMS
from broker.topic_config import PERM_READ_WRITE, PERM_WRITE, TopicConfig
from dledger import DLedgerError
from remoting.errors import RaftMQError
from remoting.message import (MAX_TOPIC_LENGTH, PROPERTY_DELAY, PROPERTY_ORIGIN_MESSAGE_ID, PROPERTY_REAL_QUEUE_ID,
                              PROPERTY_REAL_TOPIC, PROPERTY_RETRY_TOPIC, PROPERTY_UNIQ_KEY, MessageFormatError,
                              MessageInput, MessageView, create_msg_id, decode_record, dlq_topic, encode_batch,
                              pop_retry_topic, record_properties, split_pop_retry_topic)

if TYPE_CHECKING:
    from broker.node import BrokerNode

log = logging.getLogger(__name__)

__all__ = ["CHANGE_CHAIN_KEPT", "CHECKPOINT_VERSION", "MAX_BATCH_ACK", "POP_TABLE", "BatchAckBodyError", "CheckPoint",
           "CheckpointIndex", "ReceiptHandle", "ReceiptHandleError", "PopService", "batch_ack_texts", "pop_offset_key",
           "expired_checkpoints", "checkpoints_of_queue", "plan_ack", "plan_acks", "plan_reset", "plan_forget"]

POP_TABLE = "broker.pop"
DLQ_QUEUE_NUMS = 1  # RocketMQ's DLQ_NUMS_PER_GROUP, as a send-back's
_OFFSET_PREFIX = "o\x01"
_CK_PREFIX = "c\x01"
# A checkpoint whose revive failed waits pop_revive_interval_ms * 2^failures before the next try, at most this long.
REVIVE_BACKOFF_MAX_MS = 60_000
# How long a revive round waits for dispatch to catch up with the commit log before it is left to the next round.
REVIVE_DISPATCH_WAIT_S = 1.0
# A popped offset reads so once retention took it: the message is gone (it is not revived). Any other miss is a unit
# this node has not dispatched yet (a new leader, a burst, a retried dispatch error): the checkpoint waits for it.
_REMOVED = frozenset({GetMessageStatus.OFFSET_TOO_SMALL, GetMessageStatus.MESSAGE_WAS_REMOVING,
                      GetMessageStatus.OFFSET_FOUND_NULL})
_REVIVE_WARN_EVERY = 20  # failures of one checkpoint between its WARNINGs (the first one is always logged)
# Most receipt handles of one BATCH_ACK_MESSAGE: 32 full POPs, and the one write stays far below a Raft entry's limit
# (~300 KB when each handle is a checkpoint of 32 of its own). The ACL reads no longer body either (broker/acl.py).
MAX_BATCH_ACK = 1024
# The marker "v" of a checkpoint written by a node that knows it (``CheckPoint.legacy``).
CHECKPOINT_VERSION = 1
# Most pop times of a CHANGE chain's earlier checkpoints a CHANGE's checkpoint keeps (``CheckPoint.changes``): a
# chain's handles older than these are no longer superseded. 32 CHANGEs of one delivery is far past any consumer's
# use, and the checkpoint stays ~300 bytes.
CHANGE_CHAIN_KEPT = 32


def pop_retry_topic_problem(group: str, topic: str) -> str | None:
    name = pop_retry_topic(group, topic)
    if len(name) > MAX_TOPIC_LENGTH:
        return (f"with consumer group {group[:40]!r} names a POP retry topic of {len(name)} characters "
                f"(%RETRY%<group>+<topic>); at most {MAX_TOPIC_LENGTH} are allowed")
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
    # A checkpoint a CHANGE made: (start_offset, pop_time_ms) of the POP's checkpoint its message was first handed
    # out in, carried along a chain of CHANGEs; None for a POP's. Only such a checkpoint supersedes a handle
    # (``supersedes``): the message handed out again after an offset reset is in a POP's checkpoint too, and a
    # retried ack of the first delivery was answered "superseded ... changed at" with no CHANGE made.
    changed_from: tuple[int, int] | None = None
    # The pop times of the chain's earlier CHANGE checkpoints (the last CHANGE_CHAIN_KEPT, oldest first): the handles
    # those CHANGEs returned, which name only their own checkpoint (gone since), are known by them. A POP's handle
    # of a message first in its checkpoint looks the same (start_offset == queue_offset) and may be later than the
    # chain's start (a reset handed the message out again): only the pop time tells them apart.
    changes: tuple[int, ...] = ()
    # Written by a node before the marker "v" existed (read from a checkpoint without it): judged by that node's
    # rule (``supersedes``), and written back without the marker by an ack of another of its offsets.
    legacy: bool = False

    @property
    def key(self) -> str:
        return (f"{_CK_PREFIX}{self.consumer_group}\x01{self.topic}\x01{self.queue_id}\x01{self.start_offset}"
                f"\x01{self.pop_time_ms}")

    @property
    def deadline_ms(self) -> int:
        return self.pop_time_ms + self.invisible_time_ms

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"g": self.consumer_group, "t": self.topic, "q": self.queue_id,
                                "s": self.start_offset, "p": self.pop_time_ms, "i": self.invisible_time_ms,
                                "o": list(self.offsets)}
        if not self.legacy:
            # Every checkpoint this version writes is marked, so that one without the marker is known to be older
            # (a POP's and a CHANGE's looked the same before "f"). Nodes before it ignore the key.
            wire["v"] = CHECKPOINT_VERSION
        if self.changed_from is not None:
            # Only for a CHANGE's: [start_offset, pop_time_ms, *changes]. A node that reads just the first two
            # (before "changes" existed) still reads it; one before "f" ignores it and reads a POP's checkpoint.
            wire["f"] = [*self.changed_from, *self.changes]
        return wire

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> CheckPoint:
        chain = data.get("f")
        return cls(str(data["g"]), str(data["t"]), int(data["q"]), int(data["s"]), int(data["p"]), int(data["i"]),
                   tuple(int(o) for o in data["o"]),
                   None if chain is None else (int(chain[0]), int(chain[1])),
                   () if chain is None else tuple(int(t) for t in chain[2:]),
                   "v" not in data)

    def supersedes(self, handle: ReceiptHandle) -> bool:
        """Whether this checkpoint holds ``handle``'s message because a CHANGE of that handle (or of one a CHANGE
        of it returned, and so on) moved it here. Not so for a POP's checkpoint holding the same offset (handed out
        again after an offset reset), nor for one a CHANGE of such a later delivery made: ``handle`` was acked
        already (a retried ack), or its invisible time is over, and is answered so.

        A checkpoint without the marker ("v", ``legacy``) is judged by the rule of the node that wrote it: without
        "f" it may be a CHANGE's (they were not marked), so it supersedes every handle of another checkpoint naming
        its offset, as then; with "f" (a CHANGE's, its chain's pop times unknown) a handle of its chain's POP, or one
        a CHANGE returned popped between that POP and it."""
        if self.key == handle.checkpoint_key or handle.queue_offset not in self.offsets:
            return False
        if self.changed_from is None:
            return self.legacy
        if self.changed_from == (handle.start_offset, handle.pop_time_ms):
            return True  # the POP's handle, changed once or more since
        # A handle a CHANGE returned names a checkpoint that starts at its message (gone once changed again).
        if handle.start_offset != handle.queue_offset:
            return False
        if self.legacy:
            return self.changed_from[1] <= handle.pop_time_ms < self.pop_time_ms
        # Past CHANGE_CHAIN_KEPT changes of one chain, a handle of an older one is no longer known as the chain's:
        # its ack answers "acked already" while the message stays held by the chain's newest checkpoint.
        return handle.pop_time_ms in self.changes

    def without(self, offset: int) -> CheckPoint | None:
        """This checkpoint once ``offset`` is acked (or moved to another): None when nothing is left."""
        rest = tuple(o for o in self.offsets if o != offset)
        return dataclasses.replace(self, offsets=rest) if rest else None

    def handle(self, broker_name: str, queue_offset: int) -> ReceiptHandle:
        return ReceiptHandle(broker_name, self.consumer_group, self.topic, self.queue_id, queue_offset,
                             self.start_offset, self.pop_time_ms, self.invisible_time_ms)


class RevivePendingError(Exception):
    """A checkpoint's message is not in this node's consume queue yet: the revive waits for it (``_message``)."""


class ReceiptHandleError(ValueError):
    """A receipt handle that cannot be read; the message says what is wrong with it."""


_HANDLE_VERSION = "2"
_HANDLE_FIELDS = 9


@dataclasses.dataclass(frozen=True)
class ReceiptHandle:
    """What a consumer hands back to ack a popped message or change its invisible time (RocketMQ's "extra info"):
    enough to find its checkpoint. Its text form, fields separated by one space (no topic, group or broker name
    holds one), is ``2 <broker_name> <consumer_group> <topic> <queue_id> <queue_offset> <start_offset> <pop_time_ms>
    <invisible_time_ms>``: a version, the broker group that popped it, the consumer group it was popped for (an ack
    naming another group is refused, not taken for an ack of nothing), the topic read (the consumer's, or its POP
    retry topic), the message's queue and offset, and its checkpoint's start offset, pop time and invisible time.
    Version 1, without the group, is no longer read."""

    broker_name: str
    consumer_group: str
    topic: str
    queue_id: int
    queue_offset: int
    start_offset: int
    pop_time_ms: int
    invisible_time_ms: int

    @property
    def deadline_ms(self) -> int:
        return self.pop_time_ms + self.invisible_time_ms

    @property
    def checkpoint_key(self) -> str:
        return (f"{_CK_PREFIX}{self.consumer_group}\x01{self.topic}\x01{self.queue_id}\x01{self.start_offset}"
                f"\x01{self.pop_time_ms}")

    def encode(self) -> str:
        return " ".join((_HANDLE_VERSION, self.broker_name, self.consumer_group, self.topic, str(self.queue_id),
                         str(self.queue_offset), str(self.start_offset), str(self.pop_time_ms),
                         str(self.invisible_time_ms)))

    @classmethod
    def decode(cls, text: Any) -> ReceiptHandle:
        if not isinstance(text, str) or not text:
            raise ReceiptHandleError(f"must be a non-empty string, got {text!r:.60}")
        parts = text.split(" ")
        if parts[0] != _HANDLE_VERSION:
            raise ReceiptHandleError(f"has version {parts[0][:20]!r}; this broker reads version {_HANDLE_VERSION}")
        if len(parts) != _HANDLE_FIELDS:
            raise ReceiptHandleError(f"must have {_HANDLE_FIELDS} space-separated fields, got {len(parts)} in "
                                     f"{text[:120]!r}")
        _version, broker_name, group, topic, *numbers = parts
        if not broker_name or not group or not topic:
            raise ReceiptHandleError(f"names no broker, no consumer group or no topic: {text[:120]!r}")
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
        return cls(broker_name, group, topic, queue_id, queue_offset, start_offset, pop_time_ms, invisible_time_ms)


# --- a batch ack's body -------------------------------------------------------------------------------------------
class BatchAckBodyError(ValueError):
    """A BATCH_ACK_MESSAGE body that is no CBOR list of 1..``MAX_BATCH_ACK`` strings; the message says what it is,
    to follow "request field 'body' "."""


def _cbor_head(body: bytes | bytearray | memoryview, pos: int) -> tuple[int, int, int | None, int]:
    """The CBOR item head at ``pos``: (major type, additional information, argument, where the head ends); the
    argument is None for an indefinite length (and a break code)."""
    if pos >= len(body):
        raise BatchAckBodyError(f"is not valid CBOR: it ends at byte {pos}, within its list")
    initial = body[pos]
    major, info = initial >> 5, initial & 0x1F
    if info < 24:
        return major, info, info, pos + 1
    if info == 31:
        return major, info, None, pos + 1
    if info > 27:
        raise BatchAckBodyError(f"is not valid CBOR: byte {pos} has the reserved additional information {info}")
    end = pos + 1 + (1 << (info - 24))
    if end > len(body):
        raise BatchAckBodyError(f"is not valid CBOR: it ends at byte {len(body)}, within an item's head")
    return major, info, int.from_bytes(body[pos + 1:end], "big"), end


def _cbor_kind(major: int, info: int, argument: int | None) -> str:
    # Named after the Python type cbor2 would have made of it, as the remarks did when the whole body was decoded.
    if major == 0 and argument is not None:
        return str(argument)
    if major == 1 and argument is not None:
        return str(-1 - argument)
    if major == 7:
        return {20: "False", 21: "True", 22: "None", 23: "undefined", 25: "float", 26: "float",
                27: "float"}.get(info, "a simple value")
    return ("int", "int", "bytes", "str", "list", "dict", "a tagged item")[major]


def batch_ack_texts(body: bytes | bytearray | memoryview) -> list[str]:
    """The receipt handles of a BATCH_ACK_MESSAGE body: a CBOR list (of definite length) of 1..``MAX_BATCH_ACK`` text
    strings (of definite length), and nothing after it; else BatchAckBodyError. Read head by head, never decoding
    what the list's length or an entry's type already refuses: a 16 MiB body of ~900k made-up handles, or one entry
    nesting a million items, costs a few bytes' look, not a decode (the ACL reads it too, for any signed request)."""
    if not body:
        raise BatchAckBodyError(f"is required: a CBOR list of 1..{MAX_BATCH_ACK} receipt handles")
    wanted = f"must be a CBOR list of 1..{MAX_BATCH_ACK} receipt handles"
    major, info, count, pos = _cbor_head(body, 0)
    if major == 7 and info == 31:
        raise BatchAckBodyError("is not valid CBOR: it starts with a break code")
    if major != 4:
        raise BatchAckBodyError(f"{wanted}, got {_cbor_kind(major, info, count)}")
    if count is None:
        raise BatchAckBodyError(f"{wanted}, got a list of indefinite length (send its length in its head)")
    if not 1 <= count <= MAX_BATCH_ACK:
        raise BatchAckBodyError(f"{wanted}, got a list of {count}")
    texts = []
    for i in range(count):
        major, info, length, start = _cbor_head(body, pos)
        if major != 3:
            raise BatchAckBodyError(f"must hold receipt handles (strings); entry {i} is "
                                    f"{_cbor_kind(major, info, length)}")
        if length is None:
            raise BatchAckBodyError(f"must hold receipt handles (strings) of definite length; entry {i} is in chunks")
        pos = start + length
        if pos > len(body):
            raise BatchAckBodyError(f"is not valid CBOR: it ends at byte {len(body)}, within entry {i}")
        try:
            texts.append(bytes(body[start:pos]).decode("utf-8"))
        except UnicodeDecodeError:
            raise BatchAckBodyError(f"is not valid CBOR: entry {i} is not valid UTF-8") from None
    if pos != len(body):
        raise BatchAckBodyError(f"holds {len(body) - pos} bytes after its list of {count} receipt handles")
    return texts


# --- reading the table ---------------------------------------------------------------------------------------------
def expired_checkpoints(table: Mapping[str, Any], now: int) -> list[CheckPoint]:
    """The checkpoints whose deadline is at or before ``now`` (ms), oldest deadline first. Runs every revive round
    over the whole table: only the expired ones are parsed (10,000 checkpoints, none expired: 31 ms a round parsing
    each, 4 ms judging the wire form)."""
    due = [value for key, value in table.items() if key.startswith(_CK_PREFIX) and value["p"] + value["i"] <= now]
    return sorted((CheckPoint.from_wire(value) for value in due), key=lambda ck: ck.deadline_ms)


def checkpoints_of_queue(table: Mapping[str, Any], group: str, topic: str, queue_id: int) -> list[CheckPoint]:
    prefix = f"{_CK_PREFIX}{group}\x01{topic}\x01{queue_id}\x01"
    return [CheckPoint.from_wire(v) for k, v in table.items() if k.startswith(prefix)]


def pop_offsets(table: Mapping[str, Any], group: str, topic: str) -> dict[int, int]:
    """``group``'s pop offsets of ``topic``: queue_id -> offset."""
    prefix = f"{_OFFSET_PREFIX}{group}\x01{topic}\x01"
    return {int(k[len(prefix):]): int(v) for k, v in table.items() if k.startswith(prefix)}


def plan_ack(table: Mapping[str, Any], handle: ReceiptHandle) -> tuple[dict[str, Any], bool]:
    """The table change that acks ``handle``'s message, and whether the handle was current. Not current: its
    message was acked already (nothing to change), moved to a newer checkpoint by a CHANGE (``superseded_by`` then
    finds that checkpoint), or revived."""
    items, (current,) = plan_acks(table, [handle])
    return items, current


def plan_acks(table: Mapping[str, Any], handles: Iterable[ReceiptHandle]) -> tuple[dict[str, Any], list[bool]]:
    """The one table change that acks every handle's message (a batch ack), and per handle, in order, whether it
    was current when its turn came (see ``plan_ack``). Handles of one checkpoint add up to one change of it (its
    key removed once its last offset is acked); a handle named twice is current the first time only."""
    changed: dict[str, CheckPoint | None] = {}
    current: list[bool] = []
    for handle in handles:
        key = handle.checkpoint_key
        if key in changed:
            ck = changed[key]
        else:
            raw = table.get(key)
            ck = CheckPoint.from_wire(raw) if raw is not None else None
        if ck is None or handle.queue_offset not in ck.offsets:
            current.append(False)
            continue
        changed[key] = ck.without(handle.queue_offset)
        current.append(True)
    return {key: ck.to_wire() if ck is not None else None for key, ck in changed.items()}, current


def superseded_by(table: Mapping[str, Any], handle: ReceiptHandle) -> CheckPoint | None:
    """The checkpoint a CHANGE of ``handle`` moved its message to, if any (``CheckPoint.supersedes``). Scans the
    table, which is fine for one handle; a batch's handles are looked up in one ``CheckpointIndex`` instead."""
    for ck in checkpoints_of_queue(table, handle.consumer_group, handle.topic, handle.queue_id):
        if ck.supersedes(handle):
            return ck
    return None


class CheckpointIndex:
    """The checkpoints of ``handles``' group that hold their messages, found in one pass over the table, for
    ``superseded_by`` to look each handle up in. A batch ack's handles that are not current are judged so under their
    queues' locks: a scan of the table each (the module's ``superseded_by``) took seconds for 1,024 handles against
    10,000 checkpoints, all of it a blocked event loop. Only a checkpoint holding one of the offsets named is parsed."""

    def __init__(self, table: Mapping[str, Any], group: str, handles: Iterable[ReceiptHandle]) -> None:
        self.group = group
        # The key of a checkpoint of (topic, queue_id) up to its last two fields (start_offset, pop_time_ms) -> the
        # handles' offsets of that queue.
        wanted: dict[str, set[int]] = {}
        for handle in handles:
            if handle.consumer_group != group:
                raise ValueError(f"receipt handle of consumer group {handle.consumer_group!r} in an index of "
                                 f"group {group!r}")
            head = f"{_CK_PREFIX}{group}\x01{handle.topic}\x01{handle.queue_id}"
            wanted.setdefault(head, set()).add(handle.queue_offset)
        self._wanted = wanted
        prefix = f"{_CK_PREFIX}{group}\x01"
        self._holding: dict[tuple[str, int], list[CheckPoint]] = {}  # (head, queue_offset) -> in table order
        for key, value in table.items():
            if not key.startswith(prefix):
                continue
            head = key.rsplit("\x01", 2)[0]
            offsets = wanted.get(head)
            if offsets is not None and not offsets.isdisjoint(value["o"]):
                ck = CheckPoint.from_wire(value)
                for offset in offsets.intersection(ck.offsets):
                    self._holding.setdefault((head, offset), []).append(ck)

    def superseded_by(self, handle: ReceiptHandle) -> CheckPoint | None:
        """As the module's ``superseded_by`` (the first such checkpoint in table order), for a handle the index was
        made with."""
        head = f"{_CK_PREFIX}{handle.consumer_group}\x01{handle.topic}\x01{handle.queue_id}"
        if handle.consumer_group != self.group or handle.queue_offset not in self._wanted.get(head, ()):
            raise ValueError(f"receipt handle of consumer group {handle.consumer_group!r}, message {handle.topic}:"
                             f"{handle.queue_id}:{handle.queue_offset} is not of this index")
        for ck in self._holding.get((head, handle.queue_offset), ()):
            if ck.supersedes(handle):
                return ck
        return None


def plan_change(table: Mapping[str, Any], handle: ReceiptHandle, invisible_time_ms: int,
                now: int) -> tuple[dict[str, Any], CheckPoint] | None:
    """The table change that makes ``handle``'s message invisible for ``invisible_time_ms`` from ``now``: out of its
    checkpoint, into a new one of its own, which names the POP that first handed it out (``changed_from``) and the
    chain's earlier CHANGE checkpoints (``changes``, the last ``CHANGE_CHAIN_KEPT``). None
    when the handle is not current (see ``plan_ack``)."""
    items, current = plan_ack(table, handle)
    if not current:
        return None
    old = CheckPoint.from_wire(table[handle.checkpoint_key])
    pop_time = now
    if old.changed_from is None:
        # A chain starts at this POP's checkpoint (or, for one without the marker, which may be a CHANGE's, here).
        changed_from, changes = (handle.start_offset, handle.pop_time_ms), ()
    else:
        changed_from, changes = old.changed_from, (*old.changes, old.pop_time_ms)[-CHANGE_CHAIN_KEPT:]
    new = CheckPoint(handle.consumer_group, handle.topic, handle.queue_id, handle.queue_offset, pop_time,
                     invisible_time_ms, (handle.queue_offset,), changed_from, changes)
    while new.key in table or new.key in items:  # another change of the same message within the same ms
        pop_time += 1
        new = dataclasses.replace(new, pop_time_ms=pop_time)
    items[new.key] = new.to_wire()
    return items, new


def plan_reset(table: Mapping[str, Any], group: str, topic: str, offsets: Mapping[int, int]) -> dict[str, Any]:
    """The change an offset reset of ``group``'s queues of ``topic`` (queue_id -> offset) makes: each pop offset the
    group has there moves to the new offset (a queue it never popped reads the committed offset, which the reset
    sets). Checkpoints stay, as RocketMQ 5's resetPopOffset leaves them: messages handed out are acked or revived."""
    return {key: offsets[q] for q in offsets if (key := pop_offset_key(group, topic, q)) in table}


def plan_forget(table: Mapping[str, Any], *, group: str | None = None, topic: str | None = None) -> dict[str, Any]:
    """The change that removes every pop offset and checkpoint of ``group`` (any topic) or of ``topic`` (any
    group)."""
    if (group is None) == (topic is None):
        raise ValueError("plan_forget takes one of group and topic")
    out: dict[str, Any] = {}
    for key in table:
        parts = key.split("\x01", 3)
        if len(parts) >= 3 and (parts[1] == group if group is not None else parts[2] == topic):
            out[key] = None
    return out


@dataclasses.dataclass(frozen=True)
class _Forgetting:
    """What a delete running now removes: every key of ``group``, or of ``topic`` and its POP retry topics."""

    group: str | None
    topic: str | None

    def covers(self, group: str, topic: str) -> bool:
        if self.group is not None:
            return group == self.group
        if topic == self.topic:
            return True
        pop_retry = split_pop_retry_topic(topic)
        return pop_retry is not None and pop_retry[1] == self.topic


def _key_scope(key: str) -> tuple[str, str]:
    """(group, topic) of a ``POP_TABLE`` key."""
    parts = key.split("\x01", 3)
    return parts[1], parts[2]


@dataclasses.dataclass
class _QueueLock:
    lock: trio.Lock = dataclasses.field(default_factory=trio.Lock)
    users: int = 0  # holding or waiting


class PopService:
    """The leader's side of POP: the per-queue locks, the reads of the replicated table, and the revive task."""

    def __init__(self, node: BrokerNode) -> None:
        self.node = node
        self._locks: dict[tuple[str, str, int], _QueueLock] = {}
        self._forgetting: list[_Forgetting] = []  # the deletes running now (usually none: one test on the hot path)
        self._table: dict[str, Any] = {}
        self._generation = -1
        # checkpoint key -> (earliest next try, ms; failures) of checkpoints whose revive failed
        self._backoff: dict[str, tuple[int, int]] = {}
        self.revived = 0  # messages stored again in a POP retry topic by this node
        self.dead = 0  # ... in a dead-letter topic

    @contextlib.asynccontextmanager
    async def queue_lock(self, group: str, topic: str, queue_id: int) -> AsyncIterator[None]:
        """Hold (group, topic, queue_id)'s lock; it is forgotten once nobody holds or waits for it."""
        key = (group, topic, queue_id)
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = _QueueLock()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if not entry.users:
                del self._locks[key]

    @contextlib.asynccontextmanager
    async def queue_locks(self, group: str, topic: str, queue_ids: Iterable[int]) -> AsyncIterator[None]:
        """Hold the locks of several queues of one topic (see ``locks_of``)."""
        async with self.locks_of(group, ((topic, queue_id) for queue_id in queue_ids)):
            yield

    @contextlib.asynccontextmanager
    async def locks_of(self, group: str, queues: Iterable[tuple[str, int]]) -> AsyncIterator[None]:
        """Hold the locks of several (topic, queue_id) of ``group``, taken in (topic, queue_id) order. Every holder
        of more than one takes them in that order, and the others hold one at a time (POP, ACK, CHANGE, revive): a
        holder only ever waits for a lock after all those it holds, so no wait goes round in a circle."""
        async with contextlib.AsyncExitStack() as stack:
            for topic, queue_id in sorted(set(queues)):
                await stack.enter_async_context(self.queue_lock(group, topic, queue_id))
            yield

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

    def pop_offsets(self, group: str, topic: str) -> dict[int, int]:
        return pop_offsets(self.table(), group, topic)

    async def write(self, items: dict[str, Any]) -> bool:
        """Replicate ``items``, less the keys of a group or topic being deleted (``forgetting``); False when any was
        left out. A writer that must not act on a change nobody recorded (a POP handing messages out) reads it."""
        if self._forgetting:
            kept = {key: value for key, value in items.items() if not self.being_forgotten(*_key_scope(key))}
            if len(kept) != len(items):
                log.debug("pop write of a group or topic being deleted left out keys=%d", len(items) - len(kept))
                if kept:
                    await self.node._replicate(POP_TABLE, kept)
                return False
        if items:
            await self.node._replicate(POP_TABLE, items)
        return True

    def being_forgotten(self, group: str, topic: str) -> bool:
        """Whether a delete running now removes the state of (group, topic)."""
        return any(scope.covers(group, topic) for scope in self._forgetting)

    @contextlib.asynccontextmanager
    async def forgetting(self, *, group: str | None = None, topic: str | None = None) -> AsyncIterator[None]:
        """Run a delete of ``group`` (any topic) or of ``topic`` (any group, its POP retry topics too) inside this:
        writes of their keys are left out from now on (see ``write``), and once the POPs, acks, changes and revives
        already at one of their queues' locks are done, the body runs (it ends with ``forget``). Enter it holding
        no lock: the queue locks are waited for one at a time, and a revive holding one may want the topic lock."""
        with self._marked("forgetting", group, topic) as scope:
            for key in [key for key in self._locks if scope.covers(key[0], key[1])]:
                async with self.queue_lock(*key):
                    pass  # its holder, and whoever waited before this, are done; the next ones find scope set
            yield

    async def forget(self, *, group: str | None = None, topic: str | None = None) -> int:
        """Remove every pop offset and checkpoint of ``group`` or of ``topic`` (a deleted group or topic), replicated
        before this returns; the number of keys removed. Called inside ``forgetting``, no write can bring one back;
        its own mark alone keeps out only the writes planned after it."""
        with self._marked("forget", group, topic):
            items = plan_forget(self.table(), group=group, topic=topic)
            if items:
                await self.node._replicate(POP_TABLE, items)
        return len(items)

    @contextlib.contextmanager
    def _marked(self, what: str, group: str | None, topic: str | None) -> Iterator[_Forgetting]:
        """``group``'s or ``topic``'s keys left out of every write while inside (``write``, revive)."""
        if (group is None) == (topic is None):
            raise ValueError(f"{what} takes one of group and topic")
        scope = _Forgetting(group, topic)
        self._forgetting.append(scope)
        try:
            yield scope
        finally:
            self._forgetting.remove(scope)

    # --- revive ------------------------------------------------------------------------------------------------
    async def serve(self) -> None:
        """Revive expired checkpoints every ``pop_revive_interval_ms`` while this node is the ready leader."""
        failures = 0  # rounds in a row that failed outside one checkpoint's revive
        while True:
            interval_ms = self.node.config.pop_revive_interval_ms
            await trio.sleep(min(interval_ms << min(failures, 16), max(interval_ms, REVIVE_BACKOFF_MAX_MS)) / 1000)
            if not self.node.group.is_ready_leader:
                self._backoff.clear()
                failures = 0
                continue
            try:
                await self.revive_expired()
                failures = 0
            except (RequestRejected, DLedgerError, RaftMQError) as e:
                log.info("pop revive round stopped, retried next round error=%s", e)
            except Exception:
                # A defect outside one checkpoint's revive (or met as the leadership went); backed off as a
                # checkpoint is.
                failures += 1
                log_unexpected_round_failure(log, "pop revive", failures)

    async def revive_expired(self, now: int | None = None) -> int:
        """Revive every checkpoint expired at ``now`` (ms; default the clock), each on its own: one that fails waits
        its back-off and the others go on. Returns the messages stored again. Raises only once this node is no
        longer the leader (the round ends; the next leader's revive takes over)."""
        def clock() -> int:
            return now_ms() if now is None else now

        # A checkpoint names queue offsets, which read as missing on a node whose dispatch trails its commit log
        # (a leader just elected over another's pops): they must be in its consume queues before a revive looks.
        store = self.node.store
        end = store.max_phy_offset
        with trio.move_on_after(REVIVE_DISPATCH_WAIT_S):
            await store.wait_dispatched(end)
        if store.dispatched_phy_offset < end:
            log.info("pop revive round left to the next: dispatch is behind the commit log dispatched=%d end=%d",
                     store.dispatched_phy_offset, end)
            return 0
        table = self.table()
        for key in [k for k in self._backoff if k not in table]:
            del self._backoff[key]  # acked, revived or forgotten since
        stored = 0
        start = clock()
        for ck in expired_checkpoints(table, start):
            backoff = self._backoff.get(ck.key)
            if backoff is not None and backoff[0] > start:
                continue
            try:
                async with self.queue_lock(ck.consumer_group, ck.topic, ck.queue_id):
                    raw = self.table().get(ck.key)
                    if raw is None:
                        continue  # acked meanwhile
                    if self._forgetting and self.being_forgotten(ck.consumer_group, ck.topic):
                        continue  # its group or topic is being deleted: no retry topic is created for it
                    current = CheckPoint.from_wire(raw)
                    if current.deadline_ms > clock():
                        continue
                    stored += await self._revive(current)
                self._backoff.pop(ck.key, None)
            except Exception as e:
                if not self.node.is_leader():
                    raise
                self._revive_failed(ck, e)
        return stored

    def _revive_failed(self, ck: CheckPoint, error: Exception) -> None:
        failures = self._backoff.get(ck.key, (0, 0))[1] + 1
        delay_ms = min(self.node.config.pop_revive_interval_ms << min(failures, 16), REVIVE_BACKOFF_MAX_MS)
        self._backoff[ck.key] = (now_ms() + delay_ms, failures)
        expected = isinstance(error, (RequestRejected, DLedgerError, RaftMQError, RevivePendingError))
        level = logging.WARNING if failures == 1 or failures % _REVIVE_WARN_EVERY == 0 else logging.DEBUG
        # An unexpected error is a bug: its traceback, once.
        log.log(level, "pop checkpoint not revived, retried in %d ms; the others go on group=%s topic=%s queue_id=%d "
                "start_offset=%d messages=%d failures=%d error=%s", delay_ms, ck.consumer_group, ck.topic,
                ck.queue_id, ck.start_offset, len(ck.offsets), failures, error,
                exc_info=not expected and failures == 1)

    async def _revive(self, ck: CheckPoint) -> int:
        node = self.node
        sub_group = node.subscription_groups.get(ck.consumer_group)
        max_times = sub_group.retry_max_times if sub_group is not None else DEFAULT_RETRY_MAX_TIMES
        retry_queue_nums = sub_group.retry_queue_nums if sub_group is not None else DEFAULT_RETRY_QUEUE_NUMS
        # The topic the group pops: the checkpoint's, unless that is the group's POP retry topic (a message popped
        # from %RETRY%G, a push consumers' retry topic, keeps that as its topic).
        first_topic = ck.topic
        pop_retry = split_pop_retry_topic(ck.topic)
        if pop_retry is not None and pop_retry[0] == ck.consumer_group:
            first_topic = pop_retry[1]
        room = entry_room(node)
        appends: list[list[MessageInput]] = [[]]
        entry = 0
        count = dead = 0
        for offset in ck.offsets:
            view = self._message(ck.topic, ck.queue_id, offset)
            if view is None:
                log.info("popped message gone before its revive (retention) topic=%s queue_id=%d offset=%d",
                         ck.topic, ck.queue_id, offset)
                continue
            again = await self._stored_again(ck, view, first_topic, max_times, retry_queue_nums)
            if again is not None:
                message, to_dlq, cost = again
                # A checkpoint's messages (up to 32 of max_message_size, their keys 12 bytes each besides) need
                # not fit one entry: appended in as many as they need (one past entry_room alone), the checkpoint
                # removed after the last. A leader lost in between revives them all again: duplicates, never a loss.
                if appends[-1] and entry + cost > room:
                    appends.append([])
                    entry = 0
                appends[-1].append(message)
                entry += cost
                count += 1
                dead += to_dlq
        for messages in appends:
            if messages:
                # Each message was measured alone by _stored_again: the batch cannot fail on one of them.
                await node.append_messages(encode_batch(messages, node.store_host,
                                                        max_message_size=node.max_message_size))
        await self.write({ck.key: None})
        self.revived += count - dead
        self.dead += dead
        log.debug("pop checkpoint revived group=%s topic=%s queue_id=%d retried=%d dead=%d appends=%d",
                  ck.consumer_group, ck.topic, ck.queue_id, count - dead, dead, sum(1 for m in appends if m))
        return count

    async def _stored_again(self, ck: CheckPoint, view: MessageView, first_topic: str, max_times: int,
                            retry_queue_nums: int) -> tuple[MessageInput, bool, int] | None:
        """The copy of ``view`` revive stores, whether it goes to the dead-letter topic, and the entry bytes it takes
        appended alone; None for a message that cannot be stored again at all (logged)."""
        node = self.node
        limit = entry_limit(node)  # judged alone: _revive appends one past entry_room by itself
        stored_props = dict(view.properties)
        for name in (PROPERTY_DELAY, PROPERTY_REAL_TOPIC, PROPERTY_REAL_QUEUE_ID):
            stored_props.pop(name, None)
        props: dict[str, str] | None = dict(stored_props)
        props[PROPERTY_RETRY_TOPIC] = first_topic
        props[PROPERTY_ORIGIN_MESSAGE_ID] = (props.get(PROPERTY_ORIGIN_MESSAGE_ID) or props.get(PROPERTY_UNIQ_KEY)
                                             or create_msg_id(view.store_host, view.phy_offset))
        reconsume_times = view.reconsume_times + 1
        if view.reconsume_times < max_times:
            target = await node.ensure_topic(TopicConfig(pop_retry_topic(ck.consumer_group, first_topic),
                                                         retry_queue_nums, retry_queue_nums, PERM_READ_WRITE))
            again = stored_again(view, target.topic_name, random.randrange(max(1, target.write_queue_nums)), props,
                                 reconsume_times=reconsume_times, prepared_transaction_offset=0)
            cost, problem = self._entry_bytes(again, limit)
            if problem is None:
                return again, False, cost
            # Its properties were near the limit and the ones revive adds tipped them over (or its stored block
            # cannot be written again from its decoded properties, below): to the dead-letter topic as it was
            # stored, rather than kept invisible (and its checkpoint's other messages with it) for ever.
            log.warning("popped message cannot be stored again with the retry properties; to the dead-letter topic "
                        "as stored group=%s topic=%s queue_id=%d offset=%d error=%s", ck.consumer_group, ck.topic,
                        ck.queue_id, view.queue_offset, problem)
            props = None
        dlq = await node.ensure_topic(TopicConfig(dlq_topic(ck.consumer_group), DLQ_QUEUE_NUMS, DLQ_QUEUE_NUMS,
                                                  PERM_WRITE))
        if props is not None:
            again = stored_again(view, dlq.topic_name, 0, props, reconsume_times=reconsume_times,
                                 prepared_transaction_offset=0)
            cost, problem = self._entry_bytes(again, limit)
        if props is None or problem is not None:
            # As stored: its properties block copied, not decoded and written again, which fails for a block a
            # broker took from a batch before it refused those encode_properties does not write (an empty name, a
            # value with \x01): dropped from its checkpoint, the message was lost to the group.
            raw = node.store.look_record_by_offset(view.phy_offset)
            as_stored = record_properties(raw) if raw is not None else stored_props
            again = stored_again(view, dlq.topic_name, 0, as_stored, reconsume_times=reconsume_times,
                                 prepared_transaction_offset=0)
            cost, problem = self._entry_bytes(again, limit)
        if problem is not None:
            # As stored but for its topic (%DLQ%group may be longer) or after a limit lowered since: it stays
            # readable where it was, not redelivered.
            log.error("popped message cannot be stored again, not even in the dead-letter topic; dropped from its "
                      "checkpoint group=%s topic=%s queue_id=%d offset=%d error=%s", ck.consumer_group, ck.topic,
                      ck.queue_id, view.queue_offset, problem)
            return None
        return again, True, cost

    def _entry_bytes(self, message: MessageInput, limit: int) -> tuple[int, str | None]:
        """The entry bytes ``message`` takes appended alone, and why it cannot be stored (None if it can): a
        message past the format's limits, or one whose entry alone is past ``limit`` (``entry_limit``: the send
        path's limit, so only for a copy bigger than what was stored, or after the limit was lowered)."""
        try:
            cost = alone_entry_bytes(self.node, message)
        except MessageFormatError as e:
            return 0, str(e)
        if cost > limit:
            return cost, f"it makes a DLedger entry of {cost} bytes alone, more than max_entry_bytes {limit}"
        return cost, None

    def _message(self, topic: str, queue_id: int, offset: int) -> MessageView | None:
        """The popped message at ``offset``; None once retention removed it. Raises ``RevivePendingError`` for one
        this node cannot read yet (its checkpoint is kept, and tried again after its back-off): read as gone, it
        was never delivered again, as nothing else holds its offset."""
        result = self.node.store.get_messages(topic, queue_id, offset, 1, 1 << 30)
        if not result.messages or result.queue_offsets[0] != offset:
            if result.status in _REMOVED or (result.messages and result.queue_offsets[0] > offset):
                return None  # below the queue's min offset, or its unit's commit-log segment is gone
            raise RevivePendingError(f"popped message not readable here yet topic={topic} queue_id={queue_id} "
                                     f"offset={offset} status={result.status.value} max_offset={result.max_offset}")
        return decode_record(result.messages[0], check_crc=False)
