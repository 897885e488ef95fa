"""Producer auto-batching (client/accumulator.py) against the in-memory fake cluster: concurrent single sends
share batch requests, each caller gets its own result, order and errors hold per caller."""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing

import client.producer
from client import Message, MessageQueue, SendStatus, open_producer
from client.errors import ClientClosedError, MessageIllegalError, SendFailedError
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import BrokerSystemError, InvalidRequestError
from remoting.message import decode_batch, decode_record
from tests.unit.client.fake_cluster import NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx


@pytest.fixture
def cluster(monkeypatch):
    fake = FakeRemoting([FakeGroup("broker-a", ["a:1"]), FakeGroup("broker-b", ["b:1"])])
    monkeypatch.setattr(client.producer, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    return fake


def _sends(cluster, code):
    return [c for c in cluster.calls if c[1] == code]


def _stored(cluster, result):
    group = next(g for g in cluster.groups if g.name == result.message_queue.broker_name)
    return decode_record(group.logs[(result.message_queue.topic, result.message_queue.queue_id)][result.queue_offset])


async def test_concurrent_sends_share_requests_and_each_gets_its_own_result(cluster):
    results = {}
    async with open_producer(NAMESRV, auto_batch=True, auto_batch_max_in_flight=1) as p:
        async def one(i):
            results[i] = await p.send(Message("T", b"body-%03d" % i, tags="A" if i % 2 else "B", keys=f"k{i}"))

        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(one, i)
        assert p.statistics().sent == 200
        requests = p.statistics().auto_batches
    assert len(results) == 200 and all(r.send_status is SendStatus.SEND_OK for r in results.values())
    assert len({r.msg_id for r in results.values()}) == 200 and all("," not in r.msg_id for r in results.values())
    batches = _sends(cluster, RequestCode.SEND_BATCH_MESSAGE)
    assert len(batches) == requests < 20 and not _sends(cluster, RequestCode.SEND_MESSAGE)
    for i, r in results.items():  # each message is where its result says, with its own properties and id
        stored = _stored(cluster, r)
        assert stored.body == b"body-%03d" % i and stored.tags == ("A" if i % 2 else "B")
        assert stored.keys == [f"k{i}"] and stored.properties["UNIQ_KEY"] == r.msg_id
        assert r.offset_msg_id == str(r.queue_offset)  # the fake's offset id: its queue offset
        assert r.msg_ids == (r.msg_id,)  # as a send that went alone says (was an empty tuple)
    # Batches spread over queues as single sends would.
    assert len({r.message_queue for r in results.values()}) > 4


async def test_one_send_at_a_time_is_not_delayed(cluster):
    async with open_producer(NAMESRV, auto_batch=True, auto_batch_max_delay_ms=5000) as p:
        with trio.fail_after(2):  # a message waiting for company would sit out the 5 s delay
            results = [await p.send(Message("T", b"m%d" % i)) for i in range(10)]
    assert len(_sends(cluster, RequestCode.SEND_BATCH_MESSAGE)) == 10
    assert [r.queue_offset for r in results[:2]] == [0, 0]


async def test_sharding_key_keeps_order_within_its_queue(cluster):
    async with open_producer(NAMESRV, auto_batch=True, auto_batch_max_in_flight=1) as p:
        results = []

        async def ordered(key, n):
            for i in range(n):
                results.append((key, i, await p.send(Message("T", f"{key}-{i}".encode()), sharding_key=key)))

        async with trio.open_nursery() as nursery:
            for key in ("alpha", "beta", "gamma"):
                nursery.start_soon(ordered, key, 30)
    for key in ("alpha", "beta", "gamma"):
        mine = [(i, r) for k, i, r in results if k == key]
        assert len({r.message_queue for _, r in mine}) == 1
        offsets = [r.queue_offset for _, r in sorted(mine, key=lambda x: x[0])]
        assert all(a < b for a, b in zip(offsets, offsets[1:])), offsets  # each after the one sent before it


async def test_a_refused_batch_fails_each_of_its_callers_and_unencodable_messages_go_alone(cluster):
    original = cluster.invoke

    async def refusing(addr, request, timeout_s=3.0):
        if request.code == RequestCode.SEND_BATCH_MESSAGE:
            _, msgs = decode_batch(request.body)
            if any(m.properties.get("reject") for m in msgs):
                return make_response(request, ResponseCode.MESSAGE_ILLEGAL, remark="batch refused")
        if request.code == RequestCode.SEND_MESSAGE and request.ext["topic"] == "T T":
            cluster.calls.append((addr, request.code))
            return make_response(request, ResponseCode.INVALID_REQUEST, remark="topic 'T T' has illegal characters")
        return await original(addr, request, timeout_s)

    cluster.invoke = refusing
    errors = []
    async with open_producer(NAMESRV, auto_batch=True, auto_batch_max_in_flight=1) as p:
        async def one(i):
            try:
                await p.send(Message("T", b"x", properties={"reject": "1"} if i == 3 else {}),
                             queue=MessageQueue("T", "broker-a", 0))
            except MessageIllegalError as e:
                errors.append(e)

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
        # A topic the batch layout cannot carry: sent alone, and the broker's own answer decides.
        with pytest.raises(InvalidRequestError, match="illegal characters"):
            await p.send(Message("T T", b"y"))
    assert errors and all("batch refused" in str(e) for e in errors)
    assert len(errors) < 8  # only the callers whose batch held the refused message
    assert len(_sends(cluster, RequestCode.SEND_MESSAGE)) == 1


async def test_a_caller_cancelled_while_waiting_takes_its_message_out(cluster):
    release = trio.Event()
    in_flight = trio.Event()
    original = cluster.invoke

    async def slow(addr, request, timeout_s=3.0):
        if request.code == RequestCode.SEND_BATCH_MESSAGE:
            in_flight.set()
            await release.wait()
        return await original(addr, request, timeout_s)

    cluster.invoke = slow
    queue = MessageQueue("T", "broker-a", 1)
    async with open_producer(NAMESRV, auto_batch=True, auto_batch_max_in_flight=1,
                             auto_batch_max_delay_ms=10_000) as p:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(p.send, Message("T", b"first"), queue=queue))  # held in flight
            with trio.fail_after(5):
                await in_flight.wait()  # not a sleep: trio may run the sender's steps after a short one
            with trio.move_on_after(0.05):
                await p.send(Message("T", b"cancelled"), queue=queue)  # waits for the slot, then gives up
            nursery.start_soon(functools.partial(p.send, Message("T", b"third"), queue=queue))
            await trio.sleep(0.01)
            release.set()
    bodies = [decode_record(r).body for r in cluster.groups[0].logs[("T", 1)]]
    assert bodies == [b"first", b"third"]


