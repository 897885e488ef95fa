"""SQL92 subscriptions (MessageSelector.by_sql) against a broker node and a name server in-process: the broker
selects by properties when it enables enable_property_filter, refuses otherwise, and wakes a held pull for a match."""

from __future__ import annotations

import cbor2
import pytest
import trio

from client import (Message, MessageQueue, open_lite_pull_consumer, open_producer, open_pull_consumer,
                    open_push_consumer)
from client.filter import MessageSelector
from client.message import PullStatus
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import BrokerError
from remoting.message import decode_properties, decode_records
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import call, start_leading_node

SELECTOR = "a BETWEEN 3 AND 5 AND color IN ('red','blue')"
REFUSAL = "The broker does not support consumer to filter message by SQL92"


def _mixed_stream() -> tuple[list[Message], set[bytes]]:
    """Messages with every combination the selector judges, and the bodies it selects."""
    messages, wanted = [], set()
    for i in range(60):
        props = {}
        if i % 7:  # some without a
            props["a"] = str(i % 8) if i % 11 else "not a number"
        if i % 5:  # some without color
            props["color"] = ("red", "blue", "green")[i % 3]
        body = b"m%02d" % i
        messages.append(Message("SqlTopic", body, tags=("TagA", "TagB")[i % 2], properties=props))
        a = props.get("a", "")
        if a.isdigit() and 3 <= int(a) <= 5 and props.get("color") in ("red", "blue"):
            wanted.add(body)
    return messages, wanted


async def test_a_sql92_push_consumer_gets_exactly_the_matching_messages(nursery, tmp_path):
    namesrv, addr = await start_leading_node(nursery, tmp_path, enable_property_filter=True)
    mq = MessageQueue("SqlTopic", "broker-a", 0)
    messages, wanted = _mixed_stream()
    assert 5 < len(wanted) < 30
    async with open_producer(namesrv) as producer:
        for msg in messages:
            await producer.send(msg, queue=mq)
        async with open_push_consumer(namesrv, topic="SqlTopic", expression=MessageSelector.by_sql(SELECTOR),
                                      consumer_group="sql_group",
                                      consume_from_where="CONSUME_FROM_FIRST_OFFSET") as consumer:
            assert consumer.subscriptions() == {"SqlTopic": MessageSelector.by_sql(SELECTOR)}
            last = Message("SqlTopic", b"last", properties={"a": "4", "color": "red"})
            await producer.send(last, queue=mq)
            got: list[bytes] = []
            with trio.move_on_after(20):  # a guard only: the test ends once "last" is in
                async for msg in consumer:
                    got.append(msg.body)
                    if wanted | {b"last"} <= set(got):
                        break
            assert sorted(got) == sorted(wanted | {b"last"})

            # The group's subscription, from its heartbeats, keeps its type: a pull naming none is filtered by it.
            async with open_remoting_client() as client:
                r = await call(client, addr, RequestCode.PULL_MESSAGE, {
                    "consumer_group": "sql_group", "topic": "SqlTopic", "queue_id": 0, "queue_offset": 0,
                    "max_msg_nums": 100, "sys_flag": 0})
    assert r.code == ResponseCode.SUCCESS, r.remark
    pulled = {rec[1] for rec in decode_records(r.body)}
    assert pulled == wanted | {b"last"}
    assert all(decode_properties(rec[4])["color"] in ("red", "blue") for rec in decode_records(r.body))


