"""The raftmq frame: a sans-IO encoder and an incremental decoder (no sockets, no trio).

The shape is RocketMQ's RemotingCommand with a CBOR header instead of JSON::

    0               4               8                     8+H                  4+T
    +---------------+---------------+----------------------+--------------------+
    | total_length  | header_length |   header (CBOR map)  |  body (raw bytes)  |
    |  uint32 BE    |   uint32 BE   |      H bytes         |   T - 4 - H bytes  |
    +---------------+---------------+----------------------+--------------------+

``total_length`` (T) counts every byte after itself: 4 + H + len(body). The header is one CBOR map with
short text keys: ``code``, ``opaque``, ``flag``, ``version`` (always present, unsigned ints < 2**31),
``remark`` (text, only when set) and ``ext`` (map with text keys, only when non-empty). Unknown header keys are
ignored so a newer peer may add some; CBOR tags are refused (a header is plain data: no regex, no shared
references, no sets) and so is anything after the map inside the header bytes.

Rules of the decoder, after h11: ``feed`` bytes in any split, call ``next_frame`` until it returns
``NEED_DATA``. A frame over ``max_frame_size`` is refused as soon as its 4-byte length arrives, and a header
over ``MAX_HEADER_SIZE`` as soon as its own length does, before any of it is buffered. Any error leaves the
decoder failed: every later call raises the same error, because after a bad frame the byte stream has no
trustworthy frame boundary left.

Decoded CBOR is many times larger than its bytes: an empty map is one byte on the wire and a 64-byte dict in
Python, so 16 MiB of ``[{}, {}, ...]`` made a 1.2 GB list in 1.5 s with the event loop (and the GIL) held, before
anyone knew who sent it. The header is bounded by its length (``MAX_HEADER_SIZE``); a request body, which may be
megabytes, by the maps and arrays its decoding makes (``decode_body``).

The header's fixed part is encoded by hand: cbor2 spends ~3.5 µs on a 4-key map, the hand-written encoder
~1 µs, and the bytes are identical to ``cbor2.dumps`` of the same map (a test pins it).
"""

from __future__ import annotations

import gc
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import cbor2

from remoting.errors import FrameTooLargeError, ProtocolError, RemotingError

__all__ = [
    "BODY_BYTES_PER_CONTAINER", "BodyFormatError", "DEFAULT_MAX_FRAME_SIZE", "EncodedExt", "FLAG_ONEWAY",
    "FLAG_RESPONSE", "Frame", "FrameDecoder", "MAX_BODY_DEPTH", "MAX_HEADER_SIZE", "MAX_REMARK_LENGTH", "NEED_DATA",
    "cut_remark", "decode_body", "encode", "make_request", "make_response",
]

FLAG_RESPONSE: Final = 0x1
FLAG_ONEWAY: Final = 0x2
DEFAULT_MAX_FRAME_SIZE: Final = 16 * 1024 * 1024
# What a server takes from whoever connects. The largest request header our own code sends is a send's at the
# properties limit (MAX_PROPERTIES_SIZE, 32767 bytes as stored): 33,283 bytes with the longest topic and group; a
# remark cut at MAX_REMARK_LENGTH of 4-byte characters takes 16,573. Eight times the largest leaves room for fields
# to come; a larger header is refused as a bad frame, before any of it is buffered, because it decodes to as much
# as 70 bytes of Python objects per byte (a list of empty maps) before anything can judge it. Answers can be larger
# (a batch send's answer lists every message id: 33 bytes each), so a client reads them bounded by its frame size
# only (``FrameDecoder``'s ``max_header_size``).
MAX_HEADER_SIZE: Final = 256 * 1024
# The four fixed header fields are Java ints in RocketMQ; keeping them below 2**31 keeps us compatible in spirit.
MAX_HEADER_INT: Final = 2**31 - 1

# total_length(4, BE) | header_length(4, BE)
PREFIX = struct.Struct(">II")
_U8 = struct.Struct(">BB")
_U16 = struct.Struct(">BH")
_U32 = struct.Struct(">BI")


