"""A 3-node broker group in-process and a name server: what the name server routes when the group's leader leaves."""

from __future__ import annotations

import functools

import cbor2
import trio

from broker.node import serve_broker
from namesrv import NamesrvConfig, serve_namesrv
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_namesrv
from tests.procs import free_port


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


async def test_a_restarted_name_server_learns_the_nodes_again_within_seconds(nursery, tmp_path):
    # A name server keeps nothing on disk: restarted, it knows no node until each registers again, and meanwhile it
    # routes a cluster's topics on the groups that did (with two groups, clients and `raftmq admin create-topic`
    # used one). Nodes registered again only at their next period, up to register_interval_ms (30 s) later.
    port = free_port()
    addr = f"127.0.0.1:{port}"

    async def namesrv(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await serve_namesrv(NamesrvConfig(listen=addr), task_status=task_status)

    async def start_namesrv_at() -> trio.CancelScope:
        scope = trio.CancelScope()

        async def run(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await namesrv(task_status=task_status)

        await nursery.start(run)
        return scope

    async def wait_registered(client, timeout_s: float) -> None:
        with trio.fail_after(timeout_s):
            while True:
                r = await call(client, addr, RequestCode.GET_BROKER_CLUSTER_INFO)
                if r.code == ResponseCode.SUCCESS and cbor2.loads(r.body)["nodes"].get("broker-a"):
                    return
                await trio.sleep(0.05)

    scope = await start_namesrv_at()
    (config,) = broker_configs(tmp_path, addr)
    await nursery.start(functools.partial(serve_broker, config))
    async with open_remoting_client() as client:
        await wait_registered(client, 10)
        for down_s in (0, 2.5):  # restarted at once (its connection closed), and after registrations failed
            scope.cancel()
            await trio.sleep(down_s)
            scope = await start_namesrv_at()
            await wait_registered(client, 5)


async def _hung_name_server(task_status=trio.TASK_STATUS_IGNORED):
    """A name server that accepts and reads, and never answers (SIGSTOPped, its VM paused, its replies dropped)."""
    async def handler(stream):
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(f"127.0.0.1:{listeners[0].socket.getsockname()[1]}")
    await trio.serve_listeners(handler, listeners)


async def test_a_hung_name_server_holds_up_neither_the_others_rounds_nor_a_topic_change(nursery, tmp_path):
    # One round for every name server waited out the hung one's register_timeout_ms (3 s): each period was that
    # much longer, so the healthy name server evicted the node between registrations (broker_not_active_timeout_ms
    # 2 s, twice the period), and an auto-create waited for it before the message was stored: the producer's 3 s
    # send timeout ran out first, and the send was reported failed although the message was stored.
    from client import Message, open_producer
    from namesrv.route_info import RouteInfoManager

    route_info = RouteInfoManager()
    host, port = await nursery.start(functools.partial(serve_namesrv, NamesrvConfig(listen="127.0.0.1:0",
                                                                                    scan_interval_ms=200),
                                                       route_info=route_info))
    healthy = f"{host}:{port}"
    hung = await nursery.start(_hung_name_server)
    (config,) = broker_configs(tmp_path, [healthy, hung], register_interval_ms=1000,
                               broker_not_active_timeout_ms=2000)
    h, p = await nursery.start(functools.partial(serve_broker, config))
    async with open_remoting_client() as client:
        await _leader(client, [f"{h}:{p}"])
    with trio.fail_after(10):
        while route_info.statistics().nodes == 0:
            await trio.sleep(0.05)
    absent = 0
    for _ in range(60):  # 6 s: four periods of the hung name server's rounds as they were
        absent += route_info.statistics().nodes == 0
        await trio.sleep(0.1)
    assert absent == 0 and route_info.statistics().removals.get("expired", 0) == 0, route_info.statistics()
    async with open_producer(healthy, send_msg_timeout_ms=3000, retry_times_when_send_failed=0) as producer:
        result = await producer.send(Message("AutoCreated", b"first"))  # the broker creates the topic
    assert result.msg_id
