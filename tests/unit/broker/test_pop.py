"""POP bookkeeping (broker/pop.py): receipt handles, checkpoints, and the table changes an ack or a change makes.
Pure: the replicated table is a plain dict here, changed as DLedger applies a metadata write (None deletes)."""

from __future__ import annotations

import dataclasses
from typing import Any

import cbor2
import pytest
import trio
import trio.testing

from broker.long_polling import PullRequestHoldService
from broker.pop import (MAX_BATCH_ACK, BatchAckBodyError, CheckPoint, CheckpointIndex, PopService, ReceiptHandle,
                        ReceiptHandleError, RevivePendingError, batch_ack_texts, checkpoints_of_queue,
                        expired_checkpoints, plan_ack, plan_acks, plan_change, plan_forget, plan_reset,
                        pop_offset_key, pop_retry_topic_problem, superseded_by)
from broker.store.results import GetMessageResult, GetMessageStatus
from broker.topic_config import TopicConfigError, check_sendable_topic, validate_topic_name
from namesrv.requests import _legal_topic
from remoting.message import MessageFormatError, check_topic, pop_retry_topic, split_pop_retry_topic

G, T = "g1", "TopicA"


def apply(table: dict[str, Any], items: dict[str, Any]) -> None:
    for key, value in items.items():
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value


def popped(table: dict[str, Any], offsets: tuple[int, ...], pop_time: int = 10_000, invisible: int = 5_000,
           queue_id: int = 1) -> CheckPoint:
    ck = CheckPoint(G, T, queue_id, offsets[0], pop_time, invisible, offsets)
    apply(table, {ck.key: ck.to_wire(), pop_offset_key(G, T, queue_id): offsets[-1] + 1})
    return ck


# --- receipt handles ---------------------------------------------------------------------------------------------
def test_handle_round_trips_and_has_a_fixed_text_form():
    handle = ReceiptHandle("broker-a", "g1", "%RETRY%g1+TopicA", 3, 17, 15, 1_700_000_000_123, 30_000)
    text = handle.encode()
    assert text == "2 broker-a g1 %RETRY%g1+TopicA 3 17 15 1700000000123 30000"
    assert ReceiptHandle.decode(text) == handle
    assert handle.deadline_ms == 1_700_000_030_123


def test_handle_names_its_group_and_checkpoint():
    table: dict[str, Any] = {}
    ck = popped(table, (4, 5, 6))
    handle = ck.handle("broker-a", 5)
    assert handle.consumer_group == G and handle.checkpoint_key == ck.key
    assert dataclasses.replace(handle, consumer_group="other").checkpoint_key != ck.key


@pytest.mark.parametrize("text, problem", [
    (None, "non-empty string"),
    ("", "non-empty string"),
    (42, "non-empty string"),
    ("garbage", "version 'garbage'"),
    ("2 garbage", "9 space-separated fields, got 2"),
    ("1 broker-a T 0 1 1 5 5", "version '1'"),  # version 1 named no group: an ack could not be checked against it
    ("2  g T 0 1 1 5 5", "names no broker"),
    ("2 broker-a  T 0 1 1 5 5", "no consumer group"),
    ("2 broker-a g T x 1 1 5 5", "queue_id must be a non-negative integer"),
    ("2 broker-a g T 0 -1 0 5 5", "queue_offset must be a non-negative integer"),
    ("2 broker-a g T 0 +1 0 5 5", "queue_offset must be a non-negative integer"),
    ("2 broker-a g T 0 1 0 5 ５", "invisible_time_ms must be a non-negative integer"),
    ("2 broker-a g T 0 1 0 5 99999999999999999999", "invisible_time_ms must be a non-negative integer"),
    ("2 broker-a g T 0 1 2 5 5", "below its checkpoint's start offset 2"),
])
def test_malformed_handles_are_refused_saying_why(text, problem):
    with pytest.raises(ReceiptHandleError, match=problem.replace("(", r"\(").replace("+", r"\+")):
        ReceiptHandle.decode(text)


def test_a_batch_ack_body_is_a_definite_list_of_strings_read_head_by_head():
    handles = [f"2 broker-a g1 T {i} 5 5 1700000000000 30000" for i in range(MAX_BATCH_ACK)]
    assert batch_ack_texts(cbor2.dumps(handles)) == handles
    assert batch_ack_texts(memoryview(cbor2.dumps(["é", ""]))) == ["é", ""]
    # Refused from the list's head alone, whatever follows it: a frame-sized body of made-up handles costs nothing.
    too_many = cbor2.dumps(handles * 5)
    with pytest.raises(BatchAckBodyError, match=f"got a list of {5 * MAX_BATCH_ACK}$"):
        batch_ack_texts(too_many)
    with pytest.raises(BatchAckBodyError, match="got a list of 5120$"):
        batch_ack_texts(too_many[:3])  # only the head is there, and it is all that was read


