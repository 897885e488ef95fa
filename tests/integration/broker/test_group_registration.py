"""A 3-node broker group in-process and a name server: what the name server routes when the group's leader leaves."""

from __future__ import annotations

import functools

import cbor2
import trio

from broker.node import serve_broker
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_namesrv


async def _leader(client, addrs: list[str]) -> str:
    with trio.fail_after(15):
        while True:
            for addr in addrs:
                r = await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)
                if r.code == ResponseCode.SUCCESS and cbor2.loads(r.body)["role"] == "LEADER":
                    return addr
            await trio.sleep(0.05)


async def test_a_topic_created_after_the_followers_registered_stays_routed_when_the_leader_leaves(nursery, tmp_path):
    # While a group has no master, the name server takes its queue data from the followers' registrations. A
    # follower registered only every register_interval_ms (30 s), so the topic set it last registered could
    # predate a topic: with the leader gone (killed, or here stopped), the topic dropped out of the group's route
    # until the next leader registered, and a client that refreshed meanwhile stopped using the group (in a
    # two-group cluster, for good until its next periodic refresh: nothing failed that would make it look again).
    namesrv = await start_namesrv(nursery)
    scopes: dict[str, trio.CancelScope] = {}

    async def run(config, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            scopes[config.broker_addr] = scope
            await serve_broker(config, task_status=task_status)

    addrs = []
    for config in broker_configs(tmp_path, namesrv, n=3):
        host, port = await nursery.start(functools.partial(run, config))
        addrs.append(f"{host}:{port}")
    async with open_remoting_client() as client:
        leader = await _leader(client, addrs)
        with trio.fail_after(10):  # every node registered once, before the topic exists
            while True:
                info = cbor2.loads((await call(client, namesrv, RequestCode.GET_BROKER_CLUSTER_INFO)).body)
                if len(info["nodes"].get("broker-a", ())) == 3:
                    break
                await trio.sleep(0.05)
        r = await call(client, leader, RequestCode.UPDATE_AND_CREATE_TOPIC,
                       {"topic_name": "LateTopic", "read_queue_nums": 4, "write_queue_nums": 4, "perm": 6})
        assert r.code == ResponseCode.SUCCESS, r.remark
        await trio.sleep(1)  # the followers apply it within milliseconds; well within one registration interval

        scopes[leader].cancel()  # the leader stops (and unregisters): the group has no master for a moment
        with trio.fail_after(10):
            while True:
                info = cbor2.loads((await call(client, namesrv, RequestCode.GET_BROKER_CLUSTER_INFO)).body)
                if leader not in info["broker_addr_table"]["broker-a"]["broker_addrs"].values():
                    break
                await trio.sleep(0.01)
        route = await call(client, namesrv, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "LateTopic"})
        assert route.code == ResponseCode.SUCCESS, f"the topic left the route with the leader: {route.remark}"
        assert cbor2.loads(route.body)["queue_datas"][0]["write_queue_nums"] == 4
