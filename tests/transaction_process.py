"""A transactional producer in a process of its own, for tests that SIGKILL one
(``python -m tests.transaction_process``).

It opens a producer of ``--group`` with a transaction listener, looks up ``--topic``'s route (so its heartbeats
reach the topic's brokers, which send their checks to producers that heartbeat), and prints
``ready kind=transaction-producer pid=...``. Then it sends one transactional message per ``--send KEY`` (body and
key ``KEY``). ``execute`` prints ``executing KEY`` and, with ``--hang``, never returns, so a SIGKILL lands after
the half message is stored and before its END_TRANSACTION. ``check`` answers COMMIT for keys starting with
"commit", ROLLBACK otherwise, and prints ``checked KEY STATE`` (each line flushed at once). SIGTERM closes the
producer cleanly; it also stops by itself once the process that started it is gone.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import trio

from client import Message, MessageExt, TransactionState, open_producer
from tests.consumer_process import run_until_stopped


class _Listener:
    def __init__(self, hang: bool) -> None:
        self.hang = hang

    async def execute(self, msg: Message, arg: object) -> TransactionState:
        print(f"executing {msg.keys}", flush=True)
        if self.hang:
            await trio.sleep_forever()
        return TransactionState.UNKNOWN

    async def check(self, msg: MessageExt) -> TransactionState:
        key = msg.keys[0]
        state = TransactionState.COMMIT if key.startswith("commit") else TransactionState.ROLLBACK
        print(f"checked {key} {state.value}", flush=True)
        return state


async def _main(args: argparse.Namespace) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with open_producer(args.namesrv, producer_group=args.group, transaction_listener=_Listener(args.hang),
                                 heartbeat_broker_interval_ms=200) as producer:
            await producer.fetch_publish_queues(args.topic)
            print(f"ready kind=transaction-producer pid={os.getpid()} client_id={producer.client_id}", flush=True)
            async with trio.open_nursery() as nursery:
                for key in args.send:
                    nursery.start_soon(producer.send_in_transaction, Message(args.topic, key.encode(), keys=key))
                await run_until_stopped(signals)
                nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.transaction_process")
    parser.add_argument("--namesrv", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--send", action="append", default=[], help="send one transactional message, key KEY")
    parser.add_argument("--hang", action="store_true", help="execute never returns")
    trio.run(_main, parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