@pytest.mark.parametrize("body, problem", [
    (b"", "is required: a CBOR list of 1..1024 receipt handles"),
    (b"\xff\x00", "is not valid CBOR: it starts with a break code"),
    (b"\x9c", "is not valid CBOR: byte 0 has the reserved additional information 28"),
    (b"\x99\x01", "is not valid CBOR: it ends at byte 2, within an item's head"),
    (cbor2.dumps({"receipt_handles": ["h"]}), "must be a CBOR list of 1..1024 receipt handles, got dict"),
    (cbor2.dumps("h"), "got str"),
    (cbor2.dumps(None), "got None"),
    (cbor2.dumps([]), "got a list of 0"),
    (b"\x9f\x61h\xff", "got a list of indefinite length"),
    (cbor2.dumps(["h", 7]), "entry 1 is 7"),
    (cbor2.dumps(["h", -8]), "entry 1 is -8"),
    (cbor2.dumps([[0] * 1_000_000]), "entry 0 is list"),  # never decoded
    (cbor2.dumps([b"h"]), "entry 0 is bytes"),
    (b"\x81\x7f\x61h\xff", "entry 0 is in chunks"),
    (b"\x82\x61h", "it ends at byte 3, within its list"),
    (b"\x81\x65h", "it ends at byte 3, within entry 0"),
    (b"\x81\x62\xff\xfe", "entry 0 is not valid UTF-8"),
    (cbor2.dumps(["h"]) + b"\x00\x00", "holds 2 bytes after its list of 1 receipt handles"),
])
def test_a_bad_batch_ack_body_is_refused_saying_what_it_is(body, problem):
    with pytest.raises(BatchAckBodyError) as refused:
        batch_ack_texts(body)
    assert problem in str(refused.value)


def test_retry_topic_name_and_its_length_limit():
    assert pop_retry_topic("g", "T") == "%RETRY%g+T"
    assert pop_retry_topic_problem("g", "T") is None
    assert "at most 127" in pop_retry_topic_problem("g" * 60, "t" * 60)


# --- checkpoints ---------------------------------------------------------------------------------------------------
def test_checkpoint_round_trips_through_its_table_form():
    ck = CheckPoint(G, T, 2, 7, 1_000, 2_000, (7, 9))
    assert CheckPoint.from_wire(ck.to_wire()) == ck
    assert ck.deadline_ms == 3_000


def test_acks_empty_a_checkpoint_and_then_remove_it():
    table: dict[str, Any] = {}
    ck = popped(table, (4, 5))
    items, current = plan_ack(table, ck.handle("b", 4))
    assert current and CheckPoint.from_wire(items[ck.key]).offsets == (5,)
    apply(table, items)
    # Acked again (a retried ack): nothing to change, and not an error.
    assert plan_ack(table, ck.handle("b", 4)) == ({}, False)
    items, current = plan_ack(table, ck.handle("b", 5))
    assert current and items == {ck.key: None}
    apply(table, items)
    assert checkpoints_of_queue(table, G, T, 1) == []
    assert table == {pop_offset_key(G, T, 1): 6}  # the pop offset stays where the POP moved it


def test_change_moves_one_message_to_a_checkpoint_of_its_own_and_supersedes_the_old_handle():
    table: dict[str, Any] = {}
    ck = popped(table, (4, 5, 6), pop_time=10_000, invisible=5_000)
    old = ck.handle("b", 5)
    items, new = plan_change(table, old, 60_000, now=12_000)
    apply(table, items)
    assert new.offsets == (5,) and new.deadline_ms == 72_000 and new.consumer_group == G
    assert CheckPoint.from_wire(table[ck.key]).offsets == (4, 6)
    # The old handle: no longer current, and the checkpoint that now holds its message says why.
    assert plan_ack(table, old) == ({}, False)
    assert superseded_by(table, old) == new
    assert plan_change(table, old, 1_000, now=13_000) is None
    # The new handle acks it; then nothing supersedes the old one any more (it reads as acked).
    items, current = plan_ack(table, new.handle("b", 5))
    assert current
    apply(table, items)
    assert superseded_by(table, old) is None


