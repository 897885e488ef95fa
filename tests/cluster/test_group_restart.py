"""A whole group SIGKILLed and started again, member by member, under its clients: a name server and the 3-node group
broker-a as real processes, clients in this process.

Until a majority is back and its leader has applied the new term's no-op, no member's metadata is known to hold
everything the group committed: each restarted member has applied its log only up to the commit index its journal
stored, about a second behind, and one that was down before the kill lacks what was committed without it."""

from __future__ import annotations

from collections import Counter

import cbor2
import pytest
import trio

from client import Message, MessageQueue, open_admin, open_producer, open_pull_consumer, open_push_consumer
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError
from remoting.transport import open_remoting_client
from tests.cluster.test_e2e_produce_consume import start_cluster
from tests.integration.broker.helpers import call

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.timeout(180)
async def test_a_consumer_started_while_its_group_restarts_resumes_at_its_committed_offsets(spawn, tmp_path):
    """A group commits its first offsets with one follower down, then the other two members are killed and that
    follower alone is started: it never applied the commits. A push consumer from its last offset opens against
    it, then the old leader comes back. The consumer must resume at the committed offsets and get the 10 messages
    after them (was: the follower answered "no offset", the consumer started at the queues' end, committed that
    once the leader was back, and the 10 were never consumed)."""
    cluster = await start_cluster(spawn, tmp_path)
    topic = "ResumeTopic"
    await cluster.create_topic(topic, 2)
    async with open_producer(cluster.namesrv) as producer:
        for i in range(20):
            await producer.send(Message(topic, b"m%02d" % i), queue=MessageQueue(topic, "broker-a", i % 2))
    leader = await cluster.leader_addr()
    await trio.sleep(1.5)  # every member's journal has stored a commit index past the topic and the messages
    stale, down = [nid for nid in cluster.nodes if cluster.addr_of[nid] != leader]
    cluster.nodes[stale].kill()
    committed = {0: 5, 1: 5}  # queue offsets: m10..m19 (5 a queue) follow them
    async with open_remoting_client() as client:
        for queue_id, offset in committed.items():
            r = await call(client, leader, RequestCode.UPDATE_CONSUMER_OFFSET, {
                "consumer_group": "resumer", "topic": topic, "queue_id": queue_id, "commit_offset": offset})
            assert r.code == ResponseCode.SUCCESS, r.remark  # a first offset: replicated before the answer
        cluster.nodes[down].kill()
        cluster.nodes[cluster.node_at(leader)].kill()
        await trio.to_thread.run_sync(cluster.start, stale)

        # Alone, it cannot tell whether its table is complete: it refuses rather than answer from it.
        r = await call(client, cluster.addr_of[stale], RequestCode.QUERY_CONSUMER_OFFSET,
                       {"consumer_group": "resumer", "topic": topic, "queue_id": 0})
        assert r.code == ResponseCode.NOT_LEADER, (r.code, r.remark, r.ext)

        got: Counter[bytes] = Counter()

        async def on_message(msg) -> None:
            got[msg.body] += 1

        async with open_push_consumer(cluster.namesrv, topic=topic, handler=on_message, consumer_group="resumer",
                                      consume_from_where="CONSUME_FROM_LAST_OFFSET",
                                      persist_consumer_offset_interval_ms=200, rebalance_interval_ms=500):
            await trio.sleep(2)  # its queues' starts looked up (and, before the fix, committed) meanwhile
            await trio.to_thread.run_sync(cluster.start, cluster.node_at(leader))
            want = {b"m%02d" % i for i in range(10, 20)}
            with trio.move_on_after(30):
                while not want <= set(got):
                    await trio.sleep(0.1)
        assert set(got) == want, f"never consumed: {sorted(want - set(got))}; consumed {sorted(got)}"
        async with open_pull_consumer(cluster.namesrv, consumer_group="resumer") as puller:
            for queue_id in committed:
                assert await puller.committed_offset(MessageQueue(topic, "broker-a", queue_id)) == 10


