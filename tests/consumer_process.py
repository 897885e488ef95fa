"""A push consumer in a process of its own, for tests that SIGKILL a consumer (``python -m tests.consumer_process``).

It prints ``ready kind=consumer pid=... client_id=...`` once ``open_push_consumer`` has returned, then appends the
body of each message its handler has processed to ``--out`` as one line (written and flushed before the handler
returns, so a line exists for every message whose offset may have been committed). ``--delay-ms`` makes each
message take that long, so a kill lands in the middle of a pulled batch. With ``--times`` each line also carries when
the handler started and ended (``time.monotonic_ns()``, one clock for every process of the machine), for tests that
check no two members handle a key at once (``--option orderly=true``), and a handler the consumer cancels midway
writes its line too, ending in ``cut``. SIGTERM closes the consumer cleanly
(offsets committed); it also stops by itself once the process that started it is gone.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

import trio

from client import open_push_consumer
from raftmq.runner import PARENT_PID_ENV


def _option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    if value in ("true", "false"):
        return key, value == "true"
    return key, int(value) if value.lstrip("-").isdigit() else value


async def _main(args: argparse.Namespace) -> None:
    options = dict(_option(o) for o in args.option)
    out = open(args.out, "a", encoding="ascii")

    async def handler(msg) -> None:
        started_ns = time.monotonic_ns()
        line = msg.body.decode("ascii")
        try:
            if args.delay_ms:
                await trio.sleep(args.delay_ms / 1000)
        except trio.Cancelled:
            if args.times:  # a handling cut off (the consumer cancelled its handler): it was begun all the same
                out.write(f"{line} {started_ns} {time.monotonic_ns()} cut\n")
                out.flush()
            raise
        if args.times:
            line += f" {started_ns} {time.monotonic_ns()}"
        out.write(line + "\n")
        out.flush()

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with open_push_consumer(args.namesrv, topic=args.topic, expression=args.expression, handler=handler,
                                      consumer_group=args.group, **options) as consumer:
            print(f"ready kind=consumer pid={os.getpid()} client_id={consumer.client_id}", flush=True)
            await run_until_stopped(signals)
    out.close()


async def run_until_stopped(signals: Any) -> None:
    """Return at the first SIGTERM/SIGINT from ``signals`` or once the process that started this one is gone (a
    client process of a test must not outlive it)."""
    parent = int(os.environ.get(PARENT_PID_ENV, "0") or 0)
    async with trio.open_nursery() as nursery:
        async def watch_parent() -> None:
            while not parent or os.getppid() == parent:
                await trio.sleep(0.5)
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch_parent)
        async for _ in signals:
            nursery.cancel_scope.cancel()
            break


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.consumer_process")
    parser.add_argument("--namesrv", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--expression", default="*")
    parser.add_argument("--delay-ms", type=int, default=0)
    parser.add_argument("--times", action="store_true", help="write each line as BODY START_NS END_NS [cut]")
    parser.add_argument("--option", action="append", default=[], help="a PushConsumerConfig field, KEY=VALUE")
    trio.run(_main, parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
