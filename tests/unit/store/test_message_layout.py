"""The batch and record layouts of remoting/message.py: golden bytes, round trips, bad input."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remoting.message import (BATCH_HEAD, MessageFormatError, MessageInput, create_msg_id, decode_batch,
                              decode_record, encode_batch, encode_record, iter_records, parse_msg_id, tags_code,
                              scan_batch, validate_batch)

GOLDEN_RECORD = bytes.fromhex(
    "00000065"  # total_size 101
    "daa320a7"  # magic
    "f59dd9c2"  # crc32c(b"hi")
    "00000001"  # queue_id
    "00000000"  # flag
    "0000000000000003"  # queue_offset
    "0000000000000004"  # phy_offset
    "00000000"  # sys_flag
    "0000000000000001"  # born_timestamp
    "7f000001" "00000002"  # born host 127.0.0.1:2
    "0000000000000005"  # store_timestamp
    "0a000001" "00000006"  # store host 10.0.0.1:6
    "00000000"  # reconsume_times
    "0000000000000000"  # prepared_transaction_offset
    "00000002" "6869"  # body
    "01" "54"  # topic "T"
    "0007" "54414753016102"  # properties "TAGS\x01a\x02"
)

MESSAGE = MessageInput("T", 1, b"hi", {"TAGS": "a"}, born_timestamp=1, born_host=("127.0.0.1", 2))


def test_golden_record_bytes():
    buf = bytearray(200)
    size = encode_record(buf, 0, MESSAGE, queue_offset=3, phy_offset=4, store_timestamp=5,
                         store_host=("10.0.0.1", 6))
    assert bytes(buf[:size]) == GOLDEN_RECORD


def test_golden_record_decodes():
    view = decode_record(GOLDEN_RECORD)
    assert (view.topic, view.queue_id, view.queue_offset, view.phy_offset, view.size) == ("T", 1, 3, 4, 101)
    assert view.body == b"hi" and view.tags == "a" and view.store_host == ("10.0.0.1", 6)
    assert view.msg_id == "0A0000010000000600000000000000" + "04"


def test_golden_batch_bytes():
    batch = encode_batch([MESSAGE], ("10.0.0.1", 6))
    assert batch == bytes.fromhex(
        "524d4231" "00000001" "0a000001" "00000006"  # magic, count, store host
        "0000003d" "00000001" "00000000" "00000000" "0000000000000001" "7f000001" "00000002" "00000000"
        "0000000000000000"  # entry head: size 61, queue 1, flag, sys_flag, born ts, born host, reconsume, prepared
    ) + GOLDEN_RECORD[84:]


def test_record_fed_one_byte_at_a_time_is_never_accepted_truncated():
    for n in range(len(GOLDEN_RECORD)):
        with pytest.raises(MessageFormatError):
            decode_record(GOLDEN_RECORD[:n])
    assert decode_record(GOLDEN_RECORD).size == len(GOLDEN_RECORD)


def test_corrupted_body_fails_crc():
    bad = bytearray(GOLDEN_RECORD)
    bad[88] ^= 1
    with pytest.raises(MessageFormatError, match="CRC"):
        decode_record(bytes(bad))


def test_tags_code_is_java_string_hash_code():
    assert tags_code("TagA") == 2598919
    assert tags_code("") == 0 and tags_code(None) == 0
    assert tags_code("hello") == 99162322
    assert tags_code("Hello World") == -862545276  # overflows like a Java int


def test_long_tags_are_hashed_but_not_remembered():
    """Both tags-code caches were bounded by count alone: distinct 30 KB tags (a tag may be 32 KB) grew a broker by
    twice the tag bytes a producer sent (4,000 such messages: +244 MiB). Long tags are hashed each time instead."""
    from broker.store import dispatch_info
    from remoting import message

    long_tag = "L" * (message.CACHED_TAG_MAX_LENGTH + 1) + "unremembered"
    cached_before = message._cached_tags_code.cache_info().currsize
    expected = 0
    for ch in long_tag:
        expected = (31 * expected + ord(ch)) & 0xFFFFFFFF
    expected = expected - (1 << 32) if expected >= 1 << 31 else expected
    assert tags_code(long_tag) == expected
    assert dispatch_info.tags_code_of(long_tag.encode()) == expected
    assert long_tag.encode() not in dispatch_info._TAGS_CODES
    assert message._cached_tags_code.cache_info().currsize == cached_before
    short = "S" * message.CACHED_TAG_MAX_LENGTH
    assert dispatch_info.tags_code_of(short.encode()) == tags_code(short)
    assert short.encode() in dispatch_info._TAGS_CODES


def test_msg_id_round_trip():
    msg_id = create_msg_id(("192.168.0.9", 10911), 123456789)
    assert parse_msg_id(msg_id) == (("192.168.0.9", 10911), 123456789)
    with pytest.raises(MessageFormatError, match="msg_id"):
        parse_msg_id("zz")
    with pytest.raises(MessageFormatError, match="32 hex"):
        parse_msg_id("00")
    # VIEW_MESSAGE_BY_ID answered "no message at commit-log offset -1" (SYSTEM_ERROR) for the first one
    for bad in ("7F000001000063A0FFFFFFFFFFFFFFFF", "7F000001FFFFFFFF0000000000000000"):
        with pytest.raises(MessageFormatError, match="port within 0..65535 and an offset >= 0"):
            parse_msg_id(bad)
    assert parse_msg_id("7F0000010000FFFF7FFFFFFFFFFFFFFF") == (("127.0.0.1", 65535), 2 ** 63 - 1)


@pytest.mark.parametrize("message, field", [
    (MessageInput("", 0, b""), "topic"),
    (MessageInput("a" * 128, 0, b""), "topic"),
    (MessageInput("bad topic", 0, b""), "topic"),
    (MessageInput("T", -1, b""), "queue_id"),
    (MessageInput("T", 0, b"x" * 1025), "body"),
    (MessageInput("T", 0, b"", {"k": "v" * 40000}), "properties"),
    (MessageInput("T", 0, b"", {"k\x01": "v"}), "properties"),
    (MessageInput("T", 0, b"", born_host=("::1", 1)), "born_host"),
    (MessageInput("T", 0, b"", born_host=("1.2.3.4", 70000)), "born_host"),
])
def test_encode_batch_rejects_bad_input_naming_the_field(message, field):
    with pytest.raises(MessageFormatError) as info:
        encode_batch([message], ("10.0.0.1", 1), max_message_size=1024)
    assert info.value.field == field


def test_validate_batch_rejects_malformed_batches():
    good = encode_batch([MESSAGE, MESSAGE], ("10.0.0.1", 6))
    assert validate_batch(good) == 2
    for bad, what in [(good[:10], "shorter"), (b"XXXX" + good[4:], "magic"), (good + b"\0", "trailing"),
                      (good[:-1], "fit"), (good[:4] + b"\0\0\0\3" + good[8:], "ends inside"),
                      (good[:4] + b"\0\0\0\0" + good[8:], "at least one")]:
        with pytest.raises(MessageFormatError, match=what):
            validate_batch(bad)
    with pytest.raises(MessageFormatError, match="max_message_size"):
        validate_batch(good, max_message_size=1)
    with pytest.raises(MessageFormatError):
        encode_batch([], ("10.0.0.1", 6))


def test_properties_that_are_not_utf8_are_refused_in_a_batch_and_read_with_replacements_from_a_record():
    """A batch's properties were stored unchecked: a record holding bytes that are not UTF-8 then failed every
    read (the consumers' pulls, the broker's queue status), found by fuzzing SEND_BATCH_MESSAGE. Batches now
    refuse them; a record that holds them anyway (stored before, or damaged on disk: the CRC covers only the
    body) reads with U+FFFD in their place, as RocketMQ's Java decoding does."""
    accented = dataclasses.replace(MESSAGE, properties={"TAGS": "é"})  # UTF-8 that is not ASCII: c3 a9
    batch = bytearray(encode_batch([MESSAGE, accented], ("10.0.0.1", 6)))
    assert scan_batch(bytes(batch)) == (2, False)
    assert decode_batch(bytes(batch))[1][1].properties == {"TAGS": "é"}
    assert batch[-3:-1] == b"\xc3\xa9"
    batch[-2] = 0x41  # no longer a continuation byte
    with pytest.raises(MessageFormatError, match=r"message 1 properties are not UTF-8 \(invalid continuation") \
            as info:
        scan_batch(bytes(batch))
    assert info.value.field == "properties"

    record = bytearray(GOLDEN_RECORD)
    record[-2] = 0xff  # the "a" of TAGS
    view = decode_record(bytes(record))
    assert view.properties == {"TAGS": "\ufffd"} and view.body == b"hi"
    assert [v.properties for v in iter_records(bytes(record))] == [{"TAGS": "\ufffd"}]


