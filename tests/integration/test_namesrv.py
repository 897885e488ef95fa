"""A name server in-process on port 0, spoken to over the wire by a RemotingClient."""

from __future__ import annotations

import functools

import cbor2
import pytest
import trio

from namesrv import NamesrvConfig, RouteInfoManager, TopicConfig, encode_topic_configs, serve_namesrv
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client

RW = TopicConfig(read_queue_nums=4, write_queue_nums=4, perm=6)


def register_request(broker_id: int, role: str = "FOLLOWER", term: int = 1, *, broker_name: str = "broker-a",
                     topics: dict | None = None, oneway: bool = False, changes: dict | None = None):
    ext = {"cluster_name": "DefaultCluster", "broker_name": broker_name, "broker_id": broker_id,
           "broker_addr": f"127.0.0.1:{10910 + broker_id}", "role": role, "term": term, "data_version": 1}
    ext.update(changes or {})
    ext = {k: v for k, v in ext.items() if v is not None}
    return make_request(RequestCode.REGISTER_BROKER, ext=ext,
                        body=encode_topic_configs({"TopicA": RW} if topics is None else topics), oneway=oneway)


async def start(nursery: trio.Nursery, **config) -> tuple[str, RouteInfoManager]:
    cfg = NamesrvConfig(listen="127.0.0.1:0", **config)
    table = RouteInfoManager(broker_expired_ms=cfg.broker_expired_ms)
    host, port = await nursery.start(functools.partial(serve_namesrv, cfg, route_info=table))
    assert port != 0
    return f"{host}:{port}", table


async def route(client, addr: str, topic: str = "TopicA"):
    return await client.invoke(addr, make_request(RequestCode.GET_ROUTEINFO_BY_TOPIC, ext={"topic": topic}))


async def wait_topic_gone(client, addr: str, topic: str = "TopicA", timeout_s: float = 5.0) -> float:
    started = trio.current_time()
    with trio.fail_after(timeout_s):
        while (await route(client, addr, topic)).code != ResponseCode.TOPIC_NOT_EXIST:
            await trio.sleep(0.01)
    return trio.current_time() - started


async def test_register_route_cluster_info_topic_list_unregister(nursery):
    addr, _ = await start(nursery)
    async with open_remoting_client() as client:
        for node_id in (1, 2, 3):
            resp = await client.invoke(addr, register_request(node_id, "LEADER" if node_id == 2 else "FOLLOWER"))
            assert resp.code == ResponseCode.SUCCESS, resp.remark
        assert resp.ext == {"master_addr": "127.0.0.1:10912", "master_id": 2, "master_term": 1}

        resp = await route(client, addr)
        assert resp.code == ResponseCode.SUCCESS
        assert cbor2.loads(resp.body) == {
            "queue_datas": [{"broker_name": "broker-a", "read_queue_nums": 4, "write_queue_nums": 4, "perm": 6,
                             "topic_sys_flag": 0, "order": False}],
            "broker_datas": [{"cluster": "DefaultCluster", "broker_name": "broker-a",
                              "broker_addrs": {"0": "127.0.0.1:10912", "1": "127.0.0.1:10911",
                                               "3": "127.0.0.1:10913"}}]}

        resp = await client.invoke(addr, make_request(RequestCode.GET_BROKER_CLUSTER_INFO))
        info = cbor2.loads(resp.body)
        assert info["cluster_addr_table"] == {"DefaultCluster": ["broker-a"]}
        assert [n["broker_id"] for n in info["nodes"]["broker-a"]] == [1, 2, 3]
        assert [n["is_master"] for n in info["nodes"]["broker-a"]] == [False, True, False]

        resp = await client.invoke(addr, make_request(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER))
        assert cbor2.loads(resp.body) == {"topic_list": ["TopicA"]}

        unregister = {"cluster_name": "DefaultCluster", "broker_name": "broker-a", "broker_addr": "127.0.0.1:10912"}
        resp = await client.invoke(addr, make_request(RequestCode.UNREGISTER_BROKER,
                                                      ext={**unregister, "broker_id": 2}))
        assert (resp.code, resp.ext) == (ResponseCode.SUCCESS, {"removed": True})
        body = cbor2.loads((await route(client, addr)).body)
        assert body["broker_datas"][0]["broker_addrs"] == {"1": "127.0.0.1:10911", "3": "127.0.0.1:10913"}
        for node_id in (1, 3):
            ext = {**unregister, "broker_id": node_id, "broker_addr": f"127.0.0.1:{10910 + node_id}"}
            assert (await client.invoke(addr, make_request(RequestCode.UNREGISTER_BROKER, ext=ext))).ext["removed"]
        resp = await route(client, addr)
        assert resp.code == ResponseCode.TOPIC_NOT_EXIST and "'TopicA'" in resp.remark
        assert resp.ext == {"topic": "TopicA"}


