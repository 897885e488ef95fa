"""Consumers against real processes: a name server and the 3-node group broker-a, consumers in processes of their
own (``tests/consumer_process.py``) where a test kills one with SIGKILL, in this process otherwise."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import trio

from client import Message, MessageQueue, open_producer
from remoting.codes import RequestCode, ResponseCode
from remoting.message import iter_records
from remoting.transport import open_remoting_client
from tests.cluster.test_e2e_produce_consume import Cluster, start_cluster
from tests.integration.broker.helpers import call
from tests.procs import ServerProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


async def start_consumer(spawn, cluster: Cluster, topic: str, group: str, out: Path, *, delay_ms: int = 0,
                         expression: str = "*", times: bool = False, **options: object) -> ServerProcess:
    """A push consumer process appending each processed body to ``out`` (with its handler's start and end times if
    ``times``); returns once it has opened."""
    argv = [sys.executable, "-m", "tests.consumer_process", "--namesrv", cluster.namesrv, "--topic", topic,
            "--group", group, "--out", str(out), "--delay-ms", str(delay_ms), "--expression", expression]
    if times:
        argv.append("--times")
    for key, value in options.items():
        argv += ["--option", f"{key}={value}"]
    return await trio.to_thread.run_sync(lambda: spawn(argv, ready_timeout_s=60))


def consumed(*outs: Path) -> Counter[str]:
    """How often each body was processed, over the output files of consumer processes."""
    return Counter(line for out in outs if out.exists() for line in out.read_text().split())


async def wait_consumed(outs: list[Path], want: set[str], timeout_s: float = 30.0) -> Counter[str]:
    with trio.move_on_after(timeout_s):
        while not want <= set(consumed(*outs)):
            await trio.sleep(0.1)
    return consumed(*outs)


@pytest.mark.timeout(180)
async def test_a_member_killed_before_its_first_commit_leaves_its_start_to_the_next(spawn, tmp_path):
    """A new group's member from its last offset is killed before it has committed anything (its periodic commit
    is a minute away, each message takes 10 s): its successor starts where it started, and gets every message
    (was: the group had no offset, the successor started from the end, and all 20 were skipped)."""
    cluster = await start_cluster(spawn, tmp_path)
    await cluster.create_topic("KilledEarly", 4)
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    killed = await start_consumer(spawn, cluster, "KilledEarly", "killed_early", first, delay_ms=10_000,
                                  persist_consumer_offset_interval_ms=60_000)
    sent = {f"m{i:03d}" for i in range(20)}
    async with open_producer(cluster.namesrv) as producer:
        for body in sorted(sent):
            await producer.send(Message("KilledEarly", body.encode()))
    await trio.sleep(0.5)  # pulled, and the first of each queue in the handler
    killed.kill()
    await start_consumer(spawn, cluster, "KilledEarly", "killed_early", second)
    got = await wait_consumed([first, second], sent)
    assert set(got) == sent, f"never consumed: {sorted(sent - set(got))}"


@pytest.mark.timeout(180)
async def test_a_groups_first_offsets_survive_the_leader_killed_before_its_next_offset_flush(spawn, tmp_path):
    """The leader replicates consumer offsets every consumer_offset_flush_interval_ms (here widened to 30 s to hold
    the window open) and a leader that dies loses what it had not replicated: later commits are re-consumed, but
    a group's first ones left it without an offset. A new group's member from its last offset commits its starts,
    the leader is killed, 20 messages are sent to the new one, the member is killed: its successor gets all 20
    (was: none, it started from the end)."""
    cluster = await start_cluster(spawn, tmp_path, {"consumer_offset_flush_interval_ms": "30000"})
    await cluster.create_topic("FirstOffsets", 4)
    leader = await cluster.leader_addr()
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    member = await start_consumer(spawn, cluster, "FirstOffsets", "first_offsets", first, delay_ms=10_000,
                                  persist_consumer_offset_interval_ms=60_000)
    cluster.nodes[cluster.node_at(leader)].kill()
    sent = {f"m{i:03d}" for i in range(20)}
    async with open_producer(cluster.namesrv) as producer:
        for body in sorted(sent):
            await producer.send(Message("FirstOffsets", body.encode()))
    member.kill()
    await start_consumer(spawn, cluster, "FirstOffsets", "first_offsets", second)
    got = await wait_consumed([first, second], sent)
    assert set(got) == sent, f"never consumed: {sorted(sent - set(got))}"

@pytest.mark.load
@pytest.mark.timeout(240)
async def test_a_group_loses_nothing_to_members_joining_leaving_and_killed_while_another_group_reads(spawn, tmp_path,
                                                                                                    figure):
    """3,000 messages sent at a steady pace into 8 queues while group `churn` changes under them: a member joins,
    one leaves cleanly (SIGTERM: offsets committed, unregistered), one is killed (SIGKILL: the brokers drop its
    channel when its connections close, and its queues move to the others), another joins. Every message is
    consumed by the group (duplicates, from the killed member's uncommitted progress, counted), and group
    `other`, on the same topic, consumes every message too, on its own offsets."""
    cluster = await start_cluster(spawn, tmp_path)
    await cluster.create_topic("Churn", 8)
    outs = {name: tmp_path / f"{name}.txt" for name in ("a", "b", "c", "d", "other")}
    options = {"consume_from_where": "CONSUME_FROM_FIRST_OFFSET"}
    members = {name: await start_consumer(spawn, cluster, "Churn", "churn", outs[name], delay_ms=2, **options)
               for name in ("a", "b")}
    await start_consumer(spawn, cluster, "Churn", "other", outs["other"], **options)
    sent: set[str] = set()
    async with open_producer(cluster.namesrv) as producer:
        async def produce() -> None:
            for i in range(3000):
                body = f"c{i:05d}"
                await producer.send(Message("Churn", body.encode()))
                sent.add(body)
                await trio.sleep(0.002)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            await trio.sleep(2)
            members["c"] = await start_consumer(spawn, cluster, "Churn", "churn", outs["c"], delay_ms=2, **options)
            await trio.sleep(2)
            assert await trio.to_thread.run_sync(members["b"].stop) == 0
            await trio.sleep(2)
            members["a"].kill()
            await trio.sleep(1)
            members["d"] = await start_consumer(spawn, cluster, "Churn", "churn", outs["d"], delay_ms=2, **options)
    assert len(sent) == 3000
    group = await wait_consumed([outs[name] for name in "abcd"], sent, timeout_s=60)
    other = await wait_consumed([outs["other"]], sent, timeout_s=30)
    assert set(group) == sent, f"group churn never consumed {len(sent - set(group))}"
    assert set(other) == sent, f"group other never consumed {len(sent - set(other))}"
    per_member = {name: sum(consumed(outs[name]).values()) for name in "abcd"}
    figure(f"churn: 3000 messages, per member {per_member}, duplicates {sum(group.values()) - len(sent)} in group "
           f"churn, {sum(other.values()) - len(sent)} in group other")


@pytest.mark.timeout(180)
async def test_a_pull_held_by_a_follower_is_answered_when_a_message_it_wants_arrives(spawn, tmp_path):
    """Followers serve pulls from their own store and hold them as the leader does: a held pull filtered on TagB
    stays held through TagA messages and is answered as soon as a TagB message is dispatched there."""
    cluster = await start_cluster(spawn, tmp_path)
    await cluster.create_topic("Held", 1)
    leader = await cluster.leader_addr()
    mq = MessageQueue("Held", "broker-a", 0)
    async with open_producer(cluster.namesrv) as producer, open_remoting_client() as client:
        await producer.send(Message("Held", b"first", tags="TagA"), queue=mq)
        for follower in [addr for addr in cluster.addr_of.values() if addr != leader]:
            end = (await call(client, leader, RequestCode.GET_MAX_OFFSET, {"topic": "Held", "queue_id": 0})).ext
            with trio.fail_after(10):  # the follower has applied and dispatched what the leader has
                while (await call(client, follower, RequestCode.GET_MAX_OFFSET,
                                  {"topic": "Held", "queue_id": 0})).ext["offset"] < end["offset"]:
                    await trio.sleep(0.05)
            answers = []

            async def pull() -> None:
                answers.append(await call(client, follower, RequestCode.PULL_MESSAGE,
                                          {"consumer_group": "held", "topic": "Held", "queue_id": 0,
                                           "queue_offset": end["offset"], "max_msg_nums": 32, "sys_flag": 0x2 | 0x4,
                                           "subscription": "TagB", "suspend_timeout_millis": 15_000}, timeout_s=20))
                answers.append(trio.current_time())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(pull)
                for _ in range(5):
                    await producer.send(Message("Held", b"unwanted", tags="TagA"), queue=mq)
                await trio.sleep(0.5)
                assert answers == [], f"{follower} answered a pull no message it wants had arrived for"
                sent_at = trio.current_time()
                await producer.send(Message("Held", b"wanted", tags="TagB"), queue=mq)
            response, answered_at = answers
            assert response.code == ResponseCode.SUCCESS, response.remark
            assert [view.body for view in iter_records(response.body)] == [b"wanted"]
            assert answered_at - sent_at < 2.0
