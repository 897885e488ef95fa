"""A broker's request bodies are decoded by the header's rules (``remoting.codec.decode_body``): a CBOR tag, a
bignum above all, is INVALID_REQUEST naming ``body``. Decoded as any CBOR, a 5000-digit queue_id reached a
remark's repr() and Python's int-to-str limit: SYSTEM_ERROR and a logged traceback."""

from __future__ import annotations

import cbor2
import pytest

from broker.acl import request_resources
from broker.processor.base import RequestRejected, request_data
from broker.processor.client_manage import ClientManageProcessor
from broker.processor.queue_lock import parse_lock_request
from remoting.codec import MAX_BODY_DEPTH, BodyFormatError, decode_body, make_request
from remoting.codes import RequestCode, ResponseCode

BIG = 10**5000


def _rejected_on_body(call) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        call()
    assert info.value.code == ResponseCode.INVALID_REQUEST and info.value.ext == {"field": "body"}
    assert len(info.value.remark) < 300
    return info.value


def test_a_bignum_in_a_lock_request_is_invalid_request_naming_the_body():
    body = cbor2.dumps({"consumer_group": "g", "client_id": "c1", "mq_set": [{"topic": "T", "queue_id": BIG}]})
    request = make_request(RequestCode.LOCK_BATCH_MQ, body=body)
    rejected = _rejected_on_body(lambda: parse_lock_request(request, "broker-a"))
    assert "tag 2" in rejected.remark


async def test_a_bignum_in_a_heartbeat_is_invalid_request_naming_the_body():
    body = cbor2.dumps({"client_id": "c1", "consumers": [{"consumer_group": "g", "subscriptions": [
        {"topic": "T", "sub_version": BIG}]}]})
    processor = ClientManageProcessor(node=None)  # refused before the node is asked anything
    with pytest.raises(RequestRejected) as info:
        await processor.heartbeat(make_request(RequestCode.HEART_BEAT, body=body), conn=None)
    assert info.value.code == ResponseCode.INVALID_REQUEST and info.value.ext == {"field": "body"}


@pytest.mark.parametrize("body, text", [
    (cbor2.dumps({"a": -(BIG)}), "tag 3"),
    (cbor2.dumps({"a": cbor2.CBORTag(4660, 1)}), "tag 4660"),
    (cbor2.dumps({"a": {1, 2}}), "tag 258"),
    (b"\x81" * (MAX_BODY_DEPTH + 1) + b"\x00", "nesting depth"),
    (b"\xff\x00", "not valid CBOR"),
], ids=["negative-bignum", "unknown-tag", "set", "too-deep", "garbage"])
def test_request_data_refuses_tags_deep_nesting_and_garbage(body, text):
    rejected = _rejected_on_body(lambda: request_data(make_request(RequestCode.HEART_BEAT, body=body)))
    assert text in rejected.remark
    with pytest.raises(BodyFormatError, match=text):
        decode_body(body)


def test_plain_bodies_decode_as_before_and_acl_resources_skip_a_refused_one():
    plain = {"consumer_group": "g", "mq_set": [{"topic": "T", "queue_id": 2**64 - 1}], "n": -(2**64), "b": b"x"}
    assert request_data(make_request(RequestCode.LOCK_BATCH_MQ, body=cbor2.dumps(plain))) == plain
    assert decode_body(b"\x81" * MAX_BODY_DEPTH + b"\x00") is not None
    tagged = cbor2.dumps({"consumer_group": cbor2.CBORTag(4660, "g")})
    assert request_resources(make_request(RequestCode.LOCK_BATCH_MQ, body=tagged)) == []
