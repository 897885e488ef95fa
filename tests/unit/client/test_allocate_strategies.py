"""Queue allocation strategies (``client/rebalance.py``, RocketMQ's AllocateMessageQueueStrategy) and the push
consumer's ``allocate_strategy``: properties over many random groups (every queue to exactly one member), worked
examples of RocketMQ's circle and consistent-hash algorithms derived by hand, the choice by name or function with its
errors, and members on the in-memory fake cluster splitting a topic's queues by the strategy they were given."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from client import MessageQueue, open_push_consumer
from client.errors import ConfigError
from client.push_consumer import PushConsumerConfig
from client.rebalance import (ALLOCATE_STRATEGIES, allocate_average, allocate_average_by_circle, allocate_by_config,
                              allocate_consistent_hash, resolve_allocate_strategy)
from tests.unit.client.fake_cluster import NAMESRV, recording_fake, wait_until

CIRCLE = "AllocateMessageQueueAveragelyByCircle"
HASH = "AllocateMessageQueueConsistentHash"

# Every strategy that shares a topic among its members (allocate_by_config does not: each member names its own).
SHARING = {"average": allocate_average, "circle": allocate_average_by_circle,
           "hash-1": allocate_consistent_hash(1), "hash-10": allocate_consistent_hash(), "hash-50":
           allocate_consistent_hash(50)}


def _queues(spec: dict[str, int], topic: str = "T") -> list[MessageQueue]:
    return [MessageQueue(topic, broker, q) for broker, n in spec.items() for q in range(n)]


def _ids(allocated: list[MessageQueue]) -> list[str]:
    return [f"{mq.broker_name[-1]}{mq.queue_id}" for mq in allocated]


# -- properties ---------------------------------------------------------------------------------------------------

groups = st.tuples(
    st.dictionaries(st.sampled_from(["broker-a", "broker-b", "broker-c"]), st.integers(1, 16), min_size=1),
    st.sets(st.text("0123456789.@#abc", min_size=1, max_size=12), min_size=1, max_size=12))


@pytest.mark.parametrize("name", sorted(SHARING))
@settings(max_examples=300, deadline=None)
@given(group=groups, seed=st.randoms(use_true_random=False))
def test_every_queue_goes_to_exactly_one_member(name, group, seed):
    """Over all members, each computing its own share from the lists in whatever order it got them, every queue of
    the topic is allocated once: none to nobody, none to two."""
    strategy = SHARING[name]
    spec, cids = group
    mqs = _queues(spec)
    shares = {}
    for cid in cids:
        mine_mqs, mine_cids = list(mqs), list(cids)
        seed.shuffle(mine_mqs)
        seed.shuffle(mine_cids)
        shares[cid] = strategy("g", cid, mine_mqs, mine_cids)
    allocated = [mq for share in shares.values() for mq in share]
    assert sorted(allocated) == sorted(mqs)
    assert all(share == sorted(share) for share in shares.values())  # in queue order, as RocketMQ's sorted lists
    assert strategy("g", "not-a-member", mqs, cids) == []


@pytest.mark.parametrize("name", ["average", "circle"])
@settings(max_examples=200, deadline=None)
@given(group=groups)
def test_the_averaging_strategies_differ_by_one_queue_at_most(name, group):
    spec, cids = group
    sizes = [len(SHARING[name]("g", cid, _queues(spec), cids)) for cid in cids]
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=200, deadline=None)
@given(group=groups, data=st.data())
def test_consistent_hash_moves_only_the_queues_of_a_member_that_leaves(group, data):
    """What consistent hashing is for: when a member leaves, the others keep every queue they had and take only
    the leaver's (the averaging strategies may move every queue)."""
    spec, cids = group
    if len(cids) < 2:
        return
    leaver = data.draw(st.sampled_from(sorted(cids)))
    strategy = allocate_consistent_hash()
    mqs = _queues(spec)
    before = {cid: set(strategy("g", cid, mqs, cids)) for cid in cids}
    after = {cid: set(strategy("g", cid, mqs, cids - {leaver})) for cid in cids - {leaver}}
    for cid, share in after.items():
        assert before[cid] <= share
        assert share - before[cid] <= before[leaver]


# -- worked examples ----------------------------------------------------------------------------------------------

