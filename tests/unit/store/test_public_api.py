"""The public names of broker.store, pinned; and the store benchmark run small."""

from __future__ import annotations

import os

import pytest

import broker.store
from raftmq.bench.store import bench_mode


def test_public_api_is_pinned():
    assert sorted(broker.store.__all__) == sorted([
        "AppendResult", "AppendStatus", "AppendedMessage", "GetMessageResult", "GetMessageStatus",
        "MessageFormatError", "MessageInput", "MessageStore", "MessageView", "QueryMessageResult",
        "StoreClosedError", "StoreConfig", "StoreCorruptedError", "StoreError", "StoreStatistics",
        "create_msg_id", "decode_batch", "decode_record", "encode_batch", "iter_records", "parse_msg_id",
        "tags_code", "validate_batch",
    ])
    for name in broker.store.__all__:
        assert getattr(broker.store, name) is not None
    for method in ("open", "close", "append_batch", "check_batch", "prepare_append", "apply_built",
                   "read_commit_log", "append_commit_log_raw",
                   "segment_checksums", "serve", "wait_flushed", "wait_dispatched", "add_dispatch_listener",
                   "get_messages", "get_min_offset_in_queue", "get_max_offset_in_queue", "get_offset_by_time",
                   "look_message_by_offset", "look_message_by_id", "query_message", "statistics"):
        assert callable(getattr(broker.store.MessageStore, method)), method


@pytest.mark.parametrize("mode", ["ASYNC_FLUSH", "SYNC_FLUSH"])
def test_bench_store_runs_bounded_and_cleans_up(tmp_path, mode):
    result = bench_mode(mode, size=200, batch=16, messages=3000, queues=3, segment_size_mb=8, parent=str(tmp_path))
    # Exactly --messages: 187 batches of 16 and a last one of 8 (it was rounded down to 2,992).
    assert result.messages == 3000 and result.append_msgs_per_s > 0 and result.read_msgs_per_s > 0
    assert result.commit_log_bytes > 3000 * 200
    assert (result.fdatasyncs > 0) == (mode == "SYNC_FLUSH")
    assert os.listdir(tmp_path) == []
