"""Tag filters as RocketMQ parses them: ``"*"`` (everything) or ``"TagA || TagB"``.

The broker filters by ``tags_code`` (the 8-byte hash in each ConsumeQueue unit), which is Java's
``String.hashCode()`` of the tag, sign-extended (``remoting.message.tags_code``); different tags can share a
code, so the client checks the tag string itself after a pull (as RocketMQ's ``PullAPIWrapper.processPullResult`` does).
"""

from __future__ import annotations

import dataclasses

from remoting.message import (MAX_TAG_EXPRESSION_LENGTH, TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC, MessageFormatError,
                              check_topic, tags_code)

__all__ = ["SUB_ALL", "Subscription", "parse_subscription", "tags_code"]

SUB_ALL = "*"


@dataclasses.dataclass(frozen=True, slots=True)
class Subscription:
    """A parsed subscription: ``tags`` empty means every message."""

    topic: str
    expression: str
    tags: frozenset[str]
    codes: frozenset[int]
    sub_version: int = 0

    @property
    def matches_all(self) -> bool:
        return not self.tags

    def matches(self, tag: str | None) -> bool:
        return not self.tags or (tag is not None and tag in self.tags)

    def to_wire(self) -> dict:
        return {"topic": self.topic, "expression": self.expression, "expression_type": "TAG",
                "tags": sorted(self.tags), "codes": sorted(self.codes), "sub_version": self.sub_version}


def parse_subscription(topic: str, expression: str | None, *, sub_version: int = 0) -> Subscription:
    """Parse ``expression``; None, empty and ``*`` mean all. Raises ``ValueError`` naming a bad tag."""
    try:
        check_topic(topic)
    except MessageFormatError as e:
        raise ValueError(f"subscription {e}") from None
    if topic in (TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC):
        raise ValueError(f"topic {topic!r} holds the brokers' transaction records, not messages to consume: a "
                         f"transactional message reaches its own topic once committed")
    if expression is not None and not isinstance(expression, str):
        raise TypeError(f"tag expression of topic {topic!r} must be a string, got {expression!r}")
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
