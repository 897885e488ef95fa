"""``message_delay_level``: RocketMQ's delay levels ("1s 5s 10s 30s 1m ... 2h"), parsed once at start.

Kept apart from ``broker/schedule.py`` so the config can check the key without importing the service.
"""

from __future__ import annotations

import re

__all__ = ["DEFAULT_MESSAGE_DELAY_LEVEL", "MAX_DELAY_LEVELS", "parse_delay_levels", "delay_levels_problem",
           "format_delay", "timer_level"]

DEFAULT_MESSAGE_DELAY_LEVEL = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
MAX_DELAY_LEVELS = 64
# RocketMQ's units (s, m, h, d), and ms, which RocketMQ lacks, so tests and demos can use short delays.
_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_UNITS_LARGEST_FIRST = sorted(_UNITS_MS.items(), key=lambda item: -item[1])
_LEVEL_RE = re.compile(r"([0-9]{1,9})(ms|s|m|h|d)")


def parse_delay_levels(text: str) -> tuple[int, ...]:
    """The delay of each level in ms from RocketMQ's ``messageDelayLevel`` format ("1s 5s 10s 30s 1m ... 2h");
    raises ValueError naming the bad piece."""
    if not isinstance(text, str):
        raise ValueError(f"must be a string of delays such as '1s 5s 1m', got {text!r}")
    pieces = text.split()
    if not pieces:
        raise ValueError("must name at least one delay, such as '1s 5s 1m'")
    if len(pieces) > MAX_DELAY_LEVELS:
        raise ValueError(f"names {len(pieces)} delay levels; at most {MAX_DELAY_LEVELS} are allowed")
    out = []
    for i, piece in enumerate(pieces, 1):
        m = _LEVEL_RE.fullmatch(piece)
        if m is None or int(m.group(1)) == 0:
            raise ValueError(f"level {i} is {piece!r}; each level is a positive number with a unit ms, s, m, h or d")
        out.append(int(m.group(1)) * _UNITS_MS[m.group(2)])
    return tuple(out)


def format_delay(ms: int) -> str:
    """One level's delay as ``message_delay_level`` writes it, in its largest whole unit: 2h, 30m, 5s, 250ms."""
    for unit, size in _UNITS_LARGEST_FIRST:
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def delay_levels_problem(text: str) -> str | None:
    """The config check of ``message_delay_level`` (``remoting.config.bounded``)."""
    try:
        parse_delay_levels(text)
    except ValueError as e:
        return str(e)
    return None


def timer_level(levels_ms: tuple[int, ...] | list[int], remaining_ms: int) -> int:
    """The level (1-based) a timer message that is due in ``remaining_ms`` (> 0) waits in next: the one with the
    longest delay not past that time, so it never arrives early and the next hop is shorter; or, when every level
    is longer (less than the shortest level is left), the shortest, the least it can arrive late. Ties go to the
    first such level; the levels need not be sorted."""
    best = 0
    shortest = 0
    for i, delay_ms in enumerate(levels_ms):
        if delay_ms <= remaining_ms and (not best or delay_ms > levels_ms[best - 1]):
            best = i + 1
        if not shortest or delay_ms < levels_ms[shortest - 1]:
            shortest = i + 1
    if not shortest:
        raise ValueError("timer_level needs at least one delay level")
    return best or shortest
