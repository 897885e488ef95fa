"""Member requests on the service port: signed with the group's ``dledger.secret``, so that only members are served.

A member copies commit-log bytes from a peer with ``FETCH_COMMIT_LOG`` on the peer's service port, the port every
client reaches. Unauthenticated, that request handed anyone who could reach the port every stored message, past
any ACL (the broker's ACL judges clients' requests, and this one is no client's). The Raft port authenticates every
frame with the group's secret (``dledger.patches``); the service port's member requests now carry a MAC keyed by
the same secret, so that the two ways into a member's log are guarded alike.

The MAC is ``remoting.acl.signature`` (HMAC-SHA1 over the request code, the canonical CBOR of the ext without
``MemberSignature``, and the body), keyed by a key derived from the secret in a context of its own (BLAKE3's
key derivation, as the Raft frames' key is, in another context), so that neither MAC can be turned into the other.
Like an ACL signature it binds what the request asks (group, offset, size), not when: a recorded request can be
sent again, which hands its sender the bytes it could already see on the wire (use TLS where the network is not
trusted).
"""

from __future__ import annotations

import hmac
from typing import Final

import blake3

from remoting.acl import signature
from remoting.codec import Frame

__all__ = ["MEMBER_SIGNATURE", "MemberSigner"]

MEMBER_SIGNATURE: Final = "MemberSignature"

# A new context is a new wire version: members of another version cannot fetch from each other.
_KEY_CONTEXT: Final = "raftmq-dledger-v1 2026-11-29 member request MAC key"


class MemberSigner:
    """Signs and checks member requests with one group's secret (``sign`` returns a new frame: frames are shared)."""

    __slots__ = ("_key",)

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("a DLedger member needs a non-empty cluster secret")
        self._key = blake3.blake3(secret.encode(), derive_key_context=_KEY_CONTEXT).hexdigest()

    def __repr__(self) -> str:
        return "MemberSigner()"  # never the key

    def _mac(self, request: Frame) -> str:
        ext = request.ext
        if MEMBER_SIGNATURE in ext:
            ext = {k: v for k, v in ext.items() if k != MEMBER_SIGNATURE}
        return signature(self._key, request.code, ext, request.body)

    def sign(self, request: Frame) -> Frame:
        ext = {k: v for k, v in request.ext.items() if k != MEMBER_SIGNATURE}
        signed = Frame(request.code, request.opaque, request.flag, request.version, request.remark, ext, request.body)
        ext[MEMBER_SIGNATURE] = self._mac(signed)
        return signed

    def verify(self, request: Frame) -> bool:
        """Whether ``request`` carries this group's member signature of what it asks."""
        sent = request.ext.get(MEMBER_SIGNATURE)
        if not isinstance(sent, str):
            return False
        return hmac.compare_digest(sent.encode("ascii", "replace"), self._mac(request).encode("ascii"))
