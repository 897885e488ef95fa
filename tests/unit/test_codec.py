"""The frame codec: golden bytes, round trips, byte-at-a-time decoding, and every way a frame can be bad."""

from __future__ import annotations

import functools
import gc
import struct

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remoting.codec import (
    BODY_BYTES_PER_CONTAINER,
    FLAG_ONEWAY,
    FLAG_RESPONSE,
    MAX_BODY_DEPTH,
    MAX_HEADER_SIZE,
    NEED_DATA,
    BodyFormatError,
    EncodedExt,
    Frame,
    FrameDecoder,
    decode_body,
    encode,
    make_request,
    make_response,
)
from remoting.codec import _BODY_CONTAINERS_SLACK, _WATCH_CHUNK, _decode_header, _frame_from_header
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import FrameTooLargeError, ProtocolError

# Golden frames, computed by hand from the layout in remoting/codec.py and docs/protocol.md:
# total_length(4 BE) | header_length(4 BE) | CBOR map | body.
# CBOR pieces: a4/a5/a6 = map of 4/5/6 pairs; 64 'code', 66 'opaque', 64 'flag', 67 'version', 66 'remark',
# 63 'ext' are text strings of that length; 00..17 are uints 0..23 in one byte, 18 xx one more byte,
# 19 xxxx two more bytes.
GOLDEN = [
    (
        "SEND_MESSAGE request, opaque 1, nothing else",
        Frame(code=10, opaque=1),
        "00000022" "0000001e"                      # total 34 = 4 + 30, header 30
        "a4"                                       # map(4)
        "64" "636f6465" "0a"                       # "code": 10
        "66" "6f7061717565" "01"                   # "opaque": 1
        "64" "666c6167" "00"                       # "flag": 0
        "67" "76657273696f6e" "00",                # "version": 0
    ),
    (
        "TOPIC_NOT_EXIST response with a remark, opaque 300",
        Frame(code=17, opaque=300, flag=FLAG_RESPONSE, remark="no"),
        "0000002e" "0000002a"                      # total 46 = 4 + 42, header 42
        "a5"                                       # map(5)
        "64" "636f6465" "11"                       # "code": 17
        "66" "6f7061717565" "19012c"               # "opaque": 300 (uint16)
        "64" "666c6167" "01"                       # "flag": 1 (response)
        "67" "76657273696f6e" "00"                 # "version": 0
        "66" "72656d61726b" "62" "6e6f",           # "remark": "no"
    ),
    (
        "ECHO oneway request with ext and a 2-byte body, opaque 24",
        Frame(code=1000, opaque=24, flag=FLAG_ONEWAY, ext={"topic": "t"}, body=b"\x00\x01"),
        "00000034" "0000002e"                      # total 52 = 4 + 46 + 2, header 46
        "a5"                                       # map(5)
        "64" "636f6465" "1903e8"                   # "code": 1000 (uint16)
        "66" "6f7061717565" "1818"                 # "opaque": 24 (uint8)
        "64" "666c6167" "02"                       # "flag": 2 (oneway)
        "67" "76657273696f6e" "00"                 # "version": 0
        "63" "657874" "a1" "65" "746f706963" "61" "74"  # "ext": {"topic": "t"}
        "0001",                                    # body
    ),
    (
        "response with remark and ext, version 3, opaque 2**31-1",
        Frame(code=0, opaque=2**31 - 1, flag=FLAG_RESPONSE, version=3, remark="", ext={"n": -1}),
        "00000036" "00000032"                      # total 54 = 4 + 50, header 50
        "a6"                                       # map(6)
        "64" "636f6465" "00"                       # "code": 0
        "66" "6f7061717565" "1a7fffffff"           # "opaque": 2**31-1 (uint32)
        "64" "666c6167" "01"                       # "flag": 1
        "67" "76657273696f6e" "03"                 # "version": 3
        "66" "72656d61726b" "60"                   # "remark": ""
        "63" "657874" "a1" "61" "6e" "20",         # "ext": {"n": -1}
    ),
]


