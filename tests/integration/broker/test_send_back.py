"""CONSUMER_SEND_MSG_BACK against one in-process broker node: retry topic, backoff, dead letters, bad input."""

from __future__ import annotations

import cbor2
import trio

from remoting.codes import RequestCode, ResponseCode
from remoting.message import decode_record, iter_records
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, wait_leader

LEVELS = "100ms 200ms 300ms 400ms"


async def _pull_all(client, addr, topic, queue_id=0, offset=0):
    r = await call(client, addr, RequestCode.PULL_MESSAGE,
                   {"consumer_group": "cg", "topic": topic, "queue_id": queue_id, "queue_offset": offset,
                    "max_msg_nums": 32})
    return r, (list(iter_records(r.body)) if r.code == ResponseCode.SUCCESS else [])


async def _wait_pulled(client, addr, topic, count, timeout_s=10):
    with trio.fail_after(timeout_s):
        while True:
            _, got = await _pull_all(client, addr, topic)
            if len(got) >= count:
                return got
            await trio.sleep(0.05)


async def _topics(client, addr):
    r = await call(client, addr, RequestCode.GET_ALL_TOPIC_CONFIG)
    return cbor2.loads(r.body)["topic_configs"]


async def test_a_message_sent_back_is_retried_with_backoff_then_buried_in_the_dead_letter_topic(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None, message_delay_level=LEVELS)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        props = {"TAGS": "TagR", "KEYS": "order-9", "UNIQ_KEY": "UNIQ-9", "color": "blue"}
        r = await call(client, addr, RequestCode.SEND_MESSAGE,
                       {"topic": "Orders", "queue_id": 0, "born_timestamp": 5, "flag": 3, "properties": props},
                       b"payload")
        assert r.code == ResponseCode.SUCCESS
        (original,) = (await _pull_all(client, addr, "Orders"))[1]

        back = {"offset": original.phy_offset, "group": "billing", "delay_level": 0, "origin_msg_id": "UNIQ-9",
                "origin_topic": "Orders", "max_reconsume_times": 2}
        r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK, back)
        assert r.code == ResponseCode.SUCCESS, r.remark
        assert r.ext["topic"] == "%RETRY%billing" and r.ext["reconsume_times"] == 1 and not r.ext["dead"]
        # Waiting at level 3 (300 ms): 3 + reconsume_times 0, as RocketMQ.
        waiting = decode_record((await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID,
                                            {"msg_id": r.ext["msg_id"]})).body)
        assert waiting.topic == "SCHEDULE_TOPIC_XXXX" and waiting.queue_id == 2
        # The delayed copy itself is the broker's record, not a consumed message: sent back, it would go out early.
        refused = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK, {**back, "offset": waiting.phy_offset,
                                                                               "origin_topic": ""})
        assert refused.code == ResponseCode.INVALID_REQUEST and refused.ext["field"] == "offset", refused.remark
        assert "SCHEDULE_TOPIC_XXXX" in refused.remark
        retry_config = (await _topics(client, addr))["%RETRY%billing"]
        assert (retry_config["read_queue_nums"], retry_config["write_queue_nums"], retry_config["perm"]) == (1, 1, 6)

        (retried,) = await _wait_pulled(client, addr, "%RETRY%billing", 1)
        assert retried.reconsume_times == 1 and retried.body == b"payload"
        assert (retried.flag, retried.born_timestamp) == (3, 5)
        assert retried.properties["RETRY_TOPIC"] == "Orders" and retried.properties["ORIGIN_MESSAGE_ID"] == "UNIQ-9"
        assert {k: retried.properties[k] for k in props} == props and "DELAY" not in retried.properties

        # Second failure: from the retry topic (origin_topic is still the first topic), level 3 + 1.
        r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK, {**back, "offset": retried.phy_offset})
        assert r.code == ResponseCode.SUCCESS and r.ext["reconsume_times"] == 2 and not r.ext["dead"]
        waiting = decode_record((await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID,
                                            {"msg_id": r.ext["msg_id"]})).body)
        assert waiting.queue_id == 3
        retried2 = (await _wait_pulled(client, addr, "%RETRY%billing", 2))[1]
        assert retried2.reconsume_times == 2 and retried2.properties["RETRY_TOPIC"] == "Orders"

        # Third: reconsume_times 2 reached max_reconsume_times 2: the dead-letter topic, at once.
        r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK, {**back, "offset": retried2.phy_offset})
        assert r.code == ResponseCode.SUCCESS and r.ext["topic"] == "%DLQ%billing" and r.ext["dead"]
        dlq_config = (await _topics(client, addr))["%DLQ%billing"]
        assert (dlq_config["read_queue_nums"], dlq_config["perm"]) == (1, 2)
        refused, _ = await _pull_all(client, addr, "%DLQ%billing")
        assert refused.code == ResponseCode.NO_PERMISSION
        found = await call(client, addr, RequestCode.QUERY_MESSAGE, {"topic": "%DLQ%billing", "key": "order-9"})
        assert found.code == ResponseCode.SUCCESS
        (dead,) = iter_records(found.body)
        assert dead.reconsume_times == 3 and dead.body == b"payload" and dead.queue_id == 0
        assert {k: dead.properties[k] for k in props} == props
        assert dead.properties["RETRY_TOPIC"] == "Orders" and dead.properties["ORIGIN_MESSAGE_ID"] == "UNIQ-9"
        assert not {"DELAY", "REAL_TOPIC", "REAL_QID"} & set(dead.properties)
        # delay_level -1: straight to the DLQ, whatever the count.
        r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK,
                       {**back, "delay_level": -1, "max_reconsume_times": 16})
        assert r.code == ResponseCode.SUCCESS and r.ext["dead"] and r.ext["reconsume_times"] == 1