# Members started again, in steps (each a list started side by side); "later" waits before the next step.
RESTART_ORDERS = {
    "all_at_once": [["n1", "n2", "n3"]],
    "one_by_one": [["n3"], ["n1"], ["n2"]],
    "two_then_the_third_later": [["n2", "n3"], "later", ["n1"]],
}
# What the topic changes made just before the kill leave: (read queues, write queues, perm); None: deleted.
EXPECTED_TOPICS = {"Kept": (6, 6, 6), "Created": (8, 8, 6), "ReadOnly": (2, 2, 4), "Deleted": None}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("order", list(RESTART_ORDERS))
async def test_a_group_killed_at_once_keeps_its_topics_and_offsets_and_is_routed_again(spawn, tmp_path, order):
    """Topics created, updated (queue counts, perm) and deleted, a push group's offsets and a pull consumer's
    first commits, all just before every member is SIGKILLed at once; the members come back in different orders.
    The name server routes every topic again as it was, with the new leader as master; every member holds the
    same topic table; the push group resumes exactly after what it consumed and the pull consumer's commits are
    there."""
    cluster = await start_cluster(spawn, tmp_path)
    await cluster.create_topic("Kept", 4)
    async with open_producer(cluster.namesrv) as producer:
        for i in range(40):
            await producer.send(Message("Kept", b"old%02d" % i), queue=MessageQueue("Kept", "broker-a", i % 4))
    pushed: Counter[bytes] = Counter()

    async def on_message(msg) -> None:
        pushed[msg.body] += 1

    push_options = {"consumer_group": "pushed", "consume_from_where": "CONSUME_FROM_FIRST_OFFSET",
                    "persist_consumer_offset_interval_ms": 200, "rebalance_interval_ms": 500}
    async with open_push_consumer(cluster.namesrv, topic="Kept", handler=on_message, **push_options):
        with trio.fail_after(30):
            while len(pushed) < 40:
                await trio.sleep(0.05)
    await trio.sleep(0.5)  # the commits on close replicated (consumer_offset_flush_interval_ms, 200 ms)
    async with open_admin(cluster.namesrv) as admin:
        await admin.create_topic("Created", read_queue_nums=8, write_queue_nums=8)
        await admin.create_topic("Kept", read_queue_nums=6, write_queue_nums=6)
        await admin.create_topic("ReadOnly", read_queue_nums=2, write_queue_nums=2, perm=4)
        await admin.create_topic("Deleted", read_queue_nums=2, write_queue_nums=2)
        await admin.delete_topic("Deleted")
    async with open_pull_consumer(cluster.namesrv, consumer_group="pulled") as puller:
        for queue_id in range(4):  # first commits: replicated before they are answered
            await puller.commit(MessageQueue("Kept", "broker-a", queue_id), 7)
    for proc in cluster.nodes.values():
        proc.proc.kill()
    for proc in cluster.nodes.values():
        proc.proc.wait(10)

    async with open_remoting_client() as client, open_admin(cluster.namesrv) as admin:
        for step in RESTART_ORDERS[order]:
            if step == "later":
                await _check_routes_and_tables(client, admin, cluster, ["n2", "n3"])
                await trio.sleep(3)
                continue
            await trio.to_thread.run_sync(lambda s=step: [cluster.start(nid) for nid in s])
        await _check_routes_and_tables(client, admin, cluster, list(cluster.nodes))

    async with open_pull_consumer(cluster.namesrv, consumer_group="pulled") as puller:
        for queue_id in range(4):
            assert await puller.committed_offset(MessageQueue("Kept", "broker-a", queue_id)) == 7
    new = {b"new%02d" % i for i in range(12)}
    async with open_producer(cluster.namesrv) as producer:
        for i, body in enumerate(sorted(new)):
            await producer.send(Message("Kept", body), queue=MessageQueue("Kept", "broker-a", i % 6))
    pushed.clear()
    async with open_push_consumer(cluster.namesrv, topic="Kept", handler=on_message, **push_options):
        with trio.move_on_after(30):
            while not new <= set(pushed):
                await trio.sleep(0.1)
        await trio.sleep(1)  # anything it would consume twice, or from before its offsets, by now
    assert pushed == Counter(new), f"after the restart the group consumed {sorted(pushed.items())}"


async def _check_routes_and_tables(client, admin, cluster, nids: list[str], timeout_s: float = 15.0) -> None:
    """Within ``timeout_s``: the name server routes each topic of EXPECTED_TOPICS as expected (a deleted one not at
    all) with the node that reports itself leader as master, and each of ``nids`` holds that topic table."""
    routes: dict[str, object] = {}
    tables: dict[str, object] = {}
    with trio.move_on_after(timeout_s):
        while True:
            leaders = [cluster.addr_of[nid] for nid in nids
                       if (await _runtime(client, cluster.addr_of[nid]) or {}).get("role") == "LEADER"]
            for topic in EXPECTED_TOPICS:
                try:
                    route = await admin.get_route(topic)
                except RaftMQError as e:
                    routes[topic] = type(e).__name__
                else:
                    routes[topic] = [(q.read_queue_nums, q.write_queue_nums, q.perm, b.master_addr)
                                     for q in route.queue_datas for b in route.broker_datas]
            for nid in nids:
                r = await client.invoke(cluster.addr_of[nid], make_request(RequestCode.GET_ALL_TOPIC_CONFIG))
                configs = cbor2.loads(r.body)["topic_configs"] if r.code == ResponseCode.SUCCESS else {}
                tables[nid] = {t: (c["read_queue_nums"], c["write_queue_nums"], c["perm"])
                               for t, c in configs.items() if t in EXPECTED_TOPICS}
            want_tables = {t: v for t, v in EXPECTED_TOPICS.items() if v is not None}
            if len(leaders) == 1 and all(table == want_tables for table in tables.values()) and routes == {
                    t: ([(*v, leaders[0])] if v is not None else "TopicNotExistError")
                    for t, v in EXPECTED_TOPICS.items()}:
                return
            await trio.sleep(0.1)
    raise AssertionError(f"after {timeout_s}s: routes {routes}, topic tables {tables}")


async def _runtime(client, addr: str) -> dict | None:
    try:
        r = await client.invoke(addr, make_request(RequestCode.GET_BROKER_RUNTIME_INFO), timeout_s=2)
    except RaftMQError:
        return None
    return cbor2.loads(r.body) if r.code == ResponseCode.SUCCESS else None