class _NeedData:
    """The decoder's answer when it holds no complete frame yet (a singleton, compare with ``is``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()


class EncodedExt(Mapping[str, Any]):
    """A frame's ext given as its CBOR bytes, by a sender that encodes its own ext faster than cbor2 can (the
    producer's sends: the same keys in the same order every time, most values fixed): ``encode`` writes the bytes
    as they are. They must be the CBOR of a non-empty map with text keys, as ``cbor2.dumps`` writes it (the
    sender's tests compare the two). Read as a mapping it decodes them, once, on first use."""

    __slots__ = ("cbor", "_map")

    def __init__(self, cbor: bytes) -> None:
        self.cbor = cbor
        self._map: dict[str, Any] | None = None

    def _decoded(self) -> dict[str, Any]:
        m = self._map
        if m is None:
            m = self._map = cbor2.loads(self.cbor)
        return m

    def __getitem__(self, key: str) -> Any:
        return self._decoded()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())

    def __len__(self) -> int:
        return len(self._decoded())

    def __eq__(self, other: object) -> bool:
        return self._decoded() == (other._decoded() if isinstance(other, EncodedExt) else other)

    __hash__ = None  # type: ignore[assignment]  # like the dict it stands for

    def __repr__(self) -> str:
        return repr(self._decoded())


@dataclass(slots=True)
class Frame:
    """One request or response. Treat it as immutable (``ext`` included): frames are shared, not copied.
    It is not a frozen dataclass only because freezing triples the cost of building one (1.6 µs vs 0.45 µs),
    paid for every frame on the hot path."""

    code: int
    opaque: int = 0
    flag: int = 0
    version: int = 0
    remark: str | None = None
    ext: dict[str, Any] | EncodedExt = field(default_factory=dict)  # an EncodedExt only in frames built to send
    body: bytes = b""

    @property
    def is_response(self) -> bool:
        return bool(self.flag & FLAG_RESPONSE)

    @property
    def is_oneway(self) -> bool:
        return bool(self.flag & FLAG_ONEWAY)

    def __repr__(self) -> str:
        # Bodies may hold user messages: show their size, never their bytes (conventions: no bodies in logs).
        kind = "response" if self.flag & FLAG_RESPONSE else ("oneway" if self.flag & FLAG_ONEWAY else "request")
        return (f"Frame({kind} code={self.code} opaque={self.opaque} flag={self.flag} version={self.version} "
                f"remark={self.remark!r} ext={self.ext!r} body={len(self.body)}B)")


def make_request(code: int, ext: dict[str, Any] | EncodedExt | None = None, body: bytes = b"",
                 oneway: bool = False) -> Frame:
    """A request frame. Its ``opaque`` is 0: the connection that sends it stamps its own request id."""
    return Frame(int(code), 0, FLAG_ONEWAY if oneway else 0, 0, None, ext if ext is not None else {}, body)


# A remark explains; it never needs more than this. Remarks quote the values they refuse, and a value sent in a
# request may be megabytes (a list in a heartbeat body): quoted whole, the answer to a malformed request outgrew
# the frame limit and became SYSTEM_ERROR.
MAX_REMARK_LENGTH: Final = 4096


def cut_remark(remark: str) -> str:
    """``remark`` if it is at most ``MAX_REMARK_LENGTH`` characters, else its start and how much was cut."""
    if len(remark) <= MAX_REMARK_LENGTH:
        return remark
    return f"{remark[:MAX_REMARK_LENGTH]}... ({len(remark) - MAX_REMARK_LENGTH} more characters cut)"


def make_response(request: Frame, code: int, remark: str | None = None, ext: dict[str, Any] | None = None,
                  body: bytes = b"") -> Frame:
    """The response to ``request``: same ``opaque`` and ``version``, the response flag set; a remark longer than
    ``MAX_REMARK_LENGTH`` is cut (``cut_remark``)."""
    if remark is not None and len(remark) > MAX_REMARK_LENGTH:
        remark = cut_remark(remark)
    return Frame(int(code), request.opaque, FLAG_RESPONSE, request.version, remark,
                 ext if ext is not None else {}, body)


# Pre-encoded CBOR for the fixed keys and for small unsigned ints (major type 0, values 0..23 in one byte).
_SMALL_UINTS = [bytes((n,)) for n in range(24)]
_KEY_CODE = cbor2.dumps("code")
_KEY_OPAQUE = cbor2.dumps("opaque")
_KEY_FLAG = cbor2.dumps("flag")
_KEY_VERSION = cbor2.dumps("version")
_KEY_REMARK = cbor2.dumps("remark")
_KEY_EXT = cbor2.dumps("ext")
_MAP4, _MAP5, _MAP6 = b"\xa4", b"\xa5", b"\xa6"


