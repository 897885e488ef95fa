"""When the check-back asks about a transaction its producer already ended, traced on the transaction service over a
real message store. A stand-in for the broker node lets the test set the clock halves are stored at, hold an
append back, and leave what an append wrote undispatched (as the reput task does for a moment after it applied).

What these pin: an END that reached the service before a check round started (applied, or still being appended)
is never checked back, in this term or the next. A committed transaction is checked back only when its END came
after its half was older than ``transaction_timeout_ms`` and a round re-stored the half first, as in RocketMQ;
then the END commits the re-stored copy, the message is stored once, and the producer's answer to the check
changes nothing. Whichever of the two ENDs comes first decides, and the other is told what was decided.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from broker.processor.base import RequestRejected
from broker.store import MessageStore
from broker.transaction import TransactionalMessageService
from remoting.codes import RequestCode, ResponseCode
from remoting.message import (TRANS_HALF_TOPIC, TRANSACTION_COMMIT_TYPE, TRANSACTION_PREPARED_TYPE,
                              TRANSACTION_ROLLBACK_TYPE, MessageInput, decode_record, encode_batch)
from tests.unit.store.helpers import small_config

GROUP = "tx_group"
TOPIC, QUEUE_ID = "TxT", 1
T0 = 1_700_000_000_000
TIMEOUT_MS = 300
LATER = T0 + 3_600_000  # every half older than the timeout


class StandInGroup:
    """The Raft group as the service sees it: a term and the replicated metadata."""

    def __init__(self) -> None:
        self.term = 1
        self.is_ready_leader = True
        self.tables: dict[str, dict[str, Any]] = {}

    def metadata(self, table: str) -> dict[str, Any]:
        return dict(self.tables.get(table, {}))

    async def put_metadata(self, table: str, items: dict[str, Any], *, timeout_s: float) -> int:
        self.tables.setdefault(table, {}).update(items)
        return len(self.tables[table])


class StandInNode:
    """What ``TransactionalMessageService`` uses of a ``BrokerNode``. ``append_messages`` stores at ``clock_ms``,
    waits for ``gate`` when one is set, and dispatches only when ``dispatch`` is true (the consume queues of a
    serving store are fed by its reput task, a moment after the append)."""

    def __init__(self, store: MessageStore) -> None:
        self.config = SimpleNamespace(broker_name="broker-a", send_timeout_ms=3_000, transaction_timeout_ms=TIMEOUT_MS,
                                      transaction_check_max=15, transaction_check_interval_ms=60_000,
                                      dledger=SimpleNamespace(max_entry_bytes=8 << 20))  # rounds fit one entry
        self.group = StandInGroup()
        self.store = store
        self.store_host = ("127.0.0.1", 10911)
        self.max_message_size = store.config.max_message_size
        self.clock_ms = T0
        self.gate: trio.Event | None = None
        self.dispatch = True
        self.checks_sent: list[Any] = []  # CHECK_TRANSACTION_STATE frames
        producer = SimpleNamespace(conn=SimpleNamespace(closed=False))
        self.clients = SimpleNamespace(producer_groups={GROUP: {"producer-1": producer}})

    async def wait_ready_leader(self) -> None:
        pass

    def is_leader(self) -> bool:
        return True

    def not_leader(self) -> Exception:
        raise AssertionError("the stand-in node always leads")

    async def ensure_topic(self, config: Any) -> None:
        pass

    def deleted_real_topic(self, view: Any) -> None:
        return None  # every topic exists: none is deleted here

    async def append_messages(self, batch: bytes) -> Any:
        if self.gate is not None:
            await self.gate.wait()
        result = self.store.append_batch(batch, self.clock_ms, self.store.max_phy_offset)
        assert result.ok, result
        if self.dispatch:
            self.store.dispatch_pending()
        return result.messages

    def read_record(self, phy_offset: int) -> bytes | None:
        raw = self.store.commit_log.record_at(phy_offset)
        return bytes(raw) if raw is not None else None

    def notify_soon(self, conn: Any, frame: Any) -> None:
        assert frame.code == RequestCode.CHECK_TRANSACTION_STATE
        self.checks_sent.append(frame)


@pytest.fixture
def node(tmp_path):
    with MessageStore.open(small_config(tmp_path / "store")) as store:
        yield StandInNode(store)


class Half:
    """A stored half message: what its producer's END names it by."""

    def __init__(self, key: str, queue_offset: int, phy_offset: int) -> None:
        self.key, self.transaction_id = key, f"U-{key}"
        self.queue_offset, self.phy_offset = queue_offset, phy_offset


