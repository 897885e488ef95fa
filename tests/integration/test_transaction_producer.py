"""The transactional producer against a broker node (a single-member group) and a name server in-process: the
listener's outcome reaches the broker, a raised or UNKNOWN outcome is settled by the check-back, and the check
runs in a task of its own (the connection it came on carries the answer)."""

from __future__ import annotations

import pytest
import trio

from client import Message, MessageExt, TransactionSendResult, TransactionState, open_producer, open_push_consumer
from tests.integration.broker.helpers import start_leading_node

TOPIC = "TxOrders"


class Listener:
    """execute: the message's key names the outcome ("commit", "rollback", "unknown", "raise"); check answers
    from ``on_check`` (by key), COMMIT if the key is not there."""

    def __init__(self) -> None:
        self.executed: list[tuple[str, object]] = []
        self.checked: list[MessageExt] = []
        self.on_check: dict[str, TransactionState] = {}

    async def execute(self, msg: Message, arg: object) -> TransactionState:
        self.executed.append((msg.keys, arg))
        outcome = msg.keys.split("-")[0]
        if outcome == "raise":
            raise RuntimeError("the local transaction failed")
        return TransactionState[outcome.upper()]

    async def check(self, msg: MessageExt) -> TransactionState:
        self.checked.append(msg)
        await trio.sleep(0.05)  # answered from a task: the connection goes on reading meanwhile
        return self.on_check.get(msg.keys[0], TransactionState.COMMIT)


async def test_execute_decides_and_the_check_settles_what_it_left_open(nursery, tmp_path):
    namesrv, _ = await start_leading_node(nursery, tmp_path, transaction_timeout_ms=300, transaction_check_interval_ms=100)
    listener = Listener()
    # commit-1 and rollback-1 are checked too if their END came after the 300 ms timeout (a stall under load): the
    # check answers as execute did, and whichever END comes first decides (test_transaction_check_race.py).
    listener.on_check.update({"unknown-2": TransactionState.ROLLBACK, "rollback-1": TransactionState.ROLLBACK})
    got: list[MessageExt] = []

    async def on_message(msg: MessageExt) -> None:
        got.append(msg)

    async with open_producer(namesrv, producer_group="tx_orders", transaction_listener=listener,
                             heartbeat_broker_interval_ms=100) as producer, \
            open_push_consumer(namesrv, topic=TOPIC, handler=on_message, consumer_group="tx_readers",
                               consume_from_where="CONSUME_FROM_FIRST_OFFSET", broker_suspend_max_time_ms=300):
        results: dict[str, TransactionSendResult] = {}
        for key in ("commit-1", "rollback-1", "unknown-1", "unknown-2", "raise-1"):
            results[key] = await producer.send_in_transaction(Message(TOPIC, key.encode(), keys=key, tags="T"),
                                                              arg={"order": key})
        assert listener.executed[0] == ("commit-1", {"order": "commit-1"})
        assert {k: r.local_transaction_state for k, r in results.items()} == {
            "commit-1": TransactionState.COMMIT, "rollback-1": TransactionState.ROLLBACK,
            "unknown-1": TransactionState.UNKNOWN, "unknown-2": TransactionState.UNKNOWN,
            "raise-1": TransactionState.UNKNOWN}
        result = results["commit-1"]
        assert result.transaction_id == result.msg_id and result.message_queue.topic == TOPIC
        with trio.fail_after(15):
            while {m.body for m in got} != {b"commit-1", b"unknown-1", b"raise-1"}:
                await trio.sleep(0.05)
        await trio.sleep(1.0)  # nothing else arrives, nothing twice
    assert sorted(m.body for m in got) == [b"commit-1", b"raise-1", b"unknown-1"]
    by_body = {m.body: m for m in got}
    assert by_body[b"commit-1"].msg_id == results["commit-1"].msg_id and by_body[b"commit-1"].tags == "T"
    assert by_body[b"commit-1"].properties["TRAN_MSG"] == "true"
    checked = {m.keys[0] for m in listener.checked}
    assert checked - {"commit-1", "rollback-1"} == {"unknown-1", "unknown-2", "raise-1"}, checked
    first = next(m for m in listener.checked if m.keys[0] == "unknown-1")
    assert first.topic == TOPIC and first.msg_id == results["unknown-1"].msg_id and first.body == b"unknown-1"
    assert first.properties["TRANSACTION_CHECK_TIMES"] == "1"


async def test_send_in_transaction_refuses_what_cannot_be_a_transaction(nursery, tmp_path):
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    async with open_producer(namesrv) as plain:
        with pytest.raises(ValueError, match="transaction_listener"):
            await plain.send_in_transaction(Message(TOPIC, b"x"))
    with pytest.raises(TypeError, match="has no execute"):
        async with open_producer(namesrv, transaction_listener=object()):
            pass
    listener = Listener()
    async with open_producer(namesrv, transaction_listener=listener) as producer:
        with pytest.raises(ValueError, match="may not be delayed"):
            await producer.send_in_transaction(Message(TOPIC, b"x", keys="commit-1", delay_level=2))
        assert listener.executed == []
    with pytest.raises(ValueError, match="transaction records"):
        async with open_push_consumer(namesrv, topic="RMQ_SYS_TRANS_HALF_TOPIC", consumer_group="nosy"):
            pass
