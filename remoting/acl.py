"""Request signing for ACL (RocketMQ's AclClientRPCHook and AclUtils), shared by the client that signs and the
broker that checks.

A client with credentials adds two ext fields to every request it sends: ``AccessKey`` (its account) and
``Signature``, the base64 of HMAC-SHA1 keyed by the account's secret key over the request's *content*::

    content = request code (uint32, big endian)
            | canonical CBOR of the ext map without "Signature"  (AccessKey included)
            | body

"Canonical CBOR" is RFC 7049 §3.9 as ``cbor2.dumps(..., canonical=True)`` writes it: map keys sorted (shortest
first, then bytewise), every integer, length and float in its shortest form. RocketMQ signs its ext values sorted
by name and joined as text, then the body; raftmq's ext values are CBOR items, not text, so the map is signed as
CBOR, keys included, in an encoding that cannot be ambiguous (joined text is: values "ab", "c" and "a", "bc" sign
alike). The request code is signed as well (RocketMQ does not), so that a captured request cannot be replayed as
another kind.

Why this covers exactly what the broker reads: the broker signs again what it *decoded* (code, ext map, body), and
re-encoding a decoded CBOR map canonically gives the same bytes whatever key order or integer widths the sender
used. A client's ``EncodedExt`` (the producer's pre-encoded sends) is decoded once to be signed: that costs only a
client with credentials, and nothing at all without (the pool binds signing in only then, ``RemotingClient``).
Nothing else of the frame (opaque, flag, version, remark) is signed: the broker acts on none of them but the
oneway flag, which only decides whether it answers.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct
from collections.abc import Mapping
from typing import Any, Final

import cbor2

from remoting.codec import Frame

__all__ = ["ACCESS_KEY", "SIGNATURE", "RequestSigner", "request_signature", "signature"]

ACCESS_KEY: Final = "AccessKey"
SIGNATURE: Final = "Signature"

_CODE = struct.Struct(">I")


def signature(secret_key: str, code: int, ext: Mapping[str, Any], body: bytes | bytearray | memoryview) -> str:
    """The ``Signature`` of a request with ``code``, ``ext`` (which must hold its ``AccessKey``; a ``Signature`` in it
    is left out) and ``body``, signed with ``secret_key``."""
    signed = {k: v for k, v in ext.items() if k != SIGNATURE} if SIGNATURE in ext else ext
    mac = hmac.new(secret_key.encode("utf-8"), _CODE.pack(code), hashlib.sha1)
    mac.update(cbor2.dumps(signed, canonical=True))
    mac.update(body)
    return base64.b64encode(mac.digest()).decode("ascii")


def request_signature(secret_key: str, request: Frame) -> str:
    """``signature`` of a received (decoded) request, as the broker computes it."""
    return signature(secret_key, request.code, request.ext, request.body)


class RequestSigner:
    """Signs requests with one account's credentials: ``sign(frame)`` returns a new frame whose ext also holds
    ``AccessKey`` and ``Signature`` (frames are shared, never changed)."""

    __slots__ = ("access_key", "_secret_key")

    def __init__(self, access_key: str, secret_key: str) -> None:
        if not isinstance(access_key, str) or not access_key:
            raise ValueError("access_key must be a non-empty string")
        if not isinstance(secret_key, str) or not secret_key:
            raise ValueError("secret_key must be a non-empty string")
        self.access_key = access_key
        self._secret_key = secret_key

    def __repr__(self) -> str:
        return f"RequestSigner(access_key={self.access_key!r})"  # never the secret

    def sign(self, request: Frame) -> Frame:
        # dict() of an EncodedExt decodes its CBOR; the copy also keeps the caller's map as it was.
        ext = dict(request.ext)
        ext.pop(SIGNATURE, None)
        ext[ACCESS_KEY] = self.access_key
        ext[SIGNATURE] = signature(self._secret_key, request.code, ext, request.body)
        return Frame(request.code, request.opaque, request.flag, request.version, request.remark, ext, request.body)
