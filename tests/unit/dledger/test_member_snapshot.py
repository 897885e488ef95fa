"""``RaftMember._read_snapshot``: what pysyncobj hands it to load, checked before anything is taken from it."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import crc32c
import pytest

from dledger.member import _CRC, SNAPSHOT_MAGIC, RaftMember

RAFT = ((None, 1, 1), (None, 2, 1), [])


def _write(tmp_path, **snap) -> str:
    body = pickle.dumps({"version": 1, "group": "g", **snap}, protocol=5)
    path = tmp_path / "snapshot"
    path.write_bytes(SNAPSHOT_MAGIC + _CRC.pack(crc32c.crc32c(body)) + body)
    return str(path)


def _member():
    return SimpleNamespace(_config=SimpleNamespace(group="g"), _metadata={"broker.topic": {"T": {"perm": 6}}},
                           _metadata_applied=0, _snapshot_loaded_at=0, _snapshots_loaded=0,
                           _sm=SimpleNamespace(end_offset=500), _notify=lambda *a: None,
                           _dledger_apply_gate_open=True, _applied_end_offset=500, _catch_up_target=None)


@pytest.mark.parametrize("snap, problem", [
    ({"end_offset": None, "metadata": {}, "raft": RAFT}, "end_offset None is not an offset"),
    ({"end_offset": 100, "metadata": ["not", "a", "map"], "raft": RAFT}, "metadata is a list"),
    ({"end_offset": 100, "metadata": {"broker.topic": 7}, "raft": RAFT}, "metadata is a dict, not a map of tables"),
    ({"end_offset": 100, "metadata": {}}, "holds no Raft state"),
])
def test_a_snapshot_that_cannot_be_loaded_changes_nothing(tmp_path, snap, problem):
    # pysyncobj logs a failed load and goes on: the metadata had been replaced before end_offset failed, and
    # metadata that is no map of maps then raised in the broker's registration task and stopped the node.
    member = _member()
    with pytest.raises(ValueError, match=problem):
        RaftMember._read_snapshot(member, _write(tmp_path, **snap))
    assert member._metadata == {"broker.topic": {"T": {"perm": 6}}}
    assert member._snapshots_loaded == 0 and member._applied_end_offset == 500


def test_a_good_snapshot_ahead_of_the_log_is_loaded_and_caught_up_to(tmp_path):
    member = _member()
    raft = RaftMember._read_snapshot(member, _write(tmp_path, end_offset=900, metadata={"b": {"k": 1}}, raft=RAFT))
    assert raft == RAFT and member._metadata == {"b": {"k": 1}}
    assert member._catch_up_target == 900 and member._applied_end_offset == 900 and member._snapshots_loaded == 1
