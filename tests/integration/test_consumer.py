"""The push and pull consumers against a broker node (a single-member group) and a name server in-process."""

from __future__ import annotations

import cbor2
import trio

from client import Message, open_producer, open_push_consumer
from remoting.codes import RequestCode, ResponseCode
from remoting.transport import open_remoting_client
from tests.integration.broker.helpers import broker_configs, call, start_broker, start_namesrv


async def _start(nursery, tmp_path, **overrides) -> tuple[str, str]:
    """A name server and a broker node that leads; (name server address, broker address)."""
    namesrv = await start_namesrv(nursery)
    (config,) = broker_configs(tmp_path, namesrv, **overrides)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        with trio.fail_after(10):
            while True:
                r = await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)
                if r.code == ResponseCode.SUCCESS and cbor2.loads(r.body)["role"] == "LEADER":
                    break
                await trio.sleep(0.05)
    return namesrv, addr


async def _receive(consumer, body: bytes, timeout_s: float = 3.0) -> list[bytes]:
    """What ``consumer`` delivers until ``body`` (or ``timeout_s``)."""
    got = []
    with trio.move_on_after(timeout_s):
        async for msg in consumer:
            got.append(msg.body)
            if msg.body == body:
                break
    return got


async def test_a_new_group_from_the_last_offset_consumes_what_is_sent_once_it_has_opened(nursery, tmp_path):
    """CONSUME_FROM_LAST_OFFSET skips the backlog, not messages sent after open_push_consumer returned (was:
    each queue's start was looked up by its pull task, after such a send, so the message was skipped)."""
    namesrv, _ = await _start(nursery, tmp_path)
    async with open_producer(namesrv) as producer:
        for i in range(8):
            await producer.send(Message("Backlog", b"old%d" % i))
        for trial in range(3):
            async with open_push_consumer(namesrv, topic="Backlog", consumer_group=f"new_group_{trial}",
                                          broker_suspend_max_time_ms=300) as consumer:
                await producer.send(Message("Backlog", b"new%d" % trial))
                assert await _receive(consumer, b"new%d" % trial) == [b"new%d" % trial]
