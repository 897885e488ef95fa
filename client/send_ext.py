"""The ext of the producer's sends, encoded straight to CBOR.

Every SEND_MESSAGE and SEND_BATCH_MESSAGE carries the same nine ext fields in the same order (``ext_fields`` below,
docs/protocol.md), most with the same value every time: ``cbor2.dumps`` of that map took 1.1 µs of every send,
and the codec then checked its keys again. Here the fixed parts are encoded once (per producer, and per topic)
and the values that change are spliced in, to the very bytes ``cbor2.dumps`` writes for the map (a test
compares them over random messages); the frame carries them as an ``EncodedExt``. The queue id is spliced in
per attempt: a retry may pick another queue. An attempt made on a stand-in route (a topic no name server knows
yet, which the send creates) adds a tenth field, ``default_topic_queue_nums``, last (``SendExt.for_stand_in``):
the broker creates the topic with at most that many queues, as RocketMQ's ``defaultTopicQueueNums``; the usual
send's bytes stay the nine fields. A topic that cannot be encoded (a lone surrogate; a message's
properties cannot hold one, ``Message.validate`` refuses it) is left to the codec in a plain map, which
refuses it where and as it refuses any other ext.
"""

from __future__ import annotations

import struct
from typing import Any

import cbor2

from client.message import PROPERTY_UNIQ_KEY, Message, new_uniq_key
from remoting.codec import EncodedExt

__all__ = ["SendExt", "SendExtEncoder", "ext_fields"]


def ext_fields(producer_group: str, topic: str, queue_id: int, born_timestamp: int, flag: int,
               properties: dict[str, str], batch: bool) -> dict[str, Any]:
    """The ext of a send as a map: what the bytes of ``SendExtEncoder`` encode."""
    return {"producer_group": producer_group, "topic": topic, "queue_id": queue_id, "sys_flag": 0,
            "born_timestamp": born_timestamp, "flag": flag, "properties": properties, "reconsume_times": 0,
            "batch": batch}


_SMALL_UINTS = [bytes((n,)) for n in range(24)]
_UINT64 = struct.Struct(">BQ")
_TOPIC_CACHE_MAX = 1024
_ENCODE_ERRORS = (cbor2.CBOREncodeError, TypeError, ValueError)


def _int(value: int) -> bytes:
    return _SMALL_UINTS[value] if 0 <= value < 24 else cbor2.dumps(value)


_MAP9 = b"\xa9"
_MAP10 = b"\xaa"
_KEY_DEFAULT_QUEUE_NUMS = cbor2.dumps("default_topic_queue_nums")
_KEY_QUEUE_ID = cbor2.dumps("queue_id")
_SYS_FLAG_TO_BORN = cbor2.dumps("sys_flag") + _int(0) + cbor2.dumps("born_timestamp")
_KEY_FLAG = cbor2.dumps("flag")
_KEY_PROPERTIES = cbor2.dumps("properties")
_SINGLE_TAIL = cbor2.dumps("reconsume_times") + _int(0) + cbor2.dumps("batch") + cbor2.dumps(False)
_BATCH_TAIL = cbor2.dumps("reconsume_times") + _int(0) + cbor2.dumps("batch") + cbor2.dumps(True)
_NO_PROPERTIES = cbor2.dumps({})
_UNIQ_ONLY = b"\xa1" + cbor2.dumps(PROPERTY_UNIQ_KEY)
# A text string's CBOR head by its length in bytes, below 256.
_TEXT_HEADS = [bytes((0x60 + n,)) for n in range(24)] + [bytes((0x78, n)) for n in range(24, 256)]


