"""Stopping a consumer group, as with RocketMQ's ``mqadmin updateSubGroup -g G -s false``: a name server and the
3-node group broker-a as real processes, ``raftmq admin update-sub-group`` as the operator runs it, a producer and
two push consumer groups in this process.

The stopped group receives nothing more (its pulls are refused NO_PERMISSION) while the other keeps receiving; the
stop is replicated Raft metadata, so it holds after the leader is SIGKILLed (the followers refuse the group too,
and the new leader lists it); enabled again, the group resumes from its committed offsets and gets what it
missed."""

from __future__ import annotations

import functools

import pytest
import trio

from client import Message, open_admin, open_producer, open_push_consumer
from tests.cluster.test_admin_cli import _admin_json
from tests.cluster.test_e2e_produce_consume import routed_master, start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TOPIC = "StopTopic"
OPTIONS = {"consume_from_where": "CONSUME_FROM_FIRST_OFFSET", "persist_consumer_offset_interval_ms": 200,
           "rebalance_interval_ms": 1000}


async def _cli(namesrv: str, *args: str) -> dict:
    return await trio.to_thread.run_sync(functools.partial(_admin_json, namesrv, *args))


@pytest.mark.timeout(240)
async def test_a_group_stopped_with_the_cli_receives_nothing_until_enabled_and_the_stop_survives_a_leader_kill(
        spawn, tmp_path):
    cluster = await start_cluster(spawn, tmp_path)
    await cluster.create_topic(TOPIC, 2)
    leader = await cluster.leader_addr()
    got: dict[str, set[bytes]] = {"stopped": set(), "running": set()}

    def handler(group: str):
        async def on_message(msg) -> None:
            got[group].add(msg.body)
        return on_message

    async def wait_for(group: str, bodies: set[bytes]) -> None:
        with trio.fail_after(60):  # liveness: pulls, a failover, the consumers' route refresh
            while not bodies <= got[group]:
                await trio.sleep(0.05)

    async def send(producer, prefix: str) -> set[bytes]:
        bodies = {b"%s-%d" % (prefix.encode(), i) for i in range(10)}
        for body in sorted(bodies):
            await producer.send(Message(TOPIC, body))
        return bodies

    async with open_producer(cluster.namesrv) as producer, open_admin(cluster.namesrv) as admin, \
            open_push_consumer(cluster.namesrv, topic=TOPIC, consumer_group="stopped", handler=handler("stopped"),
                               **OPTIONS), \
            open_push_consumer(cluster.namesrv, topic=TOPIC, consumer_group="running", handler=handler("running"),
                               **OPTIONS):
        first = await send(producer, "first")
        await wait_for("stopped", first)
        await wait_for("running", first)

        done = await _cli(cluster.namesrv, "update-sub-group", "-g", "stopped", "-s", "false")
        [group] = done["groups"]
        assert group["broker_name"] == "broker-a" and group["changed"] == {"consume_enable": [True, False]}, done
        second = await send(producer, "second")
        await wait_for("running", second)
        await trio.sleep(1.5)  # time for the stopped group's pulls, which must all be refused
        assert got["stopped"] == first

        # The leader dies: the stop is in every member's replicated table.
        cluster.nodes[cluster.node_at(leader)].kill()
        with trio.fail_after(60):  # liveness: an election and a registration
            while await routed_master(admin) == leader:
                await trio.sleep(0.1)
        listed = await _cli(cluster.namesrv, "sub-group-list", "-g", "stopped")
        assert [(g["broker_name"], g["consume_enable"]) for g in listed["subscription_groups"]] == [
            ("broker-a", False)], listed
        third = await send(producer, "third")
        await wait_for("running", third)
        await trio.sleep(1.5)
        assert got["stopped"] == first

        done = await _cli(cluster.namesrv, "update-sub-group", "-g", "stopped", "--consume-enable", "true")
        assert done["groups"][0]["changed"] == {"consume_enable": [False, True]}, done
        await wait_for("stopped", first | second | third)
        assert got["running"] == first | second | third
