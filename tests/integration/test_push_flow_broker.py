"""suspend() against a broker node in-process: a pull the broker holds (long polling) is cancelled by suspend(), so a
message sent while suspended is not delivered, and the broker's late answer to it does no harm: after resume() the
message comes, on the same connection. The rest of the push consumer's pull-side controls are unit-tested on the
fake cluster (tests/unit/client/test_push_flow.py)."""

from __future__ import annotations

import trio

from client import Message, MessageQueue, open_producer, open_push_consumer
from tests.integration.broker.helpers import start_leading_node


async def test_suspend_cancels_a_pull_held_on_a_real_broker_and_resume_pulls_again(nursery, tmp_path):
    namesrv, _ = await start_leading_node(nursery, tmp_path)
    mq = MessageQueue("Paused", "broker-a", 0)
    async with open_producer(namesrv) as producer:
        await producer.send(Message("Paused", b"before"), queue=mq)
        async with open_push_consumer(namesrv, topic="Paused", consumer_group="paused",
                                      consume_from_where="CONSUME_FROM_FIRST_OFFSET") as consumer:
            assert (await consumer.__anext__()).body == b"before"
            await trio.sleep(0.3)  # the next pull is held on the broker (15 s)
            consumer.suspend()
            pulls = consumer.statistics().pulls
            await producer.send(Message("Paused", b"while suspended"), queue=mq)
            # The held pull would have been answered with it at once (the broker wakes held pulls on arrival).
            with trio.move_on_after(1):
                msg = await consumer.__anext__()
                raise AssertionError(f"delivered while suspended: {msg.body!r}")
            assert consumer.statistics().pulls == pulls and consumer.statistics().suspended
            consumer.resume()
            with trio.fail_after(30):  # a guard against hanging, not a measure: it comes at once
                assert (await consumer.__anext__()).body == b"while suspended"
