"""Auto-batching against a broker whose limits are not the client's (client/accumulator.py), and closing with sends
in flight (client/producer.py), against the in-memory fake cluster.

Found by review: with the broker's max_batch_messages at 16, 192 of 200 concurrent single sends failed with "request
field 'body' holds 64 messages"; one message refused in a batch failed every caller of the batch; a batch carried
any number of index keys; closing told ClientClosedError ("not sent") to callers whose batch was in flight."""

from __future__ import annotations

import collections
import contextlib
import functools

import pytest
import trio
import trio.testing

import client.producer
from client import Message, MessageQueue, SendStatus, open_producer
from client.errors import ClientClosedError, MessageIllegalError, SendFailedError
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import ConnectionClosedError
from remoting.message import decode_batch, decode_record
from tests.unit.client.fake_cluster import NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx

QUEUE = MessageQueue("T", "broker-a", 0)


@pytest.fixture
def cluster(monkeypatch):
    fake = FakeRemoting([FakeGroup("broker-a", ["a:1"]), FakeGroup("broker-b", ["b:1"])])
    monkeypatch.setattr(client.producer, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    return fake


def _stored_bodies(cluster, queue=QUEUE):
    group = next(g for g in cluster.groups if g.name == queue.broker_name)
    return [decode_record(r).body for r in group.logs[(queue.topic, queue.queue_id)]]


def _batch_limit(cluster, max_messages):
    """The fake broker answers a batch of more than ``max_messages`` as the real one does; returns the sizes of
    the batches it refused and of those it took."""
    original = cluster.invoke
    refused, taken = [], []

    async def limited(addr, request, timeout_s=3.0):
        if request.code == RequestCode.SEND_BATCH_MESSAGE:
            count = len(decode_batch(request.body)[1])
            if count > max_messages:
                refused.append(count)
                return make_response(request, ResponseCode.INVALID_REQUEST, ext={"field": "body"}, remark=(
                    f"request field 'body' holds {count} messages; at most {max_messages} are accepted in one batch"))
            taken.append(count)
        return await original(addr, request, timeout_s)

    cluster.invoke = limited
    return refused, taken


async def _burst(p, n, prefix, **kwargs):
    results = {}

    async def one(i):
        results[i] = await p.send(Message("T", b"%s-%03d" % (prefix, i), **kwargs), queue=QUEUE)

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return results


async def test_a_batch_past_the_brokers_count_is_sent_again_in_halves_and_the_limit_is_remembered(cluster):
    refused, taken = _batch_limit(cluster, 16)
    async with open_producer(NAMESRV, auto_batch=True, auto_batch_max_in_flight=1,
                             auto_batch_max_delay_ms=1000) as p:
        first = await _burst(p, 200, b"a")
        refused_in_first = len(refused)
        second = await _burst(p, 200, b"b")
        assert p.statistics().sent == 400 and p.statistics().failed == 0
    assert all(r.send_status is SendStatus.SEND_OK for r in [*first.values(), *second.values()])
    assert refused and refused_in_first == len(refused)  # learned: the second burst was not refused once
    assert max(taken) <= 16 and sum(taken) == 400
    stored = _stored_bodies(cluster)
    assert sorted(stored) == sorted([b"a-%03d" % i for i in range(200)] + [b"b-%03d" % i for i in range(200)])
    for results in (first, second):  # each result names where its message is
        for r in results.values():
            assert stored[r.queue_offset] == (b"a-" if results is first else b"b-") + b"%03d" % next(
                i for i, x in results.items() if x is r)


async def test_a_refusal_of_one_message_reaches_only_its_caller(cluster):
    original = cluster.invoke
    held = trio.Event()
    release = trio.Event()

    async def refusing(addr, request, timeout_s=3.0):
        if request.code == RequestCode.SEND_BATCH_MESSAGE:
            _, msgs = decode_batch(request.body)
            if msgs[0].body == b"first":
                held.set()
                await release.wait()
            if any(m.properties.get("reject") for m in msgs):
                return make_response(request, ResponseCode.MESSAGE_ILLEGAL, remark="message refused")
        return await original(addr, request, timeout_s)

    cluster.invoke = refusing
    outcomes = {}

    async def one(p, i):
        try:
            outcomes[i] = await p.send(Message("T", b"m%d" % i, properties={"reject": "1"} if i == 3 else {}),
                                       queue=QUEUE)
        except MessageIllegalError as e:
            outcomes[i] = e

    async with open_producer(NAMESRV, auto_batch=True, auto_batch_max_in_flight=1,
                             auto_batch_max_delay_ms=10_000) as p:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(p.send, Message("T", b"first"), queue=QUEUE))
            await held.wait()
            for i in range(8):  # they wait for the one slot: one batch of 8 once it is free
                nursery.start_soon(one, p, i)
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    assert isinstance(outcomes.pop(3), MessageIllegalError)
    assert all(r.send_status is SendStatus.SEND_OK for r in outcomes.values())
    assert sorted(_stored_bodies(cluster)) == sorted([b"first"] + [b"m%d" % i for i in range(8) if i != 3])


