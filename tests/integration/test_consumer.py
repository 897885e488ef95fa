"""The push and pull consumers against a broker node (a single-member group) and a name server in-process."""

from __future__ import annotations

import argparse
import os

import cbor2
import trio

import raftmq.commands.admin
import raftmq.commands.admin_groups
from client import Message, MessageQueue, open_admin, open_producer, open_push_consumer
from remoting.codes import RequestCode
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import call, start_leading_node


async def _receive(consumer, body: bytes, timeout_s: float = 3.0) -> list[bytes]:
    """What ``consumer`` delivers until ``body`` (or ``timeout_s``)."""
    got = []
    with trio.move_on_after(timeout_s):
        async for msg in consumer:
            got.append(msg.body)
            if msg.body == body:
                break
    return got


async def test_a_new_group_from_the_last_offset_consumes_what_is_sent_once_it_has_opened(nursery, tmp_path):
    """CONSUME_FROM_LAST_OFFSET skips the backlog, not messages sent after open_push_consumer returned (was:
    each queue's start was looked up by its pull task, after such a send, so the message was skipped)."""
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    async with open_producer(namesrv) as producer:
        for i in range(8):
            await producer.send(Message("Backlog", b"old%d" % i))
        for trial in range(3):
            async with open_push_consumer(namesrv, topic="Backlog", consumer_group=f"new_group_{trial}",
                                          broker_suspend_max_time_ms=300) as consumer:
                await producer.send(Message("Backlog", b"new%d" % trial))
                assert await _receive(consumer, b"new%d" % trial) == [b"new%d" % trial]


async def test_messages_a_held_pull_does_not_want_do_not_wake_it(nursery, tmp_path):
    """A consumer of TagZ on a queue that gets 300 TagA messages, one at a time: its held pulls stay held (was: each
    arrival woke them, the answer was "nothing matched", and the consumer pulled again: ~150 pulls), and a TagZ
    message still reaches it at once."""
    namesrv, addr = await start_leading_node(nursery, tmp_path)
    mq = MessageQueue("Busy", "broker-a", 0)
    async with open_producer(namesrv) as producer, open_remoting_client() as client:
        await producer.send(Message("Busy", b"before", tags="TagA"), queue=mq)
        async with open_push_consumer(namesrv, topic="Busy", expression="TagZ", consumer_group="rare_tag") as consumer:
            await trio.sleep(0.3)  # its pulls are held
            pulls = consumer.statistics().pulls
            info = cbor2.loads((await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)).body)
            for i in range(300):
                await producer.send(Message("Busy", b"unwanted%d" % i, tags="TagA"), queue=mq)
            await producer.send(Message("Busy", b"wanted", tags="TagZ"), queue=mq)
            with trio.fail_after(2):  # long before the 15 s hold would time out
                assert await _receive(consumer, b"wanted") == [b"wanted"]
            after = cbor2.loads((await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)).body)
            assert consumer.statistics().pulls - pulls <= 2
            assert after["long_polling_resumed_by_arrival"] - info["long_polling_resumed_by_arrival"] == 1


