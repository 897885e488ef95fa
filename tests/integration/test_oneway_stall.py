"""send_oneway to a leader that stopped reading (a stopped process keeps its connections open): bounded by
send_msg_timeout_ms, and the stuck connection is closed once it has been silent long enough."""

from __future__ import annotations

import os

import trio

from client import Message, open_producer
from remoting.errors import RequestTimeoutError


async def test_send_oneway_to_a_node_that_reads_nothing_times_out_and_its_connection_is_closed(nursery):
    # It blocked for good: the connection's write queue was full, and a wait for room had no deadline.
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    addr = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"

    async def hold(stream: trio.SocketStream) -> None:
        async with stream:
            await trio.sleep_forever()

    nursery.start_soon(trio.serve_listeners, hold, listeners)
    body = os.urandom(1 << 20)  # random: not compressed
    async with open_producer("127.0.0.1:1", send_msg_timeout_ms=300, heartbeat_broker_interval_ms=60_000) as p:
        await trio.sleep(0.1)  # the first heartbeat round, with no broker known yet: none is waiting meanwhile
        p.routes.install_default("T", {"broker-a": {0: addr}}, 4)
        await p.send_oneway(Message("T", body))
        conn = p._instance.remoting.connections()[addr]
        timeouts = 0
        with trio.fail_after(30):  # a guard against the hang this fixes, not a bound on the time taken
            while not conn.closed:  # closed once silent for a whole deadline and over a second
                try:
                    await p.send_oneway(Message("T", body))
                except RequestTimeoutError as e:
                    assert e.retriable and "was not sent within send_msg_timeout_ms (0.3 s)" in str(e), e
                    timeouts += 1
        assert timeouts >= 1 and "nothing received for" in conn.close_reason, conn.close_reason
