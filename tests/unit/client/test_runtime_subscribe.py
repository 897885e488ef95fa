"""``subscribe`` and ``unsubscribe`` on an open push consumer (RocketMQ allows both after start), against the
in-memory fake cluster on trio's MockClock: the subscription table changes, a heartbeat carries it to the brokers
before the call returns, a new topic's queues are allocated (start offsets fixed) and pulled, an unsubscribed
topic's queues are dropped with their offsets committed (orderly: unlocked after the message in the handler), the
retry topic stays, a new expression applies to the next pulls, and bad calls are refused. The same with real
processes: tests/cluster/test_runtime_subscribe.py."""

from __future__ import annotations

import json

import cbor2
import pytest
import trio

from client import Message, MessageQueue, open_producer, open_push_consumer
from client.errors import ClientClosedError
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from tests.unit.client.fake_cluster import NAMESRV, FakeRemoting, recording_fake, wait_until

GROUP = "g"
RETRY = "%RETRY%g"
OPTS = dict(consumer_group=GROUP, persist_consumer_offset_interval_ms=100, rebalance_interval_ms=1_000)


def _record(fake: FakeRemoting) -> FakeRemoting:
    """Also record every heartbeat's subscriptions ({topic: expression}), every pull as (topic, queue_id,
    expression), and answer LOCK_BATCH_MQ / UNLOCK_BATCH_MQ (one holder per queue, recorded as (code, queues))."""
    fake.heartbeats, fake.all_pulls, fake.lock_calls = [], [], []
    fake.holders: dict[tuple[str, int], str] = {}
    answer = fake.invoke

    async def invoke(addr, request, timeout_s=3.0):
        code, ext = request.code, request.ext
        if code == RequestCode.HEART_BEAT:
            body = cbor2.loads(request.body)
            fake.heartbeats.append({s["topic"]: s["expression"] for c in body["consumers"]
                                    for s in c["subscriptions"]})
        elif code == RequestCode.PULL_MESSAGE:
            fake.all_pulls.append((ext["topic"], ext["queue_id"], ext["subscription"]))
        elif code in (RequestCode.LOCK_BATCH_MQ, RequestCode.UNLOCK_BATCH_MQ):
            await trio.lowlevel.checkpoint()
            body = cbor2.loads(request.body)
            queues = [(q["topic"], q["queue_id"]) for q in body["mq_set"]]
            fake.lock_calls.append((code, sorted(queues)))
            if code == RequestCode.UNLOCK_BATCH_MQ:
                for q in queues:
                    if fake.holders.get(q) == body["client_id"]:
                        del fake.holders[q]
                return make_response(request, ResponseCode.SUCCESS)
            locked = [q for q in queues if fake.holders.setdefault(q, body["client_id"]) == body["client_id"]]
            return make_response(request, ResponseCode.SUCCESS, ext={"rebalance_lock_max_live_time_ms": 60_000},
                                 body=cbor2.dumps({"lock_ok_mq_set": [
                                     {"topic": t, "broker_name": "broker-a", "queue_id": q} for t, q in locked]}))
        return await answer(addr, request, timeout_s)

    fake.invoke = invoke
    return fake


@pytest.fixture
def fake(monkeypatch):
    return _record(recording_fake(monkeypatch, 2))


@pytest.fixture
def held(monkeypatch):
    """Pulls of topic T at the end of their queue are held as a broker holds them (until a message arrives)."""
    return _record(recording_fake(monkeypatch, 2, hold_pulls=True))


async def _send(topic: str, bodies: list[str], tags: str | None = None) -> None:
    async with open_producer(NAMESRV) as producer:
        for i, body in enumerate(bodies):
            await producer.send(Message(topic, body.encode(), tags=tags),
                                queue=MessageQueue(topic, "broker-a", i % 2))


class Got:
    """A handler recording (topic, body) of each message, holding those in ``gated`` until their gate opens."""

    def __init__(self, gated: set[str] = frozenset()) -> None:
        self.messages: list[tuple[str, str]] = []
        self.gated = gated
        self.gates: dict[str, trio.Event] = {}
        self.waiting: set[str] = set()

    def bodies(self, topic: str) -> list[str]:
        return sorted(b for t, b in self.messages if t == topic)

    async def __call__(self, msg) -> None:
        body = msg.body.decode()
        if body in self.gated:
            self.waiting.add(body)
            await self.gates.setdefault(body, trio.Event()).wait()
        self.messages.append((msg.topic, body))


def _queues(topic: str) -> list[MessageQueue]:
    return [MessageQueue(topic, "broker-a", 0), MessageQueue(topic, "broker-a", 1)]


def _committed(fake: FakeRemoting, topic: str) -> int:
    return sum(fake.groups[0].offsets.get((GROUP, topic, q), 0) for q in (0, 1))


