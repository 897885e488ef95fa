"""The entry a batch makes, and what the broker's background services do when a round fails.

``entry_size`` must be the state machine's own accounting (what ``prepare_batch`` builds and ``encode_entry`` holds
to ``max_entry_bytes``), not a second estimate: the delivery, check and revive rounds are sized by it. A round that
fails in a way nobody foresaw (a bare ValueError from the group once stopped the broker, and every restart met the
same round) is logged and tried again later, backed off, never out of the node's nursery.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from broker.commit_log_machine import CommitLogMachine
from broker.pop import PopService
from broker.schedule import ROUND_INTERVAL_S, ScheduleMessageService
from broker.service_rounds import alone_entry_bytes, entry_size
from broker.store import MessageStore
from broker.transaction import TransactionalMessageService
from dledger.entry import EntryTooLargeError, encode_entry
from dledger.errors import PreparedEntryTooLargeError, RecordTooLargeError
from dledger.group import DLedgerGroup
from dledger.pending import Pending
from remoting.message import MessageInput, encode_batch
from tests.unit.store.helpers import small_config

HOST = ("10.0.0.7", 10911)


def _messages(keys: int) -> list[MessageInput]:
    return [MessageInput("EntryT", i % 2, b"body-%d" % i, {"KEYS": "k " * keys, "UNIQ_KEY": f"U-{i}", "TAGS": "t"})
            for i in range(5)]


def test_entry_size_is_what_the_state_machine_builds_and_the_group_measures(tmp_path):
    with MessageStore.open(small_config(tmp_path / "store")) as store:
        for keys in (0, 1, 700):
            batch = encode_batch(_messages(keys), HOST)
            prepared = CommitLogMachine(store).prepare_batch([batch], store.max_phy_offset, 1, fresh=True)
            entry = encode_entry(store.max_phy_offset, 1, prepared.payload, max_entry_bytes=1 << 30)
            size = entry_size(store, batch)
            assert size.entry_bytes == len(entry)
            assert size.index_entries == 5 * (1 + keys)  # a UNIQ_KEY and each key of KEYS per message
        # Keys are what records do not show: 700 of them take 1,400 bytes of KEYS and 8,400 of entry.
        assert entry_size(store, encode_batch(_messages(700), HOST)).entry_bytes > 5 * 8400
        node = SimpleNamespace(store=store, store_host=HOST, max_message_size=store.config.max_message_size)
        message = _messages(700)[0]
        assert alone_entry_bytes(node, message) == entry_size(store, encode_batch([message], HOST)).entry_bytes


def _pending(record: bytes) -> Pending:
    return Pending(record, 3.0, 0.0)  # (in a task: a pending append parks its caller's)


async def test_an_entry_too_large_for_a_record_alone_is_not_retriable():
    group = DLedgerGroup.__new__(DLedgerGroup)  # the mapping reads only the config
    group.config = SimpleNamespace(group="broker-a")
    alone = group._entry_too_large(_pending(b"x" * 100), EntryTooLargeError(9000, 8000))
    # A RecordTooLargeError: the broker answers MESSAGE_ILLEGAL, which a producer does not retry. (Records proposed
    # together are never failed so: the group splits them, tests/integration/dledger/test_entry_split.py.)
    assert isinstance(alone, PreparedEntryTooLargeError) and isinstance(alone, RecordTooLargeError)
    assert not alone.retriable and (alone.size, alone.entry_size, alone.max_size) == (100, 9000, 8000)
    assert str(alone) == ("A record of 100 bytes makes a DLedger entry of 9000 bytes once prepared, more than group "
                          "broker-a's max_entry_bytes 8000; it was not stored.")


class _Group:
    is_ready_leader = True


def _service(kind: str) -> tuple[Any, str]:
    """A background service over a stand-in node, and the name of its round."""
    config = SimpleNamespace(transaction_timeout_ms=1000, transaction_check_max=15,
                             transaction_check_interval_ms=100, pop_revive_interval_ms=100)
    node = SimpleNamespace(group=_Group(), config=config, store=SimpleNamespace(queue_ids=lambda topic: []))
    if kind == "schedule":
        return ScheduleMessageService(node, [1000]), "deliver_due"  # type: ignore[arg-type]
    if kind == "transaction":
        return TransactionalMessageService(node), "check_round"  # type: ignore[arg-type]
    return PopService(node), "revive_expired"  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["schedule", "transaction", "pop"])
async def test_a_round_failing_unexpectedly_is_logged_once_with_its_traceback_and_retried_backed_off(
        kind, autojump_clock, caplog):
    service, round_name = _service(kind)
    interval_s = ROUND_INTERVAL_S if kind == "schedule" else 0.1
    calls: list[float] = []
    done = trio.Event()

    async def failing_round(*args: Any, **kwargs: Any) -> int:
        calls.append(trio.current_time())
        if len(calls) <= 3:
            raise ValueError("a defect nobody foresaw")
        done.set()
        return 0

    setattr(service, round_name, failing_round)
    with caplog.at_level(logging.DEBUG):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.serve)
            await done.wait()
            nursery.cancel_scope.cancel()
    # Not out of the nursery (the broker lives), and not every interval: 1, 2, 4, then 8 intervals apart.
    gaps = [round(b - a, 6) for a, b in zip([0.0] + calls, calls)]
    assert gaps == [interval_s, 2 * interval_s, 4 * interval_s, 8 * interval_s]
    failed = [r for r in caplog.records if "failed unexpectedly" in r.getMessage()]
    assert len(failed) == 3 and [bool(r.exc_info) for r in failed] == [True, False, False]