async def test_a_batch_carries_at_most_auto_batch_max_keys_index_keys(cluster):
    original = cluster.invoke
    keys_per_batch = []

    async def counting(addr, request, timeout_s=3.0):
        if request.code == RequestCode.SEND_BATCH_MESSAGE:
            keys_per_batch.append(sum(1 + len(m.properties.get("KEYS", "").split()) for m in
                                      decode_batch(request.body)[1]))
        return await original(addr, request, timeout_s)

    cluster.invoke = counting
    keys = " ".join(f"k{i}" for i in range(99))  # 100 index keys a message, its UNIQ_KEY included
    async with open_producer(NAMESRV, auto_batch=True, auto_batch_max_in_flight=1, auto_batch_max_keys=300,
                             auto_batch_max_delay_ms=1000) as p:
        results = await _burst(p, 64, b"k", keys=keys)
        alone = await p.send(Message("T", b"many", keys=" ".join(f"x{i}" for i in range(999))), queue=QUEUE)
    assert len(results) == 64 and alone.send_status is SendStatus.SEND_OK
    assert max(keys_per_batch[:-1]) == 300 and keys_per_batch[-1] == 1000  # the last one alone, past the limit


async def test_closing_waits_for_the_sends_in_flight_and_refuses_new_ones(cluster):
    original = cluster.invoke
    in_flight = [trio.Event()]

    async def slow(addr, request, timeout_s=3.0):
        if request.code in (RequestCode.SEND_MESSAGE, RequestCode.SEND_BATCH_MESSAGE):
            in_flight[0].set()
            await trio.sleep(0.3)
        return await original(addr, request, timeout_s)

    cluster.invoke = slow
    outcomes = {}

    async def one(p, name, **options):
        try:
            outcomes[name] = (await p.send(Message("T", name.encode()), **options)).send_status
        except ClientClosedError as e:
            outcomes[name] = e

    for auto_batch in (False, True):
        outcomes.clear()
        in_flight[0] = trio.Event()
        async with trio.open_nursery() as outer:
            async with open_producer(NAMESRV, auto_batch=auto_batch, auto_batch_max_in_flight=1,
                                     auto_batch_max_delay_ms=10_000) as p:
                for i in range(10):
                    outer.start_soon(functools.partial(one, p, f"{auto_batch}-{i}", queue=QUEUE))
                await in_flight[0].wait()
            # Closed: new sends are refused.
            await one(p, "late")
        assert isinstance(outcomes.pop("late"), ClientClosedError)
        assert outcomes == {f"{auto_batch}-{i}": SendStatus.SEND_OK for i in range(10)}, outcomes
    assert sorted(_stored_bodies(cluster)) == sorted(f"{a}-{i}".encode() for a in (False, True) for i in range(10))


