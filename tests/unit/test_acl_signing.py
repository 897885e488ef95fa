"""ACL request signing (remoting/acl.py): what is signed, and that the broker's view of a received frame signs alike
whatever its encoding; the client's credentials."""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct

import cbor2
import pytest

from client.instance import ClientConfig
from remoting.acl import ACCESS_KEY, SIGNATURE, RequestSigner, request_signature, signature
from remoting.codec import EncodedExt, FrameDecoder, encode, make_request
from remoting.config import ConfigError


def _received(frame):
    decoder = FrameDecoder()
    decoder.feed(encode(frame, opaque=7))
    return decoder.next_frame()


def test_the_signature_is_hmac_sha1_over_code_canonical_ext_and_body():
    ext = {"topic": "T", ACCESS_KEY: "producer1", "queue_id": 300}
    # Canonical CBOR sorts keys shortest first, then bytewise; integers in their shortest form.
    content = struct.pack(">I", 310) + cbor2.dumps({"topic": "T", "queue_id": 300, ACCESS_KEY: "producer1"},
                                                   canonical=True) + b"body"
    assert content[4:5] == b"\xa3" and content.index(b"topic") < content.index(b"queue_id") < content.index(b"Acc")
    expected = base64.b64encode(hmac.new(b"secret-key", content, hashlib.sha1).digest()).decode()
    assert signature("secret-key", 310, ext, b"body") == expected
    assert signature("secret-key", 310, {**ext, SIGNATURE: "ignored"}, b"body") == expected


def test_a_signed_frame_checks_out_as_the_broker_decodes_it_whatever_the_ext_encoding():
    signer = RequestSigner("producer1", "secret-key")
    fields = {"topic": "T", "queue_id": 1, "batch": False, "properties": "KEYS\x01k\x02", "born_timestamp": 2**40}
    for ext in (fields, dict(reversed(fields.items())), EncodedExt(cbor2.dumps(fields))):
        request = make_request(310, ext, b"body")
        signed = signer.sign(request)
        assert request.ext is ext and ACCESS_KEY not in request.ext  # shared frames are never changed
        got = _received(signed)
        assert got.ext[ACCESS_KEY] == "producer1"
        assert got.ext[SIGNATURE] == request_signature("secret-key", got)
        assert got.ext[SIGNATURE] != request_signature("other-secret", got)
    assert "secret-key" not in repr(signer)


def test_client_credentials_come_in_pairs_and_the_secret_stays_out_of_repr(monkeypatch):
    monkeypatch.delenv("RAFTMQ_ACCESS_KEY", raising=False)
    monkeypatch.delenv("RAFTMQ_SECRET_KEY", raising=False)
    assert ClientConfig().access_key == ""
    config = ClientConfig(access_key="producer1", secret_key="secret-key")
    assert "secret-key" not in repr(config)
    with pytest.raises(ConfigError, match="access_key is set but secret_key is not"):
        ClientConfig(access_key="producer1")
    with pytest.raises(ConfigError, match="secret_key must not contain control characters") as refused:
        ClientConfig(access_key="producer1", secret_key="secret-key\n")
    assert "secret-key" not in str(refused.value)
    monkeypatch.setenv("RAFTMQ_ACCESS_KEY", "from-env")
    monkeypatch.setenv("RAFTMQ_SECRET_KEY", "env-secret")
    assert (ClientConfig().access_key, ClientConfig().secret_key) == ("from-env", "env-secret")
