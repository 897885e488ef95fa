"""``raftmq bench consume``: how fast one push consumer drains a backlog, and end-to-end latency while live.

First ``--messages`` messages are produced with ``send_batch`` (a backlog, not measured) to a fresh topic (unless
``--topic`` names one), then a push consumer of a fresh group starts from the first offset and consumes until it
has them all or ``--seconds`` pass. The throughput is messages consumed per second over a window that opens
before the consumer does (its start, route lookup and first rebalance included: opening it starts its pulls) and
ends with the last message; the CPU figures are sampled at both ends of that window. Latency is "consumed −
born" per message, which for a backlog mostly measures its age: use ``--live`` to produce and consume at the same
time and read it as end-to-end latency.

``--simple N`` consumes with N concurrent ``receive`` loops of one simple consumer (RocketMQ 5's POP: each message
received is then acked, one ACK_MESSAGE each, as an application does) instead of the push consumer: every POP and
every ACK is a replicated write of the group's POP table, so this measures POP's own cost. With ``--ack-batch`` each
loop acks what one receive returned with one ``ack_batch`` (BATCH_ACK_MESSAGE: one replicated write for all of
them) instead: the two measure what batching acks saves.
"""

from __future__ import annotations

import argparse
import logging
import time
import uuid

import trio

from client import Message, ReceivedMessage, open_producer, open_push_consumer, open_simple_consumer
from raftmq.bench.common import (BenchError, check_range, exported_credentials, machine_speed, run_bench,
                                 summarize_latencies)
from raftmq.bench.produce import (BenchReport, add_cluster_args, bench_cluster, check_cluster_args, cpu_per_message,
                                  cpu_sample, ensure_topic, progress, report)
from remoting.config import ConfigError

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser("consume", help="push-consumer throughput over a backlog (msgs/s, MB/s)")
    add_cluster_args(parser)
    parser.add_argument("--size", type=int, default=1024, help="message body bytes (default 1024)")
    parser.add_argument("--messages", type=int, default=500_000, help="messages to produce and consume")
    parser.add_argument("--seconds", type=float, default=60.0, help="longest consume phase (default 60)")
    parser.add_argument("--pull-batch", type=int, default=None,
                        help="messages per pull (default 64), or per receive with --simple (default and at most 32)")
    parser.add_argument("--live", action="store_true", help="produce while consuming (latency = end to end)")
    parser.add_argument("--simple", type=int, default=0, metavar="N",
                        help="consume with a simple consumer (POP) and N concurrent receive-and-ack loops instead "
                             "of a push consumer (messages per receive: --pull-batch, at most 32)")
    parser.add_argument("--ack-batch", action="store_true",
                        help="with --simple: ack what each receive returned with one batch ack, not one ack each")
    # A fresh topic per run unless one is named: the consumer starts at the first offset, and on a cluster that
    # served earlier benches a shared topic would hand it their (older, colder) messages, not its backlog.
    parser.set_defaults(func=run, topic=None)
    for action in parser._actions:
        if action.dest == "topic":
            action.help = ("topic (created if no name server routes it, else used as it is; default: a fresh topic "
                           "per run; a named topic's older messages are consumed too)")


