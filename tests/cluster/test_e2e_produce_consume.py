"""End to end with real processes: a name server and the 3-node group broker-a, our client in this process.

20,000 messages are produced with acknowledgements while a consumer group of two members consumes them; a
third member joins half way. Every acknowledged message must be consumed, each member must see each queue's
messages in queue-offset order, and the third member must get queues (a rebalance) without anything lost.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from client import Message, MessageQueue, SendFailedError, open_admin, open_producer, open_push_consumer
from raftmq.commands.dev import NODE_IDS, plan_ports, write_broker_configs
from remoting.errors import RaftMQError
from remoting.message import parse_msg_id
from tests.procs import ServerProcess, raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.load, pytest.mark.slow]

GROUP = "broker-a"


class Cluster:
    """A name server and a 3-node group started with ``spawn`` (so always stopped by PID); nodes can be killed
    with SIGKILL and restarted on the same data."""

    def __init__(self, spawn, data_dir: Path, overrides: dict[str, str] | None = None) -> None:
        self._spawn = spawn
        # broker config overrides for every node (``raftmq broker --set KEY=VALUE``)
        self._set_args = [arg for key, value in (overrides or {}).items() for arg in ("--set", f"{key}={value}")]
        data_dir.mkdir(parents=True, exist_ok=True)
        state = plan_ports(data_dir, 0)
        self.paths = dict(zip(NODE_IDS, write_broker_configs(data_dir, state)))
        self.namesrv = f"127.0.0.1:{state['ports']['namesrv']}"
        self.namesrv_proc = spawn(raftmq_argv("namesrv", "--listen", self.namesrv))
        self.nodes: dict[str, ServerProcess] = {}
        self.addr_of: dict[str, str] = {}
        for nid in NODE_IDS:
            self.start(nid)

    def start(self, nid: str, *extra_args: str) -> ServerProcess:
        proc = self._spawn(raftmq_argv("broker", "--config", str(self.paths[nid]), *self._set_args, *extra_args),
                           ready_timeout_s=60)
        self.nodes[nid] = proc
        self.addr_of[nid] = proc.fields["listen"]
        return proc

    def node_at(self, addr: str) -> str:
        return next(nid for nid, a in self.addr_of.items() if a == addr)

    async def leader_addr(self, timeout_s: float = 20.0) -> str:
        """The address the name servers route as master, once one is registered."""
        async with open_admin(self.namesrv) as admin:
            return await routed_master(admin, timeout_s)

    async def create_topic(self, topic: str, queues: int, timeout_s: float = 30.0) -> None:
        async with open_admin(self.namesrv) as admin:
            with trio.fail_after(timeout_s):
                while True:
                    try:
                        if await admin.create_topic(topic, read_queue_nums=queues, write_queue_nums=queues):
                            return
                    except RaftMQError:
                        pass
                    await trio.sleep(0.2)


async def routed_master(admin, timeout_s: float = 20.0) -> str:
    """The address ``admin``'s name servers route as ``GROUP``'s master, once one is registered."""
    with trio.fail_after(timeout_s):
        while True:
            try:
                addr = (await admin.cluster_info()).master_addr(GROUP)
                if addr:
                    return addr
            except RaftMQError:
                pass
            await trio.sleep(0.1)


async def verify_output(argv: list[str], timeout_s: float = 60.0) -> bytes:
    """Run a ``raftmq verify`` command line until it passes (a node back from a stop or a cut may still be
    catching up on the last sends) or ``timeout_s`` runs out; the last run's output, stdout then stderr."""
    output = b""
    with trio.move_on_after(timeout_s):
        while True:
            done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
            output = done.stdout + done.stderr
            if done.returncode == 0:
                break
            await trio.sleep(0.5)
    return output


# The push consumer of a load that faults interrupt: it starts at the first message (every acknowledged one must
# be consumed), rebalances and commits often, and holds pulls briefly so it notices a dead node soon.
LOAD_CONSUMER_OPTIONS = {"consume_from_where": "CONSUME_FROM_FIRST_OFFSET", "rebalance_interval_ms": 500,
                         "persist_consumer_offset_interval_ms": 200, "broker_suspend_max_time_ms": 1000}