def test_scan_batch_holds_messages_to_one_topic_and_reports_their_queue():
    topic = MESSAGE.topic.encode()
    good = encode_batch([MESSAGE, MESSAGE], ("10.0.0.1", 6))
    assert scan_batch(good) == (2, False)
    assert scan_batch(good, topic=topic, queue_id=MESSAGE.queue_id) == (2, True)
    assert scan_batch(good, topic=topic, queue_id=MESSAGE.queue_id + 1) == (2, False)
    mixed = encode_batch([MESSAGE, dataclasses.replace(MESSAGE, topic="Elsewhere")], ("10.0.0.1", 6))
    with pytest.raises(MessageFormatError, match="message 1 of the batch is for topic 'Elsewhere'") as info:
        scan_batch(mixed, topic=topic)
    assert info.value.field == "batch_topic"
    assert validate_batch(mixed) == 2  # without a topic to hold it to, a mixed batch is well formed


def test_scan_batch_from_a_producer_refuses_a_negative_born_timestamp_or_reconsume_times_and_the_store_does_not():
    """A single send refuses them (get_int, lo=0); a batch's entries were taken as they came. Only what a
    producer sends is held to it: batches already written (by an older broker, or before this check) must stay
    valid for the store's own check (validate_batch: apply, replication, recovery)."""
    late = dataclasses.replace(MESSAGE, born_timestamp=-1)
    retried = dataclasses.replace(MESSAGE, reconsume_times=-(2 ** 31))
    topic = MESSAGE.topic.encode()
    for messages, index, field, value in (([MESSAGE, late], 1, "born_timestamp", -1),
                                          ([retried, MESSAGE], 0, "reconsume_times", -(2 ** 31)),
                                          ([MESSAGE, MESSAGE, dataclasses.replace(late, reconsume_times=-2)], 2,
                                           "born_timestamp", -1)):
        batch = encode_batch(messages, ("10.0.0.1", 6))
        with pytest.raises(MessageFormatError, match=f"^message {index} {field} must be >= 0, got {value}$") \
                as info:
            scan_batch(batch, topic=topic, queue_id=0, from_producer=True)
        assert info.value.field == field
        assert validate_batch(batch) == len(messages)
        assert scan_batch(batch, topic=topic) == (len(messages), False)
    # The largest values of both, and a negative queue id still refused either way.
    big = dataclasses.replace(MESSAGE, born_timestamp=2 ** 63 - 1, reconsume_times=2 ** 31 - 1)
    assert scan_batch(encode_batch([big], ("10.0.0.1", 6)), from_producer=True) == (1, False)
    negative_queue = bytearray(encode_batch([MESSAGE], ("10.0.0.1", 6)))
    negative_queue[BATCH_HEAD.size + 4:BATCH_HEAD.size + 8] = (-1).to_bytes(4, "big", signed=True)
    for producer in (False, True):
        with pytest.raises(MessageFormatError, match="message 0 queue_id must be >= 0, got -1"):
            scan_batch(bytes(negative_queue), from_producer=producer)