def test_circle_deals_the_sorted_queues_like_cards():
    """RocketMQ's AllocateMessageQueueAveragelyByCircle on 8 queues of two brokers (sorted a0 a1 a2 a3 b0 b1 b2 b3:
    by broker name, then queue id) and 3 members (sorted c1 c2 c3): member k takes positions k, k+3, k+6. So
    c1: a0 a3 b2; c2: a1 b0 b3; c3: a2 b1. Averagely cuts the same list into blocks of 3, 3, 2 instead."""
    mqs = _queues({"broker-b": 4, "broker-a": 4})  # any order in
    cids = ["c3", "c1", "c2"]
    assert [_ids(allocate_average_by_circle("g", c, mqs, cids)) for c in ("c1", "c2", "c3")] == [
        ["a0", "a3", "b2"], ["a1", "b0", "b3"], ["a2", "b1"]]
    assert [_ids(allocate_average("g", c, mqs, cids)) for c in ("c1", "c2", "c3")] == [
        ["a0", "a1", "a2"], ["a3", "b0", "b1"], ["b2", "b3"]]
    # More members than queues: the first ones take one each, the rest none (RocketMQ's loop starts past the end).
    two = _queues({"broker-a": 2})
    assert [_ids(allocate_average_by_circle("g", c, two, cids)) for c in ("c1", "c2", "c3")] == [["a0"], ["a1"], []]


# RocketMQ's ConsistentHashRouter puts member "a" at MD5("a-0") and MD5("a-1") (virtual node i of a member is
# "<client id>-<i>"), each point the digest's first 4 bytes read as an unsigned big-endian number, and routes a queue
# by the same hash of its MessageQueue.toString(). Digests (hex, first 4 bytes) and points:
POINTS = {
    "a-0": ("a165efd1", 2707812305),
    "a-1": ("737c191a", 1937512730),
    "b-0": ("34f25f6f", 888299375),
    "b-1": ("b1d10db2", 2983267762),
    "MessageQueue [topic=T, brokerName=broker-a, queueId=0]": ("612f4674", 1630488180),
    "MessageQueue [topic=T, brokerName=broker-a, queueId=1]": ("8b35eabf", 2335566527),
    "MessageQueue [topic=T, brokerName=broker-a, queueId=2]": ("004e3e1b", 5127707),
    "MessageQueue [topic=T, brokerName=broker-a, queueId=3]": ("db778d95", 3682045333),
}


def test_consistent_hash_follows_rocketmqs_ring_on_a_worked_example():
    """Two members, 2 virtual nodes each. The ring, in order: b-0 888299375, a-1 1937512730, a-0 2707812305,
    b-1 2983267762. Each queue goes to the first point at or after its own, round to the first:
    q0 1630488180 -> a-1 (a); q1 2335566527 -> a-0 (a); q2 5127707 -> b-0 (b); q3 3682045333 -> past the last point,
    round to b-0 (b). So a takes q0 q1, b takes q2 q3."""
    for key, (digest, point) in POINTS.items():
        assert hashlib.md5(key.encode()).hexdigest()[:8] == digest and int(digest, 16) == point
    mqs = _queues({"broker-a": 4})
    strategy = allocate_consistent_hash(2)
    assert _ids(strategy("g", "a", mqs, ["b", "a"])) == ["a0", "a1"]
    assert _ids(strategy("g", "b", mqs, ["b", "a"])) == ["a2", "a3"]
    # b leaves: the ring is a-1, a-0 only, and a takes all four.
    assert _ids(strategy("g", "a", mqs, ["a"])) == ["a0", "a1", "a2", "a3"]
    # One virtual node each (a-0 2707812305, b-0 888299375): q0 and q1 -> a-0 (a); q2 -> b-0; q3 round to b-0.
    assert _ids(allocate_consistent_hash(1)("g", "a", mqs, ["a", "b"])) == ["a0", "a1"]


def test_the_named_consistent_hash_has_rocketmqs_ten_virtual_nodes():
    assert allocate_consistent_hash().virtual_node_count == 10
    assert resolve_allocate_strategy(HASH) == allocate_consistent_hash(10)
    for bad in (0, -1, 10_001, 2.5, True, "10"):
        with pytest.raises(ValueError, match=r"^virtual_node_count must be an integer within 1\.\.10000, got "):
            allocate_consistent_hash(bad)