async def test_each_caller_keeps_its_own_deadline_and_a_batch_runs_to_the_latest_of_them(cluster):
    # A batch's request ran to the earliest deadline among its messages: a send with the default 3 s failed with
    # the 0.3 s one it happened to share a batch with, where alone it would have waited, or retried elsewhere.
    releases = [trio.Event(), trio.Event()]
    in_flight = trio.Event()
    timeouts: list[float] = []
    original = cluster.invoke

    async def held(addr, request, timeout_s=3.0):
        if request.code == RequestCode.SEND_BATCH_MESSAGE:
            timeouts.append(timeout_s)
            in_flight.set()
            await releases[len(timeouts) - 1].wait()
        return await original(addr, request, timeout_s)

    cluster.invoke = held
    queue = MessageQueue("T", "broker-a", 1)
    outcomes: dict[str, object] = {}

    async def send(name: str, timeout_s: float | None) -> None:
        try:
            outcomes[name] = await p.send(Message("T", name.encode()), queue=queue, timeout_s=timeout_s)
        except SendFailedError as e:
            outcomes[name] = e

    async with open_producer(NAMESRV, auto_batch=True, auto_batch_max_in_flight=1,
                             auto_batch_max_delay_ms=10_000) as p:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, "first", None)  # holds the one slot
            with trio.fail_after(5):
                await in_flight.wait()
            nursery.start_soon(send, "short", 0.3)
            nursery.start_soon(send, "long", None)
            await trio.sleep(0.05)
            releases[0].set()  # "short" and "long" leave together, and are held
            await trio.sleep(0.6)
            releases[1].set()
    assert len(timeouts) == 2 and timeouts[1] > 2.5, timeouts
    short = outcomes["short"]
    assert isinstance(short, SendFailedError) and "timed out after 0.300s" in str(short), short
    assert outcomes["long"].send_status is SendStatus.SEND_OK and outcomes["first"].send_status is SendStatus.SEND_OK
    # "short" was in the request when its caller gave up: stored all the same, as a single send timing out may be.
    stored = [decode_record(r).body for r in cluster.groups[0].logs[("T", 1)]]
    assert stored[0] == b"first" and sorted(stored[1:]) == [b"long", b"short"]  # the two in either order