@pytest.mark.parametrize("name,frame,wire_hex", GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_bytes(name, frame, wire_hex):
    wire = bytes.fromhex(wire_hex)
    assert encode(frame) == wire
    decoder = FrameDecoder()
    decoder.feed(wire)
    assert decoder.next_frame() == frame
    assert decoder.next_frame() is NEED_DATA


def test_golden_stream_fed_one_byte_at_a_time():
    frames = [g[1] for g in GOLDEN]
    stream = b"".join(bytes.fromhex(g[2]) for g in GOLDEN)
    decoder = FrameDecoder()
    out = []
    for i in range(len(stream)):
        decoder.feed(stream[i:i + 1])
        while (frame := decoder.next_frame()) is not NEED_DATA:
            out.append(frame)
    assert out == frames
    assert decoder.buffered_bytes == 0


def test_opaque_override_stamps_the_wire_not_the_frame():
    frame = make_request(RequestCode.ECHO, body=b"x")
    wire = encode(frame, opaque=77)
    decoder = FrameDecoder()
    decoder.feed(wire)
    assert decoder.next_frame().opaque == 77
    assert frame.opaque == 0


def test_make_request_and_response():
    request = make_request(RequestCode.SEND_MESSAGE, ext={"topic": "t"}, body=b"b")
    assert (request.code, request.flag, request.is_response, request.is_oneway) == (10, 0, False, False)
    assert type(request.code) is int
    assert make_request(RequestCode.HEART_BEAT, oneway=True).is_oneway
    request = Frame(code=10, opaque=9, version=2)
    response = make_response(request, ResponseCode.TOPIC_NOT_EXIST, remark="topic t does not exist",
                             ext={"topic": "t"})
    assert (response.code, response.opaque, response.version) == (17, 9, 2)
    assert response.is_response and not response.is_oneway
    assert response.ext == {"topic": "t"} and response.remark == "topic t does not exist"


def test_repr_shows_body_size_not_bytes():
    text = repr(make_request(RequestCode.SEND_MESSAGE, body=b"secret-payload"))
    assert "secret" not in text and "14B" in text


# ---------------------------------------------------------------------------------------------- properties

json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
uint31 = st.integers(0, 2**31 - 1)
frames = st.builds(
    Frame,
    code=uint31, opaque=uint31, flag=st.integers(0, 3) | uint31, version=st.integers(0, 30) | uint31,
    remark=st.none() | st.text(max_size=40),
    ext=st.dictionaries(st.text(max_size=12), json_like, max_size=5),
    body=st.binary(max_size=300),
)


@given(frames)
@settings(max_examples=200)
def test_round_trip(frame):
    decoder = FrameDecoder()
    decoder.feed(encode(frame))
    assert decoder.next_frame() == frame
    assert decoder.next_frame() is NEED_DATA


@given(frames)
@settings(max_examples=100)
def test_hand_encoded_header_matches_cbor2(frame):
    wire = encode(frame)
    total, header_length = struct.unpack_from(">II", wire)
    header = {"code": frame.code, "opaque": frame.opaque, "flag": frame.flag, "version": frame.version}
    if frame.remark is not None:
        header["remark"] = frame.remark
    if frame.ext:
        header["ext"] = frame.ext
    assert wire[8:8 + header_length] == cbor2.dumps(header)
    assert total == len(wire) - 4


@given(st.lists(frames, min_size=1, max_size=6), st.data())
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
def test_any_split_of_a_stream_decodes_the_same(frame_list, data):
    stream = b"".join(encode(f) for f in frame_list)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    decoder = FrameDecoder()
    out = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)]):
        decoder.feed(stream[start:end])
        while (frame := decoder.next_frame()) is not NEED_DATA:
            out.append(frame)
    assert out == frame_list


@given(st.binary(min_size=1, max_size=200))
@settings(max_examples=200)
def test_garbage_never_escapes_as_another_exception(garbage):
    decoder = FrameDecoder(max_frame_size=1024)
    decoder.feed(garbage)
    try:
        while decoder.next_frame() is not NEED_DATA:
            pass
    except ProtocolError:
        assert decoder.failed is not None


