"""Admin requests of RocketMQ's mqadmin: GET_PRODUCER_CONNECTION_LIST (producerConnection: the producers of a group
whose heartbeats reach a node, and a clear refusal for a group with none) and GET_BROKER_CONFIG (getBrokerConfig:
a node's effective config, the cluster secret left out)."""

from __future__ import annotations

import cbor2
import trio

from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_connection, open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, wait_leader


async def test_producers_of_a_group_are_listed_while_connected(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        async with open_connection(addr) as p1, open_connection(addr) as p2:
            for conn, client_id in ((p1, "p1"), (p2, "p2")):
                hb = {"client_id": client_id, "producers": [{"producer_group": "pg"}]}
                assert (await conn.invoke(make_request(RequestCode.HEART_BEAT, body=cbor2.dumps(hb)))).code == 0
            r = await call(client, addr, RequestCode.GET_PRODUCER_CONNECTION_LIST, {"producer_group": "pg"})
            assert r.code == ResponseCode.SUCCESS, r.remark
            rows = cbor2.loads(r.body)["connections"]
            assert [row["client_id"] for row in rows] == ["p1", "p2"]
            assert all(row["client_addr"].startswith("127.0.0.1:") and row["last_heartbeat_age_ms"] >= 0
                       for row in rows)
        with trio.fail_after(5):  # liveness: the closes reach the broker a moment later
            while (r := await call(client, addr, RequestCode.GET_PRODUCER_CONNECTION_LIST,
                                   {"producer_group": "pg"})).code == ResponseCode.SUCCESS:
                await trio.sleep(0.02)
        assert r.code == ResponseCode.SYSTEM_ERROR and "has no producer online" in r.remark
        r = await call(client, addr, RequestCode.GET_PRODUCER_CONNECTION_LIST, {"producer_group": "p g"})
        assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == "producer_group"


async def test_a_node_tells_its_effective_config_but_not_the_cluster_secret(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None, long_polling_timeout_ms=12_345)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        r = await call(client, addr, RequestCode.GET_BROKER_CONFIG)
        assert r.code == ResponseCode.SUCCESS, r.remark
        got = cbor2.loads(r.body)
    assert got["long_polling_timeout_ms"] == 12_345  # set in the file
    assert got["max_topic_count"] == 50_000  # left to its default
    assert got["store"]["store_dir"] == str(config.store.store_dir)
    assert got["dledger"]["self_id"] == config.dledger.self_id
    assert [m["id"] for m in got["dledger"]["members"]] == [m.id for m in config.dledger.members]
    assert got["dledger"]["secret"] == "<set>" and config.dledger.secret not in r.body.decode("latin-1")