def test_consistent_hash_is_the_same_in_every_process_whatever_its_hash_seed():
    """Members are separate processes, each with its own str hash seed: a ring built with Python's hash() would
    differ in each, and queues would go to nobody or to two. MD5 does not."""
    cids = [f"10.0.0.{i}@{1000 + i}#DEFAULT#1" for i in range(5)]
    mqs = _queues({"broker-a": 8, "broker-b": 8})
    script = ("import json, sys; from client.message import MessageQueue; "
              "from client.rebalance import allocate_consistent_hash as h; "
              "cids, mqs = json.loads(sys.argv[1]); mqs = [MessageQueue(*m) for m in mqs]; "
              "print(json.dumps({c: [m.queue_id + 100 * (m.broker_name == 'broker-b') for m in h()('g', c, mqs, cids)] "
              "for c in cids}))")
    arg = json.dumps([cids, [[m.topic, m.broker_name, m.queue_id] for m in mqs]])
    answers = []
    for seed in ("1", "2", "3"):
        out = subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, cwd=os.getcwd()).stdout
        answers.append(json.loads(out))
    assert answers[0] == answers[1] == answers[2]
    assert sorted(q for share in answers[0].values() for q in share) == sorted(
        m.queue_id + 100 * (m.broker_name == "broker-b") for m in mqs)


# -- by config ----------------------------------------------------------------------------------------------------

def test_by_config_takes_the_queues_given_that_the_topic_has():
    """RocketMQ's AllocateMessageQueueByConfig: the member's own list, whoever else is in the group. Queues of
    other topics in the list are for those topics' rebalances; one the topic's route does not have is returned
    (the consumer warns about it and does not pull it)."""
    strategy = allocate_by_config([MessageQueue("T", "broker-a", 1), MessageQueue("T", "broker-a", 3),
                                   MessageQueue("U", "broker-a", 0), MessageQueue("T", "broker-a", 9)])
    assert _ids(strategy("g", "me", _queues({"broker-a": 4}), ["me", "other"])) == ["a1", "a3", "a9"]
    assert _ids(strategy("g", "me", _queues({"broker-a": 4}, "U"), [])) == ["a0"]
    with pytest.raises(ValueError, match="at least one queue"):
        allocate_by_config([])
    for bad in ("T", MessageQueue("T", "broker-a", 0), [("T", "broker-a", 0)], 5):
        with pytest.raises(TypeError, match="allocate_by_config takes MessageQueue objects"):
            allocate_by_config(bad)


# -- choosing a strategy --------------------------------------------------------------------------------------------

def test_strategies_are_chosen_by_rocketmqs_names_or_given_as_functions():
    assert resolve_allocate_strategy("AllocateMessageQueueAveragely") is allocate_average
    assert resolve_allocate_strategy(CIRCLE) is allocate_average_by_circle
    assert set(ALLOCATE_STRATEGIES) == {"AllocateMessageQueueAveragely", CIRCLE, HASH}
    assert PushConsumerConfig().allocate_strategy == "AllocateMessageQueueAveragely"  # RocketMQ's default

    def mine(consumer_group, current_client_id, queues, client_ids):
        return list(queues)[:1]

    assert resolve_allocate_strategy(mine) is mine
    assert PushConsumerConfig(allocate_strategy=mine).allocate_strategy is mine
    config = PushConsumerConfig(allocate_strategy=allocate_by_config([MessageQueue("T", "broker-a", 0)]))
    assert resolve_allocate_strategy(config.allocate_strategy)("g", "me", _queues({"broker-a": 2}), ["me"]) == [
        MessageQueue("T", "broker-a", 0)]


@pytest.mark.parametrize("value, problem", [
    ("AllocateMessageQueueAverage", "must be one of 'AllocateMessageQueueAveragely', "
                                    "'AllocateMessageQueueAveragelyByCircle', 'AllocateMessageQueueConsistentHash' or "
                                    "a function"),
    ("AllocateMessageQueueByConfig",
     "needs the queues to take: pass allocate_strategy=client.rebalance.allocate_by_config([...]) instead of the name"),
    (7, "must be one of"),
])
def test_a_bad_strategy_is_refused_naming_it(value, problem):
    want = f"^{re.escape(f'allocate_strategy {problem}')}.*, got {re.escape(repr(value))}$"
    with pytest.raises(ConfigError, match=want):
        PushConsumerConfig(allocate_strategy=value)
    with pytest.raises(ValueError, match=want):
        resolve_allocate_strategy(value)


def test_a_function_of_the_wrong_shape_is_refused():
    async def asynchronous(consumer_group, current_client_id, queues, client_ids):
        return []

    with pytest.raises(ConfigError, match=r"^allocate_strategy must take \(consumer_group, current_client_id, "
                                          r"queues, client_ids\) as allocate_average does, not \(queues\), got "):
        PushConsumerConfig(allocate_strategy=lambda queues: queues)
    with pytest.raises(ConfigError, match="^allocate_strategy must be a plain function, not an async one, got "):
        PushConsumerConfig(allocate_strategy=asynchronous)


