"""Consumers ask the brokers before they consume a SQL92 subscription (CHECK_CLIENT_CONFIG, RocketMQ's
checkClientInBroker), against a broker node and a name server in-process: a broker without enable_property_filter
fails the consumer's start, ``subscribe`` or ``poll`` instead of refusing its every pull."""

from __future__ import annotations

import logging

import cbor2
import pytest
import trio

from client import Message, MessageQueue, open_lite_pull_consumer, open_producer, open_push_consumer
from client.errors import SubscriptionRefusedError
from client.filter import MessageSelector
from client.instance import ClientInstance
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import call, start_leading_node

SQL = MessageSelector.by_sql("a > 3")
REFUSAL = "The broker does not support consumer to filter message by SQL92"


async def _create(namesrv: str, *topics: str) -> None:
    """Each topic created by a first message (auto-create), so the name server routes it."""
    async with open_producer(namesrv) as producer:
        for topic in topics:
            await producer.send(Message(topic, b"first", properties={"a": "5"}),
                                queue=MessageQueue(topic, "broker-a", 0))


async def _members(addr: str, group: str) -> list[str]:
    async with open_remoting_client() as client:
        r = await call(client, addr, RequestCode.GET_CONSUMER_LIST_BY_GROUP, {"consumer_group": group})
    return cbor2.loads(r.body)["consumer_id_list"]


@pytest.fixture
def sent_codes(monkeypatch) -> list[int]:
    """The request codes every client instance sends, in order."""
    codes: list[int] = []
    invoke = ClientInstance.invoke

    async def recording(self, addr, code, *args, **kwargs):
        codes.append(code)
        return await invoke(self, addr, code, *args, **kwargs)

    monkeypatch.setattr(ClientInstance, "invoke", recording)
    return codes


async def test_a_push_consumer_with_a_sql92_subscription_does_not_open_on_a_broker_that_cannot_filter_by_it(
        nursery, tmp_path, sent_codes):
    namesrv, addr = await start_leading_node(nursery, tmp_path)
    await _create(namesrv, "SqlTopic")
    with pytest.raises(SubscriptionRefusedError) as info:
        async with open_push_consumer(namesrv, topic="SqlTopic", expression=SQL, consumer_group="refused"):
            pytest.fail("the consumer opened")
    error = info.value
    assert (error.topic, error.broker_name, error.addr, error.code) == ("SqlTopic", "broker-a", addr,
                                                                       ResponseCode.SYSTEM_ERROR)
    assert REFUSAL in error.remark and "enable_property_filter = false" in error.remark
    assert "broker group 'broker-a'" in str(error) and "'refused'" in str(error) and REFUSAL in str(error)
    assert not error.retriable
    # Asked before its first heartbeat: it never joined the group, so no member was allocated queues it never pulls.
    assert RequestCode.HEART_BEAT not in sent_codes[:sent_codes.index(RequestCode.CHECK_CLIENT_CONFIG)]
    assert await _members(addr, "refused") == []