def _uint(value: int, name: str) -> bytes:
    # type() rather than isinstance(): bool is an int subclass and must be refused; IntEnum members are
    # converted by make_request/make_response, and the slow branch below accepts them too.
    if type(value) is not int:
        if isinstance(value, int) and not isinstance(value, bool):
            value = int(value)
        else:
            raise ProtocolError(f"header field {name!r} must be an int, got {value!r}")
    if value < 24:
        if value < 0:
            raise ProtocolError(f"header field {name!r} must be >= 0, got {value}")
        return _SMALL_UINTS[value]
    if value < 0x100:
        return _U8.pack(0x18, value)
    if value < 0x10000:
        return _U16.pack(0x19, value)
    if value <= MAX_HEADER_INT:
        return _U32.pack(0x1A, value)
    raise ProtocolError(f"header field {name!r} must be <= {MAX_HEADER_INT}, got {value}")


# Key tuples already found to be all str: a request kind's ext has the same keys every time, and one set lookup
# (~0.2 µs) replaces a generator over them (~0.4 µs), paid on every frame with an ext. Decoded keys come from
# peers, so the cache is bounded in entries and each entry in size: a peer sending ever new (or huge) key sets
# is only not cached, it cannot grow this.
_STR_KEY_TUPLES: set[tuple[Any, ...]] = set()
_STR_KEY_TUPLES_MAX = 1024
_STR_KEY_TUPLE_MAX_CHARS = 512


def _str_keys(ext: dict[Any, Any]) -> bool:
    keys = tuple(ext)
    if keys in _STR_KEY_TUPLES:
        return True
    chars = 0
    for k in keys:
        if type(k) is not str:
            return False
        chars += len(k)
    if chars <= _STR_KEY_TUPLE_MAX_CHARS and len(_STR_KEY_TUPLES) < _STR_KEY_TUPLES_MAX:
        _STR_KEY_TUPLES.add(keys)
    return True


def encode(frame: Frame, *, opaque: int | None = None) -> bytes:
    """The frame's wire bytes. ``opaque`` overrides ``frame.opaque`` (connections stamp request ids this way,
    so one request frame can be sent many times). Raises ``ProtocolError`` for a field of the wrong type; an
    ``EncodedExt`` is written as it is."""
    code, flag, version, remark, ext, body = frame.code, frame.flag, frame.version, frame.remark, frame.ext, \
        frame.body
    if opaque is None:
        opaque = frame.opaque
    # Flag and version are almost always tiny: one table lookup instead of a call.
    flag_bytes = _SMALL_UINTS[flag] if type(flag) is int and 0 <= flag < 24 else _uint(flag, "flag")
    version_bytes = _SMALL_UINTS[version] if type(version) is int and 0 <= version < 24 else _uint(version,
                                                                                                    "version")
    parts = [_MAP4, _KEY_CODE, _uint(code, "code"), _KEY_OPAQUE, _uint(opaque, "opaque"),
             _KEY_FLAG, flag_bytes, _KEY_VERSION, version_bytes]
    if remark is not None:
        if type(remark) is not str:
            raise ProtocolError(f"header field 'remark' must be a str or None, got {remark!r}")
        parts[0] = _MAP5
        parts.append(_KEY_REMARK)
        parts.append(cbor2.dumps(remark))
    if type(ext) is EncodedExt:
        parts[0] = _MAP6 if remark is not None else _MAP5
        parts.append(_KEY_EXT)
        parts.append(ext.cbor)
    elif ext:
        if type(ext) is not dict or not _str_keys(ext):
            raise ProtocolError(f"header field 'ext' must be a dict with str keys, got {ext!r}")
        parts[0] = _MAP6 if remark is not None else _MAP5
        parts.append(_KEY_EXT)
        try:
            parts.append(cbor2.dumps(ext))
        except (cbor2.CBOREncodeError, TypeError, ValueError) as e:
            raise ProtocolError(f"header field 'ext' cannot be encoded as CBOR: {e}") from None
    if type(body) is not bytes and not isinstance(body, (bytearray, memoryview)):
        raise ProtocolError(f"frame body must be bytes, got {type(body).__name__}")
    header = b"".join(parts)
    return b"".join((PREFIX.pack(4 + len(header) + len(body), len(header)), header, body))


class _TagRefused(Exception):
    pass


def _refuse_tag(decoder: Any, *args: Any) -> Any:
    raise _TagRefused("CBOR tags are not allowed in a frame header")


