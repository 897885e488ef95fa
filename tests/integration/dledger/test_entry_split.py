"""A batch whose prepared entry is past ``max_entry_bytes`` is proposed in parts, never failing a record that fits.

The batcher packs records by their own bytes (``max_batch_bytes``), but a state machine may prepare an entry
several times that: the message store adds 12 bytes of index per key, so concurrent key-heavy sends that each fit
one entry were packed into one too large, all answered busy, and packed together again when they retried.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio

from dledger import ByteLog, open_dledger_group
from dledger.errors import PreparedEntryTooLargeError
from dledger.byte_log import RECORD_HEADER
from dledger.entry import ENTRY_HEADER
from tests.integration.dledger.helpers import make_configs, ready_leader, wait_ends

pytestmark = pytest.mark.timeout(60)

INFLATION = 6  # what the message store makes of a key-heavy message


class InflatingLog(ByteLog):
    """A ByteLog storing each record ``INFLATION`` times over: entries several times their records, as the broker's."""

    def prepare_batch(self, records, start_offset, store_timestamp, *, fresh):
        return super().prepare_batch([r * INFLATION for r in records], start_offset, store_timestamp, fresh=fresh)


def alone_entry_bytes(record: bytes) -> int:
    return ENTRY_HEADER.size + RECORD_HEADER.size + INFLATION * len(record)


async def test_records_that_each_fit_an_entry_are_all_appended_in_order_when_together_they_do_not(tmp_path):
    configs = make_configs(tmp_path, append_entries_batch_size_bytes=64 * 1024, max_batch_bytes=12 * 1024,
                           max_batch_messages=16)
    cfg = configs[0]
    logs = [InflatingLog(tmp_path / c.self_id / "byte.log", segment_size_bytes=1 << 20) for c in configs]
    fits = [bytes([i]) * 3000 for i in range(1, 12)]
    too_large = b"\xff" * 5000  # within max_batch_bytes, packed with the others, but never one entry alone
    assert all(alone_entry_bytes(r) <= cfg.max_entry_bytes < 2 * alone_entry_bytes(r) for r in fits)
    assert alone_entry_bytes(too_large) > cfg.max_entry_bytes and len(too_large) <= cfg.max_batch_bytes
    records = fits[:5] + [too_large] + fits[5:]
    async with AsyncExitStack() as stack:
        groups = [await stack.enter_async_context(open_dledger_group(c, log)) for c, log in zip(configs, logs)]
        leader = await ready_leader(groups)
        outcomes: dict[int, BaseException | None] = {}
        all_done = trio.Event()

        def on_done(i, pending):
            outcomes[i] = pending.error
            if len(outcomes) == len(records):
                all_done.set()

        # Queued in one go, in this order: the first goes out at once, the rest are packed by record bytes
        # (four at most) while it is in flight, and then again once it committed.
        for i, record in enumerate(records):
            leader.append_nowait(record, lambda p, i=i: on_done(i, p), timeout_s=10)
        await all_done.wait()
        failed = {i: type(e).__name__ for i, e in outcomes.items() if e is not None}
        assert failed == {5: "PreparedEntryTooLargeError"}
        assert isinstance(outcomes[5], PreparedEntryTooLargeError)
        stats = leader.statistics()
        assert stats.busy_records == 0 and stats.failed_batches == 0
        assert stats.appended_records == len(fits)
        await wait_ends(logs, stats.end_offset)
    expected = [r * INFLATION for r in fits]
    for log in logs:
        assert [data for _, data in log.read_records()] == expected  # every member, in the order queued
        log.close()
