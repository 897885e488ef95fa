"""A CHANGE's checkpoint names the POP that handed its message out and the pop times of the chain's earlier CHANGE
checkpoints (``CheckPoint.changed_from``, ``changes``, wire key "f"); every checkpoint this version writes is marked
("v"), and one without the marker is judged by the rule of the node that wrote it (``CheckPoint.legacy``)."""

from __future__ import annotations

from broker.pop import CHANGE_CHAIN_KEPT, CheckPoint, ReceiptHandle, plan_change


def test_a_pops_checkpoint_is_marked_and_carries_no_chain():
    ck = CheckPoint("g", "T", 0, 5, 1_000, 60_000, (5, 6))
    assert ck.to_wire() == {"g": "g", "t": "T", "q": 0, "s": 5, "p": 1_000, "i": 60_000, "o": [5, 6], "v": 1}
    assert CheckPoint.from_wire(ck.to_wire()) == ck
    assert ck.changed_from is None and not ck.legacy


def test_a_chain_of_changes_keeps_naming_the_first_pop_and_its_changes():
    pop = CheckPoint("g", "T", 0, 5, 1_000, 60_000, (5, 6))
    table = {pop.key: pop.to_wire()}
    first = pop.handle("b", 6)
    items, changed = plan_change(table, first, 30_000, 2_000)
    assert changed.changed_from == (5, 1_000) and items[changed.key]["f"] == [5, 1_000]
    table.update(items)
    second = changed.handle("b", 6)
    items, again = plan_change(table, second, 30_000, 3_000)
    assert again.changed_from == (5, 1_000) and again.changes == (2_000,)
    assert items[again.key]["f"] == [5, 1_000, 2_000]
    assert CheckPoint.from_wire(items[again.key]) == again
    assert again.supersedes(first) and again.supersedes(second)
    # Another POP of the same offset (after a reset), and a CHANGE of it, supersede neither.
    repop = CheckPoint("g", "T", 0, 6, 4_000, 60_000, (6,))
    assert not repop.supersedes(first) and not repop.supersedes(second)
    later = CheckPoint("g", "T", 0, 6, 5_000, 60_000, (6,), (6, 4_000))
    assert not later.supersedes(first) and not later.supersedes(second)
    assert later.supersedes(ReceiptHandle("b", "g", "T", 0, 6, 6, 4_000, 60_000))


def test_a_pop_handle_first_in_its_checkpoint_is_not_taken_for_a_changes():
    # POP at 1000 hands out 5, 6; 6 changed at 2000; a reset hands 6 out again at 2500 (first in its checkpoint);
    # the change's handle changed again at 3000: the re-delivery's handle (6, 6, 2500) is not of that chain.
    again = CheckPoint("g", "T", 0, 6, 3_000, 60_000, (6,), (5, 1_000), (2_000,))
    redelivered = ReceiptHandle("b", "g", "T", 0, 6, 6, 2_500, 60_000)
    assert not again.supersedes(redelivered)
    assert again.supersedes(ReceiptHandle("b", "g", "T", 0, 6, 6, 2_000, 60_000))


def test_a_chain_keeps_its_last_changes_only():
    pop = CheckPoint("g", "T", 0, 6, 1_000, 60_000, (6,))
    table = {pop.key: pop.to_wire()}
    handles = [pop.handle("b", 6)]
    for i in range(CHANGE_CHAIN_KEPT + 2):
        items, ck = plan_change(table, handles[-1], 30_000, 2_000 + i)
        table = {k: v for k, v in {**table, **items}.items() if v is not None}
        handles.append(ck.handle("b", 6))
    assert len(ck.changes) == CHANGE_CHAIN_KEPT
    assert ck.supersedes(handles[0])  # the POP's handle, always
    assert not ck.supersedes(handles[1])  # older than the kept changes: documented as no longer known
    assert all(ck.supersedes(h) for h in handles[-CHANGE_CHAIN_KEPT - 1:-1])


def test_checkpoints_without_the_marker_are_judged_by_the_rule_of_their_writer():
    handle = ReceiptHandle("b", "g", "T", 0, 6, 5, 1_000, 60_000)
    # Before "f": a POP's and a CHANGE's looked the same; any other checkpoint holding the offset supersedes.
    wire = {"g": "g", "t": "T", "q": 0, "s": 6, "p": 2_000, "i": 60_000, "o": [6]}
    old = CheckPoint.from_wire(wire)
    assert old.legacy and old.supersedes(handle)
    assert not old.supersedes(old.handle("b", 6))
    # An ack of another of its offsets writes it back unmarked, so it keeps being judged so.
    two = CheckPoint.from_wire({**wire, "o": [6, 7]})
    assert "v" not in two.without(7).to_wire() and two.without(7).supersedes(handle)
    # With "f" but no marker (a CHANGE's before its chain's pop times were kept): the POP's handle, or one a CHANGE
    # returned between that POP and it.
    changed = CheckPoint.from_wire({**wire, "f": [5, 1_000]})
    assert changed.legacy and changed.supersedes(handle)
    assert changed.supersedes(ReceiptHandle("b", "g", "T", 0, 6, 6, 1_500, 60_000))
    assert not changed.supersedes(ReceiptHandle("b", "g", "T", 0, 6, 5, 900, 60_000))
    # A CHANGE of an unmarked checkpoint writes a marked one: its chain starts there (its history is unknown).
    table = {old.key: wire}
    items, new = plan_change(table, old.handle("b", 6), 30_000, 3_000)
    assert items[new.key]["v"] == 1 and new.changed_from == (6, 2_000) and not new.legacy
    assert new.supersedes(old.handle("b", 6)) and not new.supersedes(handle)
