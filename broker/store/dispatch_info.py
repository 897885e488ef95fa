"""What dispatch derives from one record, computed in one place so both ways of dispatching agree byte for byte.

A record's ConsumeQueue unit is ``(phy_offset, size, tags_code)`` and its IndexFile entries are the hashes of
``topic#UNIQ_KEY`` and of ``topic#key`` for each of its KEYS. The dispatcher derives them by parsing the record
(recovery, raw copies from a peer); an append derives them while it builds the records and hands them over as
a ``DispatchHint``, so the dispatcher writes a whole batch's units of a queue with one copy instead of parsing
every record again. A Raft leader builds once and ships the hint inside the entry: followers parse nothing.
"""

from __future__ import annotations

from typing import NamedTuple

from crc32c import crc32c

from remoting.message import CACHED_TAG_MAX_LENGTH, tags_code

__all__ = ["DispatchHint", "scan_properties", "tags_code_of", "index_hashes"]

_TAGS_CODES: dict[bytes, int] = {}


_UNIQ_ONLY = b"UNIQ_KEY\x01"
_UNIQ_AT = len(_UNIQ_ONLY)


def scan_properties(props: bytes) -> tuple[bytes | None, bytes | None, bytes | None]:
    """``(TAGS, KEYS, UNIQ_KEY)`` raw values of encoded properties (None when absent)."""
    if props.startswith(_UNIQ_ONLY) and props.find(b"\x02", _UNIQ_AT) == len(props) - 1:
        # Nothing but a UNIQ_KEY (a producer's usual message): the loop's answer, without splitting.
        return None, None, props[_UNIQ_AT:-1]
    tags = raw_keys = uniq = None
    for pair in props.split(b"\x02"):
        name, _, value = pair.partition(b"\x01")
        if name == b"TAGS":
            tags = value
        elif name == b"KEYS":
            raw_keys = value
        elif name == b"UNIQ_KEY":
            uniq = value
    return tags, raw_keys, uniq


def tags_code_of(tags: bytes) -> int:
    code = _TAGS_CODES.get(tags)
    if code is None:
        code = tags_code(tags.decode("utf-8", "replace"))
        if len(_TAGS_CODES) < 100_000 and len(tags) <= CACHED_TAG_MAX_LENGTH:
            _TAGS_CODES[tags] = code
    return code


def index_hashes(topic: bytes, uniq: bytes | None, raw_keys: bytes | None) -> list[int]:
    """Index hashes of a record, in the order they are put: UNIQ_KEY, then each non-empty key of KEYS."""
    prefix = topic + b"#"
    out = [crc32c(prefix + uniq) & 0x7FFFFFFF] if uniq else []
    if raw_keys:
        out += [crc32c(prefix + k) & 0x7FFFFFFF for k in raw_keys.split(b" ") if k]
    return out


class DispatchHint(NamedTuple):
    """Dispatch of the records in ``[start, end)``, known when they were built."""

    start: int
    end: int
    store_timestamp: int
    last_phy: int  # offset of the last record
    count: int  # records
    # ((topic, queue_id), first queue offset, units of consecutive queue offsets) per queue written to
    queues: list[tuple[tuple[bytes, int], int, bytes | memoryview]]
    index: list[tuple[int, int]]  # (hash, phy_offset) in put order
