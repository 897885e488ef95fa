"""The producer's send ext, encoded by hand: the very bytes cbor2 writes for the map it stands for."""

from __future__ import annotations

import string

import cbor2
from hypothesis import given, settings
from hypothesis import strategies as st

from client.message import PROPERTY_UNIQ_KEY, Message
from client.send_ext import SendExtEncoder, ext_fields
from remoting.codec import EncodedExt, Frame, encode
from remoting.message import SYSTEM_PROPERTIES

names = st.text(st.sampled_from(string.ascii_letters + string.digits + "%|_-"), min_size=1, max_size=127)
# Any text, lone surrogates included: a topic the codec refuses must still be refused by it.
topics = names | st.text(min_size=1, max_size=300) | st.builds("{}\udc80{}".format, st.text(max_size=5),
                                                                st.text(max_size=5))
# What a message's properties, tags and keys may hold (Message.validate refuses the separator bytes).
texts = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x01\x02"), max_size=300)
tags = st.none() | texts.map(str.strip).filter(lambda t: t and "|" not in t and t != "*")
keys = st.none() | texts | st.lists(texts.filter(lambda k: " " not in k), max_size=3)
# Message refuses RocketMQ's system names in properties (each has its own field or call, or is the broker's);
# hypothesis once drew "TRAN_MSG", and draws names from our source, such as "RECONSUME_TIME".
properties = st.dictionaries(texts.filter(lambda k: k and k not in SYSTEM_PROPERTIES), texts, max_size=4)
queue_ids = st.integers(0, 2**31 - 1) | st.integers(0, 30)
born = st.integers(0, 2**63 - 1) | st.integers(1_700_000_000_000, 1_800_000_000_000)


def _check(ext, expected: dict) -> None:
    try:
        expected_cbor = cbor2.dumps(expected)
    except ValueError:  # not encodable: left to the codec as the map, to be refused there as any ext
        assert type(ext) is dict and ext == expected
        return
    assert type(ext) is EncodedExt and ext.cbor == expected_cbor and ext == expected
    assert encode(Frame(10, ext=ext), opaque=7) == encode(Frame(10, ext=expected), opaque=7)


@given(group=names, topic=topics, body=st.binary(min_size=1, max_size=4), tags=tags, keys=keys,
       props=properties, flag=st.integers(-(2**31), 2**31 - 1) | st.just(0), queue_ids=st.lists(queue_ids, min_size=1,
                                                                                               max_size=3),
       born=born, delay=st.just(0) | st.integers(0, 18))
@settings(max_examples=300)
def test_a_single_send_ext_is_the_map_as_cbor2_writes_it(group, topic, body, tags, keys, props, flag, queue_ids,
                                                          born, delay):
    message = Message(topic, body, tags=tags, keys=keys, properties=props, flag=flag, delay_level=delay)
    ext, uniq = SendExtEncoder(group).single(message, born)
    wire_properties = message.wire_properties()
    assert uniq == wire_properties.get(PROPERTY_UNIQ_KEY, uniq)
    wire_properties.setdefault(PROPERTY_UNIQ_KEY, uniq)
    for queue_id in queue_ids:  # one per attempt: a retry may take another queue
        _check(ext.for_queue(queue_id), ext_fields(group, topic, queue_id, born, flag, wire_properties, False))


@given(group=names, topic=topics, queue_id=queue_ids, born=born)
@settings(max_examples=100)
def test_a_batch_send_ext_is_the_map_as_cbor2_writes_it(group, topic, queue_id, born):
    _check(SendExtEncoder(group).batch(topic, born).for_queue(queue_id), ext_fields(group, topic, queue_id, born, 0, {},
                                                                                   True))


def test_a_message_with_its_own_unique_key_keeps_it():
    message = Message("T", b"b", properties={PROPERTY_UNIQ_KEY: "mine"})
    ext, uniq = SendExtEncoder("G").single(message, 1_750_000_000_000)
    assert uniq == "mine" and ext.for_queue(1)["properties"] == {PROPERTY_UNIQ_KEY: "mine"}


def test_a_delayed_message_without_other_properties_keeps_its_delay():
    ext, uniq = SendExtEncoder("G").single(Message("T", b"b", delay_level=3), 1_750_000_000_000)
    assert ext.for_queue(0)["properties"] == {"DELAY": "3", PROPERTY_UNIQ_KEY: uniq}