async def send_half(service: TransactionalMessageService, key: str) -> Half:
    """The send path's half: stored where ``half_destination`` puts it, flagged PREPARED."""
    node = service.node
    topic, queue_id, props = service.half_destination(TOPIC, QUEUE_ID, {
        "TRAN_MSG": "true", "PGROUP": GROUP, "UNIQ_KEY": f"U-{key}", "KEYS": key})
    batch = encode_batch([MessageInput(topic, queue_id, f"body-{key}".encode(), props,
                                       sys_flag=TRANSACTION_PREPARED_TYPE)], node.store_host)
    (stored,) = await node.append_messages(batch)
    return Half(key, stored.queue_offset, stored.phy_offset)


async def end(service: TransactionalMessageService, half: Half, state: int):
    return await service.end(GROUP, half.queue_offset, half.phy_offset, state, half.transaction_id)


def checked(node: StandInNode) -> list[Half]:
    """The re-stored copies the producer was asked about, in order."""
    out = []
    for frame in node.checks_sent:
        view = decode_record(frame.body)
        assert (view.topic, view.phy_offset) == (TRANS_HALF_TOPIC, frame.ext["commit_log_offset"])
        out.append(Half(view.properties["KEYS"], frame.ext["tran_state_table_offset"], view.phy_offset))
        assert out[-1].transaction_id == frame.ext["transaction_id"]
    return out


def delivered(node: StandInNode) -> list[bytes]:
    node.store.dispatch_pending()
    result = node.store.get_messages(TOPIC, QUEUE_ID, 0, 64, 1 << 20)
    return [bytes(decode_record(raw).body) for raw in result.messages]


@pytest.mark.parametrize("new_term", [False, True], ids=["same-term", "next-term"])
async def test_an_end_applied_before_a_round_is_not_checked_back(node, new_term):
    service = TransactionalMessageService(node)
    committed, rolled_back, _ = [await send_half(service, k) for k in ("commit", "rollback", "open")]
    node.dispatch = False  # the op records are applied, not yet in the op queue: the leader knows them anyway
    assert (await end(service, committed, TRANSACTION_COMMIT_TYPE)).code == ResponseCode.SUCCESS
    assert (await end(service, rolled_back, TRANSACTION_ROLLBACK_TYPE)).code == ResponseCode.SUCCESS
    node.dispatch = True
    if new_term:  # a new leader's view is rebuilt from the replicated progress (none yet) and the op queue
        node.group.term = 2
    assert await service.check_round(now_ms=LATER) == 1
    assert [h.key for h in checked(node)] == ["open"]
    assert delivered(node) == [b"body-commit"]


async def test_an_end_being_appended_when_a_round_starts_holds_the_round_back_and_is_not_checked(node):
    service = TransactionalMessageService(node)
    half = await send_half(service, "slow-end")
    node.gate = trio.Event()
    answers = []
    async with trio.open_nursery() as nursery:
        async def end_it() -> None:
            answers.append(await end(service, half, TRANSACTION_COMMIT_TYPE))

        nursery.start_soon(end_it)
        await trio.testing.wait_all_tasks_blocked()  # the END waits in its append (replicating)
        assert await service.check_round(now_ms=LATER) == 0  # the half being ended stops the scan
        node.gate.set()
    node.gate = None
    assert [a.outcome for a in answers] == ["committed"]
    assert await service.check_round(now_ms=LATER) == 0
    assert node.checks_sent == [] and service.progress()["half"] == half.queue_offset + 1
    assert delivered(node) == [b"body-slow-end"]


async def test_an_end_after_a_round_re_stored_its_half_commits_the_copy_once_and_the_check_answer_changes_nothing(
        node):
    """How a committed transaction gets checked back: its END came after the half was older than the timeout, and
    a round re-stored the half first. Expected, as in RocketMQ; the outcome stays right."""
    service = TransactionalMessageService(node)
    half = await send_half(service, "late")
    assert await service.check_round(now_ms=T0 + TIMEOUT_MS - 1) == 0  # young: not yet
    assert await service.check_round(now_ms=T0 + TIMEOUT_MS) == 1
    (copy,) = checked(node)
    assert copy.transaction_id == half.transaction_id and copy.queue_offset > half.queue_offset

    done = await end(service, half, TRANSACTION_COMMIT_TYPE)  # execute's END, late: commits the live copy
    assert (done.code, done.outcome) == (ResponseCode.SUCCESS, "committed")
    log_end = node.store.max_phy_offset
    for answer in (TRANSACTION_ROLLBACK_TYPE, TRANSACTION_COMMIT_TYPE):  # the check's answer, either way
        late = await end(service, copy, answer)
        assert late.code == ResponseCode.TRANSACTION_SHOULD_COMMIT and "already committed" in late.remark
    assert await service.check_round(now_ms=LATER) == 0  # the copy is settled: never checked again
    assert service.progress()["half"] == copy.queue_offset + 1
    # Past the progress, the outcome is no longer held: still nothing is done.
    assert (await end(service, copy, TRANSACTION_COMMIT_TYPE)).code == ResponseCode.TRANSACTION_STATE_UNKNOW
    assert node.store.max_phy_offset == log_end
    assert delivered(node) == [b"body-late"] and len(node.checks_sent) == 1 and service.committed == 1


