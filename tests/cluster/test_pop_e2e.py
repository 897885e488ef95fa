"""POP consumption end to end (broker/pop.py, client/simple_consumer.py): a name server and a 3-node group, shared by
the module's tests, each with its own topic and consumer group (created by the admin: auto-create of subscription
groups is off, so an unknown group's POP is refused).

Short invisible times (1-3 s) and a revive every 200 ms keep each test a few seconds long.
"""

from __future__ import annotations

import cbor2
import pytest
import trio

from broker.pop import ReceiptHandle
from client import Message, open_admin, open_producer, open_simple_consumer
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError
from remoting.transport import open_remoting_client
from tests.cluster.test_e2e_produce_consume import Cluster
from tests.procs import spawner

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

OVERRIDES = {"pop_revive_interval_ms": "200", "pop_invisible_time_min_ms": "500",
             "auto_create_subscription_group": "false"}


@pytest.fixture(scope="module")
def pop_cluster(tmp_path_factory):
    """Every process stopped at the end, pass or fail."""
    tmp = tmp_path_factory.mktemp("pop")
    with spawner(tmp) as spawn:
        cluster = Cluster(spawn, tmp / "cluster", OVERRIDES)
        trio.run(cluster.leader_addr)
        yield cluster


async def _prepare(cluster: Cluster, topic: str, group: str, *, queues: int = 2, retry_max_times: int = 16) -> None:
    await cluster.create_topic(topic, queues)
    async with open_admin(cluster.namesrv) as admin:
        with trio.fail_after(30):
            while True:
                try:
                    await admin.update_subscription_group(group, retry_max_times=retry_max_times)
                    return
                except RaftMQError:
                    await trio.sleep(0.2)


async def _send(cluster: Cluster, topic: str, bodies: list[str]) -> None:
    async with open_producer(cluster.namesrv) as producer:
        for body in bodies:
            await producer.send(Message(topic, body.encode(), tags="TagA", keys=[body]))


def _consumer(cluster: Cluster, group: str, topic: str, await_ms: int = 300):
    return open_simple_consumer(cluster.namesrv, consumer_group=group, subscriptions={topic: "TagA"},
                                await_duration_ms=await_ms, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                                request_timeout_ms=2_000)


async def _receive_all(consumer, want: int, invisible_ms: int, timeout_s: float = 30) -> list:
    got: list = []
    with trio.fail_after(timeout_s):
        while len(got) < want:
            try:
                got.extend(await consumer.receive(32, invisible_ms))
            except RaftMQError:
                await trio.sleep(0.2)  # a leader moving
    return got


async def _nothing_for(consumer, seconds: float, invisible_ms: int = 5_000) -> list:
    """What ``consumer`` receives in ``seconds``: nothing, if all goes well."""
    got: list = []
    with trio.move_on_after(seconds):
        while True:
            got.extend(await consumer.receive(32, invisible_ms))
    return got


async def test_receive_and_ack_consume_each_message_once(pop_cluster):
    topic, group = "PopOnce", "pop_once"
    await _prepare(pop_cluster, topic, group)
    bodies = [f"once-{i}" for i in range(12)]
    await _send(pop_cluster, topic, bodies)
    async with _consumer(pop_cluster, group, topic) as consumer:
        got = await _receive_all(consumer, len(bodies), invisible_ms=1_000)
        for msg in got:
            await consumer.ack(msg)
        assert sorted(m.body.decode() for m in got) == sorted(bodies)
        assert all(m.topic == topic and m.reconsume_times == 0 and m.tags == "TagA" for m in got)
        # Their invisible time (1 s) passes: acked, none comes back.
        assert await _nothing_for(consumer, 2.5) == []
        async with open_admin(pop_cluster.namesrv) as admin:  # a member of its group, as RocketMQ 5 shows it
            assert (await admin.consumer_connections(group)).consume_type == "CONSUME_POP"


async def test_ack_batch_acks_many_in_one_request_and_says_which_it_could_not(pop_cluster):
    topic, group = "PopBatchAck", "pop_batch_ack"
    await _prepare(pop_cluster, topic, group)
    bodies = [f"batch-{i}" for i in range(10)]
    await _send(pop_cluster, topic, bodies)
    async with _consumer(pop_cluster, group, topic) as consumer:
        got = await _receive_all(consumer, len(bodies), invisible_ms=2_000)
        deferred = await consumer.change_invisible_duration(got[0], 30_000)
        results = await consumer.ack_batch(got)
        # got[0]'s handle was superseded by the change: only that one is not acked.
        assert results[0] is not None and results[0].code == ResponseCode.NO_MESSAGE
        assert "superseded" in str(results[0])
        assert results[1:] == [None] * (len(got) - 1)
        assert await consumer.ack_batch([deferred]) == [None]
        assert await consumer.ack_batch([]) == []
        assert sorted(m.body.decode() for m in got) == sorted(bodies)
        # Their invisible time (2 s) passes: all acked, none comes back.
        assert await _nothing_for(consumer, 2.5) == []


