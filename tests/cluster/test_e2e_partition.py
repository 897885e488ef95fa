"""Network partitions, with real processes on a private network of namespaces (``tests/netns.py``).

A killed or stopped node is silent to everyone at once. A partition is not: a node cut off from its group may
still be reached by clients and name servers, and answer them. These tests put the name server and the test's
client on one host and each member of ``broker-a`` on its own, load the group with acknowledged sends and a
push consumer, cut links silently (no reset, no error) while the load goes on, heal them, and then require
that every acknowledged message is consumed and that the three commit logs are identical (``raftmq verify``).

- The leader cut off from both followers, still reachable by the client and the name server: it can commit
  nothing, so it must acknowledge nothing sent after the cut; it steps down after ``leader_fallback_timeout_ms``;
  the two followers elect a leader of a higher term, the name server routes that one (a lower term's claim is
  stale), and the client's sends are acknowledged there while the cut lasts. After the heal the old leader
  follows and drops the entries it could not commit.
- A follower cut off from the leader only, still talking to the other follower: its election timer fires, and
  without the pre-vote (dledger/patches.py, 15) its higher term would reach the other follower and depose a
  leader a majority still follows. With it, nothing changes: same leader, same term, no send fails.

The gap from the cut to the first acknowledgement by a new leader is printed, not asserted.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import Counter
from pathlib import Path

import pytest
import trio

from client import open_admin, open_producer, open_push_consumer
from raftmq.commands.dev import GROUP, NODE_IDS
from remoting.errors import RaftMQError
from tests.cluster.test_e2e_produce_consume import send_until
from tests.netns import NetLab, unavailable
from tests.procs import ServerProcess, raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CLIENT = "client"
CUT_S = 8.0  # longer than leader_fallback_timeout_ms (3 s) and than a send's timeout (3 s)
SERVICE_PORT, RAFT_PORT, NAMESRV_PORT = 10911, 20911, 9876  # fixed: every namespace of the lab is new and empty


@pytest.fixture
def netlab():
    reason = unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"partition tests must run in CI: {reason}")
        pytest.skip(reason)
    lab = NetLab([CLIENT, *NODE_IDS])
    yield lab
    lab.close()


class LabCluster:
    """A name server on the client's host and a 3-node group, one node per host; processes come from ``spawn``
    (stopped by PID, pass or fail)."""

    def __init__(self, lab: NetLab, spawn, data_dir: Path) -> None:
        self.lab = lab
        self.namesrv = f"{lab.ip[CLIENT]}:{NAMESRV_PORT}"
        self.addr_of = {nid: f"{lab.ip[nid]}:{SERVICE_PORT}" for nid in NODE_IDS}
        secret = secrets.token_urlsafe(24)
        members = ", ".join(f'{{ id = "{nid}", raft_address = "{lab.ip[nid]}:{RAFT_PORT}", '
                            f'service_address = "{self.addr_of[nid]}" }}' for nid in NODE_IDS)
        self.namesrv_proc = spawn(lab.argv(CLIENT, raftmq_argv("namesrv", "--listen", self.namesrv)))
        self.nodes: dict[str, ServerProcess] = {}
        for nid in NODE_IDS:
            node_dir = data_dir / nid
            node_dir.mkdir(parents=True)
            path = data_dir / f"{nid}.toml"
            path.write_text(
                f'cluster_name = "DefaultCluster"\nnamesrv_addrs = ["{self.namesrv}"]\n\n'
                f'[store]\nstore_dir = "{node_dir / "store"}"\n\n'
                f'[dledger]\ngroup = "{GROUP}"\nself_id = "{nid}"\nsecret = "{secret}"\n'
                f'data_dir = "{node_dir / "dledger"}"\nmembers = [{members}]\n')
            self.nodes[nid] = spawn(lab.argv(nid, raftmq_argv("broker", "--config", str(path))), ready_timeout_s=60)

    def node_at(self, addr: str) -> str:
        return next(nid for nid, a in self.addr_of.items() if a == addr)

    async def leader_addr(self, admin, timeout_s: float = 20.0) -> str:
        with trio.fail_after(timeout_s):
            while True:
                try:
                    addr = (await admin.cluster_info()).master_addr(GROUP)
                    if addr:
                        return addr
                except RaftMQError:
                    pass
                await trio.sleep(0.1)

    async def roles(self, admin) -> dict[str, tuple[str, int]]:
        out = {}
        for nid, addr in self.addr_of.items():
            try:
                status = await admin.broker_status(addr)
                out[nid] = (status["role"], status["term"])
            except RaftMQError as e:
                out[nid] = (f"unreachable: {type(e).__name__}", -1)
        return out

    async def verify(self) -> bytes:
        """``raftmq verify`` of the three members, from the client's host, until it passes (a node back from a
        cut may still be catching up) or 60 s; returns its output."""
        argv = self.lab.argv(CLIENT, raftmq_argv("verify", "--group", GROUP, "--members",
                                                 ",".join(self.addr_of.values())))
        with trio.fail_after(60):
            while True:
                done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
                if done.returncode == 0:
                    return done.stdout
                await trio.sleep(0.5)


async def _partition_under_load(netlab: NetLab, spawn, tmp_path, capsys, *, cut_leader: bool) -> None:
    cluster = await trio.to_thread.run_sync(LabCluster, netlab, spawn, tmp_path / "cluster")
    topic = "PartitionTopic"
    acked: dict[str, float] = {}
    ack_log: list[tuple[float, str]] = []
    consumed: Counter[str] = Counter()
    failed: list[str] = []
    stop_producing = trio.Event()

    async def on_message(msg) -> None:
        consumed[msg.msg_id] += 1

    # Every socket of the client is made by this thread, now on the client's host.
    with netlab.entered(CLIENT):
        async with open_admin(cluster.namesrv) as admin:
            leader_addr = await cluster.leader_addr(admin)
            with trio.fail_after(30):
                while not await admin.create_topic(topic, read_queue_nums=4, write_queue_nums=4):
                    await trio.sleep(0.2)
            async with open_producer(cluster.namesrv, retry_backoff_ms=20) as producer, \
                    open_push_consumer(cluster.namesrv, topic=topic, handler=on_message,
                                       consumer_group="partition_group", consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                                       rebalance_interval_ms=500, persist_consumer_offset_interval_ms=200,
                                       broker_suspend_max_time_ms=1000):
                async with trio.open_nursery() as nursery:
                    for k in range(8):
                        nursery.start_soon(send_until, producer, topic, k, stop_producing, acked, ack_log, failed)
                    await trio.sleep(2)
                    leader_addr = await cluster.leader_addr(admin)
                    leader = cluster.node_at(leader_addr)
                    followers = [nid for nid in NODE_IDS if nid != leader]
                    before = await cluster.roles(admin)
                    cut_pairs = [(leader, f) for f in followers] if cut_leader else [(leader, followers[-1])]
                    cut_at = time.monotonic()
                    for a, b in cut_pairs:
                        netlab.cut(a, b)
                    gap = stepped_down = None
                    try:
                        with trio.move_on_after(CUT_S):
                            while True:
                                now = time.monotonic()
                                if gap is None:
                                    after = [t for t, addr in ack_log if t > cut_at and addr != leader_addr]
                                    gap = min(after) - cut_at if after else None
                                if cut_leader and stepped_down is None:
                                    if (await admin.broker_status(leader_addr))["role"] != "LEADER":
                                        stepped_down = now - cut_at
                                await trio.sleep(0.05)
                        during = await cluster.roles(admin)
                        failed_during = len(failed)
                        old_leader_acks_late = sum(1 for t, addr in ack_log if t > cut_at + 1.0 and addr == leader_addr
                                                   and t < cut_at + CUT_S)
                        acked_during = sum(1 for t, _ in ack_log if cut_at < t < cut_at + CUT_S)
                    finally:
                        netlab.heal()
                    healed_at = time.monotonic()
                    await trio.sleep(3)  # the cut-off node catches up while the load goes on
                    stop_producing.set()

                with trio.move_on_after(60):
                    while not set(acked) <= set(consumed):
                        await trio.sleep(0.2)
            after_heal = await cluster.roles(admin)
        verified = await cluster.verify()

    storers = sorted({addr for t, addr in ack_log if t > healed_at})
    missing = set(acked) - set(consumed)
    duplicates = sum(c - 1 for c in consumed.values() if c > 1)
    with capsys.disabled():
        cut = " and ".join(f"{a}-{b}" for a, b in cut_pairs)
        print(f"\npartition {cut} (leader {leader}) for {CUT_S:.0f} s: "
              + (f"first ack by a new leader after {gap:.3f} s, old leader stepped down after "
                 f"{stepped_down:.3f} s; " if cut_leader and gap is not None and stepped_down is not None else "")
              + f"{acked_during} acked and {failed_during} failed during the cut; roles before {before}, during "
              f"{during}, after {after_heal}; acks after the heal by {', '.join(storers)}; {len(acked)} acked in "
              f"all, {len(failed)} failed ({dict(Counter(failed))}), {duplicates} duplicates")
    if cut_leader:
        assert gap is not None, f"no send was acknowledged by another node during the {CUT_S:.0f} s cut"
        assert stepped_down is not None, (f"leader {leader_addr}, cut off from both followers, still claimed "
                                          f"leadership {CUT_S:.0f} s later: {during}")
        assert old_leader_acks_late == 0, (f"leader {leader_addr} acknowledged {old_leader_acks_late} sends more "
                                           f"than 1 s after it was cut off from both followers")
        new = {nid for nid, (role, _) in during.items() if role == "LEADER"}
        assert len(new) == 1 and leader not in new and during[new.pop()][1] > before[leader][1], during
    else:
        assert during == before and after_heal == before, (
            f"a follower cut off from the leader only changed the group: {before} -> {during} -> {after_heal}")
        assert acked_during > 0 and failed_during == 0, (
            f"the leader and the other follower must go on committing: {acked_during} acked, {failed_during} "
            f"failed")
    assert not missing, f"{len(missing)} acknowledged messages were never consumed"
    assert b"are identical" in verified, verified


@pytest.mark.timeout(180)
async def test_leader_cut_off_from_its_followers_is_replaced_and_commits_nothing(netlab, spawn, tmp_path,
                                                                                  capsys):
    await _partition_under_load(netlab, spawn, tmp_path, capsys, cut_leader=True)


@pytest.mark.timeout(180)
async def test_follower_cut_off_from_the_leader_only_does_not_depose_it(netlab, spawn, tmp_path, capsys):
    await _partition_under_load(netlab, spawn, tmp_path, capsys, cut_leader=False)