def test_a_strategy_is_for_clustering_consumers():
    """A broadcasting member consumes every queue; RocketMQ ignores its strategy, which was set to do something."""
    with pytest.raises(ConfigError, match="^allocate_strategy is for CLUSTERING consumers .* got "
                                          "'AllocateMessageQueueAveragelyByCircle' with message_model 'BROADCASTING'$"):
        PushConsumerConfig(message_model="BROADCASTING", allocate_strategy=CIRCLE)
    assert PushConsumerConfig(message_model="BROADCASTING").allocate_strategy == "AllocateMessageQueueAveragely"


# -- on the fake cluster ------------------------------------------------------------------------------------------

OPTS = dict(consumer_group="g", consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=500)


@pytest.mark.parametrize("strategy", [CIRCLE, HASH, allocate_average_by_circle])
async def test_two_members_split_the_queues_by_their_strategy(monkeypatch, autojump_clock, strategy):
    """Circle: the member whose client id sorts first takes queues 0 and 2, the other 1 and 3 (averagely gives 0 1
    and 2 3); consistent hash: what the function computes for the two ids. Either way each queue is pulled by one."""
    recording_fake(monkeypatch, 8)
    async with open_push_consumer(NAMESRV, topic="T", allocate_strategy=strategy, **OPTS) as one, \
            open_push_consumer(NAMESRV, topic="T", allocate_strategy=strategy, **OPTS) as two:
        first, second = sorted((one, two), key=lambda c: c.client_id)
        cids = [first.client_id, second.client_id]
        await wait_until(lambda: len(one.assigned_queues()) + len(two.assigned_queues()) == 8
                          and not set(one.assigned_queues()) & set(two.assigned_queues()))
        await trio.sleep(2)  # a few more rebalances change nothing
        mqs = _queues({"broker-a": 8})
        if strategy == HASH:
            want = [allocate_consistent_hash()("g", cid, mqs, cids) for cid in cids]
        else:
            want = [mqs[0::2], mqs[1::2]]
        assert [first.assigned_queues(), second.assigned_queues()] == want


async def test_a_strategy_that_fails_leaves_the_queues_as_they_are(monkeypatch, autojump_clock, caplog):
    """A function of the user's that raises, or returns something that is no queue, is logged at ERROR and the
    topic's assignment stays (RocketMQ's rebalanceByTopic does the same); the rebalance task, and the consumer, go
    on."""
    recording_fake(monkeypatch, 4)
    mode = {"now": "first two"}

    def flaky(consumer_group, current_client_id, queues, client_ids):
        if mode["now"] == "raise":
            raise RuntimeError("strategy broke")
        if mode["now"] == "junk":
            return ["T@broker-a:3"]
        return list(queues)[:3 if mode["now"] == "first three" else 2]

    caplog.set_level(logging.INFO, logger="client.push_consumer")
    async with open_push_consumer(NAMESRV, topic="T", allocate_strategy=flaky, **OPTS) as consumer:
        assert _ids(consumer.assigned_queues()) == ["a0", "a1"]
        before = consumer.statistics().rebalances
        for mode["now"] in ("raise", "junk"):
            await trio.sleep(2)  # four periodic rebalances
            assert _ids(consumer.assigned_queues()) == ["a0", "a1"]
        assert consumer.statistics().rebalances == before
        assert any(r.levelno == logging.ERROR and "allocate strategy failed" in r.getMessage() for r in caplog.records)
        assert any(r.levelno == logging.ERROR and "returned 'T@broker-a:3', not a MessageQueue" in r.getMessage()
                   for r in caplog.records)
        mode["now"] = "first three"  # the rebalance task lived on
        await wait_until(lambda: _ids(consumer.assigned_queues()) == ["a0", "a1", "a2"])


async def test_by_config_members_take_their_own_lists(monkeypatch, autojump_clock, caplog):
    """Each member takes the queues it was given; a queue the topic lacks is warned about once, not pulled."""
    recording_fake(monkeypatch, 4)
    caplog.set_level(logging.WARNING, logger="client.push_consumer")
    low = allocate_by_config([MessageQueue("T", "broker-a", 0), MessageQueue("T", "broker-a", 9)])
    high = allocate_by_config(_queues({"broker-a": 4})[1:])
    async with open_push_consumer(NAMESRV, topic="T", allocate_strategy=low, **OPTS) as one, \
            open_push_consumer(NAMESRV, topic="T", allocate_strategy=high, **OPTS) as two:
        await trio.sleep(3)
        assert _ids(one.assigned_queues()) == ["a0"] and _ids(two.assigned_queues()) == ["a1", "a2", "a3"]
    strays = [r for r in caplog.records if "route does not have" in r.getMessage()]
    assert len(strays) == 1 and "T@broker-a:9" in strays[0].getMessage()
