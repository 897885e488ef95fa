"""END_TRANSACTION against one in-process broker node, over the wire: a late END after a check round re-stored its
half settles that half's copy and no other transaction sharing its UNIQ_KEY; an END reaching a leader whose no-op
is not applied is answered NOT_LEADER (retriable), not NO_MESSAGE (final)."""

from __future__ import annotations

import functools

import trio

from broker.node import serve_broker
from remoting.codes import RequestCode, ResponseCode
from remoting.message import TRANSACTION_COMMIT_TYPE, TRANSACTION_ROLLBACK_TYPE
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, wait_leader
from tests.integration.broker.test_transactions import RawProducer, end_ext, heartbeat_producer, pull, send_half


async def test_a_late_rollback_does_not_roll_back_another_transaction_with_the_same_key(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None, transaction_timeout_ms=300, transaction_check_interval_ms=100)
    host, port = await nursery.start(functools.partial(serve_broker, config))
    addr = f"{host}:{port}"
    producer = RawProducer()
    async with open_remoting_client(handler=producer) as client:
        await wait_leader(client, addr)
        await heartbeat_producer(client, addr)
        a = await send_half(client, addr, "a", UNIQ_KEY="SHARED-KEY")
        with trio.fail_after(10):
            await producer.arrived.wait()  # A re-stored for a check
        b = await send_half(client, addr, "b", UNIQ_KEY="SHARED-KEY")
        r = await call(client, addr, RequestCode.END_TRANSACTION, end_ext(a, TRANSACTION_ROLLBACK_TYPE))
        assert r.code == ResponseCode.SUCCESS and r.ext["outcome"] == "rolled back", (r.code, r.remark)
        r = await call(client, addr, RequestCode.END_TRANSACTION, end_ext(b, TRANSACTION_COMMIT_TYPE))
        assert r.code == ResponseCode.SUCCESS and r.ext["outcome"] == "committed", (r.code, r.remark)
        assert [m.body for m in (await pull(client, addr, "TxT", 1))[0]] == [b"body-b"]


async def test_an_end_on_a_leader_not_ready_in_time_is_not_leader_not_no_message(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None)
    nodes = []
    host, port = await nursery.start(functools.partial(serve_broker, config, on_serving=nodes.append))
    addr, node = f"{host}:{port}", nodes[0]
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
        applied = await send_half(client, addr, "applied")
        # A half an earlier term acknowledged, which this leader has not applied yet: the next offsets.
        pending = end_ext(applied, TRANSACTION_COMMIT_TYPE)
        pending.update(tran_state_table_offset=applied.ext["queue_offset"] + 1,
                       commit_log_offset=node.store.max_phy_offset)
        node.group._can_propose = lambda: False  # elected, its no-op not applied (and not within the second)
        try:
            r = await call(client, addr, RequestCode.END_TRANSACTION, pending)
        finally:
            del node.group._can_propose
        assert r.code == ResponseCode.NOT_LEADER and "is not the leader" in r.remark, (r.code, r.remark)
        # Ready, the leader answers what it holds: that half does not exist; the one sent is committed.
        r = await call(client, addr, RequestCode.END_TRANSACTION, pending)
        assert r.code == ResponseCode.NO_MESSAGE, (r.code, r.remark)
        r = await call(client, addr, RequestCode.END_TRANSACTION, end_ext(applied, TRANSACTION_COMMIT_TYPE))
        assert r.code == ResponseCode.SUCCESS and r.ext["outcome"] == "committed", (r.code, r.remark)
