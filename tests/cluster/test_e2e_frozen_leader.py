"""A leader that hangs instead of dying, with real processes: SIGSTOP the group's leader under load.

A stopped process keeps its sockets open, so unlike a kill nothing tells the client the leader is gone: no
reset, no NOT_LEADER. The other two nodes elect a new leader within a second, which registers with the name
server at once; the client's leader watch (client/instance.py) must notice that the old leader's connection
went silent with sends waiting, see the new route and resend there. The test requires sends acknowledged by
another node *while the old leader is still stopped*, then resumes it, and requires every acknowledged
message to be consumed and the resumed node to hold the same commit log end as the others. The gap from the
stop to the first acknowledgement elsewhere is printed, not asserted (speed is for benchmarks).
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest
import trio

from client import Message, SendFailedError, open_admin, open_producer, open_push_consumer
from remoting.errors import RaftMQError
from remoting.message import parse_msg_id
from tests.cluster.test_e2e_produce_consume import Cluster, start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# Long enough that a client waiting for the stopped node to answer would see every send time out (3 s).
STOPPED_S = 8.0


@pytest.mark.timeout(180)
async def test_stopped_leader_is_left_for_the_new_one_before_it_resumes(spawn, tmp_path, capsys):
    cluster: Cluster = await start_cluster(spawn, tmp_path)
    topic = "FrozenLeaderTopic"
    await cluster.create_topic(topic, 4)

    acked: dict[str, float] = {}
    ack_log: list[tuple[float, str]] = []
    consumed: Counter[str] = Counter()
    failed: list[str] = []
    stop_producing = trio.Event()

    async def on_message(msg) -> None:
        consumed[msg.msg_id] += 1

    async with open_producer(cluster.namesrv, retry_backoff_ms=20) as producer, \
            open_push_consumer(cluster.namesrv, topic=topic, handler=on_message, consumer_group="frozen_group",
                               consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=500,
                               persist_consumer_offset_interval_ms=200, broker_suspend_max_time_ms=1000):

        async def produce_loop(k: int) -> None:
            i = 0
            while not stop_producing.is_set():
                i += 1
                try:
                    r = await producer.send(Message(topic, b"%02d-%08d" % (k, i)))
                except (SendFailedError, RaftMQError) as e:
                    failed.append(type(getattr(e, "last_error", None) or e).__name__)
                    await trio.sleep(0.01)
                    continue
                now = time.monotonic()
                acked[r.msg_id] = now
                (store_ip, store_port), _ = parse_msg_id(r.offset_msg_id)
                ack_log.append((now, f"{store_ip}:{store_port}"))
                await trio.sleep(0.002)

        async with trio.open_nursery() as nursery:
            for k in range(8):
                nursery.start_soon(produce_loop, k)
            await trio.sleep(2)
            leader = await cluster.leader_addr()
            stopped = cluster.nodes[cluster.node_at(leader)]
            stopped_at = time.monotonic()
            os.kill(stopped.pid, signal.SIGSTOP)
            try:
                gap = None
                with trio.move_on_after(STOPPED_S):
                    while gap is None:
                        after = [t for t, addr in ack_log if t > stopped_at and addr != leader]
                        gap = min(after) - stopped_at if after else None
                        await trio.sleep(0.01)
                failed_while_stopped = len(failed)
            finally:
                os.kill(stopped.pid, signal.SIGCONT)
            assert gap is not None, (f"no send was acknowledged by another node in the {STOPPED_S:.0f} s the leader "
                                     f"{leader} was stopped ({len(failed)} sends failed: {Counter(failed)})")
            await trio.sleep(3)  # the resumed node steps down and catches up while the load goes on
            stop_producing.set()

        with trio.move_on_after(60):
            while not set(acked) <= set(consumed):
                await trio.sleep(0.2)

    ends: dict[str, int] = {}
    async with open_admin(cluster.namesrv) as admin:
        with trio.move_on_after(30):
            while True:
                ends = {addr: (await admin.broker_status(addr))["commit_log_max_offset"]
                        for addr in cluster.addr_of.values()}
                if len(set(ends.values())) == 1:
                    break
                await trio.sleep(0.2)

    missing = set(acked) - set(consumed)
    duplicates = sum(c - 1 for c in consumed.values() if c > 1)
    with capsys.disabled():
        print(f"\nstopped leader: first ack by the new leader {gap:.3f} s after SIGSTOP; {len(acked)} acked, "
              f"{failed_while_stopped} sends failed while it was stopped ({len(failed)} in all: "
              f"{dict(Counter(failed))}), {duplicates} duplicates")
    assert not missing, f"{len(missing)} acknowledged messages were never consumed"
    assert len(set(ends.values())) == 1, f"commit log ends differ after the stopped leader resumed: {ends}"