topics = st.text(alphabet="abcXYZ019_-%|", min_size=1, max_size=127)
props = st.dictionaries(st.text(st.characters(blacklist_characters="\x01\x02", blacklist_categories=("Cs",)),
                                min_size=1, max_size=8),
                        st.text(st.characters(blacklist_characters="\x01\x02", blacklist_categories=("Cs",)),
                                max_size=20), max_size=4)
messages = st.builds(MessageInput, topics, st.integers(0, 2 ** 31 - 1), st.binary(max_size=300), props,
                     st.integers(-(2 ** 31), 2 ** 31 - 1), st.integers(-(2 ** 31), 2 ** 31 - 1),
                     st.integers(-(2 ** 63), 2 ** 63 - 1),
                     st.tuples(st.ip_addresses(v=4).map(str), st.integers(0, 65535)),
                     st.integers(-(2 ** 31), 2 ** 31 - 1), st.integers(-(2 ** 63), 2 ** 63 - 1))


@settings(max_examples=150, deadline=None)
@given(st.lists(messages, min_size=1, max_size=5))
def test_batch_round_trip(msgs):
    batch = encode_batch(msgs, ("10.1.2.3", 4))
    host, decoded = decode_batch(batch)
    assert host == ("10.1.2.3", 4)
    assert decoded == [MessageInput(m.topic, m.queue_id, m.body, dict(m.properties), m.flag, m.sys_flag,
                                    m.born_timestamp, m.born_host, m.reconsume_times,
                                    m.prepared_transaction_offset) for m in msgs]
    assert BATCH_HEAD.unpack_from(batch)[1] == len(msgs)


