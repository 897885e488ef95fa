"""How the client picks among its name servers, against real name servers in-process on port 0 and one that
accepts connections and answers nothing (as a stopped process does): ``ClientInstance.invoke_namesrv`` and the
route lookups share which one answered last and which failed, and an answer with nothing in it (a name server with
no registration yet) sends the client on to the next."""

from __future__ import annotations

import pytest
import trio

from client import Message, open_producer
from client.admin import open_admin
from client.instance import ClientConfig, ClientInstance, answer_data, build_config, open_remoting
from remoting.codec import make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client, serve_remoting
from tests.integration.broker.helpers import start_leading_node, start_namesrv
from tests.integration.test_namesrv import register_request, start


class Hung:
    """Accepts connections and requests and answers none."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    async def handle(self, request, conn):
        self.asked.append(request.code)
        await trio.sleep_forever()


async def start_hung(nursery: trio.Nursery) -> tuple[str, Hung]:
    handler = Hung()
    host, port = await nursery.start(serve_remoting, handler, "127.0.0.1", 0)
    return f"{host}:{port}", handler


async def test_invoke_namesrv_starts_at_the_one_that_answered_and_asks_a_hung_one_no_more(nursery):
    """Found by review: it always began with the first name server, so with that one stopped every cluster info,
    topic list and admin call waited its whole request timeout there first."""
    hung_addr, hung = await start_hung(nursery)
    live, _ = await start(nursery)
    config: ClientConfig = build_config(ClientConfig, {"namesrv": f"{hung_addr};{live}", "request_timeout_ms": 500})
    async with open_remoting_client() as broker, open_remoting(config) as remoting:
        assert (await broker.invoke(live, register_request(1, "LEADER"))).code == ResponseCode.SUCCESS
        async with trio.open_nursery() as client_nursery:
            instance = ClientInstance(config, remoting, client_nursery)
            instance.routes._ns_index = 0
            for _ in range(3):
                frame = await instance.invoke_namesrv(RequestCode.GET_BROKER_CLUSTER_INFO)
                assert sorted(answer_data(frame)["broker_addr_table"]) == ["broker-a"]
            assert (await instance.routes.get("TopicA")).broker("broker-a") is not None
            assert hung.asked == [RequestCode.GET_BROKER_CLUSTER_INFO]
            instance.closed = True


async def test_a_name_server_without_registrations_does_not_answer_for_the_others(nursery):
    """Found by review: invoke_namesrv took the first answer, so a name server restarted a moment ago (no
    registration yet) answered the admin's cluster info with no group and its route lookups with TOPIC_NOT_EXIST,
    although the next name server knew broker-a and its topics."""
    empty = await start_namesrv(nursery)
    live, _ = await start(nursery)
    async with open_remoting_client() as broker:
        assert (await broker.invoke(live, register_request(1, "LEADER"))).code == ResponseCode.SUCCESS
        async with open_admin(f"{empty};{live}") as admin:
            admin._instance.routes._ns_index = 0
            assert sorted((await admin.cluster_info()).broker_addrs) == ["broker-a"]
            admin._instance.routes._ns_index = 0
            assert await admin.list_topics() == ["TopicA"]
            admin._instance.routes._ns_index = 0
            route = await admin.get_route("TopicA")
            assert [b.broker_name for b in route.broker_datas] == ["broker-a"]


@pytest.mark.parametrize("first", ["empty", "live, then hung"])
async def test_a_first_send_to_a_new_topic_gets_past_an_empty_or_a_hung_name_server(nursery, tmp_path, first):
    """Found by review: with a name server that had no registration yet asked first, the auto-create took its
    cluster info naming no group and every send to a new topic failed; with a stopped one in the list, the lookup
    of the new topic waited for it the send's whole deadline and failed before the auto-create."""
    live, _ = await start_leading_node(nursery, tmp_path)
    other = await start_namesrv(nursery) if first == "empty" else (await start_hung(nursery))[0]
    namesrvs = f"{other};{live}" if first == "empty" else f"{live};{other}"
    async with open_producer(namesrvs, producer_group="pg", retry_times_when_send_failed=0) as producer:
        producer.routes._ns_index = 0
        for i in range(2):
            result = await producer.send(Message(f"New{i}", b"x"))
            assert result.message_queue.broker_name == "broker-a"


async def test_heartbeat_entries_of_nodes_no_longer_routed_or_connected_are_dropped(nursery):
    """Found by review: every node that ever answered a heartbeat kept an entry with its last connection for the
    client's life."""

    class Broker:
        """Answers every request (the heartbeats) SUCCESS."""

        async def handle(self, request, conn):
            return make_response(request, ResponseCode.SUCCESS)

    b_scope = trio.CancelScope()

    async def serve_b(task_status=trio.TASK_STATUS_IGNORED):
        with b_scope:
            await serve_remoting(Broker(), "127.0.0.1", 0, task_status=task_status)

    host, port = await nursery.start(serve_remoting, Broker(), "127.0.0.1", 0)
    a = f"{host}:{port}"
    host, port = await nursery.start(serve_b)
    b = f"{host}:{port}"
    live, _ = await start(nursery)
    config: ClientConfig = build_config(ClientConfig, {"namesrv": live})
    async with open_remoting(config) as remoting, trio.open_nursery() as client_nursery:
        instance = ClientInstance(config, remoting, client_nursery)
        instance.heartbeat_data = lambda: {"producer_data_set": [{"group_name": "pg"}]}
        instance.routes.install_default("T", {"broker-a": {0: a, 1: b}}, 4)
        await instance.send_heartbeat_to_all()
        assert sorted(instance._heartbeat_conns) == sorted([a, b])
        assert instance.heartbeat_needed([a, b]) == []
        instance.routes.install_default("T", {"broker-a": {0: b}}, 4)  # a is no longer routed
        await instance.send_heartbeat_to_all()
        assert list(instance._heartbeat_conns) == [b]
        b_scope.cancel()  # b goes away: its connection is closed and no new one opens
        remoting.close_connection(b, "the test closed it")
        await instance.send_heartbeat_to_all()
        assert instance._heartbeat_conns == {}
        assert instance.heartbeat_needed([b]) == [b]
        instance.closed = True
