from __future__ import annotations

import pytest

from broker.topic_config import (PERM_READ_WRITE, TopicConfig, TopicConfigError, TopicConfigTable,
                                 auto_create_config, check_sendable_topic, is_reserved_topic, validate_topic_name)


@pytest.mark.parametrize("name", ["a", "TopicTest", "%RETRY%group-1", "a|b_c-d", "x" * 127])
def test_legal_topic_names(name):
    assert validate_topic_name(name) == name


@pytest.mark.parametrize("name,needle", [("", "non-empty"), ("a b", "illegal characters"),
                                         ("top/ic", "illegal characters"), ("x" * 128, "at most 127"),
                                         (None, "non-empty"), ("héllo", "illegal characters"),
                                         ("Orders\n", "illegal characters")])
def test_illegal_topic_names_say_why(name, needle):
    with pytest.raises(TopicConfigError, match=needle) as info:
        validate_topic_name(name)
    assert info.value.field == "topic"


def test_reserved_topics_cannot_be_sent_to():
    with pytest.raises(TopicConfigError, match="reserved"):
        check_sendable_topic("TBW102")
    with pytest.raises(TopicConfigError, match="reserved"):
        check_sendable_topic("rmq_sys_TOPIC_DELETE_LOG")
    check_sendable_topic("TopicTest")
    check_sendable_topic("RMQ_SYS_lookalike")  # RocketMQ's prefix is case-sensitive


def test_the_trace_topic_takes_traces_but_is_the_systems():
    # Traced clients send to RMQ_SYS_TRACE_TOPIC (RocketMQ's NOT_ALLOWED_SEND_TOPIC_SET leaves it out); the admin
    # API creates none of the system's names (RocketMQ's isSystemTopic).
    check_sendable_topic("RMQ_SYS_TRACE_TOPIC")
    assert is_reserved_topic("RMQ_SYS_TRACE_TOPIC") and is_reserved_topic("TBW102")
    assert is_reserved_topic("rmq_sys_TOPIC_DELETE_LOG") and not is_reserved_topic("TopicTest")


def test_auto_create_uses_rocketmq_defaults():
    config = auto_create_config("T")
    assert (config.read_queue_nums, config.write_queue_nums, config.perm) == (4, 4, PERM_READ_WRITE)
    assert config.readable and config.writable


def test_from_wire_validates_each_field():
    assert TopicConfig.from_wire({"topic_name": "T", "read_queue_nums": 8}).read_queue_nums == 8
    with pytest.raises(TopicConfigError, match="write_queue_nums must be within 1..1024, got 0"):
        TopicConfig.from_wire({"topic_name": "T", "write_queue_nums": 0})
    with pytest.raises(TopicConfigError, match="perm must be an integer"):
        TopicConfig.from_wire({"topic_name": "T", "perm": "rw"})
    with pytest.raises(TopicConfigError, match="topic_filter_type"):
        TopicConfig.from_wire({"topic_name": "T", "topic_filter_type": "SQL"})
    with pytest.raises(TopicConfigError, match="must be a map"):
        TopicConfig.from_wire([1])
    # Consumers read queues below read_queue_nums only: more write queues stored messages nobody would consume.
    with pytest.raises(TopicConfigError, match="write_queue_nums 8 must not exceed read_queue_nums 4"):
        TopicConfig.from_wire({"topic_name": "T", "read_queue_nums": 4, "write_queue_nums": 8})
    assert TopicConfig.from_wire({"topic_name": "T", "read_queue_nums": 8, "write_queue_nums": 4}).write_queue_nums == 4
    # A table an older version stored such a topic in still loads.
    assert TopicConfig.from_wire({"topic_name": "T", "read_queue_nums": 4, "write_queue_nums": 8},
                                 stored=True).write_queue_nums == 8


def test_table_versions_changes_and_ignores_replays():
    table = TopicConfigTable()
    seen = []
    table.add_change_listener(lambda: seen.append(table.data_version))
    config = auto_create_config("T")
    assert table.apply_update(config) and not table.apply_update(config)
    assert table.apply_delete("T") and not table.apply_delete("T")
    assert seen == [1, 2] and "T" not in table


def test_table_snapshot_round_trip():
    table = TopicConfigTable([auto_create_config("A"), TopicConfig("B", 2, 3, 4)])
    table.data_version = 7
    other = TopicConfigTable()
    other.restore(table.snapshot())
    assert sorted(c.topic_name for c in other.all()) == ["A", "B"] and other.get("B") == TopicConfig("B", 2, 3, 4)
    assert other.data_version == 7


def test_a_stored_reserved_or_illegal_name_is_never_sendable_however_it_came_in():
    # An older version stored reserved names (TBW102, SCHEDULE_TOPIC_XXXX, rmq_sys_*) from UPDATE_AND_CREATE_TOPIC;
    # the send path trusted any topic in the table, so sends to them were taken.
    stored = [TopicConfig(name) for name in ("TBW102", "SCHEDULE_TOPIC_XXXX", "rmq_sys_x", "Orders\n", "T")]
    table = TopicConfigTable(stored)
    other = TopicConfigTable()
    other.restore(table.snapshot())
    updated = TopicConfigTable()
    for config in stored:
        updated.apply_update(config)
    for t in (table, other, updated):
        assert [c.topic_name for c in stored if t.sendable(c.topic_name)] == ["T"]
        assert all(t.get(c.topic_name) == c for c in stored)  # still stored: readable and deletable
    updated.apply_delete("T")
    assert updated.sendable("T") is None and updated.get("TBW102") is not None
