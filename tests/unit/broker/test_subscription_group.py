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
    assert table.restore({"": 1, "a": _wire("a"), "b": _wire("b")}) == set()
    assert len(table) == 2 and table.data_version == 1 and "a" in table
    # Enabling, or changing what the broker does not refuse by, narrows nothing.
    assert table.restore({"": 2, "a": _wire("a", retry_max_times=1), "b": _wire("b")}) == set()
    assert table.restore({"": 3, "a": _wire("a", consume_enable=False), "b": _wire("b")}) == {"a"}
    assert table.restore({"": 4, "a": _wire("a"), "b": _wire("b")}) == set()
    assert table.restore({"": 5, "a": _wire("a"), "b": _wire("b", consume_broadcast_enable=False)}) == {"b"}
    assert table.restore({"": 6, "a": _wire("a")}) == {"b"}  # removed
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


def test_restore_reads_only_the_entries_a_change_replaced(monkeypatch, caplog):
    """Found by review: every applied change re-read and re-validated the whole table on every node (0.4 s of the
    event loop at 50,000 groups), so pulls under ever-new group names stalled the nodes for minutes. The Raft side
    replaces only the entries a change sets: the others, still the same objects, are kept as read."""
    table = SubscriptionGroupTable()
    replicated = {"": 1, **{f"g{i}": _wire(f"g{i}") for i in range(1000)}, "bad": {"group_name": "bad", "retry_queue_nums": "x"}}
    table.restore(dict(replicated))
    assert len(table) == 1000 and caplog.text.count("skipped group='bad'") == 1
    reads = []
    from_wire = SubscriptionGroupConfig.from_wire
    monkeypatch.setattr(SubscriptionGroupConfig, "from_wire",
                        staticmethod(lambda data, **kw: reads.append(data["group_name"]) or from_wire(data, **kw)))
    replicated.update({"": 2, "new": _wire("new"), "g5": _wire("g5", consume_enable=False)})
    assert table.restore(dict(replicated)) == {"g5"}  # stopped
    assert sorted(reads) == ["g5", "new"] and len(table) == 1001 and not table.get("g5").consume_enable
    assert caplog.text.count("skipped group='bad'") == 1  # not logged again at each change
    reads.clear()
    del replicated["g7"]
    replicated[""] = 3
    assert table.restore(dict(replicated)) == {"g7"} and reads == [] and table.get("g7") is None  # removed


async def test_at_most_a_few_auto_creations_run_at_once_and_the_rest_start_on_a_later_pull():
    """Found by review: every pull of a new group name started a task and queued a Raft write, without bound. Now at
    most MAX_AUTO_CREATIONS_AT_ONCE run; a pull of another unknown group is served with the defaults meanwhile, and
    its group is created by a pull after those finished."""
    import types

    import trio
    import trio.testing

    from broker.subscription_group import MAX_AUTO_CREATIONS_AT_ONCE, SubscriptionGroupManager

    metadata: dict = {}
    gate = trio.Event()
    writes = []

    async def replicate(table, items):
        writes.append(items)
        await gate.wait()
        metadata.update({k: v for k, v in items.items() if v is not None})

    async def wait_ready_leader():
        pass

    async with trio.open_nursery() as nursery:
        node = types.SimpleNamespace(
            config=types.SimpleNamespace(auto_create_subscription_group=True, max_subscription_group_count=50_000,
                                         broker_name="broker-a"),
            group=types.SimpleNamespace(metadata_generation=lambda table: len(writes) if gate.is_set() else 0,
                                        metadata=lambda table: dict(metadata)),
            hold=types.SimpleNamespace(release=lambda pick: None), clients=types.SimpleNamespace(consumer_groups={}),
            is_leader=lambda: True, _nursery=nursery, wait_ready_leader=wait_ready_leader, _replicate=replicate)
        manager = SubscriptionGroupManager(node)
        for i in range(100):
            manager.check_pull(f"g{i}")  # served with the defaults
        await trio.testing.wait_all_tasks_blocked()
        assert len(manager._creating) == MAX_AUTO_CREATIONS_AT_ONCE and len(writes) == 1  # one write at a time
        gate.set()
        await trio.testing.wait_all_tasks_blocked()
        assert not manager._creating and len(writes) == MAX_AUTO_CREATIONS_AT_ONCE
        manager.check_pull("g99")
        await trio.testing.wait_all_tasks_blocked()
        assert "g99" in metadata and len(writes) == MAX_AUTO_CREATIONS_AT_ONCE + 1


async def test_a_group_a_later_version_replicated_is_served_with_the_defaults_but_never_overwritten():
    """Found by review: an entry this version cannot read looked unknown, and a pull's auto-creation replaced the
    newer version's config with the defaults (a rolling upgrade's edge)."""
    import types

    import trio
    import trio.testing

    from broker.subscription_group import SubscriptionGroupManager

    writes = []

    async def replicate(table, items):
        writes.append(items)

    async def wait_ready_leader():
        pass

    later = {"": 3, "g": {"group_name": "g", "retry_queue_nums": 5000}}  # past this version's bound
    async with trio.open_nursery() as nursery:
        node = types.SimpleNamespace(
            config=types.SimpleNamespace(auto_create_subscription_group=True, max_subscription_group_count=50_000,
                                         broker_name="broker-a"),
            group=types.SimpleNamespace(metadata_generation=lambda table: 1, metadata=lambda table: dict(later)),
            hold=types.SimpleNamespace(release=lambda pick: None), clients=types.SimpleNamespace(consumer_groups={}),
            is_leader=lambda: True, _nursery=nursery, wait_ready_leader=wait_ready_leader, _replicate=replicate)
        manager = SubscriptionGroupManager(node)
        assert manager.table.unreadable == {"g"}
        manager.check_pull("g")  # served with the defaults
        assert (await manager.ensure("g")).consume_enable
        await trio.testing.wait_all_tasks_blocked()
        assert writes == []