# ---------------------------------------------------------------------------------------------- bad input


def _frame_bytes(header: bytes, body: bytes = b"", *, total: int | None = None,
                 header_length: int | None = None) -> bytes:
    total = 4 + len(header) + len(body) if total is None else total
    header_length = len(header) if header_length is None else header_length
    return struct.pack(">II", total, header_length) + header + body


GOOD_HEADER = {"code": 10, "opaque": 1, "flag": 0, "version": 0}


def _expect_failure(wire: bytes, match: str, error: type[ProtocolError] = ProtocolError, *,
                    max_frame_size: int = 1 << 20) -> ProtocolError:
    decoder = FrameDecoder(max_frame_size=max_frame_size)
    decoder.feed(wire)
    with pytest.raises(error, match=match) as info:
        decoder.next_frame()
    # ...and it stays failed: the stream has no trustworthy frame boundary any more.
    with pytest.raises(error):
        decoder.next_frame()
    with pytest.raises(error):
        decoder.feed(encode(Frame(code=1)))
    assert decoder.failed is info.value
    return info.value


@pytest.mark.parametrize("wire,match", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "exceeds the maximum frame size"),
    (_frame_bytes(cbor2.dumps(GOOD_HEADER), header_length=200), r"header_length 200 does not fit"),
    (_frame_bytes(cbor2.dumps(GOOD_HEADER), header_length=0), r"header_length 0 does not fit"),
    (struct.pack(">I", 3) + b"\x00\x00\x00", "below the minimum"),
    (_frame_bytes(cbor2.dumps([10, 1, 0, 0])), "expected a CBOR map, got list"),
    (_frame_bytes(cbor2.dumps("code")), "expected a CBOR map, got str"),
    (_frame_bytes(b"\xff\xff\xff"), "not valid CBOR"),
    (_frame_bytes(cbor2.dumps(GOOD_HEADER)[:-1]), "not valid CBOR"),
    (_frame_bytes(cbor2.dumps(GOOD_HEADER) + b"\x01"), "more \\(or less\\) than one CBOR item"),
    (_frame_bytes(cbor2.dumps({**GOOD_HEADER, "code": "10"})), "field 'code' must be an int"),
    (_frame_bytes(cbor2.dumps({**GOOD_HEADER, "opaque": -1})), "field 'opaque' must be within"),
    (_frame_bytes(cbor2.dumps({**GOOD_HEADER, "flag": True})), "field 'flag' must be an int"),
    (_frame_bytes(cbor2.dumps({**GOOD_HEADER, "version": 2**31})), "field 'version' must be within"),
    (_frame_bytes(cbor2.dumps({"code": 10, "opaque": 1, "flag": 0})), "missing field 'version'"),
    (_frame_bytes(cbor2.dumps({**GOOD_HEADER, "remark": 5})), "field 'remark' must be text"),
    (_frame_bytes(cbor2.dumps({**GOOD_HEADER, "ext": [1]})), "field 'ext' must be a map"),
    (_frame_bytes(cbor2.dumps({**GOOD_HEADER, "ext": {"a": {1: 2}}})), "not valid CBOR"),
    (_frame_bytes(cbor2.dumps({**GOOD_HEADER, "ext": {b"k": 1}})), "field 'ext' must be a map with text"),
    (_frame_bytes(cbor2.dumps({**GOOD_HEADER, "ext": cbor2.CBORTag(35, "a+")})), "tags are not allowed"),
    (_frame_bytes(cbor2.dumps({**GOOD_HEADER, "ext": cbor2.CBORTag(9999, 1)})), "not valid CBOR|tags"),
    (_frame_bytes(b"\x81" * 100 + b"\x00"), "not valid CBOR"),
], ids=["http-garbage", "header-length-past-total", "zero-header-length", "tiny-total", "array-header",
        "string-header", "invalid-cbor", "truncated-header", "trailing-bytes-in-header", "code-not-int",
        "negative-opaque", "bool-flag", "version-too-large", "missing-version", "remark-not-text",
        "ext-not-map", "ext-int-key-deep", "ext-bytes-key", "regex-tag", "unknown-tag", "deep-nesting"])