def test_a_batch_ack_is_one_change_of_every_checkpoint_it_touches():
    table: dict[str, Any] = {}
    a = popped(table, (4, 5, 6), queue_id=1)
    b = popped(table, (0, 1), queue_id=2)
    retry = CheckPoint(G, pop_retry_topic(G, T), 0, 3, 10_000, 5_000, (3,))
    apply(table, {retry.key: retry.to_wire()})
    handles = [a.handle("b", 4), b.handle("b", 1), retry.handle("b", 3), a.handle("b", 6), b.handle("b", 0)]
    items, current = plan_acks(table, handles)
    assert current == [True] * 5
    # a keeps only 5; b and retry are gone: one entry per checkpoint, however many of its handles came.
    assert items == {a.key: dataclasses.replace(a, offsets=(5,)).to_wire(), b.key: None, retry.key: None}
    # The same, handle by handle, ends where the batch does.
    one_by_one = dict(table)
    for handle in handles:
        apply(one_by_one, plan_ack(one_by_one, handle)[0])
    apply(table, items)
    assert table == one_by_one


def test_a_batch_ack_reports_each_handle_that_is_not_current():
    table: dict[str, Any] = {}
    ck = popped(table, (4, 5, 6))
    changed_items, changed = plan_change(table, ck.handle("b", 6), 60_000, now=12_000)
    apply(table, changed_items)
    apply(table, plan_ack(table, ck.handle("b", 4))[0])  # acked before
    gone = CheckPoint(G, T, 1, 9, 10_000, 5_000, (9,))  # revived (or never there)
    handles = [ck.handle("b", 4), ck.handle("b", 5), ck.handle("b", 5), ck.handle("b", 6), gone.handle("b", 9),
               changed.handle("b", 6)]
    items, current = plan_acks(table, handles)
    # Acked before; acked here, the first time only; superseded by the change; revived; the change's own handle.
    assert current == [False, True, False, False, False, True]
    assert items == {ck.key: None, changed.key: None}
    assert plan_acks(table, []) == ({}, [])


class CountingTable(dict):
    """A table that counts the passes over it."""

    passes = 0

    def items(self):  # type: ignore[override]
        self.passes += 1
        return super().items()

    def __iter__(self):
        self.passes += 1
        return super().__iter__()


def test_a_checkpoint_index_answers_as_the_scan_in_one_pass():
    table: dict[str, Any] = {}
    ck = popped(table, (4, 5, 6, 7))
    items, moved = plan_change(table, ck.handle("b", 5), 60_000, now=12_000)
    apply(table, items)
    apply(table, plan_change(table, ck.handle("b", 6), 60_000, now=12_000)[0])
    items, twice = plan_change(table, superseded_by(table, ck.handle("b", 6)).handle("b", 6), 60_000, now=13_000)
    apply(table, items)  # offset 6 changed twice: its first change's handle is superseded too
    apply(table, plan_ack(table, ck.handle("b", 7))[0])  # acked
    elsewhere = popped(table, (5, 8), queue_id=11)  # a queue id sharing a prefix, holding offset 5 too
    retry = CheckPoint(G, pop_retry_topic(G, T), 1, 5, 10_000, 5_000, (5,))
    other_group = CheckPoint("g11", T, 1, 4, 10_000, 5_000, (4, 5, 6))
    apply(table, {retry.key: retry.to_wire(), other_group.key: other_group.to_wire()})
    for offset in range(100, 300):  # other queues' checkpoints: no handle's business
        popped(table, (offset,), queue_id=2)
    # A POP's checkpoint besides the handle's holding offset 5 (a reset hands it out again): it supersedes nothing;
    # the CHANGE's answers, as the scan's.
    dup = CheckPoint(G, T, 1, 3, 9_000, 5_000, (3, 5))
    apply(table, {dup.key: dup.to_wire()})
    stale_of_11 = CheckPoint(G, T, 11, 8, 1, 1, (8,)).handle("b", 8)  # revived; a POP's holding it supersedes not
    handles = [ck.handle("b", o) for o in (4, 5, 6, 7, 9)] + [
        elsewhere.handle("b", 8), elsewhere.handle("b", 5), retry.handle("b", 5), twice.handle("b", 6), stale_of_11]
    counted = CountingTable(table)
    index = CheckpointIndex(counted, G, handles)
    assert counted.passes == 1
    answers = [index.superseded_by(h) for h in handles]
    assert counted.passes == 1  # the look-ups read the index only
    assert answers == [superseded_by(table, h) for h in handles]
    assert answers[1] == moved and answers[2] == twice
    assert [a is not None for a in answers] == [False, True, True, False, False, False, False, False, False, False]
    for outside in (other_group.handle("b", 5), ck.handle("b", 8), CheckPoint(G, T, 2, 1, 1, 1, (1,)).handle("b", 1)):
        with pytest.raises(ValueError, match="is not of this index"):
            index.superseded_by(outside)
    with pytest.raises(ValueError, match="in an index of group 'g1'"):
        CheckpointIndex(table, G, [other_group.handle("b", 5)])