async def test_a_new_topic_is_allocated_and_pulled_before_subscribe_returns(fake, autojump_clock):
    """From its last offset: what U held before subscribe() is skipped, everything sent after it returns is
    consumed, because its queues' start offsets were fixed by the rebalance it ran. The heartbeat that tells the
    brokers went out during the call, and T goes on."""
    got = Got()
    await _send("U", ["u-before-1", "u-before-2"])
    async with open_push_consumer(NAMESRV, topic="T", handler=got, **OPTS) as consumer:
        assert consumer.subscriptions() == {"T": "*"}
        beats = len(fake.heartbeats)
        await consumer.subscribe("U", "*")
        assert consumer.subscriptions() == {"T": "*", "U": "*"}
        assert fake.heartbeats[beats:] and all(h == {"T": "*", RETRY: "*", "U": "*"} for h in fake.heartbeats[beats:])
        assert set(_queues("U")) <= set(consumer.assigned_queues())
        await _send("U", ["u1", "u2", "u3"])
        await _send("T", ["t1"])
        await wait_until(lambda: len(got.messages) == 4)
        await trio.sleep(5)
    assert got.bodies("U") == ["u1", "u2", "u3"] and got.bodies("T") == ["t1"]
    assert _committed(fake, "U") == 5  # its starts (2 skipped) and what was consumed


async def test_unsubscribe_drops_the_topic_commits_its_offsets_and_keeps_the_retry_topic(fake, autojump_clock):
    got = Got()
    async with open_push_consumer(NAMESRV, subscriptions={"T": "*", "U": "*"}, handler=got,
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                                  **{**OPTS, "persist_consumer_offset_interval_ms": 600_000}) as consumer:
        await _send("U", ["u1", "u2", "u3"])
        await wait_until(lambda: len(got.messages) == 3)
        assert _committed(fake, "U") == 0  # the periodic commit is ten minutes away
        beats = len(fake.heartbeats)
        await consumer.unsubscribe("U")
        # Before it returned: U's queues dropped, their offsets committed, the brokers told (the retry topic kept,
        # as RocketMQ's unsubscribe keeps it).
        assert consumer.assigned_queues() == _queues("T") and consumer.subscriptions() == {"T": "*"}
        assert _committed(fake, "U") == 3
        assert fake.heartbeats[beats:] and all(h == {"T": "*", RETRY: "*"} for h in fake.heartbeats[beats:])
        pulls = len(fake.all_pulls)
        await _send("U", ["u4", "u5"])
        await _send("T", ["t1", "t2"])
        await wait_until(lambda: got.bodies("T") == ["t1", "t2"])
        await trio.sleep(10)  # ten rebalances
        assert not any(topic == "U" for topic, _, _ in fake.all_pulls[pulls:])
        assert consumer.assigned_queues() == _queues("T")
    assert got.bodies("U") == ["u1", "u2", "u3"]
    assert _committed(fake, "U") == 3


async def test_a_topic_unsubscribed_and_subscribed_again_resumes_from_its_committed_offset(fake, autojump_clock):
    got = Got()
    async with open_push_consumer(NAMESRV, subscriptions={"T": "*", "U": "*"}, handler=got, **OPTS) as consumer:
        await _send("U", ["u1", "u2"])
        await wait_until(lambda: len(got.messages) == 2)
        await consumer.unsubscribe("U")
        await _send("U", ["u3", "u4"])
        await trio.sleep(3)
        assert got.bodies("U") == ["u1", "u2"]
        await consumer.subscribe("U")
        await wait_until(lambda: len(got.messages) == 4)
    assert got.bodies("U") == ["u1", "u2", "u3", "u4"]


async def test_a_new_expression_takes_effect_for_the_next_pulls(held, autojump_clock):
    """The long poll held on the broker with the old expression is cancelled and sent again with the new one, so a
    TagB message sent after subscribe() returned is not delivered (held, the old poll would have brought it in)."""
    got = Got()
    async with open_push_consumer(NAMESRV, topic="T", handler=got, **OPTS) as consumer:
        await wait_until(lambda: held.holding == 2)
        beats = len(held.heartbeats)
        await consumer.subscribe("T", "TagA")
        assert consumer.subscriptions() == {"T": "TagA"}
        assert held.heartbeats[beats:] and held.heartbeats[-1] == {"T": "TagA", RETRY: "*"}
        # At once: an old poll (held up to broker_suspend_max_time_ms, 15 s) would be woken by these.
        await _send("T", ["b1", "b2"], tags="TagB")
        await _send("T", ["a1", "a2"], tags="TagA")
        await wait_until(lambda: len(got.messages) == 2)
        await trio.sleep(5)
        assert [e for t, _, e in held.all_pulls if t == "T"][-2:] == ["TagA", "TagA"]
    assert got.bodies("T") == ["a1", "a2"]