def test_bad_frames_fail_the_decoder(wire, match):
    _expect_failure(wire, match)


def test_oversize_is_refused_from_the_length_prefix_alone():
    error = _expect_failure(struct.pack(">I", 1025), "1025 bytes exceeds the maximum frame size of 1024",
                            FrameTooLargeError, max_frame_size=1024)
    assert (error.size, error.max_size) == (1025, 1024)


def test_frame_of_exactly_the_maximum_size_is_accepted():
    frame = Frame(code=1, body=b"z" * 100)
    wire = encode(frame)
    decoder = FrameDecoder(max_frame_size=len(wire) - 4)
    decoder.feed(wire)
    assert decoder.next_frame() == frame


def test_good_frames_before_a_bad_one_are_delivered():
    decoder = FrameDecoder()
    decoder.feed(encode(Frame(code=1)) + encode(Frame(code=2)) + b"\x00\x00\x00\x01junk")
    assert decoder.next_frame().code == 1
    assert decoder.next_frame().code == 2
    with pytest.raises(ProtocolError):
        decoder.next_frame()


def test_unknown_header_keys_are_ignored_for_forward_compatibility():
    decoder = FrameDecoder()
    decoder.feed(_frame_bytes(cbor2.dumps({**GOOD_HEADER, "future": [1, 2]})))
    assert decoder.next_frame() == Frame(code=10, opaque=1)


@pytest.mark.parametrize("frame,match", [
    (Frame(code=True), "field 'code' must be an int"),
    (Frame(code="10"), "field 'code' must be an int"),
    (Frame(code=-1), "field 'code' must be >= 0"),
    (Frame(code=1, opaque=2**31), "field 'opaque' must be <= 2147483647"),
    (Frame(code=1, flag=None), "field 'flag' must be an int"),
    (Frame(code=1, remark=b"x"), "'remark' must be a str"),
    (Frame(code=1, ext={1: "x"}), "'ext' must be a dict with str keys"),
    (Frame(code=1, ext={"x": object()}), "cannot be encoded as CBOR"),
    (Frame(code=1, body="text"), "body must be bytes"),
])
def test_encode_refuses_bad_fields(frame, match):
    with pytest.raises(ProtocolError, match=match):
        encode(frame)


def test_ext_key_check_still_refuses_after_a_good_ext_of_the_same_size_was_cached():
    decoder = FrameDecoder()
    decoder.feed(encode(Frame(code=1, ext={"a": 1, "b": 2})))
    assert decoder.next_frame().ext == {"a": 1, "b": 2}
    with pytest.raises(ProtocolError, match="'ext' must be a dict with str keys"):
        encode(Frame(code=1, ext={"a": 1, 2: 2}))
    with pytest.raises(ProtocolError, match="'ext' must be a dict with str keys"):
        encode(Frame(code=1, ext={"a": 1, b"b": 2}))


def test_ext_key_cache_keeps_neither_huge_nor_endless_key_sets():
    from remoting import codec
    codec._STR_KEY_TUPLES.clear()
    for i in range(codec._STR_KEY_TUPLES_MAX + 50):
        encode(Frame(code=1, ext={f"key-{i}": 1}))
    assert len(codec._STR_KEY_TUPLES) == codec._STR_KEY_TUPLES_MAX
    codec._STR_KEY_TUPLES.clear()
    huge = "k" * (codec._STR_KEY_TUPLE_MAX_CHARS + 1)
    decoder = FrameDecoder()
    decoder.feed(encode(Frame(code=1, ext={huge: 1})))
    assert decoder.next_frame().ext == {huge: 1} and not codec._STR_KEY_TUPLES
    codec._STR_KEY_TUPLES.clear()