async def test_term_conflict_over_the_wire(nursery):
    addr, _ = await start(nursery)
    async with open_remoting_client() as client:
        await client.invoke(addr, register_request(2, "LEADER", 6))
        resp = await client.invoke(addr, register_request(1, "LEADER", 5))
        # The stale leader is told who the real master is.
        assert resp.ext["master_addr"] == "127.0.0.1:10912" and resp.ext["master_term"] == 6
        addrs = cbor2.loads((await route(client, addr)).body)["broker_datas"][0]["broker_addrs"]
        assert addrs == {"0": "127.0.0.1:10912", "1": "127.0.0.1:10911"}


@pytest.mark.parametrize("change, field", [
    ({"broker_id": "one"}, "broker_id"),
    ({"role": "MASTER"}, "role"),
    ({"broker_addr": 5}, "broker_addr"),
    ({"term": None}, "term"),
])
async def test_bad_registration_names_the_field(nursery, change, field):
    addr, table = await start(nursery)
    async with open_remoting_client() as client:
        resp = await client.invoke(addr, register_request(1, "LEADER", changes=change))
        assert resp.code == ResponseCode.INVALID_REQUEST
        assert repr(field) in resp.remark and resp.ext == {"field": field}
        assert table.statistics().nodes == 0
        bad_body = make_request(RequestCode.REGISTER_BROKER, ext=register_request(1).ext, body=b"\xff")
        resp = await client.invoke(addr, bad_body)
        assert resp.code == ResponseCode.INVALID_REQUEST and resp.ext == {"field": "body"}
        # The server lives on and answers a good request on the same connection.
        assert (await client.invoke(addr, register_request(1, "LEADER"))).code == ResponseCode.SUCCESS


async def test_route_errors_and_unknown_code(nursery):
    addr, _ = await start(nursery)
    async with open_remoting_client() as client:
        resp = await client.invoke(addr, make_request(RequestCode.GET_ROUTEINFO_BY_TOPIC))
        assert resp.code == ResponseCode.INVALID_REQUEST and "'topic' is missing" in resp.remark
        resp = await route(client, addr, "NoSuchTopic")
        assert resp.code == ResponseCode.TOPIC_NOT_EXIST and "NoSuchTopic" in resp.remark
        resp = await client.invoke(addr, make_request(RequestCode.SEND_MESSAGE))
        assert resp.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED
        assert str(int(RequestCode.SEND_MESSAGE)) in resp.remark


async def test_oneway_registration_registers_without_an_answer(nursery):
    addr, table = await start(nursery)
    async with open_remoting_client() as client:
        await client.invoke_oneway(addr, register_request(1, "LEADER", oneway=True))
        # Requests on one connection are handled in order: the route query sees the registration.
        assert (await route(client, addr)).code == ResponseCode.SUCCESS
        assert table.statistics().registrations == 1


async def test_silent_node_expires_and_heartbeats_keep_it(nursery):
    addr, _ = await start(nursery, broker_expired_ms=300, scan_interval_ms=20)
    async with open_remoting_client() as client:
        await client.invoke(addr, register_request(1, "LEADER", topics={"Kept": RW}))
        await client.invoke(addr, register_request(1, "LEADER", broker_name="broker-b", topics={"TopicA": RW}))
        # broker-a heart-beats every 100 ms; broker-b falls silent on the same (still open) connection.
        with trio.move_on_after(0.6):
            while True:
                await client.invoke(addr, register_request(1, "LEADER", topics={"Kept": RW}))
                await trio.sleep(0.1)
        assert (await route(client, addr, "TopicA")).code == ResponseCode.TOPIC_NOT_EXIST
        assert (await route(client, addr, "Kept")).code == ResponseCode.SUCCESS
        elapsed = await wait_topic_gone(client, addr, "Kept", timeout_s=2.0)  # liveness: expired, not kept
        assert elapsed > 0.2


async def test_closed_registration_connection_evicts_at_once(nursery):
    addr, table = await start(nursery)          # default 120 s expiry: only the closed connection can evict
    async with open_remoting_client() as observer:
        async with open_remoting_client() as broker:
            await broker.invoke(addr, register_request(1, "LEADER"))
            await broker.invoke(addr, register_request(2))
        assert (await route(observer, addr)).code in (ResponseCode.SUCCESS, ResponseCode.TOPIC_NOT_EXIST)
        await wait_topic_gone(observer, addr, timeout_s=3.0)  # evicted at once: its fail_after(3), not the 120 s expiry
        assert table.statistics().nodes == 0 and table.statistics().evictions == 2
