"""POP revive on a leader elected over another's pops while its dispatch trails its commit log: the popped messages
it has not dispatched yet are revived once it has, never dropped as if retention had taken them."""

from __future__ import annotations

import errno
import logging

import trio

from broker.node import BrokerNode, serve_broker
from remoting.codes import RequestCode, ResponseCode
from remoting.message import iter_records
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, ready_leader_among

TOPIC, GROUP = "PopT", "pop-g"


async def test_a_new_leader_revives_popped_messages_it_had_not_dispatched_yet(nursery, tmp_path, caplog):
    # Before: the new leader read the undispatched message as removed by retention, dropped its checkpoint, and as
    # the pop offset was past it, it was never delivered again.
    caplog.set_level(logging.INFO, logger="broker.pop")
    configs = broker_configs(tmp_path, None, n=3, pop_revive_interval_ms=100)
    nodes: dict[str, BrokerNode] = {}
    scopes: dict[str, trio.CancelScope] = {}
    addrs: dict[str, str] = {}

    async def run(config, task_status=trio.TASK_STATUS_IGNORED):
        with trio.CancelScope() as scope:
            scopes[config.dledger.self_id] = scope
            await serve_broker(config, on_serving=lambda n: nodes.__setitem__(config.dledger.self_id, n),
                               task_status=task_status)

    for config in configs:
        host, port = await nursery.start(run, config)
        addrs[config.dledger.self_id] = f"{host}:{port}"

    def ready_leader():
        return ready_leader_among(nodes, scopes)

    async def send(client, addr: str, body: bytes) -> None:
        r = await call(client, addr, RequestCode.SEND_MESSAGE,
                       {"producer_group": "pg", "topic": TOPIC, "queue_id": 0, "born_timestamp": 1}, body)
        assert r.code == ResponseCode.SUCCESS, r.remark

    async def pop(client, addr: str) -> list[bytes]:
        r = await call(client, addr, RequestCode.POP_MESSAGE,
                       {"consumer_group": GROUP, "topic": TOPIC, "queue_id": -1, "max_msg_nums": 32,
                        "invisible_time_ms": 1000, "init_mode": 0})
        return [m.body for m in iter_records(r.body)] if r.code == ResponseCode.SUCCESS else []

    old = await ready_leader()
    followers = [nid for nid in nodes if nid != old]
    async with open_remoting_client() as client:
        await send(client, addrs[old], b"dispatched")
        with trio.fail_after(10):
            while any(nodes[nid].store.dispatched_phy_offset < nodes[old].store.commit_log.end for nid in followers):
                await trio.sleep(0.02)

        # The followers' dispatch now meets a transient error the store retries (EMFILE, every 100 ms): their
        # consume queues trail their commit logs, as a busy or resource-starved new leader's do.
        def starved(*args, **kwargs):
            raise OSError(errno.EMFILE, "Too many open files")

        for nid in followers:
            nodes[nid].store.dispatcher.dispatch = starved
        await send(client, addrs[old], b"not dispatched")
        assert sorted(await pop(client, addrs[old])) == [b"dispatched", b"not dispatched"]
    scopes[old].cancel()  # killed with both popped and neither acked

    new = await ready_leader()
    assert any(k.startswith("c\x01") for k in nodes[new].pop.table())  # the checkpoint came with the Raft log
    await trio.sleep(2.0)  # the invisible time passes; revive rounds run every 100 ms
    assert any(k.startswith("c\x01") for k in nodes[new].pop.table()), "the checkpoint was dropped"
    for nid in followers:
        del nodes[nid].store.dispatcher.dispatch  # the error goes away: dispatch catches up
    again: list[bytes] = []
    async with open_remoting_client() as client:
        with trio.fail_after(15):
            while not {b"dispatched", b"not dispatched"} <= set(again):
                again += await pop(client, addrs[new])
                await trio.sleep(0.1)
    assert not [r for r in caplog.records if "gone before its revive" in r.getMessage()]
    for scope in scopes.values():
        scope.cancel()
