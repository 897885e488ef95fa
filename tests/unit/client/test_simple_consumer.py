"""The simple consumer's pure parts (client/simple_consumer.py): subscriptions, received messages, config."""

from __future__ import annotations

import pytest

from client import MessageSelector, ReceivedMessage, SimpleConsumerConfig
from client.message import MessageExt
from client.simple_consumer import _check_received, _parse_subscriptions, _received
from remoting.config import ConfigError


def _message(topic: str, properties: dict[str, str] | None = None) -> MessageExt:
    return MessageExt(topic, b"body", 1, 7, "broker-a", properties or {}, 4096, 1, 2, ("10.0.0.1", 10911), 1)


def test_a_message_back_from_the_pop_retry_topic_shows_its_own_topic():
    msg = _received(_message("%RETRY%g+TopicA", {"RETRY_TOPIC": "TopicA", "TAGS": "t"}), "handle")
    assert isinstance(msg, ReceivedMessage) and isinstance(msg, MessageExt)
    assert msg.topic == "TopicA" and msg.receipt_handle == "handle" and msg.reconsume_times == 1
    assert msg.queue_offset == 7 and msg.tags == "t"
    assert _received(_message("TopicA"), "h").topic == "TopicA"
    # The retry topic's name says the topic, not a property a producer could have set; and a push group's retry
    # topic (v1's ambiguous name) is no POP retry topic.
    assert _received(_message("%RETRY%g+TopicA", {"RETRY_TOPIC": "Other"}), "h").topic == "TopicA"
    assert _received(_message("%RETRY%g_TopicA", {"RETRY_TOPIC": "TopicA"}), "h").topic == "%RETRY%g_TopicA"


def test_subscriptions_are_parsed_and_bad_ones_refused():
    subs = _parse_subscriptions({"A": "x || y", "B": MessageSelector.by_sql("a > 1"), "C": None})
    assert subs["A"].tags == frozenset({"x", "y"}) and subs["B"].expression_type == "SQL92" and subs["C"].matches_all
    for bad, problem in [({}, "non-empty mapping"), (["A"], "non-empty mapping"),
                         ({"%RETRY%g": "*"}, "retry topics"), ({"A": 5}, "tag expression or a MessageSelector"),
                         ({"bad topic": "*"}, "topic")]:
        with pytest.raises(ValueError, match=problem):
            _parse_subscriptions(bad)


def test_ack_takes_only_a_received_message():
    with pytest.raises(TypeError, match="ReceivedMessage"):
        _check_received(_message("A"))
    _check_received(_received(_message("A"), "h"))


def test_config_bounds():
    assert SimpleConsumerConfig(namesrv_addrs=("127.0.0.1:9876",)).consume_from_where == "CONSUME_FROM_LAST_OFFSET"
    with pytest.raises(ConfigError, match="consume_from_where"):
        SimpleConsumerConfig(namesrv_addrs=("127.0.0.1:9876",), consume_from_where="CONSUME_FROM_TIMESTAMP")
    with pytest.raises(ConfigError, match="await_duration_ms"):
        SimpleConsumerConfig(namesrv_addrs=("127.0.0.1:9876",), await_duration_ms=-1)
