"""Orderly push consumers (``orderly=True``) against a broker node (a single-member group) and a name server
in-process. The cluster test (tests/cluster/test_e2e_orderly.py) adds members in processes of their own, killed."""

from __future__ import annotations

import pytest
import trio

from client import Message, open_admin, open_producer, open_push_consumer
from tests.integration.broker.helpers import start_leading_node


class Ledger:
    """Each handling of a message: (member, key, seq, start, end), times from the trio clock; and each one begun
    (a handler cancelled midway is begun and never handled)."""

    def __init__(self) -> None:
        self.begun: list[tuple[str, str]] = []
        self.handled: list[tuple[str, str, int, float, float]] = []

    def handler(self, member: str, delay_s: float = 0.0):
        async def handle(msg) -> None:
            start = trio.current_time()
            self.begun.append((member, msg.body.decode()))
            await trio.sleep(delay_s)
            key, seq = msg.body.decode().split(":")
            self.handled.append((member, key, int(seq), start, trio.current_time()))
        return handle

    def per_key(self) -> dict[str, list[tuple[str, int, float, float]]]:
        keys: dict[str, list[tuple[str, int, float, float]]] = {}
        for member, key, seq, start, end in sorted(self.handled, key=lambda h: h[3]):
            keys.setdefault(key, []).append((member, seq, start, end))
        return keys


async def _send_keys(producer, topic: str, keys: int, per_key: int, pause_s: float = 0.0) -> None:
    """``per_key`` messages ``key:seq`` for each key, each key's in order (a send after the last one's ack)."""
    async def one_key(k: int) -> None:
        for seq in range(per_key):
            await producer.send(Message(topic, f"k{k:02d}:{seq}".encode()), sharding_key=f"k{k:02d}")
            await trio.sleep(pause_s)

    async with trio.open_nursery() as nursery:
        for k in range(keys):
            nursery.start_soon(one_key, k)


async def test_members_joining_and_leaving_never_handle_a_key_out_of_order_or_at_once(nursery, tmp_path):
    """Two orderly members, a third joining and the first leaving while 16 keys are sent: every message handled,
    each key's exactly once and in send order, and no two handlings of a key overlap (the plain handler form
    breaks both here: a member starts a queue from the last commit while the one it comes from still handles
    what it cached). The member leaving lets its handlers finish the messages they hold: none is cut off."""
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    async with open_admin(namesrv) as admin:
        await admin.create_topic("Ordered", read_queue_nums=8, write_queue_nums=8)
    ledger = Ledger()
    options = {"consumer_group": "ordered", "orderly": True, "consume_from_where": "CONSUME_FROM_FIRST_OFFSET",
               "rebalance_interval_ms": 300, "persist_consumer_offset_interval_ms": 100}
    async with open_producer(namesrv) as producer, \
            open_push_consumer(namesrv, topic="Ordered", handler=ledger.handler("a", 0.02), **options) as a:
        async with open_push_consumer(namesrv, topic="Ordered", handler=ledger.handler("b", 0.02), **options):
            async with trio.open_nursery() as senders:
                senders.start_soon(_send_keys, producer, "Ordered", 16, 60, 0.03)
                await trio.sleep(0.8)
                async with open_push_consumer(namesrv, topic="Ordered", handler=ledger.handler("c", 0.02),
                                              **options) as c:
                    await trio.sleep(0.8)
                    assert c.assigned_queues()
                    await a.close()  # leaves while the senders go on
                    assert a.assigned_queues() == []
                    await trio.sleep(0.8)
            with trio.fail_after(20):
                while len(ledger.handled) < 16 * 60:
                    await trio.sleep(0.05)
    for key, handlings in ledger.per_key().items():
        assert [seq for _, seq, _, _ in handlings] == list(range(60)), \
            f"{key} handled as {[(member, seq) for member, seq, _, _ in handlings]}"
        for (m1, s1, _, end1), (m2, s2, start2, _) in zip(handlings, handlings[1:]):
            assert start2 >= end1, f"{key}: {s2} by {m2} started before {s1} by {m1} ended"
    assert {m for m, *_ in ledger.handled} == {"a", "b", "c"}
    assert len(ledger.begun) == len(ledger.handled)


async def test_a_failing_handler_suspends_its_queue_and_gets_the_same_message_until_its_dead_letter(nursery, tmp_path):
    """A handler that raises for one message: the queue waits suspend_current_queue_time_ms, gets that message
    again (its successors wait), and after max_reconsume_times retries the message is sent to the group's
    dead-letter topic, as RocketMQ's orderly service (it was logged and skipped: lost); the offset passes it then,
    and only then."""
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    async with open_admin(namesrv) as admin:
        await admin.create_topic("Suspended", read_queue_nums=1, write_queue_nums=1)
    attempts: list[tuple[str, float]] = []

    async def handler(msg) -> None:
        attempts.append((msg.body.decode(), trio.current_time()))
        if msg.body in (b"bad", b"flaky") and sum(1 for b, _ in attempts if b == msg.body.decode()) <= {
                b"bad": 10, b"flaky": 1}[msg.body]:
            raise RuntimeError(f"cannot handle {msg.body!r} yet")

    async with open_producer(namesrv) as producer:
        for body in (b"first", b"flaky", b"bad", b"last"):
            await producer.send(Message("Suspended", body, keys=[body.decode()]))
    async with open_push_consumer(namesrv, topic="Suspended", handler=handler, consumer_group="suspended",
                                  orderly=True, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                                  suspend_current_queue_time_ms=200, max_reconsume_times=2) as consumer:
        with trio.fail_after(10):
            while not attempts or attempts[-1][0] != "last":
                await trio.sleep(0.02)
        assert consumer.statistics().delivered == 4
    bodies = [b for b, _ in attempts]
    assert bodies == ["first", "flaky", "flaky", "bad", "bad", "bad", "last"]
    gaps = [t2 - t1 for (b1, t1), (b2, t2) in zip(attempts, attempts[1:]) if b1 == b2]
    assert all(gap >= 0.2 for gap in gaps), gaps
    async with open_admin(namesrv) as admin:
        progress = await admin.consume_stats("suspended", topic="Suspended")
        assert [row.consumer_offset for row in progress.queues] == [4]
        (dead,) = await admin.query_message("%DLQ%suspended", "bad")
        assert dead.body == b"bad" and dead.properties["RETRY_TOPIC"] == "Suspended" and dead.reconsume_times == 1


async def test_the_iterator_form_refuses_orderly(nursery, tmp_path):
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    with pytest.raises(ValueError, match=r"orderly=True needs a handler .*the iterator form cannot consume in order"):
        async with open_push_consumer(namesrv, topic="T", consumer_group="it", orderly=True):
            pass