async def _produce(namesrv: str, args: argparse.Namespace, sent: dict) -> None:
    body = b"x" * args.size
    # One batch must fit one Raft entry (64 KiB by default, headers included): stay well under it.
    per_batch = max(1, min(32, 48_000 // (args.size + 200)))

    async with open_producer(namesrv, producer_group="bench_consume_producer") as producer:
        async def worker(n_batches: int) -> None:
            for _ in range(n_batches):
                await producer.send_batch([Message(args.topic, body) for _ in range(per_batch)])
                sent["n"] += per_batch

        batches = -(-args.messages // per_batch)
        workers = 16
        async with trio.open_nursery() as nursery:
            for i in range(workers):
                nursery.start_soon(worker, batches // workers + (1 if i < batches % workers else 0))


async def consume(namesrv: str, args: argparse.Namespace) -> BenchReport:
    machine = machine_speed()
    if args.topic is None:
        args.topic = f"BenchConsume_{uuid.uuid4().hex[:8]}"
    await ensure_topic(namesrv, args.topic, args.queues)
    sent = {"n": 0}
    if not args.live:
        backlog_s = max(args.seconds, 600)
        with trio.move_on_after(backlog_s) as backlog:
            started = time.monotonic()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_produce, namesrv, args, sent)
                nursery.start_soon(progress, "producing backlog", 600, lambda: sent["n"])
                while sent["n"] < args.messages:
                    await trio.sleep(0.1)
                nursery.cancel_scope.cancel()
            log.info("backlog of %d produced in %.1fs", sent["n"], time.monotonic() - started)
        if backlog.cancelled_caught:
            raise BenchError(f"the backlog of {args.messages} messages was not produced within {backlog_s:g} s "
                             f"({sent['n']} sent)")
    target = args.messages
    latencies: list[int] = []
    got = {"n": 0}
    group = f"bench_consume_{uuid.uuid4().hex[:8]}"
    if args.simple:
        return await _consume_simple(namesrv, args, group, machine, sent, got, latencies)
    # The window opens before the consumer does: opening it starts its rebalance and pulls, and a window opened
    # after that found part of the backlog consumed already (2,000 messages read as 272k msgs/s). So it includes
    # the consumer's start (route, rebalance, first pulls), which draining a backlog takes.
    cpu_before = await cpu_sample(namesrv)
    started = trio.current_time()
    async with open_push_consumer(namesrv, topic=args.topic, consumer_group=group,
                                  consume_from_where="CONSUME_FROM_FIRST_OFFSET" if not args.live
                                  else "CONSUME_FROM_LAST_OFFSET",
                                  pull_batch_size=args.pull_batch, pull_threshold_for_queue=4 * args.pull_batch,
                                  rebalance_interval_ms=1000) as consumer:
        async with trio.open_nursery() as nursery:
            if args.live:
                nursery.start_soon(_produce, namesrv, args, sent)
            nursery.start_soon(progress, "consuming", args.seconds, lambda: got["n"])
            with trio.move_on_at(started + args.seconds):
                async for msg in consumer:
                    got["n"] += 1
                    if got["n"] % 16 == 0:
                        latencies.append(max(0, time.time_ns() - msg.born_timestamp * 1_000_000))
                    if got["n"] >= target:
                        break
            elapsed = trio.current_time() - started
            nursery.cancel_scope.cancel()
        cpu = cpu_per_message(cpu_before, await cpu_sample(namesrv), got["n"])
    return BenchReport("consume", got["n"], got["n"] * args.size, elapsed, summarize_latencies(latencies),
                       target - got["n"],
                       {"size": args.size, "pull_batch": args.pull_batch, "live": args.live}, cpu_us_per_msg=cpu,
                       machine=machine)


async def _consume_simple(namesrv: str, args: argparse.Namespace, group: str, machine: dict, sent: dict, got: dict,
                          latencies: list[int]) -> BenchReport:
    target = args.messages
    # As for the push consumer, the window opens before the consumer does (a simple consumer takes nothing before
    # its first receive, but its start is part of the run all the same).
    cpu_before = await cpu_sample(namesrv)
    started = trio.current_time()
    async with open_simple_consumer(namesrv, consumer_group=group, subscriptions={args.topic: "*"},
                                    await_duration_ms=1000,
                                    consume_from_where="CONSUME_FROM_FIRST_OFFSET" if not args.live
                                    else "CONSUME_FROM_LAST_OFFSET") as consumer:
        done = trio.Event()

        def acked(msg: ReceivedMessage) -> None:
            if done.is_set():
                return  # another loop reached the target (the backlog is rounded up to whole send batches)
            got["n"] += 1
            if got["n"] % 16 == 0:
                latencies.append(max(0, time.time_ns() - msg.born_timestamp * 1_000_000))
            if got["n"] >= target:
                done.set()

        async def receiver() -> None:
            while not done.is_set():
                received = await consumer.receive(args.pull_batch, invisible_duration_ms=60_000)
                if args.ack_batch:
                    errors = await consumer.ack_batch(received) if received else []
                    for msg, error in zip(received, errors):
                        if error is not None:
                            raise error  # as a failed ack() stops the run: not counted as consumed
                        acked(msg)
                    continue
                for msg in received:
                    await consumer.ack(msg)
                    acked(msg)

        async with trio.open_nursery() as nursery:
            if args.live:
                nursery.start_soon(_produce, namesrv, args, sent)
            nursery.start_soon(progress, "receiving and acking", args.seconds, lambda: got["n"])
            with trio.move_on_at(started + args.seconds):
                async with trio.open_nursery() as receivers:
                    for _ in range(args.simple):
                        receivers.start_soon(receiver)
                    await done.wait()
                    receivers.cancel_scope.cancel()
            elapsed = trio.current_time() - started
            nursery.cancel_scope.cancel()
        cpu = cpu_per_message(cpu_before, await cpu_sample(namesrv), got["n"])
    return BenchReport("consume", got["n"], got["n"] * args.size, elapsed, summarize_latencies(latencies),
                       target - got["n"], {"size": args.size, "pull_batch": args.pull_batch, "live": args.live,
                                           "simple": args.simple, "ack_batch": args.ack_batch},
                       cpu_us_per_msg=cpu, machine=machine)


def run(args: argparse.Namespace) -> int:
    check_range("--size", args.size, 1, 4 * 1024 * 1024)
    check_range("--messages", args.messages, 1, 10**9)
    check_range("--seconds", args.seconds, 0.1, 3600)
    check_range("--simple", args.simple, 0, 256)
    if args.pull_batch is None:
        args.pull_batch = 32 if args.simple else 64
    check_range("--pull-batch", args.pull_batch, 1, 1024)
    if args.simple:
        check_range("--pull-batch", args.pull_batch, 1, 32)  # a POP takes at most 32
    elif args.ack_batch:
        raise ConfigError("--ack-batch acks what a simple consumer receives: it needs --simple N")
    check_cluster_args(args)

    async def main() -> BenchReport:
        async with bench_cluster(args) as namesrv:
            return await consume(namesrv, args)

    with exported_credentials(args):
        result = run_bench("consume", main, as_json=args.json)
    report(result, as_json=args.json)
    return 0
