"""Nodes that hang instead of dying, with real processes: SIGSTOP a node of the group under load, then SIGCONT.

A stopped process keeps its sockets open, so unlike a kill nothing tells anyone it is gone: no reset, no
NOT_LEADER.
- The leader stopped: the other two nodes elect a new leader within a second, which registers with the name
  server at once; the client's leader watch (client/instance.py) must notice that the old leader's connection
  went silent with sends waiting, see the new route and resend there. Sends must be acknowledged by another
  node *while the old leader is still stopped*.
- A follower stopped: the leader and the other follower are a majority, so sends go on being acknowledged.
Either way, once the node resumes, every acknowledged message must be consumed and the three commit logs must
be identical (``raftmq verify``). The gap from the stop to the first acknowledgement by a new leader is
printed, not asserted (speed is for benchmarks).
- A follower back from a stop longer than ``connectionTimeout`` must not depose the leader (the pre-vote in
  dledger/patches.py, 15).
- A leader deposed with entries in flight and caught up through a snapshot must count nothing in flight and
  must lead again when leadership is handed back to it (dledger/patches.py, 16).
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest
import trio

from client import open_admin, open_producer
from dledger.service import get_raft_status, transfer_leadership
from remoting.transport import open_remoting_client
from raftmq.commands.dev import NODE_IDS
from tests.cluster.test_e2e_produce_consume import (GROUP, Cluster, LoadLedger, start_cluster, under_load,
                                                    verify_output)
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.load, pytest.mark.slow]

# Long enough that a client waiting for a stopped leader to answer would see every send time out (3 s).
STOPPED_S = 8.0


async def _stop_a_node_under_load(spawn, tmp_path, figure, *, leader: bool) -> None:
    cluster: Cluster = await start_cluster(spawn, tmp_path)
    topic = "StoppedNodeTopic"
    await cluster.create_topic(topic, 4)
    async with under_load(cluster, topic, "stopped_group") as load:
        await trio.sleep(2)
        leader_addr = await cluster.leader_addr()
        victim_addr = leader_addr if leader else min(a for a in cluster.addr_of.values() if a != leader_addr)
        victim = cluster.nodes[cluster.node_at(victim_addr)]
        stopped_at = time.monotonic()
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            gap = None
            if leader:
                with trio.move_on_after(STOPPED_S):
                    gap = await load.first_ack_after(stopped_at, not_by=victim_addr, timeout_s=STOPPED_S + 1)
            else:
                await trio.sleep(STOPPED_S)
            acked_while_stopped = load.acks_between(stopped_at, float("inf"))
            failed_while_stopped = len(load.failed)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        await trio.sleep(3)  # the resumed node catches up (a leader steps down first) while the load goes on

    verified = await verify_output(raftmq_argv("verify", "--group", GROUP, "--members",
                                               ",".join(cluster.addr_of.values())))
    storers = [addr for t, addr in load.ack_log if t > resumed_at]
    figure(f"stopped {'leader' if leader else 'follower'} {victim_addr} for "
           + (f"{gap:.3f} s until the first ack by the new leader" if leader and gap is not None
              else f"{STOPPED_S:.0f} s")
           + f"; {acked_while_stopped} acked meanwhile, {failed_while_stopped} failed; leader {leader_addr} "
           f"before, {', '.join(sorted(set(storers)))} after it resumed; {len(load.acked)} acked in all, "
           f"{len(load.failed)} failed ({dict(Counter(load.failed))}), {load.duplicates()} duplicates")
    if leader:
        assert gap is not None, (f"no send was acknowledged by another node in the {STOPPED_S:.0f} s the leader "
                                 f"{victim_addr} was stopped ({failed_while_stopped} sends failed)")
    else:
        assert acked_while_stopped > 0 and failed_while_stopped == 0, (
            f"with follower {victim_addr} stopped the other two must go on committing: {acked_while_stopped} "
            f"acked, {failed_while_stopped} failed")
    assert not load.missing(), f"{len(load.missing())} acknowledged messages were never consumed"
    assert b"are identical" in verified, verified


async def _lead_again(cluster: Cluster, addr: str, ack_log: list[tuple[float, str]]) -> tuple[dict, bool]:
    """The resumed old leader at ``addr``, once caught up: its Raft status, and whether it acknowledges sends after
    leadership is handed back to it. It was deposed with entries in flight and usually catches up through a
    snapshot, which covers those entries without applying them one by one: pysyncobj then never called their
    commit callbacks, the group kept counting them in flight, and elected again it proposed nothing (every send
    SYSTEM_BUSY until another election; dledger/patches.py, 16)."""
    async with open_remoting_client() as rpc:
        with trio.move_on_after(15):
            while True:
                status, _ = await get_raft_status(rpc, addr, GROUP)
                if status["serving_reads"] and status["in_flight_batches"] == 0:
                    break
                await trio.sleep(0.1)
        leader_addr = await cluster.leader_addr()
        await transfer_leadership(rpc, leader_addr, GROUP, cluster.node_at(addr), timeout_s=10)
        handed_at = time.monotonic()
        with trio.move_on_after(10):
            while not any(t > handed_at and a == addr for t, a in ack_log):
                await trio.sleep(0.05)
            return status, True
    return status, False


@pytest.mark.timeout(180)
async def test_stopped_leader_is_left_for_the_new_one_before_it_resumes(spawn, tmp_path, figure):
    await _stop_a_node_under_load(spawn, tmp_path, figure, leader=True)


@pytest.mark.timeout(180)
async def test_stopped_follower_leaves_the_other_two_committing_and_catches_up(spawn, tmp_path, figure):
    await _stop_a_node_under_load(spawn, tmp_path, figure, leader=False)


@pytest.mark.timeout(120)
async def test_a_follower_back_from_a_stop_does_not_depose_the_leader(spawn, tmp_path):
    """pysyncobj alone: a follower stopped for longer than connectionTimeout (3.5 s) comes back with its election
    timer long expired and no heartbeat waiting (the leader dropped the link), stands at once with a higher term,
    and every member takes that term: the leader steps down for an election (4 stops of 6 s, 4 elections, before
    dledger/patches.py 15). With the pre-vote it asks first, the two others still have their leader and say
    no, and nothing changes."""
    cluster: Cluster = await start_cluster(spawn, tmp_path)
    async with open_admin(cluster.namesrv) as admin:
        async def roles() -> dict[str, tuple[str, int]]:
            return {addr: ((st := await admin.broker_status(addr))["role"], st["term"])
                    for addr in cluster.addr_of.values()}

        await trio.sleep(1)
        leader = await cluster.leader_addr()
        before = await roles()
        follower = min(a for a in cluster.addr_of.values() if a != leader)
        proc = cluster.nodes[cluster.node_at(follower)]
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            await trio.sleep(6)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        with trio.move_on_after(10):  # until its timer fired once it ran again (or the group changed)
            while (await admin.broker_status(follower)).get("pre_votes", 0) == 0 and await roles() == before:
                await trio.sleep(0.2)
        await trio.sleep(2)  # the time an election would take, had it stood
        after = await roles()
        pre_votes = (await admin.broker_status(follower)).get("pre_votes")
    assert after == before, f"a follower back from a 6 s stop changed the group: {before} -> {after}"
    assert pre_votes and pre_votes > 0, f"the stopped follower's election timer never fired: pre_votes {pre_votes}"


@pytest.mark.timeout(180)
async def test_a_leader_deposed_with_entries_in_flight_leads_again_once_caught_up(spawn, tmp_path, figure):
    """Both followers are stopped for a moment so that the leader's entries cannot commit, then the leader is
    stopped with them in flight, and the followers are killed and started again: the entries the leader sent
    them die unread with their processes, so no acknowledgement of them waits for the old leader (resumed, it
    reads what waits in its sockets before anything else, dledger/member.py ``tick``, and would commit them).
    The followers elect a leader and go on under load for STOPPED_S, compacting their logs, so the old leader,
    resumed, catches up through a snapshot that covers its in-flight entries. Before dledger/patches.py 16 their
    commit callbacks were never called: the old leader counted them in flight for ever and, handed the
    leadership back, proposed nothing (16 SYSTEM_BUSY answers, no acknowledgement, in the run that found it)."""
    cluster: Cluster = await start_cluster(spawn, tmp_path)
    topic = "DeposedLeaderTopic"
    await cluster.create_topic(topic, 4)
    load = LoadLedger()
    async with open_producer(cluster.namesrv, retry_backoff_ms=20) as producer, open_remoting_client() as rpc:
        async with trio.open_nursery() as nursery:
            load.start_senders(nursery, producer, topic)
            await trio.sleep(1)
            leader_addr = await cluster.leader_addr()
            leader = cluster.nodes[cluster.node_at(leader_addr)]
            followers = [cluster.nodes[nid] for nid in NODE_IDS if cluster.addr_of[nid] != leader_addr]
            stopped: list[int] = []
            try:
                for proc in followers:
                    os.kill(proc.pid, signal.SIGSTOP)
                    stopped.append(proc.pid)
                await trio.sleep(0.3)  # the leader proposes what the senders send: nothing can commit now
                in_flight_at_stop = (await get_raft_status(rpc, leader_addr, GROUP))[0]["in_flight_batches"]
                os.kill(leader.pid, signal.SIGSTOP)
                stopped.append(leader.pid)
                for proc in followers:
                    proc.kill()
                    stopped.remove(proc.pid)
                follower_ids = [nid for nid in NODE_IDS if cluster.addr_of[nid] != leader_addr]
                await trio.to_thread.run_sync(lambda: [cluster.start(nid) for nid in follower_ids])
                await trio.sleep(STOPPED_S)
            finally:
                for pid in stopped:
                    os.kill(pid, signal.SIGCONT)
            status, led_again = await _lead_again(cluster, leader_addr, load.ack_log)
            load.stop.set()
    figure(f"leader {leader_addr} stopped with {in_flight_at_stop} entries in flight for {STOPPED_S:.0f} s, "
           f"then resumed: {status['snapshots_loaded']} snapshot(s) loaded, {status['in_flight_batches']} in "
           f"flight; handed the leadership back, it acknowledged sends: {led_again}; {len(load.acked)} acked in all, "
           f"{len(load.failed)} failed ({dict(Counter(load.failed))})")
    assert in_flight_at_stop > 0, "no entry was in flight when the leader stopped: the test tested nothing"
    assert status["snapshots_loaded"] > 0, f"the old leader caught up without a snapshot: {status}"
    assert status["in_flight_batches"] == 0, f"the old leader still counts entries in flight: {status}"
    assert led_again, (f"leadership handed back to {leader_addr}, it acknowledged no send within 10 s ({status}; "
                       f"failed sends {dict(Counter(load.failed))})")
