"""Which property blocks and names a producer may send, and which stored properties the broker trusts.

A batch's properties are stored as sent: a block ``encode_properties`` would not write (an empty name, a value
holding \\x01, a name twice) read back as other properties, which every path that stores the message again refused
(POP revive dropped the message, send-back answered MESSAGE_ILLEGAL). RETRY_TOPIC, REAL_TOPIC and the like are
trusted only on the records the broker wrote them on: read from a producer's message, a retry copy went to another
topic's handler, and under ACL its send-back needed SUB on a topic the producer named. The broker takes them from
producers all the same, as RocketMQ's does (its consumer's fallback send-back copies a delivered message's
properties, REAL_TOPIC included); the client refuses the names RocketMQ's putUserProperty refuses. Pure functions
and the client's ``Message``; the broker's answers are pinned in
``tests/integration/broker/test_reserved_properties.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.acl import SUB, request_resources
from client.message import Message
from remoting.message import (MAX_PROPERTIES_SIZE, SCHEDULE_TOPIC, TRANS_CHECK_MAX_TIME_TOPIC, TRANS_HALF_TOPIC,
                              MessageFormatError, MessageInput, check_topic, encode_batch, encode_properties,
                              encode_record, encode_uniform_batch, first_topic, property_block_problem,
                              record_properties, record_size, scan_batch)
from tests.unit.broker.test_acl import STORED, send_back


def producer_batch(topic: str, *blocks: bytes) -> bytes:
    return encode_uniform_batch(check_topic(topic), 0, [(b"body", block, 0) for block in blocks], 1,
                                (bytes(4), 0), (bytes(4), 0))


def refusal(topic: str, *blocks: bytes) -> MessageFormatError:
    with pytest.raises(MessageFormatError) as e:
        scan_batch(producer_batch(topic, *blocks), topic=topic.encode(), queue_id=0, from_producer=True)
    return e.value


@pytest.mark.parametrize("block, says", [
    (b"\x01v\x02", "non-empty"),  # read as {'': 'v'}
    (b"a\x01b\x01c\x02", "separator"),  # read as {'a': 'b\x01c'}
    (b"\x01\x02", "non-empty"),
    (b"abc\x02", "pairs"),  # no \x01: read as {'abc': ''}, written back as abc\x01\x02
    (b"a\x01b\x02a\x01c\x02", "no name twice"),  # read as {'a': 'c'}: the first value lost
    (b"UNIQ_KEY\x01u\x02\x01v\x02", "non-empty"),  # after a good pair
])
def test_a_batch_with_properties_encode_properties_would_not_write_is_refused(block, says):
    error = refusal("Orders", b"UNIQ_KEY\x01u1\x02", block)
    assert error.field == "properties" and "message 1 properties are malformed" in str(error) and says in str(error)
    assert property_block_problem(block) is not None
    # The store's check of written batches takes them: records a broker stored before this rule stay readable.
    assert scan_batch(producer_batch("Orders", block))[0] == 1


@given(st.dictionaries(st.text(min_size=1).filter(lambda s: "\x01" not in s and "\x02" not in s),
                       st.text().filter(lambda s: "\x01" not in s and "\x02" not in s), max_size=6))
def test_every_block_encode_properties_writes_passes(properties):
    block = encode_properties(properties)
    assert property_block_problem(block) is None
    if block and "DELAY" not in properties:
        assert scan_batch(producer_batch("Orders", block), topic=b"Orders", queue_id=0, from_producer=True)[0] == 1


@pytest.mark.parametrize("name", ["REAL_TOPIC", "REAL_QID", "TRANSACTION_CHECK_TIMES", "RETRY_TOPIC",
                                  "ORIGIN_MESSAGE_ID"])
def test_a_batch_may_carry_what_the_broker_sets_where_it_is_not_trusted(name):
    # Refused for a while: RocketMQ's consumer's fallback send-back to %RETRY%<group> copies a delivered message's
    # properties (REAL_TOPIC and REAL_QID of every delayed or retried one), and so does a tool republishing one.
    for topic in ("Orders", "%RETRY%billing"):
        block = b"UNIQ_KEY\x01u\x02" + name.encode() + b"\x01x\x02"
        assert scan_batch(producer_batch(topic, block), topic=topic.encode(), queue_id=0, from_producer=True)[0] == 1


def test_a_delayed_batch_message_is_still_refused_as_delayed():
    for block in (b"DELAY\x013\x02", b"UNIQ_KEY\x01u\x02DELAY\x013\x02"):
        assert refusal("Orders", block).field == "delay"


def test_retry_topic_is_read_from_retry_copies_and_real_topic_from_parked_records_only():
    fake = {"RETRY_TOPIC": "Elsewhere", "REAL_TOPIC": "Elsewhere"}
    assert first_topic("Orders", fake) == "Orders"
    assert first_topic("%DLQ%billing", fake) == "%DLQ%billing"
    assert first_topic("%RETRY%billing", fake) == "Elsewhere"
    assert first_topic("%RETRY%billing", {}) == "%RETRY%billing"
    for parked in (SCHEDULE_TOPIC, TRANS_HALF_TOPIC, TRANS_CHECK_MAX_TIME_TOPIC):
        assert first_topic(parked, {"REAL_TOPIC": "Orders", "RETRY_TOPIC": "Elsewhere"}) == "Orders"
    # A retry waiting for its delay: bound for the retry topic, so its RETRY_TOPIC is the broker's.
    assert first_topic(SCHEDULE_TOPIC, {"REAL_TOPIC": "%RETRY%billing", "RETRY_TOPIC": "Orders"}) == "Orders"


def test_acl_judges_a_send_back_by_the_properties_the_broker_wrote_only():
    stored = {**STORED, 600: ("Orders2", {"RETRY_TOPIC": "Audit"}), 700: ("Orders2", {"REAL_TOPIC": "Audit"})}
    for offset in (600, 700):
        assert request_resources(send_back(offset), stored.get) == [("group", "g1", SUB), ("topic", "Orders2", SUB)]


@pytest.mark.parametrize("name", ["RETRY_TOPIC", "REAL_TOPIC", "REAL_QID", "ORIGIN_MESSAGE_ID", "WAIT",
                                  "RECONSUME_TIME", "MAX_OFFSET", "POP_CK", "TRANSACTION_CHECK_TIMES"])
def test_the_client_refuses_the_names_rocketmq_reserves(name):
    with pytest.raises(ValueError, match=f"must not set '{name}': RocketMQ reserves the name"):
        Message("Orders", b"x", properties={"color": "blue", name: "v"})
    message = Message("Orders", b"x", properties={"color": "blue"})
    message.properties[name] = "v"
    with pytest.raises(ValueError, match=f"'{name}'"):
        message.validate()


def test_the_client_keeps_the_reserved_names_it_takes_from_users_on_purpose():
    kept = {"UNIQ_KEY": "U-1", "CLUSTER": "DefaultCluster", "REPLY_TO_CLIENT": "c", "CORRELATION_ID": "x",
            "TTL": "3000", "MSG_TYPE": "reply"}
    assert Message("Orders", b"x", properties=kept).properties == kept
    for name in ("TIMER_DELIVER_MS", "TIMER_DELAY_MS", "TIMER_DELAY_SEC"):
        assert Message("Orders", b"x", properties={name: "5"}).properties == {name: "5"}
    with pytest.raises(ValueError, match="give Message.tags"):
        Message("Orders", b"x", properties={"TAGS": "t"})


def test_a_record_stored_again_as_stored_keeps_its_properties_block_byte_for_byte():
    block = b"\x01v\x02a\x01b\x01c\x02"  # no dict encode_properties takes writes it
    record = bytearray(record_size(4, 6, len(block)))
    encode_record(record, 0, MessageInput("Orders", 0, b"body", block), queue_offset=0, phy_offset=0,
                  store_timestamp=1, store_host=("127.0.0.1", 1))
    assert record_properties(record) == block
    batch = encode_batch([MessageInput("%DLQ%g", 0, b"body", record_properties(record))], ("127.0.0.1", 1))
    assert batch.endswith(len(block).to_bytes(2, "big") + block)
    with pytest.raises(MessageFormatError, match="more than 32767"):
        encode_batch([MessageInput("T", 0, b"", b"a\x01" + b"x" * MAX_PROPERTIES_SIZE + b"\x02")], ("127.0.0.1", 1))
