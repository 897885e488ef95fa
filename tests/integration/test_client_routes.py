"""The client's route queries against real name servers in-process on port 0."""

from __future__ import annotations

import pytest
import trio

from client.errors import NoRouteError
from client.instance import ClientConfig, ClientInstance, build_config, open_remoting
from remoting.codes import ResponseCode
from remoting.transport import open_remoting_client
from tests.integration.test_namesrv import register_request, start


async def test_a_name_server_without_registrations_yet_sends_the_client_to_the_next(nursery):
    """One name server restarted and not yet re-registered (brokers register every 30 s) answers TOPIC_NOT_EXIST
    for a topic the other routes: the client asks the other (was: took the first answer, 'no name server knows
    topic')."""
    routed, _ = await start(nursery)
    restarted, _ = await start(nursery)  # never gets a registration
    config: ClientConfig = build_config(ClientConfig, {"namesrv": f"{restarted};{routed}"})
    # The broker's connection stays open: the name server forgets a broker whose registration connection closes.
    async with open_remoting_client() as broker, open_remoting(config) as remoting:
        resp = await broker.invoke(routed, register_request(1, "LEADER"))
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        async with trio.open_nursery() as client_nursery:
            instance = ClientInstance(config, remoting, client_nursery)
            instance.routes._ns_index = 0  # the restarted name server first
            with trio.fail_after(5):
                route = await instance.routes.get("TopicA")
                assert route.broker("broker-a").master_addr == "127.0.0.1:10911"
                with pytest.raises(NoRouteError, match=f"no name server knows topic 'Nope' \\(asked {routed}, "
                                                       f"{restarted}\\)") as e:
                    await instance.routes.get("Nope")
            assert e.value.topic_unknown is True
            instance.closed = True
