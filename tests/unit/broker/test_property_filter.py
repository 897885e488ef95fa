"""SQL92 pulls on the broker (broker/property_filter.py) over a real store, and SQL92 subscriptions in heartbeats."""

from __future__ import annotations

import pytest

from broker.consumer_manager import HeartbeatError, parse_heartbeat
from broker.property_filter import (SQL_FILTER_SCAN_UNITS, SQL_HOLD_SCAN_UNITS, get_messages_by_sql,
                                    has_sql_match_between, record_properties)
from broker.store import GetMessageStatus, MessageInput, MessageStore, decode_record, encode_batch
from remoting.sql_filter import compile_sql
from tests.unit.store.helpers import STORE_HOST, small_config

TOPIC = "Sql"


def _append(store: MessageStore, props_list: list[dict[str, str]], *, body_size: int = 100) -> None:
    msgs = [MessageInput(TOPIC, 0, b"%06d" % i + b"x" * body_size, props) for i, props in enumerate(props_list)]
    for start in range(0, len(msgs), 64):
        assert store.append_batch(encode_batch(msgs[start:start + 64], STORE_HOST), 1_700_000_000_000,
                                  store.max_phy_offset).ok
    store.dispatch_pending()


@pytest.fixture
def store(tmp_path):
    with MessageStore.open(small_config(tmp_path / "s", consume_queue_units_per_file=4096,
                                        segment_size_bytes=4 << 20)) as s:
        yield s


def _offsets(result) -> list[int]:
    return [decode_record(m).queue_offset for m in result.messages]


def test_only_matching_messages_are_answered_and_the_rest_passed_over(store):
    _append(store, [{"a": str(i % 10), "color": ("red", "blue", "green")[i % 3], "TAGS": "T"} for i in range(60)])
    sql = compile_sql("a BETWEEN 3 AND 5 AND color IN ('red','blue')")
    want = [i for i in range(60) if 3 <= i % 10 <= 5 and i % 3 != 2]
    result = get_messages_by_sql(store, TOPIC, 0, 0, 32, 1 << 20, sql)
    assert result.status is GetMessageStatus.FOUND
    assert _offsets(result) == result.queue_offsets == want
    assert result.next_begin_offset == 60 and result.max_offset == 60  # the unmatched tail is passed over too
    assert result.buffer_total_size == sum(len(m) for m in result.messages)
    # max_nums: the next pull starts right after the last one taken
    two = get_messages_by_sql(store, TOPIC, 0, 0, 2, 1 << 20, sql)
    assert _offsets(two) == want[:2] and two.next_begin_offset == want[1] + 1
    # max_bytes: at least one, then what fits; the next pull starts at the first one left out
    one = get_messages_by_sql(store, TOPIC, 0, 0, 32, 1, sql)
    assert _offsets(one) == want[:1] and one.next_begin_offset == want[1]
    three = get_messages_by_sql(store, TOPIC, 0, 0, 32, sum(len(m) for m in result.messages[:3]), sql)
    assert _offsets(three) == want[:3] and three.next_begin_offset == want[3]


def test_no_match_moves_on_from_the_scanned_range(store):
    _append(store, [{"a": "1"}] * (SQL_FILTER_SCAN_UNITS + 50) + [{"a": "9"}])
    sql = compile_sql("a > 5")
    first = get_messages_by_sql(store, TOPIC, 0, 0, 32, 1 << 20, sql)
    assert first.status is GetMessageStatus.NO_MATCHED_MESSAGE
    assert first.next_begin_offset == SQL_FILTER_SCAN_UNITS  # at most this many units per pull
    second = get_messages_by_sql(store, TOPIC, 0, first.next_begin_offset, 32, 1 << 20, sql)
    assert _offsets(second) == [SQL_FILTER_SCAN_UNITS + 50]
    end = get_messages_by_sql(store, TOPIC, 0, SQL_FILTER_SCAN_UNITS + 51, 32, 1 << 20, sql)
    assert end.status is GetMessageStatus.OFFSET_OVERFLOW_ONE  # the store's own answer at the end


