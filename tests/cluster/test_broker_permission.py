"""Draining a group's writes before maintenance, as with RocketMQ's ``mqadmin updateBrokerConfig -k brokerPermission
-v 4``: a name server and the 3-node group broker-a as real processes, ``raftmq admin update-broker-config`` as the
operator runs it, clients in this process.

Read-only, every member registers the group's topics not writable, so the route tells producers to keep off while
consumers keep reading; a send that still reaches a member is refused with NO_PERMISSION. The setting is each
member's own, kept across its restart: a new leader elected meanwhile refuses sends too, and a member that was down
during a change is reported as not changed (exit 1) and keeps its old value until it is changed in its turn."""

from __future__ import annotations

import functools

import cbor2
import pytest
import trio

from client import Message, MessageQueue, open_admin, open_producer, open_pull_consumer
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError
from remoting.transport import open_remoting_client
from tests.cluster.test_admin_cli import _admin, _admin_json
from tests.cluster.test_e2e_produce_consume import routed_master, start_cluster
from tests.integration.broker.helpers import call

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TOPIC = "DrainTopic"


async def _cli(namesrv: str, *args: str, expect_rc: int = 0):
    return await trio.to_thread.run_sync(functools.partial(_admin, namesrv, "update-broker-config", *args,
                                                           expect_rc=expect_rc))


async def _route_perm(admin) -> int:
    [queue_data] = (await admin.get_route(TOPIC)).queue_datas
    return queue_data.perm


async def _node_permission(client, addr: str) -> int:
    r = await call(client, addr, RequestCode.GET_BROKER_CONFIG)
    assert r.code == ResponseCode.SUCCESS, r.remark
    return cbor2.loads(r.body)["broker_permission"]


async def _send_to(client, addr: str, body: bytes):
    return await call(client, addr, RequestCode.SEND_MESSAGE, {"topic": TOPIC, "queue_id": 0}, body)


@pytest.mark.timeout(240)
async def test_a_group_set_read_only_takes_no_writes_keeps_serving_reads_and_keeps_the_setting_across_restarts(
        spawn, tmp_path):
    cluster = await start_cluster(spawn, tmp_path)
    await cluster.create_topic(TOPIC, 2)
    leader = await cluster.leader_addr()
    members = sorted(cluster.addr_of.values())
    async with open_admin(cluster.namesrv) as admin, open_remoting_client() as client, \
            open_producer(cluster.namesrv) as producer:
        for i in range(3):
            await producer.send(Message(TOPIC, b"before-%d" % i), queue=MessageQueue(TOPIC, "broker-a", 0))
        assert await _route_perm(admin) == 6

        done = await trio.to_thread.run_sync(functools.partial(
            _admin_json, cluster.namesrv, "update-broker-config", "--broker", "broker-a", "-k", "broker_permission",
            "-v", "4"))
        # Every member, not only the leader: each registers, and each may lead next.
        assert sorted(n["addr"] for n in done["nodes"]) == members
        assert all((n["previous"], n["value"]) == (6, 4) for n in done["nodes"]), done
        for addr in members:
            assert await _node_permission(client, addr) == 4

        # The leader registered before it answered: the route says not writable at once.
        assert await _route_perm(admin) == 4
        refused = await _send_to(client, leader, b"refused")
        assert refused.code == ResponseCode.NO_PERMISSION, (refused.code, refused.remark)
        assert "broker broker-a" in refused.remark and "sending messages to it is forbidden" in refused.remark
        with pytest.raises(RaftMQError):  # no writable queue left in the route, nor a broker that takes one
            await producer.send(Message(TOPIC, b"refused"), queue=MessageQueue(TOPIC, "broker-a", 0))
        async with open_pull_consumer(cluster.namesrv, consumer_group="readers") as consumer:
            pulled = await consumer.pull(MessageQueue(TOPIC, "broker-a", 0), 0, 32)
        assert [m.body for m in pulled.messages] == [b"before-0", b"before-1", b"before-2"]

        # The leader dies: the member elected next was set read-only too, and the route stays so.
        old = cluster.node_at(leader)
        cluster.nodes[old].kill()
        with trio.fail_after(60):  # liveness: an election and a registration
            while (new_leader := await routed_master(admin)) == leader:
                await trio.sleep(0.1)
        assert await _route_perm(admin) == 4
        assert (await _send_to(client, new_leader, b"refused")).code == ResponseCode.NO_PERMISSION

        # Writes back while a member is down: the others change, the command says which did not (exit 1).
        failed = await _cli(cluster.namesrv, "--broker", "broker-a", "-k", "broker_permission", "-v", "6",
                            expect_rc=1)
        assert "broker_permission was not changed on 1 of 3 node(s) of broker-a" in failed.stderr, failed.stderr
        assert f"node {leader}: failed" in failed.stderr
        for addr in members:
            if addr != leader:
                assert f"node {addr}: broker_permission 4 -> 6" in failed.stderr
        assert await _route_perm(admin) == 6
        sent = await producer.send(Message(TOPIC, b"after"), queue=MessageQueue(TOPIC, "broker-a", 0))
        assert sent.queue_offset == 3

        # The member that was down comes back with its own setting, kept in its store directory.
        await trio.to_thread.run_sync(cluster.start, old)
        assert await _node_permission(client, leader) == 4
        again = await _cli(cluster.namesrv, "--broker", "broker-a", "-k", "broker_permission", "-v", "6")
        assert f"{leader}: broker_permission 4 -> 6" in again.stdout, again.stdout
        assert again.stdout.count("broker_permission already 6, unchanged") == 2, again.stdout
        assert await _node_permission(client, leader) == 6
        assert (await _send_to(client, new_leader, b"direct")).code == ResponseCode.SUCCESS
