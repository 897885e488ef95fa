"""A CHANGE's checkpoint names the POP that handed its message out (``CheckPoint.changed_from``, wire key "f"); a
POP's checkpoint is written, and one written before "f" existed read, as before."""

from __future__ import annotations

from broker.pop import CheckPoint, ReceiptHandle, plan_change


def test_a_pops_checkpoint_is_written_as_before_and_old_ones_read_as_a_pops():
    ck = CheckPoint("g", "T", 0, 5, 1_000, 60_000, (5, 6))
    assert ck.to_wire() == {"g": "g", "t": "T", "q": 0, "s": 5, "p": 1_000, "i": 60_000, "o": [5, 6]}
    assert CheckPoint.from_wire(ck.to_wire()) == ck
    assert ck.changed_from is None


def test_a_chain_of_changes_keeps_naming_the_first_pop():
    pop = CheckPoint("g", "T", 0, 5, 1_000, 60_000, (5, 6))
    table = {pop.key: pop.to_wire()}
    first = pop.handle("b", 6)
    items, changed = plan_change(table, first, 30_000, 2_000)
    assert changed.changed_from == (5, 1_000) and items[changed.key]["f"] == [5, 1_000]
    table.update(items)
    second = changed.handle("b", 6)
    items, again = plan_change(table, second, 30_000, 3_000)
    assert again.changed_from == (5, 1_000)
    assert CheckPoint.from_wire(items[again.key]) == again
    assert again.supersedes(first) and again.supersedes(second)
    # Another POP of the same offset (after a reset), and a CHANGE of it, supersede neither.
    repop = CheckPoint("g", "T", 0, 6, 4_000, 60_000, (6,))
    assert not repop.supersedes(first) and not repop.supersedes(second)
    later = CheckPoint("g", "T", 0, 6, 5_000, 60_000, (6,), (6, 4_000))
    assert not later.supersedes(first) and not later.supersedes(second)
    assert later.supersedes(ReceiptHandle("b", "g", "T", 0, 6, 6, 4_000, 60_000))