def test_two_changes_of_one_message_in_the_same_millisecond_get_distinct_checkpoints():
    table: dict[str, Any] = {}
    ck = popped(table, (4,), pop_time=10_000)
    items, first = plan_change(table, ck.handle("b", 4), 5_000, now=11_000)
    apply(table, items)
    items, second = plan_change(table, first.handle("b", 4), 5_000, now=11_000)
    apply(table, items)
    assert second.key != first.key and second.pop_time_ms == 11_001
    assert [c.offsets for c in checkpoints_of_queue(table, G, T, 1)] == [(4,)]


def test_expired_checkpoints_are_those_past_their_deadline_oldest_first():
    table: dict[str, Any] = {}
    late = popped(table, (1,), pop_time=1_000, invisible=9_000)  # deadline 10_000
    early = popped(table, (2,), pop_time=2_000, invisible=1_000)  # deadline 3_000
    popped(table, (3,), pop_time=5_000, invisible=10_000)  # deadline 15_000
    assert expired_checkpoints(table, 2_999) == []
    assert expired_checkpoints(table, 3_000) == [early]
    assert expired_checkpoints(table, 12_000) == [early, late]


def test_checkpoints_of_one_queue_leave_out_other_queues_and_groups():
    table: dict[str, Any] = {}
    mine = popped(table, (1,), queue_id=1)
    popped(table, (1,), queue_id=11)  # a queue id sharing a prefix
    other = CheckPoint("g11", T, 1, 1, 10_000, 5_000, (1,))
    apply(table, {other.key: other.to_wire()})
    assert checkpoints_of_queue(table, G, T, 1) == [mine]


# --- the hold service's withdraw hook (a POP waits on several queues) ---------------------------------------------
async def test_a_withdrawn_hold_is_never_resumed():
    resumed: list[str] = []
    service = PullRequestHoldService(lambda topic, queue_id: 0, check_interval_ms=10)

    def resume(name: str):
        async def _resume(timed_out: bool, offset: int) -> None:
            resumed.append(name)
        return _resume

    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        a = service.hold("T", 0, 0, 0.05, resume("a"))
        service.hold("T", 1, 0, 0.05, resume("b"))
        service.withdraw(a)
        assert service.held_now() == 1
        service.notify_message_arriving("T", 0, 5)
        service.notify_message_arriving("T", 1, 5)
        await trio.sleep(0.1)  # past a's deadline too
        nursery.cancel_scope.cancel()
    assert resumed == ["b"]


async def test_withdrawn_holds_do_not_pile_up_in_the_deadline_heap():
    """A POP waiting on many queues withdraws all but one each time: their deadline entries used to stay until their
    deadline (up to long_polling_timeout_ms), with their requests."""
    service = PullRequestHoldService(lambda topic, queue_id: 0, check_interval_ms=60_000)

    async def resume(timed_out: bool, offset: int) -> None:
        pass

    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        kept = [service.hold("T", 0, 0, 600, resume) for _ in range(10)]
        for round_ in range(50):
            for req in [service.hold("T", q, 0, 600, resume) for q in range(1, 9)]:
                service.withdraw(req)
        live = sum(not entry[2].done for entry in service._deadlines)
        assert live == len(kept) == service.held_now()
        assert len(service._deadlines) <= 2 * 64 + len(kept)  # not the 400 withdrawn
        nursery.cancel_scope.cancel()


# --- admin moves of POP state ----------------------------------------------------------------------------------------
def test_a_reset_moves_the_pop_offsets_the_group_has_and_keeps_its_checkpoints():
    table: dict[str, Any] = {}
    ck = popped(table, (4, 5), queue_id=1)
    apply(table, {pop_offset_key(G, T, 2): 9, pop_offset_key("other", T, 1): 7})
    items = plan_reset(table, G, T, {0: 0, 1: 2, 2: 3})
    # Queue 0 never popped: the committed offset the reset sets is read there; other groups are left alone.
    assert items == {pop_offset_key(G, T, 1): 2, pop_offset_key(G, T, 2): 3}
    apply(table, items)
    assert checkpoints_of_queue(table, G, T, 1) == [ck]


