"""A real ``raftmq namesrv`` process against registrations no broker sends: one connection standing in for
thousands of broker nodes, and topic configs megabytes long."""

from __future__ import annotations

import cbor2
import pytest
import trio

from namesrv.route_info import MAX_NODES_PER_CONNECTION
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.procs import raftmq_argv

pytestmark = pytest.mark.cluster

RW = {"read_queue_nums": 4, "write_queue_nums": 4, "perm": 6}


@pytest.fixture
def namesrv_addr(spawn):
    proc = spawn(raftmq_argv("namesrv", "--listen", "127.0.0.1:0"))
    yield proc.fields["listen"]
    proc.stop(timeout_s=5)
    if proc.proc.stdout is not None:
        proc.proc.stdout.close()


def register(i: int, **changes):
    ext = {"cluster_name": f"cluster-{i}", "broker_name": f"broker-{i}", "broker_id": 1,
           "broker_addr": f"127.0.0.2:{1024 + i}", "role": "LEADER", "term": 1, "data_version": 1,
           "heartbeat_timeout_ms": 86_400_000, **changes}
    return make_request(RequestCode.REGISTER_BROKER, ext=ext, body=cbor2.dumps({f"Topic{i}": RW}))


async def cluster_info(client, addr):
    return cbor2.loads((await client.invoke(addr, make_request(RequestCode.GET_BROKER_CLUSTER_INFO))).body)


async def test_one_connection_cannot_register_broker_nodes_without_bound(namesrv_addr):
    """Before, every registration over one connection was a new node (a fresh broker name and cluster each time),
    kept for the day its heartbeat_timeout_ms asked for while the connection stayed open: 1000 registrations, 1000
    groups and clusters and topics, each handed to clients."""
    async with open_remoting_client() as hostile, open_remoting_client() as broker:
        codes = [(await hostile.invoke(namesrv_addr, register(i))).code for i in range(1000)]
        assert codes == [ResponseCode.SUCCESS] * MAX_NODES_PER_CONNECTION + [ResponseCode.INVALID_REQUEST] * (
            1000 - MAX_NODES_PER_CONNECTION)
        refused = await hostile.invoke(namesrv_addr, register(5000))
        assert refused.ext == {"field": "broker_name"} and "over a connection of its own" in refused.remark
        info = await cluster_info(hostile, namesrv_addr)
        assert len(info["broker_addr_table"]) == len(info["cluster_addr_table"]) == MAX_NODES_PER_CONNECTION
        # The nodes it did register still heartbeat over it, and a broker on its own connection registers.
        assert (await hostile.invoke(namesrv_addr, register(0, term=2))).code == ResponseCode.SUCCESS
        assert (await broker.invoke(namesrv_addr, register(5000))).code == ResponseCode.SUCCESS
        r = await broker.invoke(namesrv_addr, make_request(RequestCode.GET_ROUTEINFO_BY_TOPIC,
                                                           ext={"topic": "Topic5000"}))
        assert r.code == ResponseCode.SUCCESS
    async with open_remoting_client() as observer:
        # The connections closed: every node they registered is gone, whatever timeout it asked for.
        with trio.fail_after(5):  # liveness: the closes reach the name server a moment later
            while (await cluster_info(observer, namesrv_addr))["broker_addr_table"]:
                await trio.sleep(0.02)


async def test_a_huge_topic_config_is_refused_briefly_and_a_huge_unknown_key_ignored(namesrv_addr):
    """Before, a refusal echoed what it refused whole: a value near the frame size made an answer bigger than a frame
    may be. A key no name server knows is ignored (a newer broker's field), however long."""
    async with open_remoting_client() as client:
        body = cbor2.dumps({"TopicA": "x" * 8_000_000})
        request = make_request(RequestCode.REGISTER_BROKER, ext=register(1).ext, body=body)
        r = await client.invoke(namesrv_addr, request, timeout_s=30)
        assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == "body['TopicA']"
        assert "must be a map of topic config fields, got 'xxxx" in r.remark and len(r.remark) < 300
        assert (await cluster_info(client, namesrv_addr))["broker_addr_table"] == {}
        body = cbor2.dumps({"TopicA": {**RW, "k" * 8_000_000: 1}})
        request = make_request(RequestCode.REGISTER_BROKER, ext=register(1).ext, body=body)
        assert (await client.invoke(namesrv_addr, request, timeout_s=30)).code == ResponseCode.SUCCESS
        r = await client.invoke(namesrv_addr, make_request(RequestCode.GET_ROUTEINFO_BY_TOPIC,
                                                           ext={"topic": "TopicA"}))
        assert r.code == ResponseCode.SUCCESS