async def send_until(producer, topic: str, k: int, stop: trio.Event, acked: dict[str, float],
                     ack_log: list[tuple[float, str]], failed: list[str], *, body_size: int = 0,
                     pause_s: float = 0.002, failure_log: list[tuple[float, float, str]] | None = None) -> None:
    """Sender ``k`` of a failover test, until ``stop``: each acknowledged message's id and time go into
    ``acked``, (that time, the address of the node that stored it) into ``ack_log``, and each failed send's
    error class into ``failed`` (and, given ``failure_log``, when it was sent, when it failed, and the error's
    text). Bodies are padded to ``body_size``; ``pause_s`` follows each acknowledgement (the default, with ~8
    senders, is a few hundred sends a second each: load without starving the brokers)."""
    i = 0
    while not stop.is_set():
        i += 1
        sent_at = time.monotonic()
        try:
            r = await producer.send(Message(topic, (b"%02d-%08d" % (k, i)).ljust(body_size, b".")))
        except (SendFailedError, RaftMQError) as e:
            failed.append(type(getattr(e, "last_error", None) or e).__name__)
            if failure_log is not None:
                failure_log.append((sent_at, time.monotonic(), str(e)))
            await trio.sleep(0.01)
            continue
        now = time.monotonic()
        acked[r.msg_id] = now
        (store_ip, store_port), _ = parse_msg_id(r.offset_msg_id)
        ack_log.append((now, f"{store_ip}:{store_port}"))
        await trio.sleep(pause_s)


@dataclass
class LoadLedger:
    """What a load interrupted by faults saw: each acknowledged message id with its time, (that time, the node
    that stored it) per acknowledgement, consumption counts, and the error class of each failed send. ``stop``
    ends the senders."""

    acked: dict[str, float] = field(default_factory=dict)
    ack_log: list[tuple[float, str]] = field(default_factory=list)
    consumed: Counter[str] = field(default_factory=Counter)
    failed: list[str] = field(default_factory=list)
    failure_log: list[tuple[float, float, str]] = field(default_factory=list)  # failed sends: sent, failed, error
    stop: trio.Event = field(default_factory=trio.Event)

    async def on_message(self, msg) -> None:
        self.consumed[msg.msg_id] += 1

    def start_senders(self, nursery: trio.Nursery, producer, topic: str, count: int = 8, **options: Any) -> None:
        """``count`` senders (``send_until``; ``options`` are its body_size and pause_s)."""
        for k in range(count):
            nursery.start_soon(functools.partial(send_until, failure_log=self.failure_log, **options), producer,
                               topic, k, self.stop, self.acked, self.ack_log, self.failed)

    def acks_between(self, t0: float, t1: float, addr: str | None = None) -> int:
        """Acknowledgements after ``t0`` and before ``t1`` (of messages stored by ``addr``, if given)."""
        return sum(1 for t, a in self.ack_log if t0 < t < t1 and (addr is None or a == addr))

    async def first_ack_after(self, t0: float, not_by: str, timeout_s: float = 30.0) -> float:
        """Seconds from ``t0`` to the first acknowledgement stored by a node other than ``not_by``."""
        with trio.fail_after(timeout_s):
            while not (later := [t for t, addr in self.ack_log if t > t0 and addr != not_by]):
                await trio.sleep(0.01)
        return min(later) - t0

    async def wait_consumed(self, timeout_s: float = 60.0) -> None:
        with trio.move_on_after(timeout_s):
            while not set(self.acked) <= set(self.consumed):
                await trio.sleep(0.2)

    def missing(self) -> set[str]:
        return set(self.acked) - set(self.consumed)

    def duplicates(self) -> int:
        return sum(c - 1 for c in self.consumed.values() if c > 1)


@asynccontextmanager
async def under_load(cluster: Cluster, topic: str, consumer_group: str, *,
                     producer_options: dict[str, Any] | None = None, consumer_options: dict[str, Any] | None = None,
                     **sender_options: Any) -> AsyncIterator[LoadLedger]:
    """A producer with 8 senders and a push consumer (``LOAD_CONSUMER_OPTIONS``) on ``topic``, recorded in the
    ledger yielded. Leaving stops the senders, then waits (60 s at most) until every acknowledged message is
    consumed. ``producer_options`` go to the producer, ``consumer_options`` to the consumer (over
    ``LOAD_CONSUMER_OPTIONS``), ``sender_options`` to ``send_until``. ``cluster`` needs only ``namesrv``."""
    load = LoadLedger()
    async with open_producer(cluster.namesrv, retry_backoff_ms=20, **(producer_options or {})) as producer, \
            open_push_consumer(cluster.namesrv, topic=topic, handler=load.on_message, consumer_group=consumer_group,
                               **{**LOAD_CONSUMER_OPTIONS, **(consumer_options or {})}):
        async with trio.open_nursery() as nursery:
            load.start_senders(nursery, producer, topic, **sender_options)
            yield load
            load.stop.set()
        await load.wait_consumed()


