"""Rebuilding a member (docs/operations.md): a node whose disk is lost, or whose log diverged, is stopped, its
data directories are moved aside, and it is started empty. It must copy the group's log from its peers and end
serving exactly the records the others serve."""

from __future__ import annotations

import shutil
import tomllib

import pytest
import trio

from client import Message, MessageQueue, open_producer
from dledger.service import get_raft_status
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.cluster.test_e2e_produce_consume import start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TOPIC = "RebuildTopic"
QUEUES = 4


async def _records(client, addr: str) -> list[bytes] | None:
    """Every queue's raw records as ``addr`` serves them (None while it does not serve the topic)."""
    out = []
    for q in range(QUEUES):
        offset = 0
        while True:
            r = await client.invoke(addr, make_request(RequestCode.PULL_MESSAGE, ext={
                "consumer_group": "rebuild_check", "topic": TOPIC, "queue_id": q, "queue_offset": offset,
                "max_msg_nums": 256}), timeout_s=5)
            if r.code == ResponseCode.PULL_NOT_FOUND:
                break
            if r.code != ResponseCode.SUCCESS:
                return None
            out.append(r.body)
            offset = r.ext["next_begin_offset"]
    return out


@pytest.mark.timeout(180)
async def test_a_member_started_empty_copies_the_group_log(spawn, tmp_path):
    cluster = await start_cluster(spawn, tmp_path)
    await cluster.create_topic(TOPIC, QUEUES)
    async with open_producer(cluster.namesrv) as producer:
        for i in range(400):  # single sends: more Raft entries than a log keeps, so the leader compacts
            await producer.send(Message(TOPIC, b"before %d" % i), queue=MessageQueue(TOPIC, "broker-a", i % QUEUES))

    leader = await cluster.leader_addr()
    nid = next(n for n, addr in cluster.addr_of.items() if addr != leader)
    config = tomllib.loads(cluster.paths[nid].read_text())
    await trio.to_thread.run_sync(cluster.nodes[nid].kill)
    for key, path in (("store", config["store"]["store_dir"]), ("dledger", config["dledger"]["data_dir"])):
        shutil.move(path, tmp_path / f"aside-{nid}-{key}")
    await trio.to_thread.run_sync(cluster.start, nid)

    async with open_producer(cluster.namesrv) as producer:
        for i in range(40):  # the group goes on while the member copies
            await producer.send(Message(TOPIC, b"after %d" % i), queue=MessageQueue(TOPIC, "broker-a", i % QUEUES))
    async with open_remoting_client() as client:
        expected = await _records(client, leader)
        assert expected is not None and sum(len(b) for b in expected) > 0
        got = None
        with trio.move_on_after(60):
            while (got := await _records(client, cluster.addr_of[nid])) != expected:
                await trio.sleep(0.2)
        assert got == expected, f"rebuilt {nid} serves {None if got is None else sum(map(len, got))} bytes of " \
                                f"records, the leader {sum(map(len, expected))}"
        # Not only what it serves: its whole commit log is the leader's, byte for byte.
        status, _ = await get_raft_status(client, leader, "broker-a")
        end = status["end_offset"]
        sums = {addr: (await get_raft_status(client, addr, "broker-a", checksum_up_to=end))[1]
                for addr in cluster.addr_of.values()}
        assert len({tuple(v) for v in sums.values()}) == 1 and sums[leader], sums
