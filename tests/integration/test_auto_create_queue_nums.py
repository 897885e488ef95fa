"""A topic created by a producer's first send (a stand-in route) gets the producer's default_topic_queue_nums
queues, at most the broker's own (RocketMQ's defaultTopicQueueNums), against an in-process broker group."""

from __future__ import annotations

import zlib

import trio

from client import Message, open_producer
from tests.integration.broker.helpers import start_leading_node


async def _route_queue_nums(producer, topic: str) -> int:
    route = await producer.routes.refresh(topic)
    (queue_data,) = route.queue_datas
    return queue_data.write_queue_nums


async def test_a_producer_wanting_more_queues_than_the_broker_creates_sends_every_message(nursery, tmp_path):
    # The broker created its own 4 queues; the stand-in's queues 4..7 were refused until the route refresh 30 s on.
    namesrv, _ = await start_leading_node(nursery, tmp_path)  # default_topic_queue_nums 4
    # An ordered send whose key falls on one of the stand-in's queues 4..7: the very first send, so the broker
    # creates the topic with it and stores it in a queue the topic has, which the answer names.
    key = next(k for k in (f"key-{i}" for i in range(100)) if zlib.crc32(k.encode()) % 8 >= 4)
    async with open_producer(namesrv, default_topic_queue_nums=8, retry_times_when_send_failed=0) as producer:
        with trio.fail_after(20):
            first = await producer.send(Message("Wide", b"first"), sharding_key=key)
            results = [await producer.send(Message("Wide", b"m%d" % i)) for i in range(16)]
            assert await _route_queue_nums(producer, "Wide") == 4
    assert first.message_queue.queue_id == zlib.crc32(key.encode()) % 8 % 4
    assert {r.message_queue.queue_id for r in results} <= set(range(4))


async def test_a_producer_wanting_fewer_queues_gets_them_and_its_ordered_keys_stay(nursery, tmp_path):
    # The broker created 4 queues where the stand-in route had 2: each key moved queue at the next route refresh.
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    async with open_producer(namesrv, default_topic_queue_nums=2) as producer:
        keys = [f"order-{i}" for i in range(8)]
        with trio.fail_after(20):
            before = {k: (await producer.send(Message("Narrow", b"1"), sharding_key=k)).message_queue for k in keys}
            assert await _route_queue_nums(producer, "Narrow") == 2
            after = {k: (await producer.send(Message("Narrow", b"2"), sharding_key=k)).message_queue for k in keys}
    assert before == after


async def test_a_topic_auto_created_by_a_slow_producer_is_created_on_every_group(nursery, tmp_path):
    # The route was refreshed at the first answer on the stand-in route: it then named that group alone, and a
    # producer sending a message at a time never created the topic on the other.
    from tests.integration.broker.helpers import broker_configs, start_broker, start_namesrv, wait_leader
    from remoting.transport import open_remoting_client

    namesrv = await start_namesrv(nursery)
    addrs = []
    for group in ("broker-a", "broker-b"):
        (config,) = broker_configs(tmp_path / group, namesrv, **{"dledger.group": group})
        addrs.append(await start_broker(nursery, config))
    async with open_remoting_client() as client:
        for addr in addrs:
            await wait_leader(client, addr)
    from client import open_admin
    async with open_admin(namesrv) as admin:
        with trio.fail_after(10):  # both groups registered, with their masters
            while True:
                info = await admin.cluster_info()
                if all(info.master_addr(g) for g in ("broker-a", "broker-b")):
                    break
                await trio.sleep(0.1)
    async with open_producer(namesrv) as producer:
        sent = []
        for i in range(8):
            sent.append((await producer.send(Message("Spread", b"m%d" % i))).message_queue.broker_name)
            await trio.sleep(0.2)
        route = await producer.routes.refresh("Spread")
    assert sorted({q.broker_name for q in route.queue_datas}) == ["broker-a", "broker-b"], sent


async def test_a_malformed_default_topic_queue_nums_is_refused_not_taken_as_a_stand_in_send(nursery, tmp_path):
    # Its mere presence re-mapped a queue id past the topic's queues, whatever its value.
    from remoting.codes import RequestCode, ResponseCode
    from remoting.transport import open_remoting_client
    from tests.integration.broker.helpers import call

    namesrv, broker = await start_leading_node(nursery, tmp_path)
    async with open_remoting_client() as client:
        r = await call(client, broker, RequestCode.UPDATE_AND_CREATE_TOPIC,
                       {"topic_name": "T4", "read_queue_nums": 4, "write_queue_nums": 4})
        assert r.code == ResponseCode.SUCCESS, r.remark
        for bad in ("garbage", 0, -5):
            r = await call(client, broker, RequestCode.SEND_MESSAGE,
                           {"topic": "T4", "queue_id": 7, "default_topic_queue_nums": bad}, b"x")
            assert r.code == ResponseCode.INVALID_REQUEST and "default_topic_queue_nums" in r.remark, (bad, r.remark)
        r = await call(client, broker, RequestCode.SEND_MESSAGE,
                       {"topic": "T4", "queue_id": 7, "default_topic_queue_nums": 8}, b"x")
        assert r.code == ResponseCode.SUCCESS and r.ext["queue_id"] == 3, (r.code, r.remark)
