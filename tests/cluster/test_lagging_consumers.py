"""Consumers that lag behind retention, against real processes: a name server and the 3-node group broker-a with
64 KiB commit-log segments that retention deletes as soon as a newer one exists (``FORCED_RETENTION``)."""

from __future__ import annotations

from collections import Counter

import cbor2
import pytest
import trio

from client import Message, MessageQueue, PullStatus, open_producer, open_pull_consumer, open_push_consumer
from remoting.codec import make_request
from remoting.codes import RequestCode
from remoting.transport import open_remoting_client
from tests.cluster.test_e2e_produce_consume import start_cluster
from tests.cluster.test_member_rebuild import FORCED_RETENTION

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TOPIC = "LagTopic"
QUEUES = 2


@pytest.mark.timeout(180)
async def test_a_group_whose_offsets_retention_passed_resumes_at_the_min_offsets_without_spinning(spawn, tmp_path):
    """A group consumes 20 messages and goes away; retention then deletes the segments holding its offsets. A pull
    there is OFFSET_ILLEGAL naming the queue's min offset as the next; the group, back, consumes every message
    from the min offsets on, once (RocketMQ's OFFSET_TOO_SMALL correction), commits the end, and then holds its
    pulls instead of pulling in a loop."""
    cluster = await start_cluster(spawn, tmp_path, FORCED_RETENTION)
    await cluster.create_topic(TOPIC, QUEUES)
    leader = await cluster.leader_addr()
    got: Counter[tuple[int, int]] = Counter()

    async def on_message(msg) -> None:
        got[(msg.queue_id, msg.queue_offset)] += 1

    options = {"consumer_group": "lagging", "consume_from_where": "CONSUME_FROM_FIRST_OFFSET",
               "persist_consumer_offset_interval_ms": 200}
    async with open_remoting_client() as client, open_producer(cluster.namesrv) as producer:
        async def send(i: int) -> None:
            await producer.send(Message(TOPIC, b"%06d" % i + b"." * 900),
                                queue=MessageQueue(TOPIC, "broker-a", i % QUEUES))

        async with open_push_consumer(cluster.namesrv, topic=TOPIC, handler=on_message, **options):
            for i in range(20):
                await send(i)
            with trio.fail_after(20):
                while len(got) < 20:
                    await trio.sleep(0.05)
        sent = 20
        with trio.fail_after(60):
            while (await _runtime(client, leader))["commit_log_min_offset"] < 3 * 65536:
                for i in range(sent, sent + 50):
                    await send(i)
                sent += 50
        await trio.sleep(0.5)  # nothing more is sent: retention's last passes (every 100 ms) have run
        bounds = [await _bounds(client, leader, q) for q in range(QUEUES)]
        assert all(lo > 10 for lo, _hi in bounds), bounds

        async with open_pull_consumer(cluster.namesrv, consumer_group="pulling") as puller:
            mq = MessageQueue(TOPIC, "broker-a", 0)
            result = await puller.pull(mq, 0, 8)
            assert (result.status, result.next_begin_offset, result.min_offset) == (
                PullStatus.OFFSET_ILLEGAL, bounds[0][0], bounds[0][0])
            result = await puller.pull(mq, result.next_begin_offset, 8)
            assert result.status is PullStatus.FOUND and result.messages[0].queue_offset == bounds[0][0]

        got.clear()
        want = {(q, o) for q, (lo, hi) in enumerate(bounds) for o in range(lo, hi)}
        async with open_push_consumer(cluster.namesrv, topic=TOPIC, handler=on_message, **options) as consumer:
            with trio.move_on_after(30):
                while not want <= set(got):
                    await trio.sleep(0.1)
            await trio.sleep(0.5)  # its commits replicated
            pulls = consumer.statistics().pulls
            await trio.sleep(3)
            idle_pulls = consumer.statistics().pulls - pulls
        assert got == Counter(want), f"consumed {sorted(set(got) - want)} not wanted, missed {sorted(want - set(got))}"
        assert idle_pulls <= QUEUES, f"{idle_pulls} pulls in 3 s with nothing to consume"
        async with open_pull_consumer(cluster.namesrv, consumer_group="lagging") as group:
            for q, (_lo, hi) in enumerate(bounds):
                assert await group.committed_offset(MessageQueue(TOPIC, "broker-a", q)) == hi