async def test_a_malformed_answer_to_a_batch_fails_its_callers_and_not_the_producer(cluster):
    # A msg_id that was not text raised AttributeError in the batch's task, outside what it caught: the producer's
    # task group ended, every send with it.
    original = cluster.invoke

    async def odd(addr, request, timeout_s=3.0):
        response = await original(addr, request, timeout_s)
        if request.code == RequestCode.SEND_BATCH_MESSAGE and request.body.count(b"odd"):
            return make_response(request, ResponseCode.SUCCESS, ext={**response.ext, "msg_id": 7})
        return response

    cluster.invoke = odd
    queue = MessageQueue("T", "broker-a", 1)
    async with open_producer(NAMESRV, auto_batch=True) as p:
        with pytest.raises(BrokerSystemError, match="malformed answer to a send.*msg_id 7"):
            await p.send(Message("T", b"odd"), queue=queue)
        assert (await p.send(Message("T", b"fine"), queue=queue)).send_status is SendStatus.SEND_OK


async def test_a_batch_body_stays_within_max_message_size_headers_included(cluster):
    """Found by probing: with auto_batch_max_bytes near the broker's max message size, the entry headers made full
    batches bigger than it, and each of their callers (1,017 sends of 4 KiB) got the broker's "batch body of
    4248025 bytes exceeds max_message_size". Bodies and properties fit auto_batch_max_bytes, the encoded batch
    fits max_message_size_bytes; a message too big for any batch goes alone."""
    original = cluster.invoke
    batch_sizes = []

    async def measuring(addr, request, timeout_s=3.0):
        if request.code == RequestCode.SEND_BATCH_MESSAGE:
            batch_sizes.append(len(request.body))
        return await original(addr, request, timeout_s)

    cluster.invoke = measuring
    async with open_producer(NAMESRV, auto_batch=True, auto_batch_max_in_flight=1, auto_batch_max_bytes=4096,
                             max_message_size_bytes=2000, auto_batch_max_delay_ms=1000) as p:
        async with trio.open_nursery() as nursery:
            for i in range(100):
                nursery.start_soon(functools.partial(p.send, Message("T", b"x" * 100),
                                                     queue=MessageQueue("T", "broker-a", 0)))
        assert (await p.send(Message("T", b"y" * 1990))).send_status is SendStatus.SEND_OK
    assert batch_sizes and max(batch_sizes) <= 2000
    assert max(batch_sizes) > 1500  # still filled
    assert len(_sends(cluster, RequestCode.SEND_MESSAGE)) == 1  # the 1,990-byte one


async def test_every_caller_of_a_batch_is_answered_when_the_producer_closes(cluster):
    """Found by probing: sends from a nursery outside the producer's block whose batch was in flight when it
    closed waited forever. The cancellation reached the batch task as a group of Cancelled (from a nursery on the
    way, as a real connection's), which its `except trio.Cancelled` did not catch, so nobody answered them. Closing
    now waits send_msg_timeout_ms for them first; a batch still unanswered then has an unknown outcome (it may be
    stored): SendFailedError saying so, not ClientClosedError, which reads as "not sent"."""
    original = cluster.invoke

    async def slow(addr, request, timeout_s=3.0):
        if request.code == RequestCode.SEND_BATCH_MESSAGE:
            async with trio.open_nursery() as nursery:  # cancelled, it raises a group of two Cancelled
                nursery.start_soon(trio.sleep_forever)
                await trio.sleep(5)  # past the close's wait of send_msg_timeout_ms
        return await original(addr, request, timeout_s)

    cluster.invoke = slow
    outcomes = []

    async def one(p):
        try:
            await p.send(Message("T", b"x"), queue=MessageQueue("T", "broker-a", 0), timeout_s=30)
            outcomes.append("sent")
        except ClientClosedError:
            outcomes.append("closed")
        except SendFailedError as e:
            outcomes.append("unknown" if "outcome is unknown" in str(e) else str(e))

    with trio.fail_after(3):
        async with trio.open_nursery() as outer:
            async with open_producer(NAMESRV, auto_batch=True, auto_batch_max_in_flight=1,
                                     auto_batch_max_delay_ms=10_000, send_msg_timeout_ms=500) as p:
                for _ in range(10):
                    outer.start_soon(one, p)
                await trio.testing.wait_all_tasks_blocked()
    assert outcomes == ["unknown"] * 10
