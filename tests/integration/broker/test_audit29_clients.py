"""Over the wire: one connection is one member of a group, and a group whose members all left is gone."""

from __future__ import annotations

import cbor2
import trio

from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from broker import long_polling
from remoting.transport import open_connection, open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, wait_leader
from tests.integration.broker.test_broker_node import _send


async def _runtime(client, addr):
    return cbor2.loads((await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)).body)


async def test_fresh_client_ids_over_one_connection_make_one_member_and_leave_nothing_behind(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        async with open_connection(addr) as conn:
            for i in range(300):
                hb = {"client_id": f"c{i}", "producers": [{"producer_group": f"pg{i}"}],
                      "consumers": [{"consumer_group": f"g{i % 3}", "subscriptions": [{"topic": f"T{i}"}]}]}
                r = await conn.invoke(make_request(RequestCode.HEART_BEAT, body=cbor2.dumps(hb)))
                assert r.code == ResponseCode.SUCCESS, r.remark
            r = await call(client, addr, RequestCode.GET_CONSUMER_LIST_BY_GROUP, {"consumer_group": "g0"})
            assert cbor2.loads(r.body)["consumer_id_list"] == ["c297"]  # was all 100 ids g0 was sent with
            r = await call(client, addr, RequestCode.GET_CONSUMER_CONNECTION_LIST, {"consumer_group": "g0"})
            assert [s["topic"] for s in cbor2.loads(r.body)["subscriptions"]] == ["T297"]
            assert (await _runtime(client, addr))["consumer_groups"] == 3
        with trio.fail_after(5):  # liveness: the close reaches the broker a moment later
            while (await _runtime(client, addr))["consumer_groups"]:
                await trio.sleep(0.02)
        r = await call(client, addr, RequestCode.GET_CONSUMER_CONNECTION_LIST, {"consumer_group": "g0"})
        assert r.code == ResponseCode.CONSUMER_NOT_ONLINE


async def test_one_connection_holds_a_bounded_number_of_pulls_and_its_held_pulls_go_with_it(nursery, tmp_path,
                                                                                          monkeypatch):
    # A hold far longer than the test: only the per-connection bound can answer the oldest pull. The bound lowered
    # (16,384 pulls cost seconds here), as the node reads it when it starts.
    monkeypatch.setattr(long_polling, "MAX_HELD_PER_CONNECTION", 256)
    (config,) = broker_configs(tmp_path, None, long_polling_timeout_ms=60_000, long_polling_check_interval_ms=100)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        assert (await _send(client, addr)).code == ResponseCode.SUCCESS
        pull = {"consumer_group": "cg", "topic": "TopicTest", "queue_id": 0, "queue_offset": 1, "max_msg_nums": 32,
                "sys_flag": 0x2, "suspend_timeout_millis": 60_000}
        answered: list[int] = []
        async with open_connection(addr) as conn:

            async def held(i: int) -> None:
                response = await conn.invoke(make_request(RequestCode.PULL_MESSAGE, ext=pull), timeout_s=None)
                answered.append(i)
                assert response.code == ResponseCode.PULL_NOT_FOUND

            async with trio.open_nursery() as pulls:
                for i in range(long_polling.MAX_HELD_PER_CONNECTION + 1):
                    pulls.start_soon(held, i)
                    await trio.sleep(0)  # the pulls leave in this order
                with trio.fail_after(20):  # liveness: the last one sent pushes the first one out
                    while not answered:
                        await trio.sleep(0.05)
                assert answered == [0]
                pulls.cancel_scope.cancel()
        info = await _runtime(client, addr)
        assert info["long_polling_resumed_by_timeout"] == 1
        await trio.sleep(0.5)  # a few periodic checks: they drop the closed connection's pulls, unanswered
        # A message the dropped pulls waited for: none of them is resumed (each was, at its connection's cost).
        assert (await _send(client, addr)).code == ResponseCode.SUCCESS
        await trio.sleep(0.5)
        info = await _runtime(client, addr)
        assert info["long_polling_resumed_by_arrival"] == 0