async def start_cluster(spawn, tmp_path, overrides: dict[str, str] | None = None) -> Cluster:
    cluster = await trio.to_thread.run_sync(Cluster, spawn, tmp_path / "cluster", overrides)
    await cluster.leader_addr()
    return cluster


@pytest.mark.timeout(240)
async def test_20k_messages_two_members_then_a_third_joins(spawn, tmp_path, figure):
    cluster = await start_cluster(spawn, tmp_path)
    topic, total = "E2ETopic", 20_000
    await cluster.create_topic(topic, 8)

    deliveries: dict[str, list[tuple[MessageQueue, int, bytes]]] = {"c1": [], "c2": [], "c3": []}
    consumed: set[bytes] = set()
    all_consumed = trio.Event()

    def handler(name: str):
        async def on_message(msg) -> None:
            deliveries[name].append((msg.message_queue, msg.queue_offset, msg.body))
            consumed.add(msg.body)
            if len(consumed) >= total:
                all_consumed.set()
        return on_message

    opts = dict(consumer_group="e2e_group", consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                rebalance_interval_ms=500, persist_consumer_offset_interval_ms=200, pull_batch_size=32)
    acked: dict[bytes, tuple[MessageQueue, int]] = {}
    third_assigned: list[MessageQueue] = []
    started = time.monotonic()
    async with open_producer(cluster.namesrv) as producer, \
            open_push_consumer(cluster.namesrv, topic=topic, handler=handler("c1"), **opts), \
            open_push_consumer(cluster.namesrv, topic=topic, handler=handler("c2"), **opts):

        async def produce(lo: int, hi: int, workers: int = 32) -> None:
            async def worker(k: int) -> None:
                for i in range(lo + k, hi, workers):
                    body = b"%08d" % i
                    for _ in range(5):
                        try:
                            r = await producer.send(Message(topic, body, tags="TagA"))
                            break
                        except SendFailedError:
                            await trio.sleep(0.1)
                    else:
                        raise AssertionError(f"message {i} could not be sent in 5 tries")
                    acked[body] = (r.message_queue, r.queue_offset)

            async with trio.open_nursery() as nursery:
                for k in range(workers):
                    nursery.start_soon(worker, k)

        await produce(0, total // 2)
        half_at = time.monotonic() - started
        async with open_push_consumer(cluster.namesrv, topic=topic, handler=handler("c3"), **opts) as c3:
            await produce(total // 2, total)
            with trio.fail_after(120):
                await all_consumed.wait()
            third_assigned = c3.assigned_queues()
    elapsed = time.monotonic() - started

    assert len(acked) == total
    assert consumed == set(acked), f"{len(set(acked) - consumed)} acknowledged messages were never consumed"
    # Each member sees each queue in offset order, and a message is where its send said it was stored.
    for name, msgs in deliveries.items():
        last: dict[MessageQueue, int] = {}
        for mq, offset, body in msgs:
            if mq in last and offset <= last[mq]:
                raise AssertionError(f"{name} saw {mq} offset {offset} after {last[mq]}")
            last[mq] = offset
            assert acked[body] == (mq, offset)
    assert third_assigned, "the third member never got a queue: no rebalance"
    assert deliveries["c3"], "the third member consumed nothing"
    counts = Counter(body for msgs in deliveries.values() for _, _, body in msgs)
    duplicates = sum(c - 1 for c in counts.values())
    figure(f"20k e2e: first half acked after {half_at:.1f}s, all consumed after {elapsed:.1f}s; per member "
           f"{[len(v) for v in deliveries.values()]}; duplicates {duplicates}; "
           f"third member queues {len(third_assigned)}")