@settings(max_examples=150, deadline=None)
@given(st.lists(messages, min_size=1, max_size=4), st.integers(0, 2 ** 62), st.integers(0, 2 ** 40))
def test_record_round_trip(msgs, store_ts, phy0):
    buf = bytearray(sum(len(m.body) + 40000 for m in msgs))
    pos = 0
    for i, m in enumerate(msgs):
        pos += encode_record(buf, pos, m, queue_offset=i, phy_offset=phy0 + pos, store_timestamp=store_ts,
                             store_host=("10.9.8.7", 6))
    views = list(iter_records(bytes(buf[:pos])))
    assert [(v.topic, v.queue_id, v.body, v.properties, v.flag, v.sys_flag, v.born_timestamp, v.born_host,
             v.reconsume_times, v.prepared_transaction_offset) for v in views] == \
        [(m.topic, m.queue_id, m.body, m.properties, m.flag, m.sys_flag, m.born_timestamp, m.born_host,
          m.reconsume_times, m.prepared_transaction_offset) for m in msgs]
    assert [v.queue_offset for v in views] == list(range(len(msgs)))
    assert all(v.store_timestamp == store_ts for v in views)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 200))
def test_arbitrary_bytes_never_escape_as_anything_but_message_format_error(data, cut):
    for candidate in (data, GOLDEN_RECORD[:cut] + data, bytes(GOLDEN_RECORD[:84]) + data):
        try:
            decode_record(candidate)
        except MessageFormatError:
            pass
    batch = encode_batch([MESSAGE], ("10.0.0.1", 6))
    for candidate in (data, batch[:16] + data, batch[:cut] + data):
        for check in (validate_batch, decode_batch):
            try:
                check(candidate)
            except MessageFormatError:
                pass


def test_scan_batch_from_a_producer_refuses_properties_not_ending_with_the_pair_separator():
    """Every pair ends with \\x02 (encode_properties), and the commit log's recovery reads a last record whose last
    byte is 0 as a torn tail. A producer's batch stored its properties as sent: one ending with \\x00, fsynced and
    acknowledged, was cut by the next recovery when it was the log's last record (found by review, reproduced at
    the store). Refused from a producer; the store's own checks of written batches still take it."""
    for last in (0x00, ord("y")):
        batch = bytearray(encode_batch([MESSAGE, MESSAGE], ("10.0.0.1", 6)))
        assert batch[-1] == 0x02
        batch[-1] = last
        with pytest.raises(MessageFormatError, match=rf"^message 1 properties end with byte {last:#04x}, not "
                                                     r"\\x02") as info:
            scan_batch(bytes(batch), from_producer=True)
        assert info.value.field == "properties"
        assert scan_batch(bytes(batch)) == (2, False)
    no_properties = dataclasses.replace(MESSAGE, properties={})
    assert scan_batch(encode_batch([no_properties], ("10.0.0.1", 6)), from_producer=True) == (1, False)