def test_int_enum_codes_encode_as_plain_ints():
    assert encode(Frame(code=RequestCode.ECHO)) == encode(Frame(code=1000))


@pytest.mark.parametrize("bad", [0, 15, "16", None])
def test_decoder_rejects_a_silly_maximum(bad):
    with pytest.raises(ValueError, match="max_frame_size"):
        FrameDecoder(max_frame_size=bad)


@pytest.mark.parametrize("header,ext", [
    ({"code": 5, "opaque": 1, "flag": 0, "version": 0}, {}),  # the fast path
    ({"version": 0, "flag": 0, "opaque": 1, "code": 5}, {}),  # another key order: the general path
    ({"code": 5, "opaque": 1, "flag": 0, "version": 0, "ext": {"a": [1, {"b": None}]}}, {"a": [1, {"b": None}]}),
    ({"ext": {"a": 1}, "code": 5, "opaque": 1, "flag": 0, "version": 0}, {"a": 1}),
], ids=["canonical", "reordered", "canonical-ext", "reordered-ext"])
def test_both_decoding_paths_agree(header, ext):
    decoder = FrameDecoder()
    decoder.feed(_frame_bytes(cbor2.dumps(header), b"b"))
    assert decoder.next_frame() == Frame(code=5, opaque=1, ext=ext, body=b"b")


def _decoded_either_way(header: bytes) -> tuple[object, object]:
    """What the decoder makes of ``header`` (a Frame or the error's text), and what the general path makes of it."""
    results = []
    for decode in (lambda: _next_frame_of(header), lambda: _frame_from_header(_decode_header(header), b"")):
        try:
            results.append(decode())
        except ProtocolError as e:
            results.append(str(e))
    return results[0], results[1]


def _next_frame_of(header: bytes) -> Frame:
    decoder = FrameDecoder()
    decoder.feed(_frame_bytes(header))
    return decoder.next_frame()


@pytest.mark.parametrize("depth", range(26, 36))
def test_the_ext_fast_path_refuses_the_same_nesting_as_the_general_path(depth):
    # The fast path decodes the ext alone, one level less deep than inside the header map.
    value: object = 1
    for _ in range(depth):
        value = [value]
    header = cbor2.dumps({"code": 10, "opaque": 1, "flag": 0, "version": 0, "ext": {"a": value}})
    fast, general = _decoded_either_way(header)
    assert fast == general


@given(ext=st.dictionaries(st.text(max_size=12), json_like, max_size=5), tail=st.binary(max_size=3))
@settings(max_examples=200)
def test_the_ext_fast_path_agrees_with_the_general_path(ext, tail):
    header = cbor2.dumps({"code": 10, "opaque": 70000, "flag": 1, "version": 0, "ext": ext}) + tail
    fast, general = _decoded_either_way(header)
    assert fast == general


def test_non_shortest_int_forms_are_accepted():
    header = b"\xa4\x64code\x18\x05\x66opaque\x1a\x00\x00\x00\x01\x64flag\x19\x00\x00\x67version\x00"
    decoder = FrameDecoder()
    decoder.feed(_frame_bytes(header))
    assert decoder.next_frame() == Frame(code=5, opaque=1)


def test_large_frame_in_small_pieces_after_small_frames():
    frames = [Frame(code=1, opaque=i, body=bytes([i]) * 100) for i in range(5)]
    frames.append(Frame(code=2, body=b"L" * 3_000_000))
    stream = b"".join(encode(f) for f in frames)
    decoder = FrameDecoder()
    out = []
    for i in range(0, len(stream), 4093):
        decoder.feed(stream[i:i + 4093])
        while (frame := decoder.next_frame()) is not NEED_DATA:
            out.append(frame)
    assert out == frames


