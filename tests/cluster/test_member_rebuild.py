"""Rebuilding a member (docs/operations.md): a node whose disk is lost, or whose log diverged, is stopped, its
data directories are moved aside, and it is started empty. It must copy the group's log from its peers and end
serving exactly the records the others serve."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import cbor2
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
# 64 KiB segments, each deleted as soon as a newer one exists: retention catches up within a second.
FORCED_RETENTION = {
    "store.segment_size_bytes": "65536", "store.max_message_size": "8192", "store.file_reserved_hours": "0",
    "store.delete_when_hours": "[" + ",".join(str(h) for h in range(24)) + "]", "store.clean_interval_ms": "100"}


async def _restart_empty(cluster, aside: Path, *nids: str) -> None:
    """The operator's rebuild (docs/operations.md): stop the members (SIGKILL; nothing if one already exited),
    move their store and dledger directories to ``aside``, start them with the same config and ``--rejoin``.
    Several members are all stopped before any starts, so they come back empty together."""
    for nid in nids:
        await trio.to_thread.run_sync(cluster.nodes[nid].kill)
    for nid in nids:
        config = tomllib.loads(cluster.paths[nid].read_text())
        for key, path in (("store", config["store"]["store_dir"]), ("dledger", config["dledger"]["data_dir"])):
            shutil.move(path, aside / f"aside-{nid}-{key}")
    for nid in nids:
        await trio.to_thread.run_sync(cluster.start, nid, "--rejoin")


async def _fill_until_retention(producer, client, leader: str, more_than: int) -> int:
    """Filler until more than ``more_than`` messages were sent and retention deleted at least two segments on
    ``leader``; returns the next message number."""
    i = 0
    with trio.fail_after(60):
        while True:
            i = await _send_filler(producer, i)
            if i > more_than and (await _runtime(client, leader))["commit_log_min_offset"] >= 2 * 65536:
                return i


async def _send_after(producer, first: int, count: int = 40) -> int:
    for i in range(first, first + count):
        await producer.send(Message(TOPIC, b"after %d" % i), queue=MessageQueue(TOPIC, "broker-a", i % QUEUES))
    return first + count


async def _served_alike(client, leader: str, addr: str) -> tuple[list[bytes] | None, list[bytes] | None, list[int]]:
    """(the leader's records, ``addr``'s records, the queue offsets both were read from). Both read from the same
    offsets: retention runs on each node on its own."""
    starts = [max(await _min_offset(client, leader, q), await _min_offset(client, addr, q)) for q in range(QUEUES)]
    return await _records(client, leader, starts), await _records(client, addr, starts), starts


async def _send_filler(producer, first: int, count: int = 50) -> int:
    """``count`` messages of about 1 KiB, spread over the queues; returns the next message number."""
    for i in range(first, first + count):
        await producer.send(Message(TOPIC, b"%06d" % i + b"." * 900), queue=MessageQueue(TOPIC, "broker-a", i % QUEUES))
    return first + count


async def _records(client, addr: str, starts: list[int] | None = None) -> list[bytes] | None:
    """Every queue's raw records as ``addr`` serves them, from ``starts`` (None while it does not serve the
    topic)."""
    out = []
    for q in range(QUEUES):
        offset = starts[q] if starts else 0
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
    await _restart_empty(cluster, tmp_path, nid)

    async with open_producer(cluster.namesrv) as producer:
        await _send_after(producer, 0)  # the group goes on while the member copies
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


@pytest.mark.timeout(180)
# With compactions every 100 entries the snapshot's end may or may not lie behind the peers' min offset (timing);
# with every 1000 it does.
@pytest.mark.parametrize("compaction_entries, past_snapshot", [(100, None), (1000, True)])
async def test_a_member_started_empty_begins_where_the_peers_retention_left_the_log(spawn, tmp_path,
                                                                                     compaction_entries,
                                                                                     past_snapshot):
    """Retention has deleted the group's first segments: the empty member starts its commit log at a peer's
    min offset, copies from there, and serves what the others serve (each queue begins mid-way). With rare
    compactions the peers' logs begin past the snapshot's end, and the member copies up to a peer's end."""
    cluster = await start_cluster(spawn, tmp_path, {
        **FORCED_RETENTION, "dledger.log_compaction_min_entries": str(compaction_entries)})
    await cluster.create_topic(TOPIC, QUEUES)
    leader = await cluster.leader_addr()
    async with open_remoting_client() as client, open_producer(cluster.namesrv) as producer:
        # One send is one Raft entry here: past the first compaction, and two segments deleted.
        i = await _fill_until_retention(producer, client, leader, int(compaction_entries * 1.2))

        nid = next(n for n, addr in cluster.addr_of.items() if addr != leader)
        await _restart_empty(cluster, tmp_path, nid)
        i = await _send_after(producer, i)

        rebuilt = cluster.addr_of[nid]
        got = expected = None
        with trio.move_on_after(60):
            while True:
                expected, got, starts = await _served_alike(client, leader, rebuilt)
                if got == expected and expected:
                    break
                await trio.sleep(0.2)
        assert got == expected and expected, f"rebuilt {nid} does not serve what the leader serves"
        # It began past 0: the peers no longer had the start.
        assert (await _runtime(client, rebuilt))["commit_log_min_offset"] > 0
        assert all(s > 0 for s in starts)
    output = "".join(cluster.nodes[nid].output)
    assert "empty commit log starts at offset" in output
    if past_snapshot is not None:
        assert ("past the snapshot's end" in output) == past_snapshot