def test_forgetting_a_topic_or_a_group_takes_exactly_its_keys():
    table: dict[str, Any] = {}
    popped(table, (4,), queue_id=1)
    other_topic = CheckPoint(G, "TopicAB", 1, 1, 10_000, 5_000, (1,))
    other_group = CheckPoint("g11", T, 1, 1, 10_000, 5_000, (1,))
    retry = CheckPoint(G, pop_retry_topic(G, T), 0, 3, 10_000, 5_000, (3,))
    for ck in (other_topic, other_group, retry):
        apply(table, {ck.key: ck.to_wire(), pop_offset_key(ck.consumer_group, ck.topic, ck.queue_id): 9})
    by_topic = plan_forget(table, topic=T)
    assert sorted(by_topic) == sorted(k for k in table if f"\x01{T}\x01" in k and k.split("\x01")[2] == T)
    assert len(by_topic) == 4  # G's and g11's offset and checkpoint; not TopicAB's nor the retry topic's
    by_group = plan_forget(table, group=G)
    assert len(by_group) == 6 and all(k.split("\x01")[1] == G for k in by_group)
    with pytest.raises(ValueError):
        plan_forget(table)


# --- the per-queue locks ---------------------------------------------------------------------------------------------
async def test_a_queue_lock_is_forgotten_once_nobody_holds_or_waits_for_it():
    service = PopService(node=None)  # type: ignore[arg-type]  # the locks need no node
    order: list[str] = []

    async def take(name: str, queue_id: int) -> None:
        async with service.queue_lock(G, T, queue_id):
            order.append(name)
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(take, f"t{i}", 0)
        nursery.start_soon(take, "other", 1)
        await trio.testing.wait_all_tasks_blocked()
        assert service._locks[(G, T, 0)].users == 3
    assert sorted(order) == ["other", "t0", "t1", "t2"]
    assert service._locks == {}
    async with service.queue_locks(G, T, [3, 1, 3]):
        assert sorted(service._locks) == [(G, T, 1), (G, T, 3)]
    assert service._locks == {}


async def test_several_queue_locks_are_taken_in_topic_and_queue_order():
    """A batch ack's queues are locked in one order, so two batches naming the same queues in opposite orders (or a
    batch and a reset) never wait for each other in a circle."""
    service = PopService(node=None)  # type: ignore[arg-type]  # the locks need no node
    retry = pop_retry_topic(G, T)  # '%' sorts before letters: its queues come first
    held: list[str] = []

    async def batch(name: str, queues: list[tuple[str, int]]) -> None:
        async with service.locks_of(G, queues):
            held.append(name)
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        async with service.queue_lock(G, T, 1):
            nursery.start_soon(batch, "forward", [(retry, 0), (T, 1), (T, 2), (T, 0)])
            nursery.start_soon(batch, "backward", [(T, 2), (T, 1), (T, 0), (retry, 0)])
            await trio.testing.wait_all_tasks_blocked()
            # "forward" holds the retry queue and queue 0 and waits for queue 1; "backward" waits for the retry
            # queue: neither took queue 2 out of order (taken first, it would be waiting on a lock held by the other).
            assert (G, T, 2) not in service._locks
            assert service._locks[(G, retry, 0)].users == 2 and service._locks[(G, T, 0)].users == 1
            assert service._locks[(G, T, 1)].users == 2
            assert held == []
    assert sorted(held) == ["backward", "forward"]
    assert service._locks == {}


class _WritingNode:
    """What PopService.write needs of a node: ``_replicate``, recording each write."""

    def __init__(self) -> None:
        self.writes: list[dict[str, Any]] = []

    async def _replicate(self, table: str, items: dict[str, Any]) -> None:
        self.writes.append(dict(items))