def test_a_scan_reaching_the_end_answers_no_match_from_there(store):
    _append(store, [{"a": "1"}] * 10)
    result = get_messages_by_sql(store, TOPIC, 0, 3, 32, 1 << 20, compile_sql("a IS NULL"))
    assert result.status is GetMessageStatus.NO_MATCHED_MESSAGE
    assert result.next_begin_offset == result.max_offset == 10
    assert get_messages_by_sql(store, TOPIC, 7, 0, 32, 1 << 20, compile_sql("a IS NULL")).status is \
        GetMessageStatus.NO_MATCHED_LOGIC_QUEUE


def test_properties_are_read_from_the_record(store):
    _append(store, [{"TAGS": "TagA", "KEYS": "k1 k2", "a": "x\u00e9"}, {}])
    records = store.get_messages(TOPIC, 0, 0, 2, 1 << 20).messages
    assert record_properties(records[0]) == {"TAGS": "TagA", "KEYS": "k1 k2", "a": "x\u00e9"}
    assert record_properties(records[1]) == {}
    assert record_properties(memoryview(b"\x00" * 10)) == {}  # unreadable: every property missing
    assert _offsets(get_messages_by_sql(store, TOPIC, 0, 0, 32, 1 << 20, compile_sql("TAGS = 'TagA'"))) == [0]


def test_the_wake_up_check_reads_only_the_new_units(store):
    _append(store, [{"a": "1"}] * 5 + [{"a": "7"}] + [{"a": "1"}] * 4)
    sql = compile_sql("a > 5")
    assert not has_sql_match_between(store, TOPIC, 0, 0, 5, sql=sql)
    assert has_sql_match_between(store, TOPIC, 0, 0, 6, sql=sql)
    assert has_sql_match_between(store, TOPIC, 0, 5, 10, sql=sql)
    assert not has_sql_match_between(store, TOPIC, 0, 6, 10, sql=sql)
    # Too many to read here: the pull scans them.
    assert has_sql_match_between(store, TOPIC, 0, 0, SQL_HOLD_SCAN_UNITS + 1, sql=sql)


def _heartbeat(sub: dict) -> dict:
    return {"client_id": "c1", "consumers": [{"consumer_group": "G", "subscriptions": [{"topic": TOPIC, **sub}]}]}


def test_a_heartbeat_keeps_the_subscription_type():
    (sub,) = parse_heartbeat(_heartbeat({"expression": "a > 5", "expression_type": "SQL92"})).consumers[0].subscriptions
    assert sub.expression_type == "SQL92" and sub.sql_filter is not None and sub.sql_filter.matches({"a": "6"})
    assert sub.filter.matches_all  # no tags code filtering for SQL92
    for tag_sub in ({"expression": "TagA"}, {"expression": "TagA", "expression_type": "TAG"},
                    {"expression": "TagA", "expression_type": ""}):
        (sub,) = parse_heartbeat(_heartbeat(tag_sub)).consumers[0].subscriptions
        assert sub.expression_type == "TAG" and sub.sql_filter is None and sub.filter.tags == {"TagA"}


@pytest.mark.parametrize(("sub", "field", "text"), [
    ({"expression": "a >", "expression_type": "SQL92"}, "expression",
     "subscriptions[0].expression: SQL92 expression: expected a property, a literal or '(', found the end at "
     "character 4"),
    ({"expression": "a > 5", "expression_type": "CLASS"}, "expression_type",
     "expression_type must be TAG or SQL92, got 'CLASS'"),
    ({"expression": 5, "expression_type": "SQL92"}, "expression", "it must be a string"),
])
def test_a_heartbeat_with_a_bad_sql92_subscription_is_refused(sub, field, text):
    with pytest.raises(HeartbeatError) as info:
        parse_heartbeat(_heartbeat(sub))
    assert info.value.field == field and text in str(info.value)