def test_make_response_cuts_a_remark_that_quotes_a_huge_value():
    # Remarks quote refused values; a value of megabytes made an answer larger than a frame (then SYSTEM_ERROR).
    from remoting.codec import MAX_REMARK_LENGTH, cut_remark

    request = make_request(34)
    remark = f"got {[0] * 2_000_000!r}"
    response = make_response(request, 1001, remark=remark)
    assert len(response.remark) < MAX_REMARK_LENGTH + 64
    assert response.remark.startswith("got [0, 0") and response.remark.endswith(
        f"... ({len(remark) - MAX_REMARK_LENGTH} more characters cut)")
    assert make_response(request, 1001, remark="short").remark == "short"
    assert make_response(request, 0).remark is None
    assert cut_remark("x" * MAX_REMARK_LENGTH) == "x" * MAX_REMARK_LENGTH


@given(frames.filter(lambda f: bool(f.ext)))
@settings(max_examples=100)
def test_an_encoded_ext_is_written_as_it_is_and_reads_as_its_map(frame):
    encoded = EncodedExt(cbor2.dumps(frame.ext))
    assert encode(Frame(frame.code, frame.opaque, frame.flag, frame.version, frame.remark, encoded, frame.body)) \
        == encode(frame)
    assert encoded == frame.ext and dict(encoded) == frame.ext and len(encoded) == len(frame.ext)
    assert repr(encoded) == repr(frame.ext) and EncodedExt(encoded.cbor) == encoded
    key = next(iter(frame.ext))
    assert encoded[key] == frame.ext[key] and encoded.get(key) == frame.ext[key] and key in encoded



# ---------------------------------------------------------------------------------------------- what CBOR expands to


def _header_with_ext_value(value: bytes) -> bytes:
    """A header whose ext is ``{"x": value}``, the value given as its CBOR bytes (as a hostile peer writes them)."""
    return b"\xa5" + cbor2.dumps(GOOD_HEADER)[1:] + cbor2.dumps("ext") + b"\xa1" + cbor2.dumps("x") + value


def test_a_header_over_the_limit_is_refused_from_the_length_prefix_alone():
    # 16 MiB of ``[{}, {}, ...]`` in an ext was a legal frame that decoded to 1.2 GB in 1.5 s. It is refused on its
    # 8-byte prefix: nothing of the header is buffered, let alone decoded.
    header_length = MAX_HEADER_SIZE + 1
    decoder = FrameDecoder(max_frame_size=16 * 1024 * 1024)
    decoder.feed(struct.pack(">II", 4 + header_length, header_length))
    with pytest.raises(ProtocolError, match=f"frame header of {header_length} bytes exceeds the maximum header "
                                            f"size of {MAX_HEADER_SIZE} bytes"):
        decoder.next_frame()
    assert decoder.buffered_bytes == 0
    bomb = _header_with_ext_value(b"\x9f" + b"\xa0" * (4 * MAX_HEADER_SIZE) + b"\xff")
    _expect_failure(_frame_bytes(bomb), "exceeds the maximum header size", max_frame_size=16 * 1024 * 1024)


@pytest.mark.parametrize("head", [b"\x7a", b"\x7b"], ids=["fast-path", "general-path"])
def test_a_header_of_exactly_the_limit_is_accepted(head):
    # Eight times what raftmq sends (a send at the properties limit: 33 KB), and a frame like any other. A 4-byte
    # string length is what cbor2 writes (the ext fast path); an 8-byte one is not, and takes the general path.
    size = 4 if head == b"\x7a" else 8
    text_length = MAX_HEADER_SIZE - len(_header_with_ext_value(head + bytes(size)))
    header = _header_with_ext_value(head + text_length.to_bytes(size, "big") + b"v" * text_length)
    assert len(header) == MAX_HEADER_SIZE
    decoder = FrameDecoder()
    decoder.feed(_frame_bytes(header, b"body"))
    assert decoder.next_frame() == Frame(code=10, opaque=1, ext={"x": "v" * text_length}, body=b"body")


def _lock_batch(queues: int) -> dict:
    # The densest real body: one map per 47 bytes.
    return {"consumer_group": "cg", "client_id": "192.168.0.1@1234#abc",
            "mq_set": [{"topic": f"Topic{i // 16}", "broker_name": "broker-a", "queue_id": i % 16}
                       for i in range(queues)]}


