from __future__ import annotations

from broker.offset_manager import ConsumerOffsetTable


def test_leader_sees_its_pending_commits_before_replication():
    table = ConsumerOffsetTable()
    assert table.query("g", "T", 0) is None
    table.commit("g", "T", 0, 5)
    table.commit("g", "T", 0, 7)
    assert table.query("g", "T", 0) == 7
    batch = table.take_pending()
    assert batch == [("g", "T", 0, 7)] and not table.has_pending()
    table.apply_batch(batch)
    assert table.query("g", "T", 0) == 7 and len(table) == 1


def test_failed_proposal_requeues_without_overwriting_newer():
    table = ConsumerOffsetTable()
    table.commit("g", "T", 0, 5)
    table.commit("g", "T", 1, 3)
    batch = table.take_pending()
    table.commit("g", "T", 0, 9)
    table.requeue(batch)
    assert sorted(table.take_pending()) == [("g", "T", 0, 9), ("g", "T", 1, 3)]


def test_delete_topic_and_snapshot():
    table = ConsumerOffsetTable()
    table.apply_batch([("g", "T", 0, 1), ("g", "U", 0, 2), ("h", "T", 3, 4)])
    assert table.offsets_of_group("g") == {("T", 0): 1, ("U", 0): 2}
    table.apply_delete_topic("T")
    other = ConsumerOffsetTable()
    other.restore(table.snapshot())
    assert other.snapshot() == [("g", "U", 0, 2)]


def test_a_group_read_from_replicated_metadata_merges_the_leaders_pending_commits():
    # The broker node's case: committed offsets live in the group's metadata, read through the callables.
    committed = {("g", "T", 0): 4, ("g", "T", 1): 6, ("h", "T", 0): 9}
    table = ConsumerOffsetTable(read_committed=lambda g, t, q: committed.get((g, t, q)),
                                read_group=lambda g: {(t, q): o for (gg, t, q), o in committed.items() if gg == g})
    table.commit("g", "T", 1, 8)
    table.commit("g", "U", 2, 1)
    assert table.offsets_of_group("g") == {("T", 0): 4, ("T", 1): 8, ("U", 2): 1}
    assert table.offsets_of_group("h") == {("T", 0): 9}
    assert table.query("g", "T", 1) == 8 and table.query("g", "T", 0) == 4


def test_a_commit_being_replicated_is_still_what_queries_answer():
    # Between a flush taking the pending commits and their replication applying them, a query fell through to the
    # committed table and answered the offset before: 2 after a commit of 4 (a broker test, once in a make test).
    committed = {("g", "T", 0): 2}
    table = ConsumerOffsetTable(read_committed=lambda g, t, q: committed.get((g, t, q)),
                                read_group=lambda g: {(t, q): o for (gg, t, q), o in committed.items() if gg == g})
    table.commit("g", "T", 0, 4)
    batch = table.take_pending()
    assert table.query("g", "T", 0) == 4 and table.offsets_of_group("g") == {("T", 0): 4}
    table.commit("g", "T", 0, 5)  # newer than the batch in flight: the pending one wins
    assert table.query("g", "T", 0) == 5
    committed.update({(g, t, q): o for g, t, q, o in batch})
    table.flushed()
    assert table.query("g", "T", 0) == 5 and table.take_pending() == [("g", "T", 0, 5)]
    table.flushed()
    # A failed flush puts the batch back (not over a newer commit); dropping forgets both.
    table.commit("g", "T", 1, 7)
    failed = table.take_pending()
    table.requeue(failed)
    assert table.query("g", "T", 1) == 7 and table.has_pending()
    table.take_pending()
    table.drop_pending()
    assert table.query("g", "T", 1) is None and not table.has_pending()
