"""The consumer's record decoding: ``decode_records`` agrees with ``iter_records`` and fails the same way, and
pulled messages (``MessageExt`` with lazily decoded properties) read exactly as before."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.message import MessageExt, RecordProperties
from client.pull_consumer import _to_messages, to_message_ext
from remoting.message import MessageFormatError, MessageInput, decode_records, encode_record, iter_records

topics = st.text(alphabet="abcXYZ019_-%|", min_size=1, max_size=20)
props = st.dictionaries(st.text(alphabet=st.characters(blacklist_characters="\x01\x02", blacklist_categories=("Cs",)),
                                min_size=1, max_size=8),
                        st.text(alphabet=st.characters(blacklist_characters="\x01\x02", blacklist_categories=("Cs",)),
                                max_size=8), max_size=4)
messages = st.builds(MessageInput, topics, st.integers(0, 2 ** 31 - 1), st.binary(max_size=300), props,
                     st.integers(-(2 ** 31), 2 ** 31 - 1), st.integers(-(2 ** 31), 2 ** 31 - 1),
                     st.integers(-(2 ** 63), 2 ** 63 - 1),
                     st.tuples(st.ip_addresses(v=4).map(str), st.integers(0, 65535)),
                     st.integers(-(2 ** 31), 2 ** 31 - 1), st.integers(-(2 ** 63), 2 ** 63 - 1))


def _records(msgs, store_host=("10.9.8.7", 6)) -> bytes:
    buf = bytearray(sum(len(m.body) + 40000 for m in msgs))
    pos = 0
    for i, m in enumerate(msgs):
        pos += encode_record(buf, pos, m, queue_offset=i, phy_offset=7 + pos, store_timestamp=99 + i,
                             store_host=store_host)
    return bytes(buf[:pos])


@settings(max_examples=150, deadline=None)
@given(st.lists(messages, min_size=1, max_size=4), st.booleans())
def test_decoded_messages_equal_the_reference_decoding(msgs, check_crc):
    data = _records(msgs)
    reference = tuple(to_message_ext(v, "broker-a") for v in iter_records(data, check_crc=check_crc))
    fast = _to_messages(decode_records(data, check_crc=check_crc), "broker-a")
    assert fast == reference
    for f, r in zip(fast, reference):
        assert dict(f.properties) == r.properties and f.tags == r.tags and f.keys == r.keys
        assert f.msg_id == r.msg_id and f.offset_msg_id == r.offset_msg_id and repr(f) == repr(r)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 200), st.booleans())
def test_bad_bytes_fail_as_iter_records_does(data, cut, check_crc):
    good = _records([MessageInput("T", 1, b"hi", {"TAGS": "a"})])
    for candidate in (data, good[:cut] + data, good[:84] + data, good + data):
        try:
            expected = [to_message_ext(v, "b") for v in iter_records(candidate, check_crc=check_crc)]
        except MessageFormatError as e:
            with pytest.raises(MessageFormatError) as raised:
                decode_records(candidate, check_crc=check_crc)
            assert str(raised.value) == str(e)
        else:
            assert list(_to_messages(decode_records(candidate, check_crc=check_crc), "b")) == expected


def test_corrupted_body_fails_crc_only_when_checked():
    data = bytearray(_records([MessageInput("T", 1, b"hi")]))
    data[88] ^= 0xFF
    with pytest.raises(MessageFormatError, match="CRC"):
        decode_records(bytes(data))
    assert decode_records(bytes(data), check_crc=False)[0][1] == bytes(data[88:90])


def test_record_properties_read_like_a_dict():
    p = RecordProperties("TAGS\x01a\x02KEYS\x01k1 k2\x02".encode())
    d = {"TAGS": "a", "KEYS": "k1 k2"}
    assert p == d and d == p and p == RecordProperties(b"TAGS\x01a\x02KEYS\x01k1 k2\x02") and p != {"TAGS": "a"}
    assert dict(p) == d and list(p) == list(d) and len(p) == 2 and "TAGS" in p and p["KEYS"] == "k1 k2"
    assert p.get("nope") is None and p.get("nope", "x") == "x" and repr(p) == repr(d)
    assert pickle.loads(pickle.dumps(p)) == d and RecordProperties(b"") == {}
    with pytest.raises(KeyError):
        p["nope"]
    with pytest.raises(TypeError):
        hash(p)
    msg = MessageExt("T", b"", 0, 0, "b", p, 0, 0, 0, ("1.2.3.4", 5))
    assert msg.tags == "a" and msg.keys == ["k1", "k2"]


def assert_built_as_the_dataclass(fast, ref, args: tuple, change: dict, *, hashable: bool) -> None:
    """``fast`` (a hand-built instance of a frozen dataclass) is indistinguishable from ``ref``, the same built by
    the dataclass's own ``__init__`` from ``args``: type, equality (and hash), repr, fields, pickle, copy,
    ``replace(**change)`` and frozenness (setting ``change``'s field is refused)."""
    import copy
    import dataclasses

    cls = type(ref)
    assert type(fast) is cls and fast == ref
    if hashable:
        assert hash(fast) == hash(ref)
    assert repr(fast) == repr(ref) and dataclasses.astuple(fast) == dataclasses.astuple(ref)
    assert [getattr(fast, f.name) for f in dataclasses.fields(cls)] == list(args)
    assert pickle.loads(pickle.dumps(fast)) == ref and copy.copy(fast) == ref
    assert dataclasses.replace(fast, **change) == dataclasses.replace(ref, **change)
    ((name, value),) = change.items()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(fast, name, value)


def test_pulled_message_ext_is_a_plain_message_ext():
    from client.message import _PulledMessageExt
    args = ("T", b"body", 1, 2, "broker-a", {"TAGS": "a"}, 3, 4, 5, ("10.0.0.1", 6), 7, 8, 9)
    assert_built_as_the_dataclass(_PulledMessageExt(*args), MessageExt(*args), args, {"queue_id": 10},
                                  hashable=False)
