"""The simple consumer's pure parts (client/simple_consumer.py): subscriptions, received messages, config."""

from __future__ import annotations

import dataclasses

import cbor2
import pytest

from client import MessageSelector, ReceivedMessage, SimpleConsumerConfig
from client.message import MessageExt
from client.simple_consumer import (MAX_BATCH_ACK, _ack_batches, _batch_ack_results, _check_received,
                                    _parse_subscriptions, _received)
from remoting.codec import make_request, make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.config import ConfigError
from remoting.errors import InvalidRequestError, NoMessageError, RaftMQError


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


def test_a_batch_ack_is_one_request_per_broker_group_and_per_1024_messages():
    def at(broker_name: str, topic: str = "A") -> ReceivedMessage:
        return dataclasses.replace(_received(_message(topic), "h"), broker_name=broker_name)

    msgs = [at("broker-b"), at("broker-a", "B"), at("broker-b", "B"), at("broker-a")]
    assert _ack_batches(msgs) == [("broker-b", [0, 2]), ("broker-a", [1, 3])]
    many = [at("broker-a")] * (MAX_BATCH_ACK + 1) + [at("broker-b")]
    assert [(name, len(indexes)) for name, indexes in _ack_batches(many)] == [
        ("broker-a", MAX_BATCH_ACK), ("broker-a", 1), ("broker-b", 1)]
    assert _ack_batches(many)[1][1] == [MAX_BATCH_ACK]
    assert _ack_batches([]) == []


def _answer(entries) -> object:
    request = make_request(RequestCode.BATCH_ACK_MESSAGE, {"consumer_group": "g"}, b"")
    return make_response(request, ResponseCode.SUCCESS,
                         body=entries if isinstance(entries, bytes) else cbor2.dumps(entries))


def test_a_batch_ack_answer_is_none_or_the_error_ack_would_raise_per_message():
    results = _batch_ack_results(_answer([
        {"code": 0, "acked": True}, {"code": 0, "acked": False},
        {"code": int(ResponseCode.NO_MESSAGE), "remark": "request field 'receipt_handle' expired 5 ms ago"},
        {"code": int(ResponseCode.INVALID_REQUEST), "remark": "request field 'receipt_handle' was issued to ..."},
    ]), "broker-a", ["A", "A", "B", "A"])
    assert results[:2] == [None, None]
    assert isinstance(results[2], NoMessageError) and "expired" in str(results[2])
    assert results[2].fields["topic"] == "B" and results[2].fields["broker_name"] == "broker-a"
    assert isinstance(results[3], InvalidRequestError)


@pytest.mark.parametrize("body, problem", [
    (b"\xff", "not CBOR"),
    ({"code": 0}, "1 receipt handles were answered"),
    ([], "1 receipt handles were answered"),
    ([{"acked": True}], "no response code"),
    (["ok"], "no response code"),
])
def test_a_malformed_batch_ack_answer_is_an_error_of_the_whole_request(body, problem):
    with pytest.raises(RaftMQError, match=problem):
        _batch_ack_results(_answer(body), "broker-a", ["A"])
