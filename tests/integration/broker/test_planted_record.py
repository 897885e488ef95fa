"""A producer plants a record head in a message body: the requests that name a commit-log offset (VIEW_MESSAGE_BY_ID,
CONSUMER_SEND_MSG_BACK) refuse it, against one in-process broker node, and still find every record the broker
wrote (a plain message, a delayed message waiting in the schedule topic, a half message, a retry-topic copy)."""

from __future__ import annotations

import struct

import cbor2
import trio

from remoting.codes import RequestCode, ResponseCode
from remoting.message import MESSAGE_MAGIC, RECORD_HEAD, decode_record, iter_records, parse_msg_id
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, wait_leader

LEVELS = "100ms 200ms 300ms"
PAD = 16


def _planted_body(at: int, topic: bytes) -> bytes:
    """A body whose bytes from ``PAD`` on read as a whole record of ``topic`` starting at phy offset ``at``."""
    inner = b"q" * 16
    span = RECORD_HEAD.size + 4 + len(inner) + 1 + len(topic) + 2
    head = RECORD_HEAD.pack(span, MESSAGE_MAGIC, 0, 0, 0, 0, at, 0, 0, bytes(4), 0, 0, bytes(4), 0, 0, 0)
    return b"p" * PAD + head + struct.pack(">i", len(inner)) + inner + bytes([len(topic)]) + topic + b"\x00\x00" + \
        b"r" * 8


async def _view(client, addr: str, **ext):
    return await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID, ext)


async def _viewed(client, addr: str, **ext):
    r = await _view(client, addr, **ext)
    assert r.code == ResponseCode.SUCCESS, (ext, r.remark)
    return decode_record(r.body)


async def _pulled(client, addr: str, topic: str, queue_id: int, count: int):
    with trio.fail_after(10):
        while True:
            r = await call(client, addr, RequestCode.PULL_MESSAGE,
                           {"consumer_group": "cg", "topic": topic, "queue_id": queue_id, "queue_offset": 0,
                            "max_msg_nums": 32})
            got = list(iter_records(r.body)) if r.code == ResponseCode.SUCCESS else []
            if len(got) >= count:
                return got
            await trio.sleep(0.05)


async def test_a_planted_record_head_is_not_found_by_offset_and_every_real_record_is(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None, message_delay_level=LEVELS)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        info = await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)
        base = cbor2.loads(info.body)["commit_log_max_offset"]
        at = base + RECORD_HEAD.size + 4 + PAD
        r = await call(client, addr, RequestCode.SEND_MESSAGE, {"topic": "Open", "queue_id": 0, "properties": {}},
                       _planted_body(at, b"Payroll"))
        assert r.code == ResponseCode.SUCCESS, r.remark
        carrier_id = r.ext["msg_id"]
        assert parse_msg_id(carrier_id)[1] == base  # the planted head names its true offset
        planted_id = carrier_id[:16] + f"{at:016X}"

        async def refused() -> None:
            for ext in ({"offset": at}, {"msg_id": planted_id}):
                r = await _view(client, addr, **ext)
                assert r.code == ResponseCode.QUERY_NOT_FOUND, (ext, r.code, r.body[:200])
            # Sent back, it was re-stored as a message of topic Payroll into the group's retry topic.
            r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK,
                           {"offset": at, "group": "billing", "delay_level": 0})
            assert r.code == ResponseCode.NO_MESSAGE, (r.code, r.remark)

        await refused()  # maybe not dispatched yet
        await _pulled(client, addr, "Open", 0, 1)
        await refused()  # dispatched
        assert (await _viewed(client, addr, msg_id=carrier_id)).topic == "Open"

        r = await call(client, addr, RequestCode.SEND_MESSAGE,
                       {"topic": "Later", "queue_id": 1, "properties": {"DELAY": "3"}}, b"later")
        assert r.code == ResponseCode.SUCCESS, r.remark
        delayed = await _viewed(client, addr, msg_id=r.ext["msg_id"])
        assert (delayed.topic, delayed.queue_id) == ("SCHEDULE_TOPIC_XXXX", 2)

        props = {"TRAN_MSG": "true", "PGROUP": "tx_group", "UNIQ_KEY": "U-h1"}
        r = await call(client, addr, RequestCode.SEND_MESSAGE,
                       {"topic": "TxT", "queue_id": 0, "producer_group": "tx_group", "properties": props}, b"half")
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert (await _viewed(client, addr, msg_id=r.ext["msg_id"])).topic == "RMQ_SYS_TRANS_HALF_TOPIC"

        r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK,
                       {"offset": base, "group": "billing", "delay_level": 1, "origin_topic": "Open"})
        assert r.code == ResponseCode.SUCCESS, r.remark
        waiting = await _viewed(client, addr, msg_id=r.ext["msg_id"])
        assert waiting.topic == "SCHEDULE_TOPIC_XXXX"
        (retried,) = await _pulled(client, addr, "%RETRY%billing", 0, 1)
        assert (await _viewed(client, addr, offset=retried.phy_offset)).topic == "%RETRY%billing"
        (delivered,) = await _pulled(client, addr, "Later", 1, 1)
        assert (await _viewed(client, addr, offset=delivered.phy_offset)).body == b"later"
        # Dispatched by now, each is found through its ConsumeQueue unit.
        for phy in (base, delayed.phy_offset, waiting.phy_offset):
            assert (await _viewed(client, addr, offset=phy)).phy_offset == phy
        await refused()
