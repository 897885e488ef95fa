"""What a push consumer's handler says, with real processes: a name server and a 3-node group, a concurrent and an
orderly consumer (clustering) at once.

Concurrent: returning None or ``ConsumeStatus.SUCCESS`` consumes; ``ConsumeStatus.RECONSUME_LATER`` and a ported
listener's string "RECONSUME_LATER" (before: taken as success, the message lost) send the message back, and it
returns through the retry topic with reconsume_times 1; ``ReconsumeLater(delay_level=-1)`` buries it in the dead
letters at once, ``delay_level=7`` parks it at that level. Every send-back carries a count the broker takes:
max_reconsume_times -1 is sent as 16 (a -1 was refused, and the message retried locally instead). Orderly: by
default a failing message is retried past RocketMQ's concurrent 16 (orderly: unlimited), reconsume_times counting
up; ``ReconsumeLater(delay_level=-1)`` sends it to the dead letters without waiting that out. The same logic on the
fake cluster, with timings: tests/unit/client/test_listener_results.py.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import pytest
import trio

from client import ConsumeStatus, Message, ReconsumeLater, open_admin, open_producer, open_push_consumer
from client.errors import RaftMQError
from tests.cluster.test_e2e_produce_consume import Cluster, start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# Level 3, the first retry's backoff, is 300 ms; level 7 is an hour: a message parked there stays in its schedule
# queue for the whole test.
LEVELS = "100ms 200ms 300ms 400ms 500ms 600ms 1h"
ORDERLY_FAILURES = 18  # past RocketMQ's concurrent default of 16, which orderly consumption used to stop at


async def _query(admin, topic: str, key: str) -> list:
    with trio.move_on_after(20):
        while True:
            try:
                return await admin.query_message(topic, key)
            except RaftMQError:  # QUERY_NOT_FOUND until the index has it
                await trio.sleep(0.2)
    return []


@pytest.mark.timeout(180)
async def test_handler_results_decide_send_backs_and_orderly_retries(spawn, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="client")
    cluster: Cluster = await start_cluster(spawn, tmp_path, {"message_delay_level": LEVELS})
    await cluster.create_topic("Listened", 2)
    await cluster.create_topic("ListenedInOrder", 1)
    deliveries: dict[str, list] = defaultdict(list)  # key -> every delivery to the concurrent handler
    orderly: list[tuple[str, int]] = []  # (key, reconsume_times) of every orderly handler call

    async def handler(msg):
        (key,) = msg.keys
        deliveries[key].append(msg)
        if msg.reconsume_times > 0:
            return None
        if key == "dead":
            raise ReconsumeLater(delay_level=-1)
        if key == "parked":
            raise ReconsumeLater(delay_level=7)
        return {"success": ConsumeStatus.SUCCESS, "later": ConsumeStatus.RECONSUME_LATER,
                "ported": "RECONSUME_LATER"}.get(key)

    async def orderly_handler(msg):
        (key,) = msg.keys
        orderly.append((key, msg.reconsume_times))
        if key == "stubborn" and msg.reconsume_times < ORDERLY_FAILURES:
            if msg.reconsume_times % 2:
                return ConsumeStatus.RECONSUME_LATER
            raise RuntimeError("not yet")
        if key == "poison":
            raise ReconsumeLater(delay_level=-1)
        return None

    options = dict(consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=300,
                   persist_consumer_offset_interval_ms=200, broker_suspend_max_time_ms=1000)
    wanted = {"none": 1, "success": 1, "later": 2, "ported": 2, "dead": 1, "parked": 1}
    async with open_producer(cluster.namesrv) as producer, \
            open_push_consumer(cluster.namesrv, topic="Listened", handler=handler, consumer_group="listened",
                               **options), \
            open_push_consumer(cluster.namesrv, topic="ListenedInOrder", handler=orderly_handler, orderly=True,
                               consumer_group="listened_in_order", suspend_current_queue_time_ms=10, **options):
        for key in wanted:
            await producer.send(Message("Listened", key.encode(), keys=[key]))
        for key in ("stubborn", "poison", "last"):
            await producer.send(Message("ListenedInOrder", key.encode(), keys=[key]))
        with trio.move_on_after(60):
            while (any(len(deliveries[k]) < n for k, n in wanted.items())
                   or not orderly or orderly[-1][0] != "last"):
                await trio.sleep(0.1)
        await trio.sleep(1)  # more than level 3's 300 ms: what else would come back (dead, parked) has had time
        leader = await cluster.leader_addr()
        async with open_admin(cluster.namesrv) as admin:
            levels = {row.level: row for row in await admin.delay_offsets(leader)}
            dead = await _query(admin, "%DLQ%listened", "dead")
            poison = await _query(admin, "%DLQ%listened_in_order", "poison")

    assert {k: len(deliveries[k]) for k in wanted} == wanted
    for key in ("later", "ported"):
        first, again = deliveries[key]
        # Back through the broker's retry topic (a local retry would carry no ORIGIN_MESSAGE_ID), first topic
        # restored, counted once.
        assert again.topic == "Listened" and again.reconsume_times == 1 and again.msg_id == first.msg_id
        assert again.properties["ORIGIN_MESSAGE_ID"] == first.msg_id, key
    (buried,) = dead
    assert buried.reconsume_times == 1 and buried.properties["RETRY_TOPIC"] == "Listened"
    assert levels[7].waiting == 1  # "parked", an hour away: not at the default level 3
    assert orderly == ([("stubborn", n) for n in range(ORDERLY_FAILURES + 1)]
                       + [("poison", 0), ("last", 0)])
    (buried,) = poison
    assert buried.body == b"poison" and buried.properties["RETRY_TOPIC"] == "ListenedInOrder"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in warnings if "send back failed" in m], warnings
    assert [m for m in warnings if "handler returned a str" in m], warnings