async def test_a_send_unanswered_when_closing_ends_has_an_unknown_outcome_not_closed(cluster, monkeypatch):
    @contextlib.asynccontextmanager
    async def closing_ctx():
        try:
            yield cluster
        finally:  # as the real pool closes its connections: what waits on them fails, ConnectionClosedError
            for addr in list(cluster.conns):
                cluster.close_connection(addr, "client closed")

    monkeypatch.setattr(client.producer, "open_remoting", lambda config, handler=None: closing_ctx())
    cluster.hung.add("a:1")  # broker-a's leader takes the sends and answers none
    outcomes = []

    async def one(p):
        try:
            await p.send(Message("T", b"x"), queue=QUEUE, timeout_s=30)
            outcomes.append("sent")
        except ClientClosedError:
            outcomes.append("closed")
        except SendFailedError as e:
            assert "outcome is unknown" in str(e) and not e.retriable
            outcomes.append("unknown")

    for auto_batch in (False, True):
        outcomes.clear()
        with trio.fail_after(20):  # against a hang only: the close waits send_msg_timeout_ms, 0.5 s
            async with trio.open_nursery() as outer:
                async with open_producer(NAMESRV, auto_batch=auto_batch, auto_batch_max_in_flight=1,
                                         auto_batch_max_delay_ms=10_000, send_msg_timeout_ms=500) as p:
                    for _ in range(5):
                        outer.start_soon(one, p)
                    await trio.testing.wait_all_tasks_blocked()
        assert outcomes == ["unknown"] * 5, (auto_batch, outcomes)
    assert not _stored_bodies(cluster)


async def test_a_refusal_after_an_unanswered_attempt_is_not_sent_again_in_halves(cluster):
    """Found by review: an auto batch stored on broker-a whose answer was lost, then refused as a batch by broker-b
    (a lower max_batch_messages), was taken for never stored and sent again in halves: every message stored twice,
    every caller told SEND_OK. The refusal after an unanswered attempt is not the outcome: unknown."""
    original = cluster.invoke
    lost = []

    async def invoke(addr, request, timeout_s=3.0):
        if request.code == RequestCode.SEND_BATCH_MESSAGE:
            count = len(decode_batch(request.body)[1])
            group = cluster.by_addr[addr]
            if group.name == "broker-b" and count > 4:  # broker-b's max_batch_messages is 4
                return make_response(request, ResponseCode.INVALID_REQUEST, ext={"field": "body"},
                                     remark=f"request field 'body' holds {count} messages; at most 4 are accepted")
            # More than broker-b takes: retried there, it is refused (a batch of 4 or fewer is stored there too,
            # an at-least-once duplicate after a lost answer, which this test is not about).
            if group.name == "broker-a" and not lost and count > 4:
                lost.append(count)
                await original(addr, request, timeout_s)  # stored on broker-a...
                raise ConnectionClosedError(addr, "connection reset")  # ...and its answer lost
        return await original(addr, request, timeout_s)

    cluster.invoke = invoke
    outcomes: dict[int, object] = {}
    async with open_producer(NAMESRV, auto_batch=True, auto_batch_max_in_flight=1, auto_batch_max_delay_ms=1000) as p:
        async def one(i: int) -> None:
            try:
                outcomes[i] = await p.send(Message("T", b"m-%02d" % i))
            except SendFailedError as e:
                outcomes[i] = e

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(one, i)
    stored = collections.Counter(decode_record(r).body for g in cluster.groups for records in g.logs.values()
                                 for r in records)
    assert lost and not {body: n for body, n in stored.items() if n > 1}, stored
    unknown = [e for e in outcomes.values() if isinstance(e, SendFailedError)]
    assert len(unknown) == lost[0] and all("may be stored" in str(e) for e in unknown), outcomes
