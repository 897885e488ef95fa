"""Consumer retries with real processes: a name server and a 3-node group, a push consumer whose handler fails.

Short delay levels make the broker's backoff (level 3 + reconsume times) a few hundred ms. A message that fails
twice is delivered a third time with reconsume_times 2 and its first topic; one that always fails is delivered
max_reconsume_times + 1 times and then lies in the group's dead-letter topic with every property; the others are
delivered once. Retry and dead-letter topics are in the topic list and routed, and found by key.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import trio

from client import Message, open_admin, open_producer, open_push_consumer
from tests.cluster.test_e2e_produce_consume import Cluster, start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LEVELS = "100ms 200ms 300ms 400ms 500ms 600ms"
GROUP = "retry_group"
PER_KIND = 8
MAX_RECONSUME = 2


@pytest.mark.timeout(180)
async def test_failed_messages_come_back_through_the_retry_topic_then_end_in_the_dead_letter_topic(spawn, tmp_path,
                                                                                                    figure):
    cluster: Cluster = await start_cluster(spawn, tmp_path, {"message_delay_level": LEVELS})
    topic = "RetryTopic"
    await cluster.create_topic(topic, 2)
    deliveries: dict[str, list] = defaultdict(list)  # msg_id -> every delivery

    async def handler(msg) -> None:
        deliveries[msg.msg_id].append(msg)
        kind = msg.tags
        if kind == "bad" or (kind == "flaky" and len(deliveries[msg.msg_id]) <= 2):
            raise RuntimeError(f"{kind} message fails (delivery {len(deliveries[msg.msg_id])})")

    sent: dict[str, tuple[str, str]] = {}  # msg_id -> (kind, key)
    async with open_producer(cluster.namesrv) as producer, \
            open_push_consumer(cluster.namesrv, topic=topic, handler=handler, consumer_group=GROUP,
                               consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=300,
                               max_reconsume_times=MAX_RECONSUME, reconsume_delay_ms=50,
                               persist_consumer_offset_interval_ms=200, broker_suspend_max_time_ms=1000):
        for kind in ("good", "flaky", "bad"):
            for i in range(PER_KIND):
                key = f"{kind}-{i}"
                r = await producer.send(Message(topic, key.encode(), tags=kind, keys=[key],
                                                properties={"origin": "test", "i": str(i)}))
                sent[r.msg_id] = (kind, key)
        wanted = {"good": 1, "flaky": 3, "bad": MAX_RECONSUME + 1}
        with trio.move_on_after(60):
            while any(len(deliveries[m]) < wanted[kind] for m, (kind, _) in sent.items()):
                await trio.sleep(0.2)
        await trio.sleep(2)  # anything more that would come back (a DLQ message must not)

    assert set(deliveries) == set(sent), "a message nobody sent was delivered"
    for msg_id, (kind, key) in sent.items():
        got = deliveries[msg_id]
        assert len(got) == wanted[kind], f"{key} delivered {len(got)} times, expected {wanted[kind]}"
        for n, msg in enumerate(got):
            # The handler sees its topic, not %RETRY%, and how often the message failed before.
            assert msg.topic == topic and msg.reconsume_times == n, (key, n, msg.topic, msg.reconsume_times)
            assert msg.keys == [key] and msg.tags == kind and msg.body == key.encode()
            assert msg.properties["origin"] == "test" and msg.properties["i"] == key.split("-")[1]

    dlq = f"%DLQ%{GROUP}"
    async with open_admin(cluster.namesrv) as admin:
        topics = await admin.list_topics()
        assert f"%RETRY%{GROUP}" in topics and dlq in topics
        route = await admin.get_route(dlq)
        assert route.queue_datas and all(q.perm == 2 for q in route.queue_datas)
        for msg_id, (kind, key) in sent.items():
            with trio.fail_after(20):
                while True:
                    try:
                        found = await admin.query_message(dlq, key)
                        break
                    except Exception:  # noqa: BLE001 - QUERY_NOT_FOUND for the good and flaky ones
                        if kind != "bad":
                            found = []
                            break
                        await trio.sleep(0.3)
            if kind != "bad":
                assert not found, f"{key} is in the dead-letter topic"
                continue
            (dead,) = found
            assert dead.topic == dlq and dead.reconsume_times == MAX_RECONSUME + 1 and dead.body == key.encode()
            assert dead.msg_id == msg_id and dead.keys == [key] and dead.tags == "bad"
            assert dead.properties["origin"] == "test" and dead.properties["RETRY_TOPIC"] == topic
            assert dead.properties["ORIGIN_MESSAGE_ID"] == msg_id
    figure(f"retries: {sum(len(v) for v in deliveries.values())} deliveries of {len(sent)} messages")