# Every semantic tag cbor2 6 decodes by itself (datetimes, bignums, regex, MIME, shared references, sets, ...)
# is refused; unknown tags go to tag_hook, refused too.
_REFUSED_TAGS = {t: _refuse_tag for t in (0, 1, 2, 3, 4, 5, 25, 28, 29, 30, 35, 36, 37, 100, 256, 258, 260,
                                          261, 1004, 55799)}
_HEADER_KEYS = ("code", "opaque", "flag", "version")

# Fast path for the commonest header: exactly the 4 fixed keys in our order with uint values below 2**31, as
# ``encode`` writes a frame without remark and ext. A full match leaves no room for tags or trailing bytes, so
# it needs none of the checks below and costs half of cbor2 plus validation. Anything else (another key order,
# a remark, an ext but for the case below) takes the general path, which accepts the same frames and explains
# the bad ones.
_UINT31 = rb"([\x00-\x17]|\x18.|\x19..|\x1a[\x00-\x7f]...)"
_CANONICAL_FIXED_HEADER = re.compile(
    rb"\xa4\x64code" + _UINT31 + rb"\x66opaque" + _UINT31 + rb"\x64flag" + _UINT31 + rb"\x67version" + _UINT31,
    re.DOTALL).fullmatch
# The same four fields in a 5-key map whose fifth key is ``ext``, as ``encode`` writes a frame with an ext and no
# remark (every send and its answer): a prefix match, after which only the ext's value is left for cbor2
# (``_ext_after``), which then decodes half as many items.
_CANONICAL_EXT_HEADER = re.compile(
    rb"\xa5\x64code" + _UINT31 + rb"\x66opaque" + _UINT31 + rb"\x64flag" + _UINT31 + rb"\x67version" + _UINT31
    + rb"\x63ext", re.DOTALL).match


# Catching bytes after the map: cbor2.loads ignores trailing data, and a stream decoder that reports its position
# costs ~2x. So the header is decoded as the 2-item array ``[header, SENTINEL]``: if the header region holds
# exactly one item, the second element is the sentinel; extra bytes become the second element instead, and a
# truncated item swallows the sentinel. (Junk that begins with the sentinel's own 17 bytes would slip through
# and be ignored, which is harmless.)
_SENTINEL_VALUE = bytes.fromhex("9e3779b97f4a7c15f39c06015ced0834")
_ARRAY2 = b"\x82"
_SENTINEL_ITEM = cbor2.dumps(_SENTINEL_VALUE)


def _decode_header(header: bytes | bytearray) -> dict[str, Any]:
    try:
        # The tag-refusing hooks cost cbor2 ~0.04 µs a header; looking for a tag's first byte in the header
        # (to skip them where none can be) cost 0.2 µs.
        pair = cbor2.loads(b"".join((_ARRAY2, header, _SENTINEL_ITEM)), semantic_decoders=_REFUSED_TAGS,
                           tag_hook=_refuse_tag, strict_hashable_types=True, max_depth=32)
    except _TagRefused as e:
        raise ProtocolError(f"malformed frame header: {e}") from None
    except Exception as e:
        # cbor2 reports bad input with CBORDecodeError but also ValueError/OverflowError/... on odd items;
        # every one of them means the same thing here.
        cause = e.__cause__ if isinstance(e.__cause__, _TagRefused) else e
        raise ProtocolError(f"malformed frame header: not valid CBOR ({cause})") from None
    if pair[1] != _SENTINEL_VALUE:
        raise ProtocolError("malformed frame header: the header bytes hold more (or less) than one CBOR item")
    value = pair[0]
    if type(value) is not dict:
        raise ProtocolError(f"malformed frame header: expected a CBOR map, got {type(value).__name__}")
    return value


def _ext_after(header: bytes, start: int) -> dict[str, Any] | None:
    """The ext map that ends a header matched by ``_CANONICAL_EXT_HEADER`` up to ``start``, or None where the
    general path must decide (a tag, bad CBOR, trailing bytes, an ext that is not a map with text keys): that
    path accepts the same headers with the same result, and explains the bad ones."""
    try:
        # One level less than _decode_header's limit: there the ext sits inside the header map.
        pair = cbor2.loads(b"".join((_ARRAY2, header[start:], _SENTINEL_ITEM)), semantic_decoders=_REFUSED_TAGS,
                           tag_hook=_refuse_tag, strict_hashable_types=True, max_depth=31)
    except Exception:
        return None
    ext = pair[0]
    if pair[1] != _SENTINEL_VALUE or type(ext) is not dict or not _str_keys(ext):
        return None
    return ext


