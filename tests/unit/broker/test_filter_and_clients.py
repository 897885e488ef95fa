from __future__ import annotations

import pytest

from broker.consumer_manager import ClientManager, HeartbeatError, parse_heartbeat
from broker.filter import SubscriptionParseError, parse_tag_expression
from remoting.message import tags_code


def test_tags_code_matches_java_string_hashcode():
    # Values of "TagA".hashCode() etc. in Java.
    assert tags_code("TagA") == 2598919
    assert tags_code("") == 0
    assert tags_code("hello") == 99162322
    assert tags_code("polygenelubricants") == -2147483648  # the famous Java hashCode == Integer.MIN_VALUE
    assert -(1 << 31) <= tags_code("some-long-tag-value-here") < (1 << 31)


def test_tag_expressions():
    assert parse_tag_expression("*").matches_all and parse_tag_expression(None).matches_all
    f = parse_tag_expression(" TagA || TagB ")
    assert f.tags == {"TagA", "TagB"} and f.matches_code(tags_code("TagB")) and not f.matches_code(1)
    with pytest.raises(SubscriptionParseError, match="empty tag"):
        parse_tag_expression("TagA || ")
    with pytest.raises(SubscriptionParseError, match="string"):
        parse_tag_expression(5)


def _hb(client_id, group="cg", expression="*"):
    return parse_heartbeat({"client_id": client_id, "producers": [{"producer_group": "pg"}],
                            "consumers": [{"consumer_group": group, "subscriptions": [
                                {"topic": "T", "expression": expression, "sub_version": 1}]}]})


def test_heartbeat_validation_names_the_field():
    with pytest.raises(HeartbeatError, match="client_id must be a non-empty string"):
        parse_heartbeat({"client_id": ""})
    with pytest.raises(HeartbeatError, match=r"consumers\[0\].message_model must be one of"):
        parse_heartbeat({"client_id": "c", "consumers": [{"consumer_group": "g", "message_model": "X"}]})
    with pytest.raises(HeartbeatError, match="expression"):
        parse_heartbeat({"client_id": "c", "consumers": [{"consumer_group": "g", "subscriptions": [
            {"topic": "T", "expression": "a||"}]}]})
    with pytest.raises(HeartbeatError, match="CBOR map"):
        parse_heartbeat([1])


def test_heartbeat_client_id_is_at_most_255_characters():
    with pytest.raises(HeartbeatError, match="is 256 characters long; at most 255 are allowed") as info:
        parse_heartbeat({"client_id": "c" * 256})
    assert info.value.field == "client_id" and len(str(info.value)) < 120
    assert parse_heartbeat({"client_id": "c" * 255}).client_id == "c" * 255


@pytest.mark.parametrize("data, field, needle", [
    ({"consumers": [{"consumer_group": "bad group"}]}, "consumer_group", r"consumers\[0\].consumer_group 'bad group' "
                                                                         "contains illegal characters"),
    ({"consumers": [{"consumer_group": "g" * 256}]}, "consumer_group", "at most 255"),
    ({"producers": [{"producer_group": "pg\n"}]}, "producer_group", r"producers\[0\].producer_group 'pg\\n' contains"),
    ({"consumers": [{"consumer_group": "g", "subscriptions": [{"topic": "bad topic"}]}]}, "topic",
     r"consumers\[0\].subscriptions\[0\].topic 'bad topic' contains illegal characters"),
    ({"consumers": [{"consumer_group": "g", "consume_from_where": "NOWHERE"}]}, "consume_from_where",
     "consume_from_where must be one of CONSUME_FROM_LAST_OFFSET, .*got 'NOWHERE'"),
])
def test_heartbeat_holds_names_to_the_rules_of_the_requests_that_follow(data, field, needle):
    # A heartbeat once joined a member to a group that GET_CONSUMER_LIST_BY_GROUP, pulls and offsets then refused.
    with pytest.raises(HeartbeatError, match=needle) as info:
        parse_heartbeat({"client_id": "c", **data})
    assert info.value.field == field
    ok = parse_heartbeat({"client_id": "c", "producers": [{"producer_group": "%RETRY%pg_1-x"}], "consumers": [
        {"consumer_group": "cg|2", "consume_from_where": "CONSUME_FROM_TIMESTAMP",
         "subscriptions": [{"topic": "%RETRY%cg|2"}]}]})
    assert ok.consumers[0].subscriptions[0].topic == "%RETRY%cg|2"


def test_membership_join_leave_expire_notifies():
    now = [0.0]
    changes = []
    manager = ClientManager(channel_expired_timeout_ms=1000, clock=lambda: now[0],
                            on_consumer_ids_changed=lambda g, conns: changes.append((g, len(conns))))
    conn_a, conn_b = object(), object()
    manager.heartbeat(_hb("a"), conn_a)
    manager.heartbeat(_hb("a"), conn_a)  # a repeated heartbeat is not a change
    manager.heartbeat(_hb("b", expression="TagA"), conn_b)
    assert manager.consumer_ids("cg") == ["a", "b"] and changes == [("cg", 1), ("cg", 2)]
    assert manager.find_subscription("cg", "T").expression == "TagA"
    manager.connection_closed(conn_a)
    assert manager.consumer_ids("cg") == ["b"] and changes[-1] == ("cg", 1)
    now[0] = 2.0
    manager.scan_expired()
    assert manager.consumer_ids("cg") == [] and changes[-1] == ("cg", 0)
    manager.heartbeat(_hb("c"), conn_a)
    manager.unregister("c", "pg", "cg")
    assert manager.consumer_ids("cg") == [] and "c" not in manager.producer_groups["pg"]
