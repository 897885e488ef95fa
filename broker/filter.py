"""Tag expressions on the broker side: ``"*"`` or ``"TagA || TagB"`` → the set of tags codes to match.

The ConsumeQueue keeps a tags code per message (Java's ``String.hashCode()`` of the tag, as RocketMQ stores it),
so the broker filters on codes only; two tags can share a code, and the client re-checks the tag string. The
hash is ``remoting.message.tags_code``, the one the store writes into the ConsumeQueue.
"""

from __future__ import annotations

import dataclasses
import functools

from remoting.message import MAX_TAG_EXPRESSION_LENGTH, tags_code

SUB_ALL = "*"
MAX_EXPRESSION_LENGTH = MAX_TAG_EXPRESSION_LENGTH


class SubscriptionParseError(ValueError):
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class TagFilter:
    expression: str
    tags: frozenset[str]
    codes: frozenset[int]

    @property
    def matches_all(self) -> bool:
        return not self.tags

    def matches_code(self, code: int) -> bool:
        return not self.codes or code in self.codes


def parse_tag_expression(expression: object) -> TagFilter:
    """None, empty and ``*`` match everything; otherwise tags separated by ``||``."""
    if isinstance(expression, str) and len(expression) <= MAX_EXPRESSION_LENGTH:
        return _parse_cached(expression)  # every pull of a consumer carries the same expression
    return _parse(expression)


@functools.lru_cache(maxsize=1024)
def _parse_cached(expression: str) -> TagFilter:
    return _parse(expression)


def _parse(expression: object) -> TagFilter:
    if expression is None:
        return TagFilter(SUB_ALL, frozenset(), frozenset())
    if not isinstance(expression, str):
        raise SubscriptionParseError(f"subscription must be a tag expression string, got {expression!r}")
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise SubscriptionParseError(
            f"subscription is {len(expression)} characters long; at most {MAX_EXPRESSION_LENGTH} are allowed")
    text = expression.strip()
    if text in ("", SUB_ALL):
        return TagFilter(SUB_ALL, frozenset(), frozenset())
    tags = []
    for part in text.split("||"):
        tag = part.strip()
        if not tag:
            raise SubscriptionParseError(f"subscription {expression!r} has an empty tag between '||'")
        if tag == SUB_ALL:
            return TagFilter(SUB_ALL, frozenset(), frozenset())
        tags.append(tag)
    return TagFilter(text, frozenset(tags), frozenset(tags_code(t) for t in tags))