# A request body that is CBOR (registrations, heartbeats, lock and admin requests) is held to the header's rules
# for tags and nesting: plain data, no tags, nesting bounded. With tags allowed, a bignum (tag 2/3) of 5000
# digits reached a remark's repr() and Python's int-to-str limit raised there: SYSTEM_ERROR with a traceback
# where INVALID_REQUEST naming the body belonged, on the name server and the broker alike.
MAX_BODY_DEPTH: Final = 32


class BodyFormatError(RemotingError):
    """A request body that is not one plain CBOR item; the server answers INVALID_REQUEST naming ``body`` and the
    connection lives on (unlike a bad header, the frame boundaries are intact)."""


class _BodyTagRefused(Exception):
    pass


def _refuse_body_tag(number: int) -> Any:
    def refuse(decoder: Any, *args: Any) -> Any:
        raise _BodyTagRefused(f"CBOR tag {number} is not allowed in a request body (it is plain data: no "
                              f"bignums, dates, sets or shared references)")
    return refuse


def _refuse_unknown_body_tag(*args: Any) -> Any:
    # cbor2 6 calls it with (tag, immutable), 5 with (decoder, tag): the tag is whichever argument is one.
    number = next((a.tag for a in args if isinstance(a, cbor2.CBORTag)), "?")
    raise _BodyTagRefused(f"CBOR tag {number} is not allowed in a request body (it is plain data)")


_REFUSED_BODY_TAGS = {t: _refuse_body_tag(t) for t in _REFUSED_TAGS}


# What a request body may decode to. CBOR is dense: an empty map or array is one byte and a 56 to 64-byte Python
# object, so 16 MiB of ``[{}, {}, ...]`` was a 1.2 GB list built in 1.5 s, the GIL held throughout (and arrays,
# which the garbage collector walks again and again while they pile up, took longer still). Real bodies hold few
# containers for their size: a lock batch one per 47 bytes, a heartbeat one per ~85, a broker registration one
# per 70 to 93. So a body larger than _WATCH_CHUNK may make at most one map or array per BODY_BYTES_PER_CONTAINER
# bytes of it read so far, plus _BODY_CONTAINERS_SLACK. Containers are counted where the interpreter counts them:
# every map or array cbor2 makes is a garbage-collected object, whose allocation adds one to
# ``gc.get_count()[0]`` while collection is paused (it is, for the decode: no collection can reset the count, and
# none walks the half-built result over and over, which made arrays of empty arrays 3x slower). The count is read
# each time cbor2 asks for the next _WATCH_CHUNK (a seekable file is read ``read_size`` bytes at a time), so a body
# is refused within a chunk of where it went wrong, having cost milliseconds. It is process-wide: another thread
# may allocate meanwhile, which the slack absorbs. (Between chunks cbor2 is back in Python code, where a thread
# waiting for the GIL gets it: a 250 ms decode kept another thread from running for 235 ms, now for 21.)
# What remains is the cost of scalars, which no counter sees: 16 MiB of small strings, ints or map entries with
# shared one-character keys still decodes to 8-25 bytes per byte in 0.5-0.8 s (a broker registration of that size:
# 6.5 bytes per byte, 0.3 s).
BODY_BYTES_PER_CONTAINER: Final = 16
_BODY_CONTAINERS_SLACK = 16384
_WATCH_CHUNK = 64 * 1024


class _BodyTooDense(Exception):
    pass


class _WatchedBody:
    """A body as the file cbor2's decoder reads, in ``_WATCH_CHUNK`` pieces, each handed out only while the maps
    and arrays made since decoding began are within what the bytes handed out so far may make (collection must be
    paused meanwhile, see above)."""

    __slots__ = ("_data", "_pos", "_count_at_start")

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0
        self._count_at_start = gc.get_count()[0]

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = (0, self._pos, len(self._data))[whence] + offset
        return self._pos

    def read(self, size: int = -1) -> bytes:
        pos = self._pos
        containers = gc.get_count()[0] - self._count_at_start
        allowed = pos // BODY_BYTES_PER_CONTAINER + _BODY_CONTAINERS_SLACK
        if containers > allowed:
            raise _BodyTooDense(f"its first {pos} bytes decode to {containers} maps and arrays, more than the "
                                f"{allowed} a request body may hold (one per {BODY_BYTES_PER_CONTAINER} bytes, plus "
                                f"{_BODY_CONTAINERS_SLACK})")
        end = len(self._data) if size < 0 else min(len(self._data), pos + size)
        self._pos = end
        return self._data[pos:end]


