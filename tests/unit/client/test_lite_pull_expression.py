"""A new expression for a topic the lite pull consumer already pulls (``subscribe`` again, or
``set_sub_expression_for_assign``) applies at once: the long polls held on the broker with the old expression are
cancelled and sent again with the new one, as the push consumer's (tests/unit/client/test_runtime_subscribe.py).
Against the in-memory fake cluster, whose pulls at the end of a queue are held as a broker holds them."""

from __future__ import annotations

import pytest
import trio

import client.lite_pull_consumer
from client import Message, MessageQueue, open_lite_pull_consumer, open_producer
from remoting.codes import RequestCode
from tests.unit.client.fake_cluster import NAMESRV, FakeRemoting, fake_remoting_ctx, recording_fake, wait_until

GROUP = "lite_expression"
QUEUES = [MessageQueue("T", "broker-a", 0), MessageQueue("T", "broker-a", 1)]


@pytest.fixture
def held(monkeypatch) -> FakeRemoting:
    """Pulls of T at the end of their queue are held up to their suspend time (15 s) or until a message comes; every
    pull of T is recorded as (queue_id, expression)."""
    fake = recording_fake(monkeypatch, 2, hold_pulls=True)
    monkeypatch.setattr(client.lite_pull_consumer, "open_remoting",
                        lambda config, handler=None: fake_remoting_ctx(fake))
    fake.expressions = []
    invoke = fake.invoke

    async def recording(addr, request, timeout_s=3.0):
        if request.code == RequestCode.PULL_MESSAGE and request.ext["topic"] == "T":
            fake.expressions.append((request.ext["queue_id"], request.ext["subscription"]))
        return await invoke(addr, request, timeout_s)

    fake.invoke = recording
    return fake


async def _send(bodies: list[str], tags: str) -> None:
    async with open_producer(NAMESRV) as producer:
        for i, body in enumerate(bodies):
            await producer.send(Message("T", body.encode(), tags=tags), queue=QUEUES[i % 2])


async def _bodies_after_the_change(held: FakeRemoting, consumer) -> list[str]:
    """TagB messages then TagA messages, sent at once after the change to TagA; what polls hand out of them."""
    await _send(["b1", "b2"], "TagB")
    await _send(["a1", "a2"], "TagA")
    got: list = []
    with trio.fail_after(60):  # virtual seconds
        while len(got) < 2:
            got += await consumer.poll(timeout_s=1)
    got += await consumer.poll(timeout_s=5)  # nothing more comes
    return sorted(m.body.decode() for m in got)


async def test_subscribing_again_with_a_new_expression_restarts_the_held_polls(held, autojump_clock):
    """Before, the polls held with ``*`` stayed until a message or their 15 s were up: b1 and b2 woke them and
    were handed out."""
    async with open_lite_pull_consumer(NAMESRV, consumer_group=GROUP, rebalance_interval_ms=1_000) as consumer:
        await consumer.subscribe("T", "*")
        await wait_until(lambda: held.holding == 2)
        pulls = len(held.expressions)
        await consumer.subscribe("T", "TagA")
        assert await _bodies_after_the_change(held, consumer) == ["a1", "a2"]
        assert held.expressions[pulls:] and {e for _, e in held.expressions[pulls:]} == {"TagA"}
        # The same expression again restarts nothing.
        await wait_until(lambda: held.holding == 2)
        pulls = len(held.expressions)
        await consumer.subscribe("T", "TagA")
        await trio.sleep(1)
        assert held.expressions[pulls:] == [] and held.holding == 2


async def test_a_new_expression_for_assigned_queues_restarts_the_held_polls(held, autojump_clock):
    async with open_lite_pull_consumer(NAMESRV, consumer_group=GROUP) as consumer:
        consumer.assign(QUEUES)  # no expression yet: pulled with *
        await wait_until(lambda: held.holding == 2)
        pulls = len(held.expressions)
        consumer.set_sub_expression_for_assign("T", "TagA")
        assert await _bodies_after_the_change(held, consumer) == ["a1", "a2"]
        assert {e for _, e in held.expressions[pulls:]} == {"TagA"}
