"""A member rebuilt empty after its peers' retention removed the first segments (docs/operations.md, "Rebuilding a
member") begins its commit log at a peer's min offset. The peer's start state comes with it: once that member
leads, a queue whose records were all in the removed segments continues its offsets, as on the other members."""

from __future__ import annotations

import dataclasses
import shutil

import trio

from broker.node import BrokerNode, serve_broker
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, ready_leader_among

SEGMENT = 64 * 1024
RETENTION = {"store.segment_size_bytes": SEGMENT, "store.max_message_size": 8192, "store.file_reserved_hours": 0.0,
             "store.delete_when_hours": list(range(24)), "store.clean_interval_ms": 100,
             "dledger.log_compaction_min_entries": 100}


async def test_a_rebuilt_member_that_leads_continues_a_queue_whose_records_retention_removed(nursery, tmp_path):
    # Before: the rebuilt member knew nothing of Old:0 (all its records in deleted segments), gave its next message
    # offset 0, and the others stored it below their max offset 40, where consumers committed at 40 never read it.
    configs = {c.dledger.self_id: c for c in broker_configs(tmp_path, None, n=3, **RETENTION)}
    nodes: dict[str, BrokerNode] = {}
    scopes: dict[str, trio.CancelScope] = {}
    stopped: dict[str, trio.Event] = {}
    addrs: dict[str, str] = {}

    async def run(config, task_status=trio.TASK_STATUS_IGNORED):
        nid = config.dledger.self_id
        stopped[nid] = trio.Event()
        try:
            with trio.CancelScope() as scope:
                scopes[nid] = scope
                await serve_broker(config, on_serving=lambda n: nodes.__setitem__(nid, n), task_status=task_status)
        finally:
            stopped[nid].set()

    for nid, config in configs.items():
        host, port = await nursery.start(run, config)
        addrs[nid] = f"{host}:{port}"

    def ready_leader():
        return ready_leader_among(nodes, scopes)

    async def send(client, nid: str, topic: str, queue_id: int, body: bytes) -> int:
        r = await call(client, addrs[nid], RequestCode.SEND_MESSAGE,
                       {"producer_group": "pg", "topic": topic, "queue_id": queue_id, "born_timestamp": 1}, body)
        assert r.code == ResponseCode.SUCCESS, r.remark
        return r.ext["queue_offset"]

    leader = await ready_leader()
    async with open_remoting_client() as client:
        for i in range(40):
            assert await send(client, leader, "Old", 0, b"old %d" % i) == i
        # One send is one Raft entry: past a compaction (a member rebuilt empty then gets a snapshot, not the
        # entries that wrote the log from 0), and until every member's retention deleted Old:0's segment.
        i = 0
        with trio.fail_after(60):
            while i < 150 or any(node.store.min_phy_offset < 2 * SEGMENT for node in nodes.values()):
                await send(client, leader, "New", i % 4, b"%06d" % i + b"." * 1000)
                i += 1
        assert all(node.store.get_max_offset_in_queue("Old", 0) == 40 for node in nodes.values())

        rebuilt = next(nid for nid in configs if nid != leader)
        scopes[rebuilt].cancel()
        await stopped[rebuilt].wait()
        config = configs[rebuilt]
        for n, path in enumerate((config.store.store_dir, config.dledger.data_dir)):
            shutil.move(path, tmp_path / f"aside-{n}")
        del nodes[rebuilt]
        config = dataclasses.replace(config, dledger=config.dledger.replace(rejoin=True))
        host, port = await nursery.start(run, config)
        addrs[rebuilt] = f"{host}:{port}"
        with trio.fail_after(30):
            while rebuilt not in nodes or not nodes[rebuilt].group.serving_reads \
                    or nodes[rebuilt].store.max_phy_offset < nodes[leader].store.max_phy_offset:
                await trio.sleep(0.05)
        store = nodes[rebuilt].store
        assert store.min_phy_offset > 0  # it began where the peers' retention left the log
        assert store.get_max_offset_in_queue("Old", 0) == 40

        await nodes[leader].group.transfer_leadership(rebuilt, timeout_s=5.0)
        assert await ready_leader() == rebuilt
        assert await send(client, rebuilt, "Old", 0, b"after the rebuild") == 40
        with trio.fail_after(10):
            while any(node.store.get_max_offset_in_queue("Old", 0) != 41 for node in nodes.values()):
                await trio.sleep(0.02)
        for node in nodes.values():
            assert node.store.get_min_offset_in_queue("Old", 0) == 40