def decode_body(body: bytes | bytearray | memoryview) -> Any:
    """The one CBOR item of a request body, decoded as a header is (tags refused, nesting at most
    ``MAX_BODY_DEPTH``) but for map keys: integer keys stay allowed, as bodies (queue id → offset maps, a newer
    peer's extra fields) had them. A body over 64 KiB is refused once it has made more than one map or array per
    16 of its bytes (``BODY_BYTES_PER_CONTAINER``) plus 16384; garbage collection is paused while it decodes.
    ``BodyFormatError`` says what is wrong. Every server's body decoding goes through here; replicated and stored
    data, which only the group itself wrote, do not."""
    try:
        if len(body) <= _WATCH_CHUNK:
            return cbor2.loads(body, semantic_decoders=_REFUSED_BODY_TAGS, tag_hook=_refuse_unknown_body_tag,
                               max_depth=MAX_BODY_DEPTH)
        paused = gc.isenabled()
        if paused:
            gc.disable()
        try:
            watched = _WatchedBody(body if type(body) is bytes else bytes(body))
            return cbor2.CBORDecoder(watched, semantic_decoders=_REFUSED_BODY_TAGS,
                                     tag_hook=_refuse_unknown_body_tag, max_depth=MAX_BODY_DEPTH,
                                     read_size=_WATCH_CHUNK).decode()
        finally:
            if paused:
                gc.enable()
    except (_BodyTagRefused, _BodyTooDense) as e:
        raise BodyFormatError(str(e)) from None
    except Exception as e:  # cbor2 raises several unrelated types on garbage, all meaning the same here
        if isinstance(e.__cause__, (_BodyTagRefused, _BodyTooDense)):
            raise BodyFormatError(str(e.__cause__)) from None
        raise BodyFormatError(f"not valid CBOR ({e})") from None


def _frame_from_header(header: dict[str, Any], body: bytes) -> Frame:
    get = header.get
    code, opaque, flag, version = get("code"), get("opaque"), get("flag"), get("version")
    remark, ext = get("remark"), get("ext")
    # One combined test for the usual frame; the slow path below only runs to name what is wrong.
    if (type(code) is int and type(opaque) is int and type(flag) is int and type(version) is int
            and 0 <= code <= MAX_HEADER_INT and 0 <= opaque <= MAX_HEADER_INT and 0 <= flag <= MAX_HEADER_INT
            and 0 <= version <= MAX_HEADER_INT and (remark is None or type(remark) is str)):
        if ext is None:
            return Frame(code, opaque, flag, version, remark, {}, body)
        if type(ext) is dict and _str_keys(ext):
            return Frame(code, opaque, flag, version, remark, ext, body)
        raise ProtocolError(f"malformed frame header: field 'ext' must be a map with text keys, got {ext!r}")
    for key in _HEADER_KEYS:
        value = header.get(key)
        if value is None:
            raise ProtocolError(f"malformed frame header: missing field {key!r}")
        if type(value) is not int:
            raise ProtocolError(f"malformed frame header: field {key!r} must be an int, got {value!r}")
        if not 0 <= value <= MAX_HEADER_INT:
            raise ProtocolError(f"malformed frame header: field {key!r} must be within 0..{MAX_HEADER_INT}, "
                                f"got {value}")
    raise ProtocolError(f"malformed frame header: field 'remark' must be text, got {remark!r}")


# Up to this many buffered bytes, leftover and new data are joined into bytes rather than kept in a bytearray.
_CONCAT_LIMIT = 512 * 1024


