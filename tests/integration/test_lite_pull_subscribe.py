"""A subscribe-mode lite pull consumer against a broker node and a name server in-process: the broker counts it
as a member of its group (GET_CONSUMER_LIST_BY_GROUP, consumer-connection, consume type CONSUME_ACTIVELY), it
consumes, and it leaves the group on close; a SQL92 subscription the broker cannot serve is refused by subscribe."""

from __future__ import annotations

import cbor2
import pytest
import trio

from client import Message, MessageQueue, open_admin, open_lite_pull_consumer, open_producer
from client.errors import SubscriptionRefusedError
from client.filter import MessageSelector
from remoting.codes import RequestCode
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import call, start_leading_node


async def _connections(addr: str, group: str) -> tuple[list[str], dict]:
    async with open_remoting_client() as client:
        ids = await call(client, addr, RequestCode.GET_CONSUMER_LIST_BY_GROUP, {"consumer_group": group})
        conns = await call(client, addr, RequestCode.GET_CONSUMER_CONNECTION_LIST, {"consumer_group": group})
    return cbor2.loads(ids.body)["consumer_id_list"], cbor2.loads(conns.body) if conns.body else {}


async def test_a_subscribed_lite_pull_consumer_is_a_member_of_its_group_on_the_broker(nursery, tmp_path):
    namesrv, addr = await start_leading_node(nursery, tmp_path)
    async with open_producer(namesrv) as producer:
        await producer.send(Message("LiteSub", b"first"), queue=MessageQueue("LiteSub", "broker-a", 0))
        async with open_lite_pull_consumer(namesrv, consumer_group="lite_sub",
                                           consume_from_where="CONSUME_FROM_FIRST_OFFSET") as consumer:
            assert await _connections(addr, "lite_sub") == ([], {})  # no member before subscribe
            await consumer.subscribe("LiteSub", "*")
            ids, conns = await _connections(addr, "lite_sub")
            assert ids == [consumer.client_id]
            assert (conns["consume_type"], conns["message_model"]) == ("CONSUME_ACTIVELY", "CLUSTERING")
            assert [c["client_id"] for c in conns["connections"]] == [consumer.client_id]
            assert conns["subscriptions"] == [{"topic": "LiteSub", "expression": "*"}]  # no retry topic
            async with open_admin(namesrv) as admin:
                found = await admin.consumer_connections("lite_sub")
            assert found.member_subscriptions == {consumer.client_id: {"LiteSub": "*"}}
            assert consumer.assignment() == {MessageQueue("LiteSub", "broker-a", q) for q in range(4)}
            got = []
            with trio.fail_after(10):
                while not got:
                    got = await consumer.poll(timeout_s=1)
            assert [m.body for m in got] == [b"first"]
    assert (await _connections(addr, "lite_sub"))[0] == []  # left the group on close


async def test_subscribe_with_a_sql92_expression_the_broker_cannot_serve_is_refused_and_changes_nothing(
        nursery, tmp_path):
    namesrv, addr = await start_leading_node(nursery, tmp_path)
    async with open_producer(namesrv) as producer:
        await producer.send(Message("LiteSql", b"first"), queue=MessageQueue("LiteSql", "broker-a", 0))
    async with open_lite_pull_consumer(namesrv, consumer_group="lite_sql") as consumer:
        with pytest.raises(SubscriptionRefusedError, match="enable_property_filter"):
            await consumer.subscribe("LiteSql", MessageSelector.by_sql("a > 3"))
        assert consumer.mode is None and consumer.subscriptions() == {} and consumer.assignment() == set()
        assert (await _connections(addr, "lite_sql"))[0] == []
