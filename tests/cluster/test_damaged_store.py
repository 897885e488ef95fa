"""A group whose members lost derived store files while they were down, with real processes.

The three nodes of broker-a are killed (SIGKILL) after a load, and each loses ConsumeQueue and IndexFile files
of its own before it is started again: n1 the newest file of queue 0 and the newest index file, n2 the whole
directory of queue 1 and the first index file, n3 a middle file of queue 2, a middle index file and its
checkpoint. Whichever becomes leader, the group must go on where it was: every acknowledged message is pulled
at the queue offset its send returned, the next sends continue each queue's offsets, every key is found, and
each node's ConsumeQueue and IndexFile agree with its commit log.

Before recovery rebuilt lost files from the commit log, a leader that had lost a queue's newest file (or its
directory) handed out that queue's offsets again, to every replica (with queue 1's directory lost on all three
nodes, the 150 sends after the restart took offsets 0-149 and the 600 before were never pulled again); a lost
middle file was skipped by pulls, and a lost index file's keys were never found again.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import trio

from broker.store import MessageStore, StoreConfig, decode_record
from client import Message, MessageQueue, open_admin, open_producer, open_pull_consumer
from remoting.message import BLANK_MAGIC
from tests.cluster.test_e2e_produce_consume import GROUP, Cluster, start_cluster, verify_output
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TOPIC = "DamagedTopic"
QUEUES = 4
# Small files, so a few thousand messages make many of each: 16 units a ConsumeQueue file, 63 entries an
# IndexFile (two keys a message: its unique key and KEYS), 64 KiB segments.
STORE = {"segment_size_bytes": 64 << 10, "max_message_size": 16 << 10, "consume_queue_units_per_file": 16,
         "index_hash_slots": 16, "index_max_entries": 64}
OVERRIDES = {f"store.{key}": str(value) for key, value in STORE.items()}
SENDERS = 6


async def _send(producer, phase: str, count: int, acked: dict[str, tuple[int, int, bytes]]) -> None:
    async def sender(k: int) -> None:
        for i in range(count):
            key = f"{phase}-{k}-{i}"
            body = key.encode() * (1 + i % 7)
            result = await producer.send(Message(TOPIC, body, keys=key))
            acked[key] = (result.message_queue.queue_id, result.queue_offset, body)

    async with trio.open_nursery() as nursery:
        for k in range(SENDERS):
            nursery.start_soon(sender, k)


def _damage(store_dir: Path, nid: str) -> None:
    cq = store_dir / "consumequeue" / TOPIC
    index = sorted(os.listdir(store_dir / "index"))
    if nid == "n1":
        os.unlink(cq / "0" / sorted(os.listdir(cq / "0"))[-1])
        os.unlink(store_dir / "index" / index[-1])
    elif nid == "n2":
        shutil.rmtree(cq / "1")
        os.unlink(store_dir / "index" / index[0])
    else:
        files = sorted(os.listdir(cq / "2"))
        os.unlink(cq / "2" / files[len(files) // 2])
        os.unlink(store_dir / "index" / index[len(index) // 2])
        os.unlink(store_dir / "checkpoint")


def _check_store(store_dir: Path, acked: dict[str, tuple[int, int, bytes]]) -> list[str]:
    """What is wrong with the store of a stopped node: queue offsets in its commit log, its ConsumeQueue units
    and IndexFile lookups against the log, and every acknowledged message where its send said."""
    problems = []
    with MessageStore.open(StoreConfig(store_dir=store_dir, **STORE)) as store:
        at: dict[str, set[tuple[int, int, bytes]]] = {}
        next_offset: dict[int, int] = {}
        pos = store.min_phy_offset
        while pos < store.max_phy_offset:
            raw = store.commit_log.read_raw(pos, 1)
            pos += len(raw)
            if int.from_bytes(raw[4:8], "big") == BLANK_MAGIC:
                continue
            view = decode_record(raw)
            if view.topic != TOPIC:
                continue
            q = view.queue_id
            if view.queue_offset != next_offset.get(q, 0):
                problems.append(f"queue {q}: offset {view.queue_offset} after {next_offset.get(q, 0) - 1}")
            next_offset[q] = view.queue_offset + 1
            cq = store.dispatcher.queue(TOPIC, q)
            unit = cq.unit(view.queue_offset) if cq is not None else None
            if unit is None or unit[:2] != (view.phy_offset, view.size):
                problems.append(f"queue {q} offset {view.queue_offset}: unit {unit} for record at {view.phy_offset}")
            at.setdefault(view.keys[0], set()).add((q, view.queue_offset, view.body))
        for q in range(QUEUES):
            if store.get_max_offset_in_queue(TOPIC, q) != next_offset.get(q, 0):
                problems.append(f"queue {q}: max offset {store.get_max_offset_in_queue(TOPIC, q)}, log "
                                f"{next_offset.get(q, 0)}")
        for key, where in acked.items():
            if where not in at.get(key, ()):
                problems.append(f"acknowledged {key} at {where[:2]} is not in the log there")
            found = store.query_message(TOPIC, key, 4).messages
            if len(found) != len(at.get(key, ())):
                problems.append(f"key {key} found {len(found)} times, stored {len(at.get(key, ()))}")
    return problems


@pytest.mark.timeout(300)
async def test_members_that_lost_derived_files_rebuild_them_and_the_group_goes_on(spawn, tmp_path):
    cluster: Cluster = await start_cluster(spawn, tmp_path, OVERRIDES)
    await cluster.create_topic(TOPIC, QUEUES)
    acked: dict[str, tuple[int, int, bytes]] = {}
    async with open_producer(cluster.namesrv, send_msg_timeout_ms=10_000) as producer:
        await _send(producer, "before", 400, acked)
    # Each node's next checkpoint then covers every message, so re-dispatch from it restores nothing lost.
    await trio.sleep(2.5)
    for proc in cluster.nodes.values():
        proc.kill()
    store_dir = {nid: tmp_path / "cluster" / GROUP / nid / "store" for nid in cluster.nodes}
    for nid, path in store_dir.items():
        _damage(path, nid)
    for nid in list(cluster.nodes):
        await trio.to_thread.run_sync(cluster.start, nid)
    await cluster.leader_addr()
    async with open_producer(cluster.namesrv, send_msg_timeout_ms=10_000) as producer:
        await _send(producer, "after", 100, acked)

    pulled: dict[str, list[tuple[int, int, bytes]]] = {}
    async with open_pull_consumer(cluster.namesrv, consumer_group="damaged_check") as consumer:
        for q in range(QUEUES):
            mq = MessageQueue(TOPIC, GROUP, q)
            offset, end = await consumer.min_offset(mq), await consumer.max_offset(mq)
            assert offset == 0
            while offset < end:
                result = await consumer.pull(mq, offset, 32)
                for m in result.messages:
                    pulled.setdefault(m.keys[0], []).append((q, m.queue_offset, m.body))
                assert result.next_begin_offset > offset, result
                offset = result.next_begin_offset
    wrong = [key for key, where in acked.items() if pulled.get(key) != [where]]
    assert not wrong, f"{len(wrong)} acknowledged messages not pulled once where sent, e.g. " \
                      f"{[(k, acked[k][:2], [p[:2] for p in pulled.get(k, [])]) for k in wrong[:5]]}"
    async with open_admin(cluster.namesrv) as admin:
        for key in list(acked)[::97]:
            assert [m.keys for m in await admin.query_message(TOPIC, key)] == [[key]], key

    members = ",".join(cluster.addr_of[nid] for nid in cluster.nodes)
    output = await verify_output(raftmq_argv("verify", "--group", GROUP, "--members", members))
    assert b"are identical" in output, output
    for proc in cluster.nodes.values():
        proc.stop()
    for nid, path in store_dir.items():
        problems = await trio.to_thread.run_sync(_check_store, path, acked)
        assert not problems, (nid, problems[:10])
    # n1's lost newest index file is restored by re-dispatch from the end of the one before, without a rebuild.
    for nid, what in (("n1", "consume queues"), ("n2", "consume queues"), ("n3", "consume queues"),
                      ("n2", "index files"), ("n3", "index files")):
        assert f"{what} do not match the commit log, rebuilding them from it" in "".join(cluster.nodes[nid].output)
