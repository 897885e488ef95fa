"""POP bookkeeping (broker/pop.py): receipt handles, checkpoints, and the table changes an ack or a change makes.
Pure: the replicated table is a plain dict here, changed as DLedger applies a metadata write (None deletes)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from broker.long_polling import PullRequestHoldService
from broker.pop import (CheckPoint, ReceiptHandle, ReceiptHandleError, checkpoints_of_queue, expired_checkpoints,
                        plan_ack, plan_change, pop_offset_key, pop_retry_topic, pop_retry_topic_problem,
                        superseded_by)

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
    handle = ReceiptHandle("broker-a", "%RETRY%g1_TopicA", 3, 17, 15, 1_700_000_000_123, 30_000)
    text = handle.encode()
    assert text == "1 broker-a %RETRY%g1_TopicA 3 17 15 1700000000123 30000"
    assert ReceiptHandle.decode(text) == handle
    assert handle.deadline_ms == 1_700_000_030_123


def test_handle_names_its_checkpoint():
    table: dict[str, Any] = {}
    ck = popped(table, (4, 5, 6))
    assert ck.handle("broker-a", 5).checkpoint_key(G) == ck.key
    assert ck.handle("broker-a", 5).checkpoint_key("other") != ck.key


@pytest.mark.parametrize("text, problem", [
    (None, "non-empty string"),
    ("", "non-empty string"),
    (42, "non-empty string"),
    ("garbage", "8 space-separated fields, got 1"),
    ("2 broker-a T 0 1 1 5 5", "version '2'"),
    ("1  T 0 1 1 5 5", "names no broker"),
    ("1 broker-a T x 1 1 5 5", "queue_id must be a non-negative integer"),
    ("1 broker-a T 0 -1 0 5 5", "queue_offset must be a non-negative integer"),
    ("1 broker-a T 0 +1 0 5 5", "queue_offset must be a non-negative integer"),
    ("1 broker-a T 0 1 0 5 ５", "invisible_time_ms must be a non-negative integer"),
    ("1 broker-a T 0 1 0 5 99999999999999999999", "invisible_time_ms must be a non-negative integer"),
    ("1 broker-a T 0 1 2 5 5", "below its checkpoint's start offset 2"),
])
def test_malformed_handles_are_refused_saying_why(text, problem):
    with pytest.raises(ReceiptHandleError, match=problem.replace("(", r"\(").replace("+", r"\+")):
        ReceiptHandle.decode(text)


def test_retry_topic_name_and_its_length_limit():
    assert pop_retry_topic("g", "T") == "%RETRY%g_T"
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
    items, current = plan_ack(table, G, ck.handle("b", 4))
    assert current and CheckPoint.from_wire(items[ck.key]).offsets == (5,)
    apply(table, items)
    # Acked again (a retried ack): nothing to change, and not an error.
    assert plan_ack(table, G, ck.handle("b", 4)) == ({}, False)
    items, current = plan_ack(table, G, ck.handle("b", 5))
    assert current and items == {ck.key: None}
    apply(table, items)
    assert checkpoints_of_queue(table, G, T, 1) == []
    assert table == {pop_offset_key(G, T, 1): 6}  # the pop offset stays where the POP moved it


def test_change_moves_one_message_to_a_checkpoint_of_its_own_and_supersedes_the_old_handle():
    table: dict[str, Any] = {}
    ck = popped(table, (4, 5, 6), pop_time=10_000, invisible=5_000)
    old = ck.handle("b", 5)
    items, new = plan_change(table, G, old, 60_000, now=12_000)
    apply(table, items)
    assert new.offsets == (5,) and new.deadline_ms == 72_000
    assert CheckPoint.from_wire(table[ck.key]).offsets == (4, 6)
    # The old handle: no longer current, and the checkpoint that now holds its message says why.
    assert plan_ack(table, G, old) == ({}, False)
    assert superseded_by(table, G, old) == new
    assert plan_change(table, G, old, 1_000, now=13_000) is None
    # The new handle acks it; then nothing supersedes the old one any more (it reads as acked).
    items, current = plan_ack(table, G, new.handle("b", 5))
    assert current
    apply(table, items)
    assert superseded_by(table, G, old) is None


def test_two_changes_of_one_message_in_the_same_millisecond_get_distinct_checkpoints():
    table: dict[str, Any] = {}
    ck = popped(table, (4,), pop_time=10_000)
    items, first = plan_change(table, G, ck.handle("b", 4), 5_000, now=11_000)
    apply(table, items)
    items, second = plan_change(table, G, first.handle("b", 4), 5_000, now=11_000)
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
