"""``raftmq bench produce|consume`` against a cluster it cannot use: one sentence and exit 1, not a
trio.TooSlowError traceback out of nested exception groups (what an unreachable --namesrv gave after 30 s)."""

from __future__ import annotations

import pytest
import trio

from raftmq.bench.common import BenchError, run_bench
from raftmq.bench.produce import ensure_topic


def test_an_unreachable_name_server_ends_the_bench_with_one_sentence():
    async def main() -> None:
        await ensure_topic("127.0.0.1:1", "BenchTopic", 8, timeout_s=0.5)  # nothing listens on port 1

    with pytest.raises(SystemExit) as exit_info:
        run_bench("produce", main)
    message = str(exit_info.value.code)
    assert message.startswith("raftmq bench produce: error: the cluster behind name server 127.0.0.1:1 did not "
                              "take topic 'BenchTopic' within 0.5 s; last error: could not connect to 127.0.0.1:1")


def test_a_bench_error_inside_a_nursery_is_found_and_anything_else_is_raised():
    async def nested() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            raise BenchError("the backlog of 10 messages was not produced within 1 s (3 sent)")

    with pytest.raises(SystemExit, match=r"^raftmq bench consume: error: the backlog of 10 messages"):
        run_bench("consume", nested)

    async def broken() -> None:
        raise KeyError("a bug stays a traceback")

    with pytest.raises(KeyError):
        run_bench("consume", broken)