async def test_bad_calls_are_refused_with_a_clear_error(fake, autojump_clock):
    async with open_push_consumer(NAMESRV, topic="T", handler=Got(), **OPTS) as consumer:
        with pytest.raises(ValueError, match="contains characters outside"):
            await consumer.subscribe("no spaces", "*")
        with pytest.raises(ValueError, match="has an empty tag"):
            await consumer.subscribe("U", "TagA ||")
        with pytest.raises(TypeError, match="tag expression of topic 'U' must be a string"):
            await consumer.subscribe("U", 5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^topic 'U' is not subscribed \(subscribed: 'T'\)$"):
            await consumer.unsubscribe("U")
        for method in (consumer.subscribe, consumer.unsubscribe):
            with pytest.raises(ValueError, match=r"of '%RETRY%g': a CLUSTERING consumer subscribes to its group's "
                                                 r"retry topic by itself"):
                await method(RETRY)
        # Refused before anything changed.
        assert consumer.subscriptions() == {"T": "*"} and consumer.assigned_queues() == _queues("T")
        await consumer.subscribe("U")
        await consumer.unsubscribe("U")
        with pytest.raises(ValueError, match="is not subscribed"):
            await consumer.unsubscribe("U")
    for call in (consumer.subscribe("U"), consumer.unsubscribe("T")):
        with pytest.raises(ClientClosedError, match=r"the push consumer is closed: (un)?subscribe\(\) cannot be"):
            await call


async def test_the_iterator_form_takes_a_new_topic_too(fake, autojump_clock):
    got: list[str] = []
    async with open_push_consumer(NAMESRV, topic="T", **OPTS) as consumer:
        await consumer.subscribe("U")
        await _send("U", ["u1"])
        await _send("T", ["t1"])
        async for msg in consumer:
            got.append(f"{msg.topic}:{msg.body.decode()}")
            if len(got) == 2:
                break
    assert sorted(got) == ["T:t1", "U:u1"]


async def test_orderly_unsubscribe_finishes_the_message_in_hand_then_commits_and_unlocks(fake, autojump_clock):
    """An orderly queue of the unsubscribed topic stops pulling at once, lets the message in its handler finish,
    commits past it and only then gives its lock back; T's queues keep theirs."""
    got = Got(gated={"u2"})
    async with open_push_consumer(NAMESRV, subscriptions={"T": "*", "U": "*"}, handler=got, orderly=True,
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", **OPTS) as consumer:
        await _send("U", ["u1", "u2", "u3"])  # u1 and u3 on queue 0, u2 on queue 1
        await wait_until(lambda: "u2" in got.waiting and len(got.messages) == 2)
        await consumer.unsubscribe("U")
        assert consumer.assigned_queues() == _queues("T")
        await trio.sleep(5)
        unlocked = [qs for code, qs in fake.lock_calls if code == RequestCode.UNLOCK_BATCH_MQ]
        assert unlocked == [[("U", 0)]]  # queue 1 waits for its message
        assert ("U", 1) in fake.holders
        got.gates["u2"].set()
        await wait_until(lambda: ("U", 1) not in fake.holders)
        assert got.bodies("U") == ["u1", "u2", "u3"]
        assert fake.groups[0].offsets[(GROUP, "U", 1)] == 1  # past u2, committed before the unlock
        assert sorted(q for q in fake.holders) == [("T", 0), ("T", 1)]
        await _send("U", ["u4"])
        await trio.sleep(5)
    assert got.bodies("U") == ["u1", "u2", "u3"]


async def test_broadcasting_keeps_an_unsubscribed_topics_offsets_in_its_file(fake, autojump_clock, tmp_path):
    """A broadcasting member takes every queue of a new topic; unsubscribed, the topic's offsets stay in the offset
    file (RocketMQ's local store never forgets one), so subscribing again resumes there: nothing sent meanwhile is
    skipped."""
    got = Got()
    opts = dict(OPTS, message_model="BROADCASTING", offset_store_dir=str(tmp_path))
    async with open_push_consumer(NAMESRV, topic="T", handler=got, **opts) as consumer:
        await consumer.subscribe("U")
        assert consumer.assigned_queues() == _queues("T") + _queues("U")
        assert fake.heartbeats[-1] == {"T": "*", "U": "*"}  # no retry topic in broadcasting
        await _send("U", ["u1", "u2"])
        await wait_until(lambda: len(got.messages) == 2)
        await consumer.unsubscribe("U")
        [path] = tmp_path.glob("*.json")  # beside it: its lock file
        offsets = {(e["topic"], e["queue_id"]): e["offset"] for e in json.loads(path.read_text())["offsets"]}
        assert offsets[("U", 0)] == 1 and offsets[("U", 1)] == 1
        await _send("U", ["u3", "u4"])
        await trio.sleep(5)  # commits of T's queues rewrite the file meanwhile
        await consumer.subscribe("U")
        await wait_until(lambda: len(got.messages) == 4)
    assert got.bodies("U") == ["u1", "u2", "u3", "u4"]