async def test_cached_messages_are_bounded_by_their_size_as_well_as_their_number(nursery, tmp_path):
    """With 256 KiB messages the 1000-message bound alone let a queue cache 250 MiB (150 MiB seen in a probe, all
    there was); the size bound stops the pulls at 4 MiB (plus one pull), and they go on once consumed."""
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    mq = MessageQueue("Large", "broker-a", 0)
    # Bodies that do not compress: stored compressed, 32 of them fitted one pull's max_transfer_bytes, and "plus one
    # pull" would be 8 MiB inflated.
    async with open_producer(namesrv) as producer:
        for i in range(60):
            await producer.send(Message("Large", b"%03d" % i + os.urandom(256 << 10)), queue=mq)
    async with open_push_consumer(namesrv, topic="Large", consumer_group="large", pull_threshold_size_for_queue_mib=4,
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET") as consumer:
        await trio.sleep(1)
        stats = consumer.statistics()
        assert stats.cached_bytes <= (4 << 20) + (1 << 20) and stats.cached < 60, stats
        got = []
        with trio.fail_after(10):
            async for msg in consumer:
                assert consumer.statistics().cached_bytes <= 5 << 20
                got.append(msg.body[:3])
                if len(got) == 60:
                    break
        assert got == [b"%03d" % i for i in range(60)]


async def test_queues_added_to_a_topic_are_consumed_from_their_first_message(nursery, tmp_path):
    """A group from its last offset, the default, consuming a topic that goes from 4 to 8 queues: what is sent to
    the new queues before a rebalance finds them is consumed (was: they started at their max offset then, and
    the 40 of 80 messages sent there were never consumed; RocketMQ's broker answers a group's first query of a
    queue still starting at 0 with 0)."""
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    async with open_admin(namesrv) as admin:
        await admin.create_topic("Growing", read_queue_nums=4, write_queue_nums=4)
    consumed: set[bytes] = set()

    async def on_message(msg) -> None:
        consumed.add(msg.body)

    async with open_push_consumer(namesrv, topic="Growing", handler=on_message, consumer_group="growing",
                                  poll_name_server_interval_ms=300, rebalance_interval_ms=300) as consumer:
        assert len(consumer.assigned_queues()) == 4
        async with open_admin(namesrv) as admin:
            await admin.create_topic("Growing", read_queue_nums=8, write_queue_nums=8)
        sent = {b"m%02d" % i for i in range(80)}
        async with open_producer(namesrv) as producer:
            queues = {(await producer.send(Message("Growing", body))).message_queue.queue_id for body in sent}
        assert queues == set(range(8))
        with trio.move_on_after(10):
            while consumed != sent:
                await trio.sleep(0.1)
        assert len(consumer.assigned_queues()) == 8
    assert consumed == sent, f"{len(sent - consumed)} of {len(sent)} never consumed"


async def test_members_of_a_group_subscribing_differently_are_shown_and_logged(nursery, tmp_path, caplog, capsys):
    """Two members of one group, one on TagA and one on TagB: each pulls its own queues with its own expression,
    so half of the messages are skipped by the group (as in RocketMQ). consumer-connection used to show one
    subscription, the last heartbeat's, and nothing said so; now each member's is listed, the difference is
    flagged, and the broker logs it once."""
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    async with open_admin(namesrv) as admin:
        await admin.create_topic("Mixed", read_queue_nums=4, write_queue_nums=4)
        async with open_push_consumer(namesrv, topic="Mixed", expression="TagA", consumer_group="mixed") as a, \
                open_push_consumer(namesrv, topic="Mixed", expression="TagB", consumer_group="mixed") as b, \
                open_push_consumer(namesrv, topic="Mixed", expression="TagB", consumer_group="alike") as c:
            found = await admin.consumer_connections("mixed")
                    # Every clustering member also subscribes to its group's retry topic, as RocketMQ's.
            retry = {"%RETRY%mixed": "*"}
            assert found.member_subscriptions == {a.client_id: {"Mixed": "TagA", **retry},
                                                  b.client_id: {"Mixed": "TagB", **retry}}
            assert found.differing_topics() == {"Mixed": {a.client_id: "TagA", b.client_id: "TagB"}}
            assert (await admin.consumer_connections("alike")).differing_topics() == {}
            data = await raftmq.commands.admin_groups._consumer_connection(
                admin, argparse.Namespace(group="mixed", cluster=None))
            raftmq.commands.admin._print("consumer-connection", data)
    shown = capsys.readouterr().out
    assert "warning: the members subscribe to Mixed differently" in shown
    assert f"{a.client_id}: TagA" in shown and f"{b.client_id}: TagB" in shown
    assert c.client_id
    logged = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "differently" in r.getMessage()]
    assert len(logged) == 1 and "'mixed'" in logged[0] and "'TagA'" in logged[0] and "'TagB'" in logged[0]