class SendExt:
    """The ext of one send: ``for_queue(queue_id)`` is the ext of an attempt on that queue."""

    __slots__ = ("_head", "_rest", "_fields")

    def __init__(self, head: bytes | None, rest: bytes | None, fields: dict[str, Any] | None) -> None:
        self._head = head
        self._rest = rest
        self._fields = fields

    def for_queue(self, queue_id: int) -> EncodedExt | dict[str, Any]:
        head = self._head
        if head is None:
            return {**self._fields, "queue_id": queue_id}  # type: ignore[dict-item]
        return EncodedExt(b"".join((head, _int(queue_id), self._rest)))  # type: ignore[arg-type]

    def for_stand_in(self, queue_id: int, default_topic_queue_nums: int) -> EncodedExt | dict[str, Any]:
        """``for_queue`` plus ``default_topic_queue_nums``, for an attempt made on a stand-in route: the queues per
        group the producer wants the topic it creates to have (the broker takes at most its own default)."""
        head = self._head
        if head is None:
            return {**self._fields, "queue_id": queue_id,  # type: ignore[dict-item]
                    "default_topic_queue_nums": default_topic_queue_nums}
        # The head opens the nine-field map: the same map with one more field, appended after the nine.
        return EncodedExt(b"".join((_MAP10, head[1:], _int(queue_id), self._rest,  # type: ignore[arg-type]
                                    _KEY_DEFAULT_QUEUE_NUMS, _int(default_topic_queue_nums))))


class SendExtEncoder:
    """Builds the ``SendExt`` of each send of one producer."""

    def __init__(self, producer_group: str) -> None:
        self.producer_group = producer_group
        self._group = cbor2.dumps("producer_group") + cbor2.dumps(producer_group) + cbor2.dumps("topic")
        self._heads: dict[str, bytes] = {}

    def single(self, message: Message, born_timestamp: int) -> tuple[SendExt, str]:
        """The ext of a SEND_MESSAGE of ``message``, and its UNIQ_KEY: a fresh one unless it has one."""
        if not (message.properties or message.tags or message.keys or message.delay_level):
            # The usual message: its properties are the id made here, 24 ASCII characters.
            uniq = new_uniq_key()
            data = uniq.encode()
            properties = None
            properties_cbor = b"".join((_UNIQ_ONLY, _TEXT_HEADS[len(data)], data))
        else:
            properties = message.wire_properties()
            uniq = properties.setdefault(PROPERTY_UNIQ_KEY, new_uniq_key())
            properties_cbor = cbor2.dumps(properties)  # Message.validate passes only text that encodes
        head = self._head(message.topic)
        if head is None:
            return SendExt(None, None, ext_fields(self.producer_group, message.topic, 0, born_timestamp,
                                                  message.flag, properties or {PROPERTY_UNIQ_KEY: uniq}, False)), uniq
        return SendExt(head, self._rest(born_timestamp, message.flag, properties_cbor, _SINGLE_TAIL), None), uniq

    def batch(self, topic: str, born_timestamp: int) -> SendExt:
        """The ext of a SEND_BATCH_MESSAGE (its messages' properties travel in the body)."""
        head = self._head(topic)
        if head is None:
            return SendExt(None, None, ext_fields(self.producer_group, topic, 0, born_timestamp, 0, {}, True))
        return SendExt(head, self._rest(born_timestamp, 0, _NO_PROPERTIES, _BATCH_TAIL), None)

    def _head(self, topic: str) -> bytes | None:
        """Everything up to the queue id, which only depends on the topic; None if the topic cannot be encoded."""
        head = self._heads.get(topic)
        if head is None:
            try:
                topic_cbor = cbor2.dumps(topic)
            except _ENCODE_ERRORS:
                return None
            if len(self._heads) >= _TOPIC_CACHE_MAX:
                self._heads.clear()  # a producer of ever new topics must not grow it without bound
            head = self._heads[topic] = b"".join((_MAP9, self._group, topic_cbor, _KEY_QUEUE_ID))
        return head

    @staticmethod
    def _rest(born_timestamp: int, flag: int, properties_cbor: bytes, tail: bytes) -> bytes:
        # Millisecond times are past 2**32 (1970 + 49 days): a uint64, whose shortest CBOR form is 0x1b + 8 bytes.
        born = (_UINT64.pack(0x1B, born_timestamp) if 0x1_0000_0000 <= born_timestamp < 0x1_0000_0000_0000_0000
                else cbor2.dumps(born_timestamp))
        return b"".join((_SYS_FLAG_TO_BORN, born, _KEY_FLAG, _int(flag), _KEY_PROPERTIES, properties_cbor, tail))