async def test_a_push_consumer_with_a_sql92_subscription_opens_on_a_broker_that_filters_and_tags_ask_nothing(
        nursery, tmp_path, sent_codes):
    namesrv, addr = await start_leading_node(nursery, tmp_path, enable_property_filter=True)
    await _create(namesrv, "SqlTopic", "TagTopic")
    async with open_push_consumer(namesrv, topic="TagTopic", expression="TagA || TagB",
                                  consumer_group="tags") as consumer:
        assert consumer.subscriptions() == {"TagTopic": "TagA || TagB"}
    assert RequestCode.CHECK_CLIENT_CONFIG not in sent_codes  # the common case costs no round trip
    async with open_push_consumer(namesrv, subscriptions={"SqlTopic": SQL, "TagTopic": "*"}, consumer_group="sql",
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET") as consumer:
        assert sent_codes.count(RequestCode.CHECK_CLIENT_CONFIG) == 1  # the one group of the one SQL92 topic
        with trio.fail_after(20):  # a guard only
            msg = await consumer.__anext__()
        assert (msg.topic, msg.body) in (("SqlTopic", b"first"), ("TagTopic", b"first"))


async def test_subscribe_on_an_open_push_consumer_checks_a_sql92_expression_and_changes_nothing_if_refused(
        nursery, tmp_path):
    namesrv, addr = await start_leading_node(nursery, tmp_path)
    await _create(namesrv, "TagTopic", "SqlTopic")
    async with open_push_consumer(namesrv, topic="TagTopic", consumer_group="runtime") as consumer:
        with pytest.raises(SubscriptionRefusedError, match=REFUSAL) as info:
            await consumer.subscribe("SqlTopic", SQL)
        assert info.value.broker_name == "broker-a"
        assert consumer.subscriptions() == {"TagTopic": "*"}
        # A new expression for a subscribed topic is refused alike, and the old one stays.
        with pytest.raises(SubscriptionRefusedError):
            await consumer.subscribe("TagTopic", SQL)
        assert consumer.subscriptions() == {"TagTopic": "*"}
        assert all(mq.topic != "SqlTopic" for mq in consumer.assigned_queues())
        await consumer.subscribe("SqlTopic", "TagA")  # a tag expression is every broker's
        assert consumer.subscriptions() == {"SqlTopic": "TagA", "TagTopic": "*"}


async def test_subscribe_with_a_sql92_expression_on_a_broker_that_filters_takes_it(nursery, tmp_path):
    namesrv, addr = await start_leading_node(nursery, tmp_path, enable_property_filter=True)
    await _create(namesrv, "TagTopic", "SqlTopic")
    async with open_push_consumer(namesrv, topic="TagTopic", consumer_group="runtime") as consumer:
        await consumer.subscribe("SqlTopic", SQL)
        assert consumer.subscriptions() == {"SqlTopic": SQL, "TagTopic": "*"}
        assert any(mq.topic == "SqlTopic" for mq in consumer.assigned_queues())


async def test_a_sql92_topic_without_a_route_at_open_is_checked_by_the_rebalance_that_finds_it(
        nursery, tmp_path, caplog):
    namesrv, addr = await start_leading_node(nursery, tmp_path)
    await _create(namesrv, "TagTopic")
    async with open_push_consumer(namesrv, subscriptions={"LateSql": SQL, "TagTopic": "*"},
                                  consumer_group="late") as consumer:
        # Nothing to ask yet (as RocketMQ's, which skips a topic it has no route for): the consumer opens.
        await _create(namesrv, "LateSql")
        with trio.fail_after(10):
            while not any("subscription refused" in r.getMessage() for r in caplog.records):
                consumer.trigger_rebalance()
                await trio.sleep(0.05)
        (record, *_) = [r for r in caplog.records if "subscription refused" in r.getMessage()]
        assert record.levelno == logging.ERROR and "LateSql" in record.getMessage()
        assert REFUSAL in record.getMessage()
        # The refused topic is not rebalanced, so none of its queues is pulled to be refused; the other is.
        assert all(mq.topic != "LateSql" for mq in consumer.assigned_queues())
        assert any(mq.topic == "TagTopic" for mq in consumer.assigned_queues())


async def test_a_lite_pull_consumers_sql92_expression_is_checked_by_the_next_poll(nursery, tmp_path):
    namesrv, addr = await start_leading_node(nursery, tmp_path)
    await _create(namesrv, "SqlTopic")
    mq = MessageQueue("SqlTopic", "broker-a", 0)
    async with open_lite_pull_consumer(namesrv, consumer_group="lite", auto_commit=False,
                                       consume_from_where="CONSUME_FROM_FIRST_OFFSET") as consumer:
        consumer.assign([mq])
        consumer.set_sub_expression_for_assign("SqlTopic", SQL)
        for _ in range(2):  # again at each poll, until the expression is replaced
            with pytest.raises(SubscriptionRefusedError, match=REFUSAL) as info:
                await consumer.poll(timeout_s=0)
            assert (info.value.topic, info.value.broker_name) == ("SqlTopic", "broker-a")
        consumer.set_sub_expression_for_assign("SqlTopic", "*")
        got = []
        with trio.fail_after(10):
            while not got:
                got = await consumer.poll(timeout_s=1)
        assert [m.body for m in got] == [b"first"]
