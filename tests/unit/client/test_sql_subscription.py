"""MessageSelector and SQL92 subscriptions on the client: parsed when made, sent with their type, not re-filtered."""

from __future__ import annotations

import pytest

from client.filter import SQL92, TAG, MessageSelector, parse_subscription


def test_a_sql92_selector_is_parsed_when_the_subscription_is_made():
    sub = parse_subscription("T", MessageSelector.by_sql("a > 5 AND color = 'red'"), sub_version=7)
    assert (sub.expression_type, sub.expression, sub.sub_version) == (SQL92, "a > 5 AND color = 'red'", 7)
    assert sub.to_wire()["expression_type"] == SQL92
    # The broker's answer is exact: no client-side check, whatever the tag (RocketMQ's client does none either).
    assert sub.matches_all and sub.matches("AnyTag") and sub.matches(None)


def test_a_bad_sql92_expression_fails_at_subscribe_naming_the_position():
    with pytest.raises(ValueError, match=r"subscription of topic 'T': SQL92 expression: 'x' cannot be compared "
                                         r"with '>'.* at character 5"):
        parse_subscription("T", MessageSelector.by_sql("a > 'x'"))
    with pytest.raises(ValueError, match="it is empty"):
        parse_subscription("T", MessageSelector.by_sql("  "))


def test_tag_selectors_and_strings_are_the_same_subscription():
    assert parse_subscription("T", MessageSelector.by_tag("B || A")) == parse_subscription("T", "A || B")
    assert parse_subscription("T", MessageSelector.by_tag(None)).matches_all
    assert parse_subscription("T", "TagA").expression_type == TAG
    assert parse_subscription("T", "TagA").to_wire()["expression_type"] == TAG


def test_a_selector_of_an_unknown_type_or_not_text_is_refused():
    with pytest.raises(ValueError, match="expression_type must be 'TAG' or 'SQL92', got 'CLASS'"):
        MessageSelector("CLASS", "x")
    with pytest.raises(TypeError, match="a SQL92 expression must be a string"):
        MessageSelector.by_sql(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a string, got 5"):
        parse_subscription("T", 5)  # type: ignore[arg-type]
