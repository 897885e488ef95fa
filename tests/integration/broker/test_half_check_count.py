"""A half message starts at no check, whatever its producer sent: TRANSACTION_CHECK_TIMES is the broker's count. A
message committed after check-backs is delivered with it, and republished as a transaction (or set by hand) it had
the half discarded at the first check round, its producer never asked (found by review)."""

from __future__ import annotations

import trio

from remoting.codes import ResponseCode
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, start_broker, wait_leader
from tests.integration.broker.test_transactions import RawProducer, heartbeat_producer, pull, send_half


async def test_a_producers_check_count_on_a_half_is_not_the_brokers(nursery, tmp_path):
    (config,) = broker_configs(tmp_path, None, transaction_timeout_ms=300, transaction_check_interval_ms=100,
                               transaction_check_max=2)
    addr = await start_broker(nursery, config)
    producer = RawProducer()
    async with open_remoting_client(handler=producer) as client:
        await wait_leader(client, addr)
        await heartbeat_producer(client, addr)
        r = await send_half(client, addr, "x1", TRANSACTION_CHECK_TIMES="2")
        assert r.code == ResponseCode.SUCCESS, r.remark
        # Checked transaction_check_max times (nobody answers), then discarded: asked, not set aside at once.
        with trio.fail_after(10):
            while True:
                dead, _ = await pull(client, addr, "TRANS_CHECK_MAX_TIME_TOPIC", 0)
                if dead:
                    break
                await trio.sleep(0.05)
        assert len(producer.checks) == 2, producer.checks
