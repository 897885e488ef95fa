"""ByteLog: deterministic, idempotent apply; whole-record raw copies; torn tails cut on open."""

from __future__ import annotations

import pytest

from dledger import ApplyStatus, ByteLog
from dledger.byte_log import RECORD_HEADER, frame_record


def test_apply_is_idempotent_and_refuses_gaps(tmp_path):
    log = ByteLog(tmp_path / "a.log")
    prepared = log.prepare_batch([b"one", b"two"], 0, 1, fresh=True)
    payload = prepared.payload
    assert prepared.end_offset == len(payload) and prepared.record_results == (0, RECORD_HEADER.size + 3)
    assert log.end_offset == 0  # preparing writes nothing
    first = log.apply_batch(payload, 1, 0)
    assert first.status is ApplyStatus.APPLIED and first.end_offset == len(payload)
    assert log.apply_batch(payload, 1, 0).status is ApplyStatus.DUPLICATE
    assert log.apply_batch(payload, 1, len(payload) + 5).status is ApplyStatus.REJECTED
    assert log.end_offset == len(payload)
    log.close()


def test_raw_copy_is_whole_records_and_validated(tmp_path):
    src, dst = ByteLog(tmp_path / "src.log"), ByteLog(tmp_path / "dst.log")
    src.apply_batch(src.prepare_batch([b"a" * 100, b"b" * 100, b"c" * 100], 0, 1, fresh=True).payload, 1, 0)
    chunk = src.read_raw(0, 150)  # cut inside the second record: only whole records come back
    assert len(chunk) == RECORD_HEADER.size + 100
    dst.write_raw(0, chunk)
    with pytest.raises(ValueError, match="offset"):
        dst.write_raw(0, chunk)
    bad = bytearray(src.read_raw(dst.end_offset, 1 << 20))
    bad[-1] ^= 0xFF
    with pytest.raises(ValueError, match="crc32c"):
        dst.write_raw(dst.end_offset, bytes(bad))
    dst.write_raw(dst.end_offset, src.read_raw(dst.end_offset, 1 << 20))
    assert dst.prepare_checksums(dst.end_offset)(lambda: False) == src.prepare_checksums(src.end_offset)(lambda: False)
    src.close()
    dst.close()


def test_torn_tail_is_cut_on_open(tmp_path):
    log = ByteLog(tmp_path / "t.log")
    log.apply_batch(log.prepare_batch([b"whole"], 0, 1, fresh=True).payload, 1, 0)
    end = log.end_offset
    log.close()
    with open(tmp_path / "t.log", "ab") as f:
        f.write(RECORD_HEADER.pack(1000, 0) + b"partial")
    reopened = ByteLog(tmp_path / "t.log")
    assert reopened.end_offset == end
    assert reopened.read_records() == [(0, b"whole")]
    reopened.close()


def test_raw_read_from_inside_a_record_or_past_the_end_is_refused(tmp_path):
    # Was answered with bytes that are no records: data read as a header (here b"bbbb" -> 1.6 GB claimed) sent
    # the rest of the log, however long, as one "record".
    log = ByteLog(tmp_path / "a.log")
    log.apply_batch(log.prepare_batch([b"a" * 100, b"b" * 100], 0, 1, fresh=True).payload, 1, 0)
    second = RECORD_HEADER.size + 100
    for offset in (1, RECORD_HEADER.size - 1, RECORD_HEADER.size, second + 20, log.end_offset - 1):
        with pytest.raises(ValueError, match=f"phy_offset {offset} is not the start of a record"):
            log.read_raw(offset, 1 << 20)
    with pytest.raises(ValueError, match=f"phy_offset {log.end_offset + 1} is outside the log"):
        log.read_raw(log.end_offset + 1, 1 << 20)
    assert log.read_raw(log.end_offset, 1 << 20) == b""
    assert log.read_raw(second, 1) == frame_record(b"b" * 100)
    assert [d for _, d in log.read_records(0)] == [b"a" * 100, b"b" * 100]
    log.close()
