"""Subscription filters as RocketMQ parses them: tags, ``"*"`` (everything) or ``"TagA || TagB"``, and SQL92.

The broker filters by ``tags_code`` (the 8-byte hash in each ConsumeQueue unit), which is Java's
``String.hashCode()`` of the tag, sign-extended (``remoting.message.tags_code``); different tags can share a
code, so the client checks the tag string itself after a pull (as RocketMQ's ``PullAPIWrapper.processPullResult`` does).

``MessageSelector.by_sql("a > 5 AND color = 'red'")`` (RocketMQ's ``MessageSelector.bySql``) selects by the
message properties instead: the broker evaluates it on each message (``remoting.sql_filter``), if it enables
``enable_property_filter``; the client parses it when it subscribes, so a bad expression fails there, and does not
evaluate it again on what the broker answers (as RocketMQ's client does not: the broker's answer is exact).
A plain string wherever an expression is taken is a tag expression, as before.
"""

from __future__ import annotations

import dataclasses

from remoting.message import (MAX_TAG_EXPRESSION_LENGTH, TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC, MessageFormatError,
                              check_topic, tags_code)
from remoting.sql_filter import SQL92, TAG, SqlFilterError, compile_sql

__all__ = ["SQL92", "SUB_ALL", "TAG", "MessageSelector", "Subscription", "parse_subscription", "tags_code"]

SUB_ALL = "*"


@dataclasses.dataclass(frozen=True, slots=True)
class MessageSelector:
    """An expression and its type, RocketMQ's ``MessageSelector``: ``MessageSelector.by_sql("a > 5")`` or
    ``MessageSelector.by_tag("TagA || TagB")``; taken wherever a consumer takes a tag expression string."""

    expression_type: str
    expression: str

    def __post_init__(self) -> None:
        if self.expression_type not in (TAG, SQL92):
            raise ValueError(f"expression_type must be {TAG!r} or {SQL92!r}, got {self.expression_type!r}")
        if not isinstance(self.expression, str):
            raise TypeError(f"a {self.expression_type} expression must be a string, got {self.expression!r}")

    @classmethod
    def by_sql(cls, sql: str) -> MessageSelector:
        """Messages whose properties make ``sql`` TRUE (the broker must enable ``enable_property_filter``)."""
        return cls(SQL92, sql)

    @classmethod
    def by_tag(cls, tag: str | None) -> MessageSelector:
        """Messages whose tag is one of ``"TagA || TagB"``; None, empty or ``*``: every message."""
        return cls(TAG, tag or SUB_ALL)


@dataclasses.dataclass(frozen=True, slots=True)
class Subscription:
    """A parsed subscription: ``tags`` empty means every message the broker answers (all of them for ``*``; for
    SQL92, ``expression_type``, those the broker selected)."""

    topic: str
    expression: str
    tags: frozenset[str]
    codes: frozenset[int]
    sub_version: int = 0
    expression_type: str = TAG

    @property
    def matches_all(self) -> bool:
        return not self.tags

    def matches(self, tag: str | None) -> bool:
        """The client's check of a pulled message's tag (tags codes can collide); none for SQL92."""
        return not self.tags or (tag is not None and tag in self.tags)

    def to_wire(self) -> dict:
        return {"topic": self.topic, "expression": self.expression, "expression_type": self.expression_type,
                "tags": sorted(self.tags), "codes": sorted(self.codes), "sub_version": self.sub_version}


def parse_subscription(topic: str, expression: str | MessageSelector | None, *,
                       sub_version: int = 0) -> Subscription:
    """Parse ``expression``: a tag expression (None, empty and ``*`` mean all) or a ``MessageSelector``. Raises
    ``ValueError`` naming a bad tag, or the problem and its position in a SQL92 expression."""
    try:
        check_topic(topic)
    except MessageFormatError as e:
        raise ValueError(f"subscription {e}") from None
    if topic in (TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC):
        raise ValueError(f"topic {topic!r} holds the brokers' transaction records, not messages to consume: a "
                         f"transactional message reaches its own topic once committed")
    if isinstance(expression, MessageSelector):
        if expression.expression_type == SQL92:
            try:
                sql = compile_sql(expression.expression)
            except SqlFilterError as e:
                raise ValueError(f"subscription of topic {topic!r}: {e}") from None
            return Subscription(topic, sql.expression, frozenset(), frozenset(), sub_version, SQL92)
        expression = expression.expression
    if expression is not None and not isinstance(expression, str):
        raise TypeError(f"tag expression of topic {topic!r} must be a string, got {expression!r} (or a "
                        f"MessageSelector)")
    expr = (expression or "").strip()
    if not expr or expr == SUB_ALL:
        return Subscription(topic, SUB_ALL, frozenset(), frozenset(), sub_version)
    tags = set()
    for part in expr.split("||"):
        tag = part.strip()
        if not tag:
            # RocketMQ skips empty pieces; "A ||" is most likely a typo, and silently widening or narrowing a
            # subscription is worse than an error.
            raise ValueError(f"tag expression {expression!r} has an empty tag")
        if tag == SUB_ALL:
            raise ValueError(f"tag expression {expression!r} mixes '*' with tags")
        if "|" in tag:
            raise ValueError(f"tag expression {expression!r} has a malformed separator near {tag!r}")
        tags.add(tag)
    normalized = " || ".join(sorted(tags))
    if len(normalized) > MAX_TAG_EXPRESSION_LENGTH:
        # The broker would refuse every pull and heartbeat carrying it.
        raise ValueError(f"tag expression of topic {topic!r} is {len(normalized)} characters long as sent "
                         f"({len(tags)} tags joined by ' || '); brokers take at most {MAX_TAG_EXPRESSION_LENGTH}")
    return Subscription(topic, normalized, frozenset(tags), frozenset(tags_code(t) for t in tags), sub_version)