@pytest.mark.timeout(180)
async def test_a_consumer_stuck_while_retention_passes_it_moves_on_to_the_min_offsets(spawn, tmp_path):
    """A member's handler stops on its 10th message while 300 more are sent and retention deletes the segments
    after what it had cached. Let go, it finishes what it cached, then pulls below the queues' min offsets and
    is moved to them: it consumes every message from there to the end, once, and commits the end."""
    cluster = await start_cluster(spawn, tmp_path, FORCED_RETENTION)
    await cluster.create_topic(TOPIC, QUEUES)
    leader = await cluster.leader_addr()
    got: Counter[tuple[int, int]] = Counter()
    let_go = trio.Event()

    async def on_message(msg) -> None:
        got[(msg.queue_id, msg.queue_offset)] += 1
        if len(got) >= 10:
            await let_go.wait()

    options = {"consumer_group": "stuck", "consume_from_where": "CONSUME_FROM_FIRST_OFFSET",
               "persist_consumer_offset_interval_ms": 200, "pull_batch_size": 8, "pull_threshold_for_queue": 8}
    async with open_remoting_client() as client, open_producer(cluster.namesrv) as producer, \
            open_push_consumer(cluster.namesrv, topic=TOPIC, handler=on_message, **options) as consumer:
        sent = 0
        with trio.fail_after(60):
            while len(got) < 10 or (await _runtime(client, leader))["commit_log_min_offset"] < 3 * 65536:
                for i in range(sent, sent + 50):
                    await producer.send(Message(TOPIC, b"%06d" % i + b"." * 900),
                                        queue=MessageQueue(TOPIC, "broker-a", i % QUEUES))
                sent += 50
        await trio.sleep(0.5)  # nothing more is sent: retention's last passes (every 100 ms) have run
        bounds = [await _bounds(client, leader, q) for q in range(QUEUES)]
        assert all(lo > 50 for lo, _hi in bounds), bounds
        let_go.set()
        want = {(q, o) for q, (lo, hi) in enumerate(bounds) for o in range(lo, hi)}
        with trio.move_on_after(30):
            while not want <= set(got):
                await trio.sleep(0.1)
        await trio.sleep(0.5)  # its commits replicated
        assert consumer.statistics().cached == 0
    # Besides those, only what it had pulled before it stopped (below the min offsets: not read again).
    others = sorted((q, o) for q, o in set(got) - want if o >= bounds[q][0])
    assert want <= set(got) and not others, f"missed {sorted(want - set(got))}, also got {others}"
    assert max(got.values()) == 1, f"consumed twice: {sorted(k for k, n in got.items() if n > 1)}"
    async with open_pull_consumer(cluster.namesrv, consumer_group="stuck") as group:
        for q, (_lo, hi) in enumerate(bounds):
            assert await group.committed_offset(MessageQueue(TOPIC, "broker-a", q)) == hi


async def _runtime(client, addr: str) -> dict:
    r = await client.invoke(addr, make_request(RequestCode.GET_BROKER_RUNTIME_INFO), timeout_s=5)
    return cbor2.loads(r.body)


async def _bounds(client, addr: str, queue_id: int) -> tuple[int, int]:
    ext = {"topic": TOPIC, "queue_id": queue_id}
    lo = await client.invoke(addr, make_request(RequestCode.GET_MIN_OFFSET, ext=ext), timeout_s=5)
    hi = await client.invoke(addr, make_request(RequestCode.GET_MAX_OFFSET, ext=ext), timeout_s=5)
    return lo.ext["offset"], hi.ext["offset"]