async def test_a_receive_waits_for_a_message_its_filter_wants(pop_cluster):
    topic, group = "PopWait", "pop_wait"
    await _prepare(pop_cluster, topic, group, queues=1)
    async with _consumer(pop_cluster, group, topic, await_ms=20_000) as consumer:
        got: list = []

        async def receive() -> None:
            got.extend(await consumer.receive(8, 1_000))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            await trio.sleep(0.5)  # waiting by now, long polled at the broker
            async with open_producer(pop_cluster.namesrv) as producer:
                await producer.send(Message(topic, b"unwanted", tags="TagB"))
                await producer.send(Message(topic, b"wanted", tags="TagA"))
        # Woken by the TagA message, not answered empty at the end of the 20 s wait nor woken for TagB.
        assert [m.body for m in got] == [b"wanted"]
        await consumer.ack(got[0])


async def test_unacked_comes_back_a_change_defers_it_and_max_attempts_end_in_the_dlq(pop_cluster):
    topic, group = "PopRetry", "pop_retry"
    await _prepare(pop_cluster, topic, group, retry_max_times=1)
    await _send(pop_cluster, topic, ["retry-me"])
    async with _consumer(pop_cluster, group, topic) as consumer:
        (first,) = await _receive_all(consumer, 1, invisible_ms=1_000)
        assert first.reconsume_times == 0
        # Not acked: visible again after its invisible time, from the group's POP retry topic, as its own topic.
        (again,) = await _receive_all(consumer, 1, invisible_ms=1_000)
        assert again.body == b"retry-me" and again.reconsume_times == 1 and again.topic == topic
        assert ReceiptHandle.decode(again.receipt_handle).topic == f"%RETRY%{group}+{topic}"
        # Its first handle is over: refused, saying so.
        with pytest.raises(RaftMQError) as expired:
            await consumer.ack(first)
        assert expired.value.code == ResponseCode.NO_MESSAGE and "expired" in str(expired.value)
        # Deferred: 3 s from now, where 1 s would have brought it back after about a second.
        deferred = await consumer.change_invisible_duration(again, 3_000)
        with pytest.raises(RaftMQError) as superseded:
            await consumer.ack(again)
        assert superseded.value.code == ResponseCode.NO_MESSAGE and "superseded" in str(superseded.value)
        assert await _nothing_for(consumer, 2.0) == []
        # Delivered max_reconsume_times + 1 = 2 times and not acked: to the dead-letter topic, not back here.
        assert await _nothing_for(consumer, 3.0) == []
        assert deferred.receipt_handle != again.receipt_handle
    async with open_admin(pop_cluster.namesrv) as admin:
        with trio.fail_after(20):
            while True:
                try:
                    found = await admin.query_message(f"%DLQ%{group}", "retry-me")
                except RaftMQError:
                    found = []
                if found:
                    break
                await trio.sleep(0.2)
    assert found[0].body == b"retry-me" and found[0].reconsume_times == 2


async def test_a_reset_offset_moves_a_pop_group_and_another_groups_ack_is_refused(pop_cluster):
    topic, group = "PopReset", "pop_reset"
    await _prepare(pop_cluster, topic, group, queues=1)
    bodies = [f"reset-{i}" for i in range(4)]
    await _send(pop_cluster, topic, bodies)
    async with _consumer(pop_cluster, group, topic) as consumer:
        got = await _receive_all(consumer, len(bodies), invisible_ms=30_000)
        leader = await pop_cluster.leader_addr()
        # Another group's name with this group's handle: refused, the message stays invisible to this group.
        answer = await _raw(leader, RequestCode.ACK_MESSAGE, {"consumer_group": "pop_reset_other", "topic": topic,
                                                              "receipt_handle": got[0].receipt_handle})
        assert answer.code == ResponseCode.INVALID_REQUEST and answer.ext.get("field") == "receipt_handle"
        for msg in got:
            await consumer.ack(msg)
        async with open_admin(pop_cluster.namesrv) as admin:
            await admin.reset_offset(group, topic, 0)
        # The POP group starts over at the first message: its pop offsets moved with the committed ones.
        again = await _receive_all(consumer, len(bodies), invisible_ms=30_000)
        assert sorted(m.body.decode() for m in again) == sorted(bodies)
        assert all(m.reconsume_times == 0 for m in again)
        for msg in again:
            await consumer.ack(msg)


async def _raw(addr: str, code: int, ext: dict):
    async with open_remoting_client() as client:
        return await client.invoke(addr, make_request(code, ext=ext), timeout_s=5)