def _registration(topics: int) -> dict:
    return {f"t{i}": {"read_queue_nums": 8, "write_queue_nums": 8, "perm": 6, "topic_sys_flag": 0, "order": False}
            for i in range(topics)}


def _arrays_every(step: int, count: int) -> bytes:
    """``[[], 0, 0, ..., [], 0, ...]``: an empty array every ``step`` bytes, ``count`` of them."""
    return b"\x9f" + (b"\x80" + b"\x00" * (step - 1)) * count + b"\xff"


@pytest.mark.parametrize("body", [
    b"\x9f" + b"\xa0" * (1 << 20) + b"\xff",                      # [{}, {}, ...]: the 1.2 GB body, a 16th of it
    b"\x9a" + (1 << 20).to_bytes(4, "big") + b"\x80" * (1 << 20),   # [[], [], ...], of a definite length
    b"\x9f" + b"\x81\x80" * (1 << 19) + b"\xff",                    # [[[]], [[]], ...]
    cbor2.dumps(["x" * 200_000, [{"": 0}] * 300_000]),               # dense after a sparse start
    _arrays_every(BODY_BYTES_PER_CONTAINER // 2, 200_000),           # twice what the size allows
], ids=["maps", "arrays", "nested-arrays", "dense-tail", "twice-the-limit"])
def test_a_body_with_more_maps_and_arrays_than_its_size_allows_is_refused(body):
    with pytest.raises(BodyFormatError, match=r"its first \d+ bytes decode to \d+ maps and arrays, more than the "
                                              r"\d+ a request body may hold \(one per 16 bytes, plus 16384\)"):
        decode_body(body)
    assert gc.isenabled()  # paused for the decode only


@pytest.mark.parametrize("data", [
    _registration(40_000), _lock_batch(20_000), _lock_batch(3_000), [0] * 500_000, ["x" * 100] * 10_000,
    [[]] * (_WATCH_CHUNK - 3),
], ids=["registration-40k-topics", "lock-batch-20k-queues", "lock-batch-3k-queues", "small-ints", "strings",
        "small-enough-to-go-unwatched"])
def test_real_bodies_decode_as_cbor2_decodes_them(data):
    body = cbor2.dumps(data)
    assert decode_body(body) == data == cbor2.loads(body)
    assert decode_body(bytearray(body)) == data and decode_body(memoryview(body)) == data
    assert gc.isenabled()


def test_a_body_at_the_limit_is_accepted_and_collection_is_left_as_the_caller_had_it():
    count = 400_000
    body = _arrays_every(BODY_BYTES_PER_CONTAINER, count)
    assert count + 1 > _BODY_CONTAINERS_SLACK + _WATCH_CHUNK // BODY_BYTES_PER_CONTAINER  # really watched
    expected = ([[]] + [0] * (BODY_BYTES_PER_CONTAINER - 1)) * count
    assert decode_body(body) == expected
    gc.disable()
    try:
        assert decode_body(body) == expected
        with pytest.raises(BodyFormatError):
            decode_body(_arrays_every(1, count))
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("bad, text", [
    (cbor2.CBORTag(2, b"\x01" * 20), "tag 2"),
    (cbor2.CBORTag(4660, 1), "tag 4660"),
    ({"a": {1, 2}}, "tag 258"),
    (functools.reduce(lambda inner, _: [inner], range(MAX_BODY_DEPTH), 0), "nesting depth"),
], ids=["bignum", "unknown-tag", "set", "too-deep"])
def test_a_watched_body_is_held_to_the_rules_of_a_small_one(bad, text):
    body = cbor2.dumps({"pad": "x" * (2 * _WATCH_CHUNK), "bad": bad})
    with pytest.raises(BodyFormatError, match=text):
        decode_body(body)
    with pytest.raises(BodyFormatError, match="not valid CBOR"):
        decode_body(body[:-1])
    assert gc.isenabled()
