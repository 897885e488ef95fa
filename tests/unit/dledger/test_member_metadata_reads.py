"""``RaftMember``'s reads of its metadata tables for the trio side: ``metadata`` copies (for a caller that keeps or
changes the result), ``metadata_get`` and ``metadata_view`` read the applied table in place, read-only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dledger.member import RaftMember


def _member() -> SimpleNamespace:
    member = SimpleNamespace(_metadata={"t": {"a": 1}}, _metadata_applied=1, _metadata_changed_at={})
    for name in ("metadata", "metadata_get", "metadata_view"):
        setattr(member, name, getattr(RaftMember, name).__get__(member))
    return member


def test_the_view_is_the_applied_table_itself_and_read_only():
    member = _member()
    view = member.metadata_view("t")
    rows = member._metadata["t"]  # as put_metadata applies an entry: in place
    rows["b"] = 2
    del rows["a"]
    assert dict(view) == {"b": 2} and member.metadata_get("t", "b") == 2 and member.metadata_get("t", "a") is None
    with pytest.raises(TypeError):
        view["c"] = 3  # type: ignore[index]
    assert member.metadata_view("none") == {} and member.metadata_get("none", "k", 7) == 7


def test_the_copy_is_the_callers_own():
    member = _member()
    copy = member.metadata("t")
    copy["x"] = 9
    assert member.metadata_get("t", "x") is None and member.metadata("t") == {"a": 1}
