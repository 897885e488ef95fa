"""Which half a late END_TRANSACTION settles, and when a new leader may answer one, traced on the transaction service
over a real message store (the stand-in node of ``test_transaction_check_race.py``).

What these pin: a late END for a half a check round re-stored goes to the copy made from *that* half (the copies
carry TRAN_PREPARED_QUEUE_OFFSET), never to another transaction that shares its UNIQ_KEY, of its group or of
another; a half re-stored by a broker that did not mark its copies is answered "nothing done" rather than guessed
at; and an END that reaches a leader before its no-op is applied waits for it instead of answering NO_MESSAGE for a
half an earlier term acknowledged.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from broker.processor.base import RequestRejected
from broker.schedule import stored_again
from broker.store import MessageStore
from broker.transaction import TransactionalMessageService
from remoting.codes import ResponseCode
from remoting.message import (TRANS_HALF_TOPIC, TRANSACTION_COMMIT_TYPE, TRANSACTION_PREPARED_TYPE,
                              TRANSACTION_ROLLBACK_TYPE, MessageInput, decode_record, encode_batch)
from tests.unit.broker.test_transaction_check_race import (GROUP, LATER, QUEUE_ID, T0, TIMEOUT_MS, TOPIC, Half,
                                                           StandInNode, delivered)
from tests.unit.store.helpers import small_config

OTHER_GROUP = "other_group"
PREPARED_QUEUE_OFFSET = "TRAN_PREPARED_QUEUE_OFFSET"  # RocketMQ's property, on the broker's copies


@pytest.fixture
def node(tmp_path):
    with MessageStore.open(small_config(tmp_path / "store")) as store:
        yield StandInNode(store)


async def send_half(service: TransactionalMessageService, key: str, *, uniq: str, group: str = GROUP) -> Half:
    """A half of ``group`` whose transaction id (UNIQ_KEY, which producers set) is ``uniq``."""
    node = service.node
    topic, queue_id, props = service.half_destination(TOPIC, QUEUE_ID, {
        "TRAN_MSG": "true", "PGROUP": group, "UNIQ_KEY": uniq, "KEYS": key})
    batch = encode_batch([MessageInput(topic, queue_id, f"body-{key}".encode(), props,
                                       sys_flag=TRANSACTION_PREPARED_TYPE)], node.store_host)
    (stored,) = await node.append_messages(batch)
    half = Half(key, stored.queue_offset, stored.phy_offset)
    half.transaction_id = uniq
    return half


async def end(service: TransactionalMessageService, half: Half, state: int, group: str = GROUP):
    return await service.end(group, half.queue_offset, half.phy_offset, state, half.transaction_id)


def checked(node: StandInNode) -> list[Half]:
    """The re-stored copies the producer was asked about, in order, named as its END names them."""
    out = []
    for frame in node.checks_sent:
        view = decode_record(frame.body)
        assert (view.topic, view.phy_offset) == (TRANS_HALF_TOPIC, frame.ext["commit_log_offset"])
        assert view.properties["UNIQ_KEY"] == frame.ext["transaction_id"]
        out.append(Half(view.properties["KEYS"], frame.ext["tran_state_table_offset"], view.phy_offset))
        out[-1].transaction_id = frame.ext["transaction_id"]
    return out


def half_record(node: StandInNode, half: Half):
    return decode_record(node.store.commit_log.record_at(half.phy_offset))


async def test_a_late_end_settles_the_copy_of_its_own_half_not_another_transaction_with_the_same_key(node):
    """A's late ROLLBACK rolled back B (the last half with the shared UNIQ_KEY), and B's COMMIT was then answered
    TRANSACTION_SHOULD_ROLLBACK: B's message lost, A's copy left to its checks."""
    service = TransactionalMessageService(node)
    a = await send_half(service, "a", uniq="SHARED")
    assert await service.check_round(now_ms=T0 + TIMEOUT_MS) == 1  # A re-stored for a check
    (copy,) = checked(node)
    b = await send_half(service, "b", uniq="SHARED")  # younger than the timeout: not checked
    done = await end(service, a, TRANSACTION_ROLLBACK_TYPE)
    assert (done.code, done.outcome) == (ResponseCode.SUCCESS, "rolled back"), (done.code, done.remark)
    done = await end(service, b, TRANSACTION_COMMIT_TYPE)
    assert (done.code, done.outcome) == (ResponseCode.SUCCESS, "committed"), (done.code, done.remark)
    assert delivered(node) == [b"body-b"]
    # A's copy is what was rolled back: the answer to its check is told so.
    late = await end(service, copy, TRANSACTION_COMMIT_TYPE)
    assert late.code == ResponseCode.TRANSACTION_SHOULD_ROLLBACK, (late.code, late.remark)
    assert await service.check_round(now_ms=LATER) == 0 and len(node.checks_sent) == 1
    assert delivered(node) == [b"body-b"] and (service.committed, service.rolled_back) == (1, 1)


async def test_a_late_commit_never_reaches_a_half_of_another_group_that_shares_the_key(node):
    """Group tx_group's late COMMIT of A delivered group other_group's B, which nobody had ended."""
    service = TransactionalMessageService(node)
    a = await send_half(service, "a", uniq="SHARED-2")
    assert await service.check_round(now_ms=T0 + TIMEOUT_MS) == 1
    b = await send_half(service, "b-of-other", uniq="SHARED-2", group=OTHER_GROUP)
    done = await end(service, a, TRANSACTION_COMMIT_TYPE)
    assert (done.code, done.outcome) == (ResponseCode.SUCCESS, "committed"), (done.code, done.remark)
    assert delivered(node) == [b"body-a"]
    # B is still its group's to end, and only its group's.
    with pytest.raises(RequestRejected) as refused:
        await end(service, b, TRANSACTION_COMMIT_TYPE)
    assert refused.value.code == ResponseCode.TRANSACTION_STATE_GROUP_WRONG
    done = await end(service, b, TRANSACTION_ROLLBACK_TYPE, group=OTHER_GROUP)
    assert (done.code, done.outcome) == (ResponseCode.SUCCESS, "rolled back"), (done.code, done.remark)
    assert delivered(node) == [b"body-a"]


async def test_copies_of_copies_name_the_half_sent_and_a_late_end_follows_them_past_the_progress(node):
    service = TransactionalMessageService(node)
    a = await send_half(service, "a", uniq="LINE")
    assert await service.check_round(now_ms=T0 + TIMEOUT_MS) == 1
    assert await service.check_round(now_ms=LATER) == 1  # the copy checked again: a copy of the copy
    first, second = checked(node)
    for copy in (first, second):
        assert half_record(node, copy).properties[PREPARED_QUEUE_OFFSET] == str(a.queue_offset)
    assert service.progress()["half"] == second.queue_offset  # A and its first copy are behind the progress
    other = await send_half(service, "other", uniq="LINE")  # the same key, after every copy
    done = await end(service, a, TRANSACTION_COMMIT_TYPE)
    assert (done.code, done.outcome) == (ResponseCode.SUCCESS, "committed"), (done.code, done.remark)
    for named in (first, second):  # the answers to both checks
        late = await end(service, named, TRANSACTION_ROLLBACK_TYPE)
        assert late.code == ResponseCode.TRANSACTION_SHOULD_COMMIT, (late.code, late.remark)
    assert delivered(node) == [b"body-a"]
    (message,) = node.store.get_messages(TOPIC, QUEUE_ID, 0, 8, 1 << 20).messages
    assert PREPARED_QUEUE_OFFSET not in decode_record(message).properties  # not delivered
    assert (await end(service, other, TRANSACTION_ROLLBACK_TYPE)).outcome == "rolled back"
    assert service.committed == 1


async def test_a_half_re_stored_by_a_broker_that_did_not_mark_its_copy_is_answered_nothing_done(node):
    """The copy a previous version re-stored has no TRAN_PREPARED_QUEUE_OFFSET: the late END of the half it came from
    is told nothing was done (the check of the copy asks again); the copy itself is ended as any half, and its own
    copies are marked as descending from it."""
    service = TransactionalMessageService(node)
    a = await send_half(service, "a", uniq="OLD")
    view = half_record(node, a)
    props = dict(view.properties)
    props["TRANSACTION_CHECK_TIMES"] = "1"
    legacy_batch = encode_batch([stored_again(view, TRANS_HALF_TOPIC, 0, props), service._op_record(a.queue_offset,
                                                                                                     "recheck")],
                                node.store_host)
    legacy_copy, _ = await node.append_messages(legacy_batch)
    legacy = Half("a", legacy_copy.queue_offset, legacy_copy.phy_offset)
    legacy.transaction_id = "OLD"
    log_end = node.store.max_phy_offset
    done = await end(service, a, TRANSACTION_COMMIT_TYPE)
    assert done.code == ResponseCode.TRANSACTION_STATE_UNKNOW and "nothing was done" in done.remark, \
        (done.code, done.remark)
    assert node.store.max_phy_offset == log_end and delivered(node) == []
    # The round re-stores the unmarked copy; the answer to that check (naming the unmarked copy) finds the new one.
    assert await service.check_round(now_ms=LATER) == 1
    (new,) = checked(node)
    assert half_record(node, new).properties[PREPARED_QUEUE_OFFSET] == str(legacy.queue_offset)
    done = await end(service, legacy, TRANSACTION_COMMIT_TYPE)
    assert (done.code, done.outcome) == (ResponseCode.SUCCESS, "committed"), (done.code, done.remark)
    assert delivered(node) == [b"body-a"]


def test_a_producer_may_not_send_a_half_marked_as_a_copy(node):
    service = TransactionalMessageService(node)
    with pytest.raises(RequestRejected) as refused:
        service.half_destination(TOPIC, QUEUE_ID, {"TRAN_MSG": "true", "PGROUP": GROUP, "UNIQ_KEY": "U-x",
                                                   PREPARED_QUEUE_OFFSET: "0"})
    assert refused.value.code == ResponseCode.INVALID_REQUEST
    assert "'properties'" in refused.value.remark and "'TRAN_PREPARED_QUEUE_OFFSET'" in refused.value.remark


async def test_an_end_reaching_a_leader_before_its_no_op_is_applied_waits_and_finds_the_half(node):
    """Right after an election, what earlier terms committed is not applied yet: the END looked the half up first,
    found none, and answered NO_MESSAGE (which the producer does not retry) for an acknowledged half."""
    service = TransactionalMessageService(node)
    await send_half(service, "applied", uniq="U-applied")
    # The next half, acknowledged by the old leader, is applied by this one only after its election.
    pending = Half("pending", 1, node.store.max_phy_offset)
    pending.transaction_id = "U-pending"
    node.group.term = 2
    node.group.is_ready_leader = False
    ready = trio.Event()

    async def wait_ready_leader() -> None:
        await ready.wait()

    node.wait_ready_leader = wait_ready_leader
    answers = []
    async with trio.open_nursery() as nursery:
        async def end_it() -> None:
            answers.append(await end(service, pending, TRANSACTION_COMMIT_TYPE))

        nursery.start_soon(end_it)
        await trio.testing.wait_all_tasks_blocked()
        stored = await send_half(service, "pending", uniq="U-pending")  # earlier terms' entries applied
        assert (stored.queue_offset, stored.phy_offset) == (pending.queue_offset, pending.phy_offset)
        node.group.is_ready_leader = True
        ready.set()
    (done,) = answers
    assert (done.code, done.outcome) == (ResponseCode.SUCCESS, "committed"), (done.code, done.remark)
    assert delivered(node) == [b"body-pending"]