async def test_send_back_refuses_bad_input_naming_the_field_and_stores_nothing(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None, message_delay_level=LEVELS)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        r = await call(client, addr, RequestCode.SEND_MESSAGE, {"topic": "Orders", "queue_id": 0, "properties": {}},
                       b"x")
        (msg,) = (await _pull_all(client, addr, "Orders"))[1]
        good = {"offset": msg.phy_offset, "group": "billing", "origin_topic": "Orders"}
        # %RETRY% is two characters longer than %DLQ%: a length check that counted the shorter prefix let groups
        # of 121 and 122 characters through, and the send-back failed on the retry topic's name instead.
        for change, field in (({"group": None}, "group"), ({"group": "bad group"}, "group"),
                              ({"group": "g" * 121}, "group"), ({"group": "g" * 122}, "group"),
                              ({"group": "g" * 125}, "group"), ({"offset": -1}, "offset"),
                              ({"offset": "0"}, "offset"), ({"delay_level": -2}, "delay_level"),
                              ({"max_reconsume_times": -1}, "max_reconsume_times"),
                              ({"origin_topic": "bad topic"}, "origin_topic"),
                              ({"origin_topic": "Other"}, "offset"), ({"origin_msg_id": 7}, "origin_msg_id")):
            r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK, {**good, **change})
            assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == field, (change, r.remark)
            assert f"'{field}'" in r.remark
        for offset in (msg.phy_offset + 1, 1 << 40):
            r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK, {**good, "offset": offset})
            assert r.code == ResponseCode.NO_MESSAGE and f"offset {offset}" in r.remark
        assert not {t for t in await _topics(client, addr) if t.startswith("%")}


async def test_a_message_whose_properties_cannot_take_the_retry_ones_goes_to_the_dead_letters_as_stored(
        nursery, tmp_path):
    # Refused MESSAGE_ILLEGAL (its properties past the limit with RETRY_TOPIC and ORIGIN_MESSAGE_ID added), the
    # consumer retried it locally without end: its queue's offset never passed it, and it never reached the DLQ.
    (config,) = broker_configs(tmp_path, None, message_delay_level=LEVELS)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        big = "x" * 32_710  # stored in 32,730 bytes of properties; the two the send-back adds take 45 more
        r = await call(client, addr, RequestCode.SEND_MESSAGE,
                       {"topic": "BigProps", "queue_id": 0, "properties": {"UNIQ_KEY": "U-big", "big": big}}, b"body")
        assert r.code == ResponseCode.SUCCESS, r.remark
        _, (stored,) = await _pull_all(client, addr, "BigProps")
        for max_reconsume_times in (16, 0):  # a retry's copy and a dead letter's alike
            r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK,
                           {"offset": stored.phy_offset, "group": "big-g", "origin_topic": "BigProps",
                            "max_reconsume_times": max_reconsume_times})
            assert r.code == ResponseCode.SUCCESS and r.ext["dead"] is True, (r.code, r.remark)
            assert r.ext["topic"] == "%DLQ%big-g" and r.ext["reconsume_times"] == 1
            viewed = await call(client, addr, RequestCode.VIEW_MESSAGE_BY_ID, {"msg_id": r.ext["msg_id"]})
            copy = decode_record(viewed.body)
            assert (copy.topic, copy.body, copy.reconsume_times) == ("%DLQ%big-g", b"body", 1)
            assert copy.properties["big"] == big and copy.properties["UNIQ_KEY"] == "U-big"
            assert "RETRY_TOPIC" not in copy.properties and "ORIGIN_MESSAGE_ID" not in copy.properties
