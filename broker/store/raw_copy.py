"""Validation of raw commit-log bytes copied from a peer (``MessageStore.append_commit_log_raw``).

A catching-up replica receives records exactly as the leader wrote them. Nothing is written until every record
passed the same checks recovery applies (size, magic, its own phy offset, body CRC, a blank filling its segment
exactly) plus two that keep the derived state honest: a legal topic, and queue offsets that continue each
queue without a gap.
"""

from __future__ import annotations

import socket

from crc32c import crc32c

from remoting.message import (BLANK_MAGIC, BODY_LEN, MESSAGE_MAGIC, PROPS_LEN, RECORD_HEAD, MessageFormatError,
                              check_topic)

from .commit_log import MIN_RECORD_SIZE, SIZE_MAGIC, CommitLog
from .config import END_FILE_MIN_BLANK_LENGTH

__all__ = ["validate_raw"]

RawChecked = tuple[list[int], list[int], list[int], list[int], dict[tuple[bytes, int], int], tuple[str, int]]


def validate_raw(commit_log: CommitLog, data: memoryview, start: int,
                 queue_offsets: dict[tuple[bytes, int], int], *, open_queues: bool = False) -> RawChecked | str:
    """Per-record columns, the queue offsets after the copy and the store host of the first record, or a
    sentence saying what is wrong. A queue missing from ``queue_offsets`` must start at queue offset 0, or,
    with ``open_queues``, anywhere (the copy begins past the start of the log)."""
    seg_size = commit_log.segment_size
    n = len(data)
    i = 0
    touched: dict[tuple[bytes, int], int] = {}
    phys: list[int] = []
    qoffs: list[int] = []
    sizes: list[int] = []
    qids: list[int] = []
    store_host = ("0.0.0.0", 0)
    while i < n:
        phy = start + i
        off = phy % seg_size
        if i + 8 > n:
            return f"data ends inside a record header at phy_offset {phy}"
        size, magic = SIZE_MAGIC.unpack_from(data, i)
        if magic == BLANK_MAGIC:
            if size != seg_size - off or i + size > n:
                return f"blank at phy_offset {phy} has size {size}, the segment has {seg_size - off} bytes left"
            if data[i + 8:i + size] != bytes(size - 8):
                return f"blank at phy_offset {phy} is not zero-filled"
            i += size
            continue
        if magic != MESSAGE_MAGIC:
            return f"record at phy_offset {phy} has magic {magic:#x}"
        if size < MIN_RECORD_SIZE or size > commit_log.max_record_size or i + size > n \
                or off + size + END_FILE_MIN_BLANK_LENGTH > seg_size:
            return f"record at phy_offset {phy} has a bad size {size}"
        head = RECORD_HEAD.unpack_from(data, i)
        if head[6] != phy:
            return f"record at phy_offset {phy} says it is at {head[6]}"
        b = i + RECORD_HEAD.size
        body_len = BODY_LEN.unpack_from(data, b)[0]
        t = b + 4 + body_len
        if body_len < 0 or t + 3 > i + size:
            return f"record at phy_offset {phy} has a bad body length {body_len}"
        if crc32c(data[b + 4:t]) != head[2]:
            return f"record at phy_offset {phy} fails its body CRC"
        topic_len = data[t]
        p = t + 1 + topic_len
        if p + 2 > i + size or p + 2 + PROPS_LEN.unpack_from(data, p)[0] != i + size:
            return f"record at phy_offset {phy} has fields that disagree with its size {size}"
        topic = bytes(data[t + 1:p])
        try:
            check_topic(topic.decode("ascii"))
        except (UnicodeDecodeError, MessageFormatError):
            return f"record at phy_offset {phy} has an illegal topic {topic!r}"
        key = (topic, head[3])
        expected = touched.get(key)
        if expected is None:
            expected = queue_offsets.get(key)
            if expected is None:
                expected = head[5] if open_queues and head[5] >= 0 else 0
        if head[5] != expected:
            return f"record at phy_offset {phy} has queue_offset {head[5]}, queue {key[0].decode()}:{key[1]} " \
                   f"expects {expected}"
        touched[key] = expected + 1
        if not phys:
            store_host = (socket.inet_ntop(socket.AF_INET, head[12]), head[13])
        phys.append(phy)
        qoffs.append(head[5])
        sizes.append(size)
        qids.append(head[3])
        i += size
    return phys, qoffs, sizes, qids, touched, store_host