async def test_bad_input_gets_its_code_and_a_remark_naming_the_field(pop_cluster):
    topic, group = "PopBad", "pop_bad"
    await _prepare(pop_cluster, topic, group, queues=1)
    leader = await pop_cluster.leader_addr()
    pop = {"consumer_group": group, "topic": topic, "invisible_time_ms": 1_000}

    async def refused(code: int, ext: dict, want: int, field: str | None = None, addr: str = leader) -> str:
        with trio.fail_after(20):
            while True:
                answer = await _raw(addr, code, ext)
                if answer.code != ResponseCode.NOT_LEADER or want == ResponseCode.NOT_LEADER:
                    break
                await trio.sleep(0.2)
        assert answer.code == want, (answer.code, answer.remark)
        if field is not None:
            assert answer.ext.get("field") == field and field in answer.remark, answer.remark
        return answer.remark

    await refused(RequestCode.POP_MESSAGE, {**pop, "topic": "NoSuchPopTopic"}, ResponseCode.TOPIC_NOT_EXIST)
    await refused(RequestCode.POP_MESSAGE, {**pop, "consumer_group": "pop_unknown"},
                  ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST)
    await refused(RequestCode.POP_MESSAGE, {**pop, "invisible_time_ms": 10}, ResponseCode.INVALID_REQUEST,
                  "invisible_time_ms")
    await refused(RequestCode.POP_MESSAGE, {**pop, "max_msg_nums": 33}, ResponseCode.INVALID_REQUEST,
                  "max_msg_nums")
    ack = {"consumer_group": group, "topic": topic}
    await refused(RequestCode.ACK_MESSAGE, {**ack, "receipt_handle": "garbage"}, ResponseCode.INVALID_REQUEST,
                  "receipt_handle")
    foreign = ReceiptHandle("broker-z", group, topic, 0, 0, 0, 4_000_000_000_000, 1_000).encode()
    remark = await refused(RequestCode.ACK_MESSAGE, {**ack, "receipt_handle": foreign}, ResponseCode.INVALID_REQUEST,
                           "receipt_handle")
    assert "broker-z" in remark
    other_topic = ReceiptHandle("broker-a", group, "OtherTopic", 0, 0, 0, 4_000_000_000_000, 1_000).encode()
    await refused(RequestCode.ACK_MESSAGE, {**ack, "receipt_handle": other_topic}, ResponseCode.INVALID_REQUEST,
                  "receipt_handle")
    expired = ReceiptHandle("broker-a", group, topic, 0, 0, 0, 1_000, 1_000).encode()
    await refused(RequestCode.ACK_MESSAGE, {**ack, "receipt_handle": expired}, ResponseCode.NO_MESSAGE,
                  "receipt_handle")
    await refused(RequestCode.CHANGE_MESSAGE_INVISIBLETIME, {**ack, "receipt_handle": expired, "invisible_time_ms": 0},
                  ResponseCode.INVALID_REQUEST, "invisible_time_ms")
    follower = next(a for a in pop_cluster.addr_of.values() if a != leader)
    await refused(RequestCode.POP_MESSAGE, pop, ResponseCode.NOT_LEADER, addr=follower)
    batch = make_request(RequestCode.BATCH_ACK_MESSAGE, ext={"consumer_group": group}, body=cbor2.dumps([expired]))
    async with open_remoting_client() as client:
        answer = await client.invoke(follower, batch, timeout_s=5)
        assert answer.code == ResponseCode.NOT_LEADER, answer.remark
        answer = await client.invoke(leader, make_request(RequestCode.BATCH_ACK_MESSAGE, ext={"consumer_group": group},
                                                          body=cbor2.dumps("not a list")), timeout_s=5)
        assert answer.code == ResponseCode.INVALID_REQUEST and answer.ext.get("field") == "body", answer.remark
    # Nothing to pop, and no waiting asked for: PULL_NOT_FOUND at once, not an error.
    assert (await _raw(leader, RequestCode.POP_MESSAGE, pop)).code == ResponseCode.PULL_NOT_FOUND


async def test_after_a_leader_sigkill_acked_stay_acked_and_unacked_come_back(pop_cluster):
    topic, group = "PopFailover", "pop_failover"
    await _prepare(pop_cluster, topic, group)
    bodies = [f"fo-{i}" for i in range(8)]
    await _send(pop_cluster, topic, bodies)
    async with _consumer(pop_cluster, group, topic) as consumer:
        got = await _receive_all(consumer, len(bodies), invisible_ms=3_000)
        acked = {m.body.decode() for m in got[::2]}
        for msg in got[::2]:
            await consumer.ack(msg)
        unacked = set(bodies) - acked
        old_leader = await pop_cluster.leader_addr()
        killed = pop_cluster.node_at(old_leader)
        pop_cluster.nodes[killed].kill()
        try:
            back = await _receive_all(consumer, len(unacked), invisible_ms=5_000, timeout_s=60)
            assert {m.body.decode() for m in back} == unacked
            assert all(m.reconsume_times == 1 for m in back)
            for msg in back:
                await consumer.ack(msg)
            # Nothing acked before the kill comes back, nor anything acked since.
            assert await _nothing_for(consumer, 4.0) == []
        finally:
            await trio.to_thread.run_sync(pop_cluster.start, killed)
