"""``raftmq verify``'s comparison: identical members pass; a differing or missing segment is reported."""

from __future__ import annotations

from raftmq.commands.verify import compare_checksums


def test_identical_members():
    sums = {m: [(0, 100, 0xAA), (100, 50, 0xBB)] for m in ("a", "b", "c")}
    assert compare_checksums(sums) == (2, [])


def test_divergent_and_missing_segments_are_reported():
    sums = {"a": [(0, 100, 0xAA), (100, 50, 0xBB)],
            "b": [(0, 100, 0xAA), (100, 50, 0xBC)],
            "c": [(0, 100, 0xAA)]}
    segments, divergent = compare_checksums(sums)
    assert segments == 2
    assert divergent == [(100, {"a": 0xBB, "b": 0xBC})]
