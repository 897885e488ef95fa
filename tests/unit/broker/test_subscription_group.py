"""The subscription group table (``broker/subscription_group.py``): RocketMQ's defaults, field checks naming the
field, merging a change into a config, and the mirror's restore from the replicated table (what narrows a group,
entries from a later version or damaged)."""

from __future__ import annotations

import pytest

from broker.subscription_group import (FIELDS, SubscriptionGroupConfig, SubscriptionGroupError,
                                       SubscriptionGroupTable, is_builtin_group)


def test_defaults_are_rocketmqs():
    config = SubscriptionGroupConfig.from_wire({"group_name": "G"})
    assert config.to_wire() == {
        "group_name": "G", "consume_enable": True, "consume_from_min_enable": True, "consume_broadcast_enable": True,
        "retry_queue_nums": 1, "retry_max_times": 16, "broker_id": 0, "which_broker_when_consume_slowly": 1,
        "notify_consumer_ids_changed_enable": True}
    assert tuple(config.to_wire()) == FIELDS
    assert SubscriptionGroupConfig.from_wire(config.to_wire()) == config


@pytest.mark.parametrize("data, field, text", [
    ({}, "group_name", "group_name must be a non-empty string, got None"),
    ({"group_name": ""}, "group_name", "must not be empty"),
    ({"group_name": "a b"}, "group_name", "illegal characters"),
    ({"group_name": "x" * 256}, "group_name", "255"),
    ({"group_name": "G", "consume_enable": 1}, "consume_enable", "consume_enable must be true or false, got 1"),
    ({"group_name": "G", "retry_max_times": -1}, "retry_max_times", "within 0..2147483647, got -1"),
    ({"group_name": "G", "retry_max_times": 2 ** 31}, "retry_max_times", "within 0..2147483647"),
    ({"group_name": "G", "retry_queue_nums": 0}, "retry_queue_nums", "within 1..1024, got 0"),
    ({"group_name": "G", "retry_queue_nums": 1025}, "retry_queue_nums", "within 1..1024"),
    ({"group_name": "G", "retry_queue_nums": False}, "retry_queue_nums", "must be an integer"),
    ({"group_name": "G", "broker_id": "0"}, "broker_id", "must be an integer"),
    ({"group_name": "G", "consume_enabled": False}, "consume_enabled", "is not a subscription group field"),
])
def test_a_bad_field_is_named(data, field, text):
    with pytest.raises(SubscriptionGroupError) as caught:
        SubscriptionGroupConfig.from_wire(data)
    assert caught.value.field == field and text in str(caught.value)


def test_a_change_sets_the_fields_given_and_keeps_the_others():
    config = SubscriptionGroupConfig("G", retry_max_times=3)
    changed = config.with_changes({"group_name": "G", "consume_enable": False, "retry_queue_nums": None})
    assert changed == SubscriptionGroupConfig("G", consume_enable=False, retry_max_times=3)
    with pytest.raises(SubscriptionGroupError) as caught:
        config.with_changes({"group_name": "H"})
    assert caught.value.field == "group_name"
    assert config.with_changes({}) is not None and config.with_changes({}) == config


def _wire(group: str, **fields) -> dict:
    return SubscriptionGroupConfig(group, **fields).to_wire()


def test_restore_says_when_a_group_may_consume_less():
    table = SubscriptionGroupTable()
    assert table.restore({"": 1, "a": _wire("a"), "b": _wire("b")}) is False
    assert len(table) == 2 and table.data_version == 1 and "a" in table
    # Enabling, or changing what the broker does not refuse by, narrows nothing.
    assert table.restore({"": 2, "a": _wire("a", retry_max_times=1), "b": _wire("b")}) is False
    assert table.restore({"": 3, "a": _wire("a", consume_enable=False), "b": _wire("b")}) is True
    assert table.restore({"": 4, "a": _wire("a"), "b": _wire("b")}) is False
    assert table.restore({"": 5, "a": _wire("a"), "b": _wire("b", consume_broadcast_enable=False)}) is True
    assert table.restore({"": 6, "a": _wire("a")}) is True  # b removed
    assert [c.group_name for c in table.all()] == ["a"] and table.get("b") is None
    assert table.to_wire() == {"a": _wire("a")}


def test_restore_takes_a_later_versions_fields_and_skips_a_damaged_entry(caplog):
    table = SubscriptionGroupTable()
    later = {**_wire("a", consume_enable=False), "group_retry_policy": {"type": "EXPONENTIAL"}}
    table.restore({"": 7, "a": later, "b": {"group_name": "b", "retry_queue_nums": "x"}})
    assert table.get("a") == SubscriptionGroupConfig("a", consume_enable=False)
    assert table.get("b") is None and "replicated subscription group skipped group='b'" in caplog.text


def test_rocketmqs_own_groups_are_builtin():
    assert is_builtin_group("TOOLS_CONSUMER") and is_builtin_group("CID_RMQ_SYS_TRANS")
    assert not is_builtin_group("tools_consumer") and not is_builtin_group("G")