class FrameDecoder:
    """Incremental decoder: ``feed(data)``, then ``next_frame()`` until it returns ``NEED_DATA``."""

    __slots__ = ("max_frame_size", "max_header_size", "_buf", "_pos", "_error")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, *,
                 max_header_size: int = MAX_HEADER_SIZE) -> None:
        if type(max_frame_size) is not int or max_frame_size < 16:
            raise ValueError(f"max_frame_size must be an int >= 16, got {max_frame_size!r}")
        self.max_frame_size = max_frame_size
        # A server's guard against whoever connects (the default); a client reading the answers of the servers it
        # chose to dial passes its frame size: a batch send's answer holds every message id in its header (33
        # bytes each with an IPv4 store host), past 256 KiB for a batch over ~7,900 messages.
        self.max_header_size = max_header_size
        # The usual receive holds whole frames only: it is kept as the immutable bytes it arrived in (no copy)
        # and sliced; a bytearray appears only while a frame straddles two receives.
        self._buf: bytes | bytearray = b""
        self._pos = 0
        self._error: ProtocolError | None = None

    @property
    def failed(self) -> ProtocolError | None:
        """The error that failed this decoder, or None."""
        return self._error

    @property
    def buffered_bytes(self) -> int:
        """Bytes received but not yet returned as frames (left over at end of stream: a truncated frame)."""
        return len(self._buf) - self._pos

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is not None:
            raise self._error
        buf, pos = self._buf, self._pos
        if pos == len(buf):
            self._buf = data if type(data) is bytes else bytes(data)
            self._pos = 0
        elif type(buf) is bytes and len(buf) - pos + len(data) <= _CONCAT_LIMIT:
            # A receive rarely ends on a frame boundary: join the leftover tail and the new data into fresh
            # bytes (the same one copy as appending to a bytearray), so frames keep being sliced from bytes.
            self._buf = b"".join((memoryview(buf)[pos:], data))
            self._pos = 0
        else:
            # A large frame arriving in pieces: accumulate in a bytearray, linear in its size.
            if type(buf) is bytes:
                self._buf = bytearray(memoryview(buf)[pos:])
                self._pos = 0
            self._buf += data

    def next_frame(self) -> Frame | _NeedData:
        if self._error is not None:
            raise self._error
        buf, pos = self._buf, self._pos
        available = len(buf) - pos
        if available < 8:
            if available >= 4:
                self._check_total(int.from_bytes(buf[pos:pos + 4], "big"))
            return NEED_DATA
        total, header_length = PREFIX.unpack_from(buf, pos)
        self._check_total(total)
        if header_length == 0 or header_length > total - 4:
            self._fail(ProtocolError(f"bad frame: header_length {header_length} does not fit in total_length "
                                     f"{total} (must be 1..{total - 4})"))
        if header_length > self.max_header_size:
            self._fail(ProtocolError(f"frame header of {header_length} bytes exceeds the maximum header size of "
                                     f"{self.max_header_size} bytes (large data belongs in the body)"))
        end = pos + 4 + total
        if len(buf) < end:
            return NEED_DATA
        header_end = pos + 8 + header_length
        if type(buf) is bytes:
            header, body = buf[pos + 8:header_end], buf[header_end:end]
        else:
            header, body = bytes(buf[pos + 8:header_end]), bytes(buf[header_end:end])
        match = _CANONICAL_FIXED_HEADER(header)
        if match is not None:
            ext: dict[str, Any] | None = {}
        else:
            match = _CANONICAL_EXT_HEADER(header)
            ext = _ext_after(header, match.end()) if match is not None else None
        if ext is not None:
            code, opaque, flag, version = match.groups()
            frame = Frame(code[0] if len(code) == 1 else int.from_bytes(code[1:], "big"),
                          opaque[0] if len(opaque) == 1 else int.from_bytes(opaque[1:], "big"),
                          flag[0] if len(flag) == 1 else int.from_bytes(flag[1:], "big"),
                          version[0] if len(version) == 1 else int.from_bytes(version[1:], "big"),
                          None, ext, body)
        else:
            try:
                frame = _frame_from_header(_decode_header(header), body)
            except ProtocolError as e:
                self._fail(e)
        if type(buf) is bytearray and end > 65536 and end < len(buf):
            # Many frames in a bytearray: drop the consumed prefix now and then, not after every frame.
            del buf[:end]
            self._pos = 0
        else:
            self._pos = end
        return frame

    def _check_total(self, total: int) -> None:
        if total > self.max_frame_size:
            self._fail(FrameTooLargeError(total, self.max_frame_size))
        if total < 5:
            self._fail(ProtocolError(f"bad frame: total_length {total} is below the minimum of 5 "
                                     "(header_length field plus a 1-byte header)"))

    def _fail(self, error: ProtocolError) -> Any:
        self._error = error
        self._buf = b""
        self._pos = 0
        raise error
