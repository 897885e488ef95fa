"""A member that lost its Raft log while another is down, with real processes (dledger/patches.py, 19).

Leader A and follower B acknowledge messages that follower C, stopped (SIGSTOP), never gets. Then A is killed,
B loses its data and C resumes. Only C could lead now, and C lacks acknowledged messages: B must not vote for
it, so no leader may be elected while A is down. Once A is back it leads (its log is the longest), B gets the
group's log, every acknowledged message is consumed, and the three commit logs are identical. B loses either
- everything (moved aside, as in docs/operations.md, "Rebuilding a member") and is started empty while C is
  still stopped, so no peer can tell it the group exists: it needs ``--rejoin``; without the flag its empty log
  makes it vote for C, and the messages only A and B held are lost;
- everything, and is started as usual once C has resumed: C's status says the group has committed entries,
  so B rejoins by itself (without asking, it votes for C just the same);
- or only its Raft data directory, its store intact, and is started as usual: it finds a store without a Raft
  log and rejoins by itself; without that, it votes for C just the same.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import tomllib

import pytest
import trio

from client import Message, open_producer, open_push_consumer
from dledger.service import get_raft_status
from remoting.errors import RaftMQError
from remoting.transport import open_remoting_client
from tests.cluster.test_e2e_produce_consume import GROUP, Cluster, start_cluster, verify_output
from tests.procs import raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.load, pytest.mark.slow]

TOPIC = "RejoinTopic"
DOWN_S = 3.0  # how long A stays down with B empty and C resumed: several election timeouts (0.4-0.9 s)


async def _roles(addrs: list[str]) -> dict[str, tuple[str, int, bool]]:
    """Each member's role, term and whether it still waits to hear from a leader (``rejoining``)."""
    out = {}
    async with open_remoting_client() as rpc:
        for addr in addrs:
            try:
                status, _ = await get_raft_status(rpc, addr, GROUP, timeout_s=1.0)
                out[addr] = (status["role"], status["term"], status["rejoining"])
            except (RaftMQError, OSError):
                out[addr] = ("unreachable", -1, False)
    return out


async def _wait_same_end(addrs: list[str], timeout_s: float = 10.0) -> None:
    async with open_remoting_client() as rpc:
        with trio.fail_after(timeout_s):
            while True:
                ends = {(await get_raft_status(rpc, addr, GROUP, timeout_s=1.0))[0]["end_offset"] for addr in addrs}
                if len(ends) == 1:
                    return
                await trio.sleep(0.05)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("lost", ["everything", "everything_peer_tells", "raft_data"])
async def test_a_member_that_lost_its_raft_log_while_another_is_down_elects_no_one_that_lacks_acked_messages(
        spawn, tmp_path, figure, lost):
    cluster: Cluster = await start_cluster(spawn, tmp_path)
    await cluster.create_topic(TOPIC, 4)
    a_addr = await cluster.leader_addr()
    a = cluster.node_at(a_addr)
    b, c = sorted(nid for nid in cluster.addr_of if nid != a)

    acked: set[str] = set()
    async with open_producer(cluster.namesrv) as producer:
        for i in range(50):
            acked.add((await producer.send(Message(TOPIC, b"before %d" % i))).msg_id)
        await _wait_same_end([cluster.addr_of[n] for n in (a, b, c)])  # C holds these: it lags only by the rest
        os.kill(cluster.nodes[c].pid, signal.SIGSTOP)
        try:
            only_a_and_b: set[str] = set()
            for i in range(300):
                only_a_and_b.add((await producer.send(Message(TOPIC, b"only A and B %d" % i))).msg_id)
            acked |= only_a_and_b

            await trio.to_thread.run_sync(cluster.nodes[a].kill)
            await trio.to_thread.run_sync(cluster.nodes[b].kill)
            config = tomllib.loads(cluster.paths[b].read_text())
            for key, path in (("store", config["store"]["store_dir"]), ("dledger", config["dledger"]["data_dir"])):
                if lost.startswith("everything") or key == "dledger":
                    shutil.move(path, tmp_path / f"aside-{b}-{key}")
            if lost == "everything_peer_tells":
                os.kill(cluster.nodes[c].pid, signal.SIGCONT)
            await trio.to_thread.run_sync(cluster.start, b, *(["--rejoin"] if lost == "everything" else []))
        finally:
            os.kill(cluster.nodes[c].pid, signal.SIGCONT)

        leaders_while_a_down: set[str] = set()
        down_at = time.monotonic()
        while time.monotonic() - down_at < DOWN_S:
            roles = await _roles([cluster.addr_of[b], cluster.addr_of[c]])
            leaders_while_a_down |= {addr for addr, (role, _, _) in roles.items() if role == "LEADER"}
            await trio.sleep(0.2)
        roles_while_a_down = roles

        await trio.to_thread.run_sync(cluster.start, a)
        leader_after = await cluster.leader_addr(timeout_s=30)
        for i in range(20):
            acked.add((await producer.send(Message(TOPIC, b"after %d" % i))).msg_id)

    consumed: set[str] = set()

    async def on_message(msg) -> None:
        consumed.add(msg.msg_id)

    async with open_push_consumer(cluster.namesrv, topic=TOPIC, handler=on_message, consumer_group="rejoin_group",
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=500):
        with trio.move_on_after(60):
            while not acked <= consumed:
                await trio.sleep(0.2)
    verified = await verify_output(raftmq_argv("verify", "--group", GROUP, "--members",
                                               ",".join(cluster.addr_of.values())))
    missing = acked - consumed
    how = {"everything": "rebuilt empty (--rejoin)", "everything_peer_tells": "rebuilt empty (told by a peer)",
           "raft_data": "restarted without its Raft data"}[lost]
    figure(f"leader {a} down {DOWN_S:.0f} s with {b} {how} and {c} behind by "
           f"{len(only_a_and_b)} messages: roles then {roles_while_a_down}; leader once {a} was back: "
           f"{cluster.node_at(leader_after)}; {len(acked)} acked, {len(missing)} missing")
    assert not leaders_while_a_down, f"elected while {a} was down: {leaders_while_a_down} (acked messages lost)"
    assert roles_while_a_down[cluster.addr_of[b]][2], f"{b} did not report itself rejoining: {roles_while_a_down}"
    assert not (await _roles([cluster.addr_of[b]]))[cluster.addr_of[b]][2], f"{b} still rejoining after {a} led"
    assert not missing, f"{len(missing)} acknowledged messages were never consumed"
    assert b"are identical" in verified, verified