@pytest.mark.timeout(180)
async def test_two_members_started_empty_at_once_begin_where_the_leader_keeps_the_log(spawn, tmp_path):
    """Both followers rebuilt at once after retention: only the leader has the log, and each empty member's
    other peer has nothing to give. That peer must not hold the decision back (both waited for each other for
    ever, seen when a follower that started late got its first snapshot after retention had run): both begin
    at the leader's min offset and serve what it serves."""
    cluster = await start_cluster(spawn, tmp_path, {**FORCED_RETENTION, "dledger.log_compaction_min_entries": "100"})
    await cluster.create_topic(TOPIC, QUEUES)
    leader = await cluster.leader_addr()
    async with open_remoting_client() as client, open_producer(cluster.namesrv) as producer:
        # Past the first compaction, and two segments deleted on the leader.
        i = await _fill_until_retention(producer, client, leader, 120)
        rebuilt = [nid for nid, addr in cluster.addr_of.items() if addr != leader]
        await _restart_empty(cluster, tmp_path, *rebuilt)
        await _send_after(producer, i)

        served: dict[str, list[bytes] | None] = {nid: None for nid in rebuilt}
        expected = None
        with trio.move_on_after(60):
            while True:
                leader = await cluster.leader_addr()
                for nid in rebuilt:
                    expected, served[nid], _ = await _served_alike(client, leader, cluster.addr_of[nid])
                if expected and all(got == expected for got in served.values()):
                    break
                await trio.sleep(0.2)
    assert expected and all(got == expected for got in served.values()), (
        f"rebuilt {rebuilt} do not serve what the leader serves: {[nid for nid in rebuilt if served[nid] is None]} "
        f"serve nothing yet")
    for nid in rebuilt:
        assert "empty commit log starts at offset" in "".join(cluster.nodes[nid].output)


async def _min_offset(client, addr: str, queue_id: int) -> int:
    r = await client.invoke(addr, make_request(RequestCode.GET_MIN_OFFSET, ext={"topic": TOPIC, "queue_id": queue_id}),
                            timeout_s=5)
    return r.ext["offset"] if r.code == ResponseCode.SUCCESS else 0


@pytest.mark.timeout(180)
async def test_a_member_left_behind_by_retention_stops_with_exit_status_3_then_rejoins_empty(spawn, tmp_path):
    """A member away while its peers' retention deleted everything after its own end cannot catch up: it says so
    in one line and exits with status 3 (not an endless retry). Started empty, it rejoins."""
    cluster = await start_cluster(spawn, tmp_path, FORCED_RETENTION)
    await cluster.create_topic(TOPIC, QUEUES)
    leader = await cluster.leader_addr()
    nid = next(n for n, addr in cluster.addr_of.items() if addr != leader)
    async with open_remoting_client() as client, open_producer(cluster.namesrv) as producer:
        await producer.send(Message(TOPIC, b"first"), queue=MessageQueue(TOPIC, "broker-a", 0))
        with trio.fail_after(10):
            while (await _runtime(client, cluster.addr_of[nid]))["commit_log_max_offset"] == 0:
                await trio.sleep(0.05)
        await trio.to_thread.run_sync(cluster.nodes[nid].kill)
        i = 0
        with trio.fail_after(60):
            while (await _runtime(client, leader))["commit_log_min_offset"] < 3 * 65536:
                i = await _send_filler(producer, i)

        proc = await trio.to_thread.run_sync(cluster.start, nid)
        with trio.fail_after(30):
            while proc.alive:
                await trio.sleep(0.1)
        assert proc.proc.returncode == 3
        output = "".join(proc.output)
        assert f"CRITICAL raftmq.runner: stopping: member {nid} of group broker-a needs the commit log from" in output
        assert "Traceback" not in output

        await _restart_empty(cluster, tmp_path, nid)  # the member exited: only its directories move
        with trio.fail_after(30):
            while not (await _runtime(client, cluster.addr_of[nid]))["serving_reads"]:
                await trio.sleep(0.1)


async def _runtime(client, addr: str) -> dict:
    r = await client.invoke(addr, make_request(RequestCode.GET_BROKER_RUNTIME_INFO), timeout_s=5)
    assert r.code == ResponseCode.SUCCESS, r.remark
    return cbor2.loads(r.body)
