"""Timer messages (RocketMQ 5's deliver time, ``Message(deliver_time_ms=...)`` / ``delay_ms``) with real processes: a
name server and a 3-node group with the default delay levels (1s 5s 10s ...), so that a message due 2.5, 7 or 12 s
ahead hops through the 1 s, 5 s and 10 s levels.

First, timer messages wait while the leader is SIGKILLed: the next leader reads each level's replicated progress and
every parked message's absolute time, so none is lost (one whose round's progress the killed leader had not
replicated may come twice). Then, on the new leader, messages due at once, in the past and 2.5, 7 and 12 s ahead:
each arrives exactly once, not before its time, with its tags, keys, properties, time and message id.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import pytest
import trio

from client import Message, open_producer, open_push_consumer
from tests.cluster.test_e2e_produce_consume import Cluster, start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.timeout(120)
async def test_timer_messages_arrive_not_before_their_time_once_and_none_is_lost_to_a_leader_kill(spawn, tmp_path,
                                                                                                 figure):
    started = time.monotonic()
    cluster: Cluster = await start_cluster(spawn, tmp_path)
    topic = "TimerTopic"
    await cluster.create_topic(topic, 2)
    consumed: Counter[str] = Counter()
    seen: dict[str, object] = {}
    arrived_at: dict[str, float] = {}

    async def on_message(msg) -> None:
        consumed[msg.msg_id] += 1
        seen[msg.msg_id] = msg
        arrived_at.setdefault(msg.msg_id, time.time())

    # msg_id -> (key, not before: s since the epoch, phase)
    sent: dict[str, tuple[str, float, int]] = {}
    async with open_producer(cluster.namesrv) as producer, \
            open_push_consumer(cluster.namesrv, topic=topic, handler=on_message, consumer_group="timer_group",
                               consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=500,
                               persist_consumer_offset_interval_ms=200, broker_suspend_max_time_ms=1000):

        async def send(phase: int, key: str, *, ahead_ms: int | None = None, delay_ms: int | None = None) -> None:
            for _ in range(40):
                sent_at = time.time()
                deliver_ms = None if ahead_ms is None else int(sent_at * 1000) + ahead_ms
                try:
                    r = await producer.send(Message(topic, key.encode(), tags=f"P{phase}", keys=[key, "timer"],
                                                    properties={"k": key}, deliver_time_ms=deliver_ms,
                                                    delay_ms=delay_ms))
                except Exception:  # noqa: BLE001 - a send refused during the election is sent again
                    await trio.sleep(0.2)
                    continue
                # delay_ms runs from the broker's receipt, after sent_at
                not_before = deliver_ms / 1000 if deliver_ms is not None else sent_at + (delay_ms or 0) / 1000
                sent[r.msg_id] = (key, not_before, phase)
                return
            raise AssertionError(f"timer message {key} could not be sent")

        # Phase 1: due 2.5 to 5 s ahead, the leader killed 1.5 s after they were sent (each is then mid-hop).
        for i, ahead in enumerate((2500, 3000, 3500, 4000, 4500, 5000)):
            if i % 2:
                await send(1, f"kill-{i}", delay_ms=ahead)
            else:
                await send(1, f"kill-{i}", ahead_ms=ahead)
        await trio.sleep(1.5)
        leader = await cluster.leader_addr()
        await trio.to_thread.run_sync(cluster.nodes[cluster.node_at(leader)].kill)
        killed_at = time.time()

        # Phase 2, on the next leader: at once, in the past, and 2.5, 7, 12 s ahead.
        for i in range(3):
            await send(2, f"now-{i}", ahead_ms=0)
            await send(2, f"past-{i}", ahead_ms=-60_000 * (i + 1))
            await send(2, f"t2.5-{i}", ahead_ms=2500)
            if i == 1:
                await send(2, f"t7-{i}", delay_ms=7000)
            else:
                await send(2, f"t7-{i}", ahead_ms=7000)
            await send(2, f"t12-{i}", ahead_ms=12_000)
        with trio.move_on_after(40):
            while not set(sent) <= set(consumed):
                await trio.sleep(0.1)
        await trio.sleep(0.5)  # a late duplicate would come now

    missing = sorted(sent[m][0] for m in set(sent) - set(consumed))
    assert not missing, f"{len(missing)} of {len(sent)} timer messages never arrived: {missing}"
    assert set(consumed) == set(sent), "a message nobody sent arrived"
    late: dict[int, list[float]] = {1: [], 2: []}
    for msg_id, (key, not_before, phase) in sent.items():
        msg = seen[msg_id]
        assert msg.topic == topic and msg.tags == f"P{phase}" and msg.keys == [key, "timer"]
        assert msg.properties["k"] == key and "DELAY" not in msg.properties and msg.body == key.encode()
        assert msg.msg_id == msg_id
        # The broker's clock is ours (one host): never before its time.
        assert arrived_at[msg_id] >= not_before, f"{key} arrived {not_before - arrived_at[msg_id]:.3f}s early"
        assert int(msg.properties["TIMER_DELIVER_MS"]) >= int(not_before * 1000) - 1
        if not key.startswith(("now", "past")):
            late[phase].append(arrived_at[msg_id] - not_before)
    duplicates = {phase: sum(c - 1 for m, c in consumed.items() if sent[m][2] == phase) for phase in (1, 2)}
    assert duplicates[2] == 0, f"{duplicates[2]} duplicates without a kill"
    figure(f"timer messages: {len(sent)} delivered, none early; lateness after their time median "
           f"{statistics.median(late[2]):.2f}s max {max(late[2]):.2f}s (2.5/7/12 s ahead, 1 s levels); across a "
           f"leader kill max {max(late[1]):.2f}s, {duplicates[1]} duplicates, last arrival "
           f"{max(arrived_at[m] for m, v in sent.items() if v[2] == 1) - killed_at:.2f}s after the kill; "
           f"test {time.monotonic() - started:.1f}s")