async def test_a_delete_waits_for_the_queues_in_flight_and_leaves_out_the_writes_of_its_keys():
    node = _WritingNode()
    service = PopService(node=node)  # type: ignore[arg-type]
    retry = pop_retry_topic(G, T)
    events: list[str] = []

    async def pop_in_flight() -> None:
        async with service.queue_lock(G, T, 0):
            await trio.sleep(0.01)  # its write on its way
            events.append("pop done")

    async def delete() -> None:
        async with service.forgetting(topic=T):
            events.append("delete")
            assert service.being_forgotten(G, retry) and not service.being_forgotten(G, "TopicAB")
            assert not await service.write({pop_offset_key(G, T, 1): 3, pop_offset_key(G, retry, 0): 1,
                                            pop_offset_key(G, "TopicAB", 0): 2})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pop_in_flight)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(delete)
    assert events == ["pop done", "delete"]
    assert node.writes == [{pop_offset_key(G, "TopicAB", 0): 2}]  # only the key of another topic
    assert service._forgetting == [] and service._locks == {}
    assert await service.write({pop_offset_key(G, T, 1): 3})  # once the delete is over, written as ever
    for bad in ({}, {"group": G, "topic": T}):
        with pytest.raises(ValueError, match="one of group and topic"):
            async with service.forgetting(**bad):
                pass


# --- POP retry topic names -----------------------------------------------------------------------------------------
def test_split_pop_retry_topic_takes_exactly_the_v2_shape():
    assert split_pop_retry_topic("%RETRY%g1+TopicA") == ("g1", "TopicA")
    assert split_pop_retry_topic("%RETRY%g|1-x+%RETRY%push") == ("g|1-x", "%RETRY%push")
    assert split_pop_retry_topic(pop_retry_topic("g" * 59, "t" * 60)) == ("g" * 59, "t" * 60)  # 127 characters
    for name in ("%RETRY%g_TopicA", "%RETRY%g", "%RETRY%+T", "%RETRY%g+", "%RETRY%g+a+b", "%RETRY%g h+T",
                 "%DLQ%g+T", "g+T", "%retry%g+T", pop_retry_topic("g" * 60, "t" * 60)):
        assert split_pop_retry_topic(name) is None, name


@pytest.mark.parametrize("name, legal", [
    ("%RETRY%g+TopicA", True), ("TopicA", True), ("%RETRY%g_TopicA", True),
    ("a+b", False), ("%RETRY%+TopicA", False), ("%RETRY%g+", False), ("%RETRY%g+a+b", False), ("+", False),
    ("%DLQ%g+TopicA", False), ("%RETRY%g+Topic A", False), (pop_retry_topic("g" * 60, "t" * 60), False),
])
def test_every_topic_name_check_takes_a_plus_only_in_a_pop_retry_topic(name, legal):
    """Client and wire (check_topic), broker (validate_topic_name) and name server (its registrations' check)."""
    for check in (check_topic, validate_topic_name):
        if legal:
            check(name)
        else:
            with pytest.raises((MessageFormatError, TopicConfigError), match="'\\+'|characters|long"):
                check(name)
    assert _legal_topic(name) is legal


def test_producers_may_not_send_to_a_pop_retry_topic():
    with pytest.raises(TopicConfigError, match="reserved for the broker .*POP retry topic of consumer group 'g'"):
        check_sendable_topic("%RETRY%g+TopicA")
    check_sendable_topic("%RETRY%g_TopicA")  # a push group's retry topic: sent to by send-backs, not refused here


@pytest.mark.parametrize("status, removed", [
    (GetMessageStatus.OFFSET_TOO_SMALL, True), (GetMessageStatus.MESSAGE_WAS_REMOVING, True),
    (GetMessageStatus.OFFSET_FOUND_NULL, True), (GetMessageStatus.OFFSET_OVERFLOW_ONE, False),
    (GetMessageStatus.OFFSET_OVERFLOW_BADLY, False), (GetMessageStatus.NO_MESSAGE_IN_QUEUE, False),
    (GetMessageStatus.NO_MATCHED_LOGIC_QUEUE, False),
])
def test_a_popped_message_is_skipped_only_once_retention_took_it(status, removed):
    # Every miss read as "gone (retention)": a message this node had not dispatched yet lost its checkpoint and,
    # behind the pop offset, was never delivered again. Now such a miss keeps the checkpoint for a later round.
    result = GetMessageResult(status, next_begin_offset=7, min_offset=5 if removed else 0, max_offset=7)
    store = type("Store", (), {"get_messages": lambda self, *args: result})()
    service = PopService(node=type("Node", (), {"store": store})())  # type: ignore[arg-type]
    if removed:
        assert service._message("T", 0, 4) is None
    else:
        with pytest.raises(RevivePendingError, match=f"offset=9 status={status.value} max_offset=7"):
            service._message("T", 0, 9)
