"""DELETE_SUBSCRIPTIONGROUP (RocketMQ's deleteSubGroup with clean_offset): a dead group's offsets can be removed,
replicated; a group with members online, or a request that would remove nothing, is refused naming why."""

from __future__ import annotations

import cbor2
import pytest
import trio

from broker.node import OFFSET_TABLE, BrokerNode, serve_broker
from client import open_admin
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError
from remoting.transport import open_connection, open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, start_namesrv, wait_leader
from tests.integration.broker.test_broker_node import _send


async def test_a_dead_groups_offsets_are_deleted_and_a_live_one_is_refused(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None, consumer_offset_flush_interval_ms=20)
    nodes: list[BrokerNode] = []
    host, port = await nursery.start(lambda task_status: serve_broker(config, on_serving=nodes.append,
                                                                      task_status=task_status))
    addr = f"{host}:{port}"

    def replicated(group: str) -> dict[str, int]:
        return {k: v for k, v in nodes[0].group.metadata(OFFSET_TABLE).items() if k.startswith(group + "\x01")}

    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        assert (await _send(client, addr)).code == ResponseCode.SUCCESS
        for group in ("cg", "other"):
            for queue_id in (0, 1):
                r = await call(client, addr, RequestCode.UPDATE_CONSUMER_OFFSET,
                               {"consumer_group": group, "topic": "TopicTest", "queue_id": queue_id,
                                "commit_offset": 1})
                assert r.code == ResponseCode.SUCCESS, r.remark
        with trio.fail_after(5):  # liveness: the flusher replicates them, and the first commits create the groups
            while len(replicated("cg")) < 2 or len(replicated("other")) < 2 or \
                    not all(g in nodes[0].subscription_groups.table for g in ("cg", "other")):
                await trio.sleep(0.02)

        hb = {"client_id": "c1", "consumers": [{"consumer_group": "cg", "subscriptions": [{"topic": "TopicTest"}]}]}
        async with open_connection(addr) as member:
            r = await member.invoke(make_request(RequestCode.HEART_BEAT, body=cbor2.dumps(hb)))
            assert r.code == ResponseCode.SUCCESS
            r = await call(client, addr, RequestCode.DELETE_SUBSCRIPTIONGROUP, {"group_name": "cg"})
            assert r.code == ResponseCode.NO_PERMISSION and "1 member(s) online" in r.remark and "c1" in r.remark
            assert len(replicated("cg")) == 2
        with trio.fail_after(5):  # liveness: the close reaches the broker a moment later
            while cbor2.loads((await call(client, addr, RequestCode.GET_CONSUMER_LIST_BY_GROUP,
                                          {"consumer_group": "cg"})).body or b"\xa0").get("consumer_id_list"):
                await trio.sleep(0.02)

        # A group with no config (one that never pulled nor committed here) would lose nothing but its offsets.
        r = await call(client, addr, RequestCode.DELETE_SUBSCRIPTIONGROUP,
                       {"group_name": "never-seen", "clean_offset": False})
        assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == "clean_offset"
        r = await call(client, addr, RequestCode.DELETE_SUBSCRIPTIONGROUP, {"group_name": "c g"})
        assert r.code == ResponseCode.INVALID_REQUEST and r.ext["field"] == "group_name"

        r = await call(client, addr, RequestCode.DELETE_SUBSCRIPTIONGROUP, {"group_name": "cg"})
        assert r.code == ResponseCode.SUCCESS and r.ext["removed"] == 2
        assert r.ext["config_removed"] is True  # auto-created by its first commit, as by a pull
        assert replicated("cg") == {} and len(replicated("other")) == 2
        r = await call(client, addr, RequestCode.QUERY_CONSUMER_OFFSET,
                       {"consumer_group": "cg", "topic": "TopicTest", "queue_id": 0})
        assert r.code == ResponseCode.QUERY_NOT_FOUND
        r = await call(client, addr, RequestCode.QUERY_CONSUMER_OFFSET,
                       {"consumer_group": "other", "topic": "TopicTest", "queue_id": 0})
        assert r.code == ResponseCode.SUCCESS and r.ext["offset"] == 1
        r = await call(client, addr, RequestCode.DELETE_SUBSCRIPTIONGROUP, {"group_name": "cg"})
        assert r.code == ResponseCode.SUCCESS and r.ext["removed"] == 0  # nothing left: not an error, as RocketMQ


async def test_a_member_online_on_one_group_leaves_the_offsets_on_every_group(nursery, tmp_path):
    """Found by review: the brokers were asked all at once, and the one with no member online removed its offsets
    while the command failed on the other."""
    namesrv = await start_namesrv(nursery)
    addrs = {}
    for name in ("broker-a", "broker-b"):
        (config,) = broker_configs(tmp_path / name, namesrv, consumer_offset_flush_interval_ms=20,
                                   **{"dledger.group": name})
        addrs[name] = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        for addr in addrs.values():
            await wait_leader(client, addr)
            assert (await _send(client, addr)).code == ResponseCode.SUCCESS
            r = await call(client, addr, RequestCode.UPDATE_CONSUMER_OFFSET,
                           {"consumer_group": "G", "topic": "TopicTest", "queue_id": 0, "commit_offset": 1})
            assert r.code == ResponseCode.SUCCESS, r.remark
        await trio.sleep(0.5)
        hb = {"client_id": "c1", "consumers": [{"consumer_group": "G", "subscriptions": [{"topic": "TopicTest"}]}]}
        async with open_connection(addrs["broker-b"]) as member, open_admin(namesrv) as admin:
            assert (await member.invoke(make_request(RequestCode.HEART_BEAT, body=cbor2.dumps(hb)))).code == 0
            with trio.fail_after(10):
                while len((await admin.cluster_info()).broker_addrs) < 2:
                    await trio.sleep(0.1)
            with pytest.raises(RaftMQError) as caught:
                await admin.delete_group("G")
            assert "has members online (broker-b: c1)" in str(caught.value)
            r = await call(client, addrs["broker-a"], RequestCode.QUERY_CONSUMER_OFFSET,
                           {"consumer_group": "G", "topic": "TopicTest", "queue_id": 0})
            assert r.code == ResponseCode.SUCCESS and r.ext["offset"] == 1
