"""CONSUMER_SEND_MSG_BACK into a retry or dead-letter topic whose perm takes no writes: refused NO_PERMISSION, as a
send to it is (RocketMQ's "the topic[%RETRY%G] sending message is forbidden"), nothing stored; and a push consumer
whose send-back is refused consumes the message again itself. Was: the copy was stored all the same."""

from __future__ import annotations

import functools

import trio

from broker.node import BrokerNode, serve_broker
from client import Message, ReconsumeLater, open_producer, open_push_consumer
from remoting.codes import RequestCode, ResponseCode
from remoting.message import iter_records
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_namesrv, wait_leader


async def _node(nursery, tmp_path, namesrv: str | None = None) -> tuple[BrokerNode, str]:
    (config,) = broker_configs(tmp_path, namesrv)
    nodes: list[BrokerNode] = []
    host, port = await nursery.start(functools.partial(serve_broker, config, on_serving=nodes.append))
    return nodes[0], f"{host}:{port}"


async def _perm(client, addr: str, topic: str, perm: int) -> None:
    r = await call(client, addr, RequestCode.UPDATE_AND_CREATE_TOPIC,
                   {"topic": topic, "read_queue_nums": 1, "write_queue_nums": 1, "perm": perm})
    assert r.code == ResponseCode.SUCCESS, r.remark


async def test_a_send_back_to_a_topic_that_takes_no_writes_is_refused_and_stores_nothing(nursery, tmp_path):
    node, addr = await _node(nursery, tmp_path)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        r = await call(client, addr, RequestCode.SEND_MESSAGE, {"topic": "TR", "queue_id": 0}, b"fail-me")
        assert r.code == ResponseCode.SUCCESS, r.remark
        r = await call(client, addr, RequestCode.PULL_MESSAGE, {"consumer_group": "grp", "topic": "TR", "queue_id": 0,
                                                                "queue_offset": 0, "max_msg_nums": 1})
        (stored,) = iter_records(r.body)
        back = {"offset": stored.phy_offset, "group": "grp", "origin_topic": "TR", "max_reconsume_times": 16}
        await _perm(client, addr, "%RETRY%grp", 4)  # read only
        await _perm(client, addr, "%DLQ%grp", 4)
        end = node.store.max_phy_offset
        direct = await call(client, addr, RequestCode.SEND_MESSAGE, {"topic": "%RETRY%grp", "queue_id": 0}, b"x")
        assert direct.code == ResponseCode.NO_PERMISSION, direct.remark
        for delay_level, topic in ((1, "%RETRY%grp"), (-1, "%DLQ%grp")):  # -1: to the dead letters at once
            r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK, {**back, "delay_level": delay_level})
            assert r.code == ResponseCode.NO_PERMISSION, r.remark
            assert r.remark == direct.remark.replace("%RETRY%grp", topic) and topic in r.remark and "perm=4" in r.remark
        assert node.store.max_phy_offset == end  # no copy, delayed or not

        # Write given back: sent back as before, to each.
        await _perm(client, addr, "%RETRY%grp", 6)
        await _perm(client, addr, "%DLQ%grp", 2)
        for delay_level, topic in ((1, "%RETRY%grp"), (-1, "%DLQ%grp")):
            r = await call(client, addr, RequestCode.CONSUMER_SEND_MSG_BACK, {**back, "delay_level": delay_level})
            assert r.code == ResponseCode.SUCCESS and r.ext["topic"] == topic, r.remark
        assert node.store.max_phy_offset > end


async def test_a_push_consumer_whose_send_back_is_refused_consumes_the_message_again_itself(nursery, tmp_path):
    namesrv = await start_namesrv(nursery)
    node, addr = await _node(nursery, tmp_path, namesrv)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        await _perm(client, addr, "%RETRY%cg", 4)
    seen = []
    done = trio.Event()

    async def handler(msg) -> None:
        seen.append((msg.body, msg.phy_offset, msg.reconsume_times))
        if len(seen) == 1:
            raise ReconsumeLater()
        done.set()

    async with open_producer(namesrv) as producer:
        await producer.send(Message("Work", b"again"))
        end = node.store.max_phy_offset
        async with open_push_consumer(namesrv, topic="Work", consumer_group="cg", handler=handler,
                                      consume_from_where="CONSUME_FROM_FIRST_OFFSET", reconsume_delay_ms=100):
            with trio.fail_after(30):  # liveness: the local retry comes after reconsume_delay_ms
                await done.wait()
    # The same stored message both times (a retry copy through the broker would be another record), counted up.
    ((body, offset, times), again) = seen
    assert (body, times) == (b"again", 0) and again == (b"again", offset, 1)
    assert node.store.max_phy_offset == end
