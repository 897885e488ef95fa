"""A broker's answer to a producer's property blocks it must not store, and to properties the broker reads back
(RETRY_TOPIC, REAL_TOPIC): taken, as RocketMQ's broker takes them, and trusted only where the broker wrote them. One
in-process broker node (the rules themselves: tests/unit/test_reserved_properties.py)."""

from __future__ import annotations

import trio

from remoting.codes import RequestCode, ResponseCode
from remoting.message import decode_record, encode_uniform_batch, iter_records
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, wait_leader

LEVELS = "100ms 200ms 300ms 400ms"


async def _pull(client, addr, topic):
    r = await call(client, addr, RequestCode.PULL_MESSAGE,
                   {"consumer_group": "cg", "topic": topic, "queue_id": 0, "queue_offset": 0, "max_msg_nums": 32})
    return list(iter_records(r.body)) if r.code == ResponseCode.SUCCESS else []


async def _batch(client, addr, topic, block):
    body = encode_uniform_batch(topic.encode(), 0, [(b"first", b"UNIQ_KEY\x01u1\x02", 0), (b"second", block, 0)], 1,
                                (bytes(4), 0), (bytes(4), 0))
    return await call(client, addr, RequestCode.SEND_BATCH_MESSAGE, {"topic": topic, "queue_id": 0}, body)


async def test_malformed_properties_are_refused_and_the_brokers_own_names_taken(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None, message_delay_level=LEVELS)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        # Stored, these read back as {'': 'v'} and {'a': 'b\x01c'}: a POP consumer lost the message at its revive,
        # a push consumer's send-back was refused for ever.
        for block in (b"\x01v\x02", b"a\x01b\x01c\x02", b"a\x01b\x02a\x01c\x02"):
            r = await _batch(client, addr, "Orders", block)
            assert r.code == ResponseCode.MESSAGE_ILLEGAL and "message 1 properties are malformed" in r.remark, \
                (block, r.remark)
        # The single send's rule, which the batch's now is.
        for properties in ({"": "v"}, {"a": "b\x01c"}):
            r = await call(client, addr, RequestCode.SEND_MESSAGE,
                           {"topic": "Orders", "queue_id": 0, "properties": properties}, b"x")
            assert r.code == ResponseCode.MESSAGE_ILLEGAL and "property" in r.remark, (properties, r.remark)
        assert await _pull(client, addr, "Orders") == []

        # What consumers and tools send goes through: RocketMQ's consumer sending a failed message back itself (to its
        # group's retry topic, with RETRY_TOPIC and ORIGIN_MESSAGE_ID, delayed, and the delivered message's
        # REAL_TOPIC and REAL_QID copied: refused for a while, found by review), a half message, a delayed one.
        back = {"RETRY_TOPIC": "Orders", "ORIGIN_MESSAGE_ID": "U-1", "DELAY": "1", "UNIQ_KEY": "U-1",
                "REAL_TOPIC": "Orders", "REAL_QID": "0", "TRANSACTION_CHECK_TIMES": "2"}
        r = await call(client, addr, RequestCode.SEND_MESSAGE, {"topic": "%RETRY%billing", "properties": back}, b"x")
        assert r.code == ResponseCode.SUCCESS, r.remark
        r = await _batch(client, addr, "%RETRY%billing", b"RETRY_TOPIC\x01Orders\x02ORIGIN_MESSAGE_ID\x01U-2\x02")
        assert r.code == ResponseCode.SUCCESS, r.remark
        r = await call(client, addr, RequestCode.SEND_MESSAGE,
                       {"topic": "Orders", "properties": {"TRAN_MSG": "true", "PGROUP": "pg", "UNIQ_KEY": "tx-2"}},
                       b"x")
        assert r.code == ResponseCode.SUCCESS, r.remark
        r = await call(client, addr, RequestCode.SEND_MESSAGE,
                       {"topic": "Orders", "queue_id": 0, "properties": {"DELAY": "1"}}, b"late")
        assert r.code == ResponseCode.SUCCESS, r.remark
        with trio.fail_after(10):
            while not await _pull(client, addr, "Orders"):
                await trio.sleep(0.05)
        (late,) = await _pull(client, addr, "Orders")
        assert late.body == b"late" and late.properties["REAL_TOPIC"] == "Orders"


async def test_a_record_stored_with_a_producers_retry_topic_is_retried_as_its_own_topics(nursery, tmp_path):
    # RETRY_TOPIC read from a producer's record sent the retry to that topic's handler (the push consumer restores a
    # retry's topic from it), and under ACL made its send-back need SUB on that topic.
    (config,) = broker_configs(tmp_path, None, message_delay_level=LEVELS)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        r = await call(client, addr, RequestCode.SEND_MESSAGE,
                       {"topic": "Orders", "queue_id": 0,
                        "properties": {"RETRY_TOPIC": "SomeOtherTopic", "UNIQ_KEY": "U-9"}},
                       b"x")
        assert r.code == ResponseCode.SUCCESS, r.remark
        (stored,) = await _pull(client, addr, "Orders")
        assert stored.properties["RETRY_TOPIC"] == "SomeOtherTopic"
        r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK,
                       {"offset": stored.phy_offset, "group": "billing", "origin_topic": "Orders",
                        "max_reconsume_times": 16})
        assert r.code == ResponseCode.SUCCESS, r.remark
        waiting = decode_record((await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID,
                                            {"msg_id": r.ext["msg_id"]})).body)
        assert waiting.properties["RETRY_TOPIC"] == "Orders"
        # origin_topic is checked against the stored topic, not the producer's RETRY_TOPIC.
        r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK,
                       {"offset": stored.phy_offset, "group": "billing", "origin_topic": "SomeOtherTopic"})
        assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == "offset", r.remark
