"""A whole group SIGKILLed and started again, member by member, under its clients: a name server and the 3-node group
broker-a as real processes, clients in this process.

Until a majority is back and its leader has applied the new term's no-op, no member's metadata is known to hold
everything the group committed: each restarted member has applied its log only up to the commit index its journal
stored, about a second behind, and one that was down before the kill lacks what was committed without it."""

from __future__ import annotations

from collections import Counter

import pytest
import trio

from client import Message, MessageQueue, open_producer, open_pull_consumer, open_push_consumer
from remoting.codes import RequestCode, ResponseCode
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
