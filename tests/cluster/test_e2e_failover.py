"""Failover under load with real processes: kill -9 the group's leader while producing and consuming, 5 times.

Each round: find the leader, SIGKILL it, measure the gap from the kill to the first send acknowledged by
another node (the store host in the acknowledged message id tells which node wrote it), restart the killed
node on its data, let it rejoin. At the end every acknowledged message must have been consumed (duplicates are
allowed and counted). The gaps are printed (run with -s), not asserted: speed is for benchmarks, and the
target (median ≤ 1.5 s) is recorded with its figures in docs/benchmarks.md. Each failover must complete within
the liveness bound (fail_after(30)) all the same.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import pytest
import trio

from client import open_producer, open_push_consumer
from tests.cluster.test_e2e_produce_consume import LOAD_CONSUMER_OPTIONS, Cluster, send_until, start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.load, pytest.mark.slow]

KILLS = 5
TARGET_MEDIAN_GAP_S = 1.5


@pytest.mark.timeout(300)
async def test_kill_leader_five_times_under_load(spawn, tmp_path, figure):
    cluster: Cluster = await start_cluster(spawn, tmp_path)
    topic = "FailoverTopic"
    await cluster.create_topic(topic, 4)

    acked: dict[str, float] = {}           # uniq id -> ack time
    ack_log: list[tuple[float, str]] = []  # (ack time, node address that stored it)
    consumed: Counter[str] = Counter()
    failed: list[str] = []  # the error class of each failed send
    stop_producing = trio.Event()

    async def on_message(msg) -> None:
        consumed[msg.msg_id] += 1

    async with open_producer(cluster.namesrv, send_msg_timeout_ms=2000, retry_backoff_ms=20) as producer, \
            open_push_consumer(cluster.namesrv, topic=topic, handler=on_message, consumer_group="failover_group",
                               **LOAD_CONSUMER_OPTIONS):

        gaps: list[float] = []
        async with trio.open_nursery() as nursery:
            for k in range(8):
                nursery.start_soon(send_until, producer, topic, k, stop_producing, acked, ack_log, failed)
            await trio.sleep(2)
            for round_no in range(KILLS):
                leader = await cluster.leader_addr()
                nid = cluster.node_at(leader)
                killed_at = time.monotonic()
                await trio.to_thread.run_sync(cluster.nodes[nid].kill)
                with trio.fail_after(30):
                    while True:
                        after = [t for t, addr in ack_log if t > killed_at and addr != leader]
                        if after:
                            gaps.append(min(after) - killed_at)
                            break
                        await trio.sleep(0.01)
                print(f"\nround {round_no + 1}: killed {nid} ({leader}); first ack by a new leader after "
                      f"{gaps[-1]:.3f}s")
                await trio.to_thread.run_sync(cluster.start, nid)
                await trio.sleep(3)  # let it catch up and the load run on the new leader
            stop_producing.set()

        with trio.move_on_after(60):
            while not set(acked) <= set(consumed):
                await trio.sleep(0.2)

    missing = set(acked) - set(consumed)
    duplicates = sum(c - 1 for c in consumed.values() if c > 1)
    median = statistics.median(gaps)
    figure(f"failover: {len(acked)} acked, {len(failed)} failed sends, {duplicates} duplicates, gaps "
           f"{', '.join(f'{g:.3f}' for g in gaps)} s, median {median:.3f} s (target <= {TARGET_MEDIAN_GAP_S} s)")
    assert not missing, f"{len(missing)} acknowledged messages were never consumed"
    assert len(gaps) == KILLS