async def test_the_check_answer_first_decides_and_the_late_end_of_execute_is_told_what_was_decided(node):
    service = TransactionalMessageService(node)
    half = await send_half(service, "answered")
    assert await service.check_round(now_ms=T0 + TIMEOUT_MS) == 1
    (copy,) = checked(node)
    assert (await end(service, copy, TRANSACTION_COMMIT_TYPE)).outcome == "committed"
    log_end = node.store.max_phy_offset
    # It was answered TRANSACTION_STATE_UNKNOW, "settled before the broker's check progress; its outcome is no
    # longer held": the copy's outcome was held all along, and it is what the producer is told.
    for state in (TRANSACTION_COMMIT_TYPE, TRANSACTION_ROLLBACK_TYPE):
        late = await end(service, half, state)
        assert late.code == ResponseCode.TRANSACTION_SHOULD_COMMIT and "already committed" in late.remark, \
            (late.code, late.remark)
    assert node.store.max_phy_offset == log_end and delivered(node) == [b"body-answered"]


async def test_an_end_right_after_the_re_store_commits_the_copy_the_reput_has_not_dispatched_yet(node):
    """The round's batch applied, the new copy not yet in the half queue: the END found no live copy and answered
    that nothing was done, the producer took that as ended, and the commit rested on the check's answer (a check
    that can only say UNKNOWN has the message discarded after transaction_check_max checks)."""
    service = TransactionalMessageService(node)
    half = await send_half(service, "just-re-stored")
    node.dispatch = False
    assert await service.check_round(now_ms=T0 + TIMEOUT_MS) == 1
    done = await end(service, half, TRANSACTION_COMMIT_TYPE)
    assert (done.code, done.outcome) == (ResponseCode.SUCCESS, "committed"), (done.code, done.remark)
    node.dispatch = True
    assert await service.check_round(now_ms=LATER) == 0 and len(node.checks_sent) == 1
    assert delivered(node) == [b"body-just-re-stored"]


async def test_an_end_while_the_round_re_stores_its_half_is_told_to_retry_then_commits_the_copy(node):
    service = TransactionalMessageService(node)
    half = await send_half(service, "racing")
    node.gate = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(service.check_round, T0 + TIMEOUT_MS)
        await trio.testing.wait_all_tasks_blocked()  # the re-store batch is being appended
        with pytest.raises(RequestRejected) as refused:
            await end(service, half, TRANSACTION_COMMIT_TYPE)
        assert refused.value.code == ResponseCode.SYSTEM_BUSY and "retry" in refused.value.remark
        node.gate.set()
    node.gate = None
    assert (await end(service, half, TRANSACTION_COMMIT_TYPE)).outcome == "committed"
    assert delivered(node) == [b"body-racing"] and len(node.checks_sent) == 1


async def test_an_end_that_cannot_see_the_re_stored_copy_within_a_second_is_told_to_retry(node, autojump_clock,
                                                                                            monkeypatch):
    service = TransactionalMessageService(node)
    half = await send_half(service, "stalled")
    node.dispatch = False
    assert await service.check_round(now_ms=T0 + TIMEOUT_MS) == 1
    log_end = node.store.max_phy_offset
    with monkeypatch.context() as patch:
        patch.setattr(node.store, "wait_dispatched", lambda phy_offset: trio.sleep_forever())
        with pytest.raises(RequestRejected) as refused:
            await end(service, half, TRANSACTION_COMMIT_TYPE)
    assert refused.value.code == ResponseCode.SYSTEM_BUSY and "still dispatching" in refused.value.remark
    assert node.store.max_phy_offset == log_end
    assert (await end(service, half, TRANSACTION_COMMIT_TYPE)).outcome == "committed"  # the producer's retry
    assert delivered(node) == [b"body-stalled"]