async def test_a_broker_without_enable_property_filter_refuses_sql92_pulls(nursery, tmp_path):
    namesrv, addr = await start_leading_node(nursery, tmp_path)
    mq = MessageQueue("SqlTopic", "broker-a", 0)
    async with open_producer(namesrv) as producer:
        await producer.send(Message("SqlTopic", b"x", properties={"a": "4"}), queue=mq)
    async with open_pull_consumer(namesrv, consumer_group="sql_pull") as consumer:
        with pytest.raises(BrokerError) as info:
            await consumer.pull(mq, 0, expression=MessageSelector.by_sql("a > 1"))
        assert info.value.code == ResponseCode.SYSTEM_ERROR
        assert REFUSAL in info.value.remark and "enable_property_filter = false" in info.value.remark
        # A tag pull on the same broker is served as before.
        assert (await consumer.pull(mq, 0, expression="*")).status is PullStatus.FOUND
        # A bad expression fails when the consumer makes it, before any request.
        with pytest.raises(ValueError, match="at character 5"):
            await consumer.pull(mq, 0, expression=MessageSelector.by_sql("a > "))
    # A pull using the group's SQL92 subscription from its heartbeat is refused alike.
    async with open_remoting_client() as client:
        hb = {"client_id": "127.0.0.1@1#sql", "consumers": [{"consumer_group": "sql_hb", "subscriptions": [
            {"topic": "SqlTopic", "expression": "a > 1", "expression_type": "SQL92"}]}]}
        assert (await call(client, addr, RequestCode.HEART_BEAT, body=cbor2.dumps(hb))).code == ResponseCode.SUCCESS
        r = await call(client, addr, RequestCode.PULL_MESSAGE, {
            "consumer_group": "sql_hb", "topic": "SqlTopic", "queue_id": 0, "queue_offset": 0, "sys_flag": 0})
        assert r.code == ResponseCode.SYSTEM_ERROR and REFUSAL in r.remark


async def test_a_held_sql92_pull_wakes_for_a_new_match_only(nursery, tmp_path):
    namesrv, addr = await start_leading_node(nursery, tmp_path, enable_property_filter=True)
    mq = MessageQueue("SqlHeld", "broker-a", 0)
    async with open_producer(namesrv) as producer, open_pull_consumer(namesrv, consumer_group="held") as consumer, \
            open_remoting_client() as client:
        await producer.send(Message("SqlHeld", b"before", properties={"a": "9"}), queue=mq)
        info = cbor2.loads((await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)).body)
        results = []

        async def pull() -> None:
            results.append(await consumer.pull(mq, 1, expression=MessageSelector.by_sql("a < 3"), block_ms=30_000))

        async with trio.open_nursery() as inner:
            inner.start_soon(pull)
            await trio.sleep(0.3)  # held by now
            for i in range(20):
                await producer.send(Message("SqlHeld", b"unwanted%d" % i, properties={"a": str(5 + i)}), queue=mq)
            await trio.sleep(0.3)
            assert not results  # the unwanted ones did not answer it
            await producer.send(Message("SqlHeld", b"wanted", properties={"a": "1"}), queue=mq)
        (result,) = results
        assert result.status is PullStatus.FOUND
        assert [m.body for m in result.messages] == [b"wanted"]
        assert result.next_begin_offset == 22
        after = cbor2.loads((await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)).body)
        # Woken once, by the arrival of the match; not by its deadline.
        assert after["long_polling_resumed_by_arrival"] - info["long_polling_resumed_by_arrival"] == 1
        assert after["long_polling_resumed_by_timeout"] == info["long_polling_resumed_by_timeout"]


async def test_a_lite_pull_consumer_pulls_its_assigned_queues_with_a_sql92_expression(nursery, tmp_path):
    namesrv, _ = await start_leading_node(nursery, tmp_path, enable_property_filter=True)
    mq = MessageQueue("SqlTopic", "broker-a", 0)
    messages, wanted = _mixed_stream()
    async with open_producer(namesrv) as producer:
        for msg in messages:
            await producer.send(msg, queue=mq)
    async with open_lite_pull_consumer(namesrv, consumer_group="sql_lite", auto_commit=False,
                                       consume_from_where="CONSUME_FROM_FIRST_OFFSET") as consumer:
        with pytest.raises(ValueError, match="SQL92 expression: "):
            consumer.set_sub_expression_for_assign("SqlTopic", MessageSelector.by_sql("a BETWEEN"))
        consumer.set_sub_expression_for_assign("SqlTopic", MessageSelector.by_sql(SELECTOR))
        consumer.assign([mq])
        got: list[bytes] = []
        with trio.move_on_after(20):  # a guard only
            while set(got) != wanted:
                got.extend(m.body for m in await consumer.poll(timeout_s=1))
        assert sorted(got) == sorted(wanted)
        assert await consumer.position(mq) == len(messages)  # the unmatched tail was passed over
