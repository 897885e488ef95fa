"""``raftmq chaos``: kill or hang nodes of a cluster under load, and prove that nothing acknowledged is lost.

The command starts a cluster of its own: a name server and the 3-node group ``broker-a``, laid out as
``raftmq dev`` lays them out, in a directory of its own. So every process it signals is one it started; it
never touches anything else. Senders produce acknowledged messages and a push consumer consumes them while
``--rounds`` faults are injected one after another, each on the current leader (``--target leader``), on a
follower or on a random node:

- ``--fault kill``: SIGKILL; after ``--down-seconds`` the node is started again on its data and rejoins.
- ``--fault stop``: SIGSTOP, a hung process whose connections stay open and silent; SIGCONT after
  ``--down-seconds``.
- ``--fault restart``: SIGTERM, a planned restart: the node stops cleanly (a leader hands its leadership to a
  follower first) and after ``--down-seconds`` it is started again on its data. Its exit status must be 0.
- ``--fault rebuild``: SIGKILL, then its store and Raft data are moved aside (as a lost disk, kept under
  ``aside/`` for a post-mortem) and after ``--down-seconds`` it is started empty, without ``--rejoin``: it must
  learn from its peers that the group is not new, keep out of elections until it hears from a leader, and copy
  the group's log (docs/operations.md, "Rebuilding a member").

Each round reports the gap from the fault to the first acknowledgement stored by another node (after a leader
fault: the clients found the new leader) and the longest pause between two acknowledgements. Then the senders
stop, and within ``--drain-seconds`` every acknowledged message must be consumed, and the three members must
report the same non-zero applied end with identical commit logs (crc32c per segment, as ``raftmq verify``).
Consumption proves delivery, not that the group kept a message: then every queue of the topic is read back from
its min offset (pulls of a fresh group, within another ``--drain-seconds``) and every acknowledged message must
be there; one that is not is lost, and counted apart when it had been consumed. Acknowledged means answered
SEND_OK: a send answered otherwise (FLUSH_SLAVE_TIMEOUT, the Raft commit timed out) has an unknown outcome, is
counted apart, and is neither acknowledged nor missing. Delivery is at least once, as in RocketMQ, so
duplicates are counted, not failed.

With ``--tls`` the whole cluster serves TLS only, as ``raftmq dev --tls-dir`` (``raftmq/commands/dev_tls.py``):
certificates made under the data directory, or those of ``--tls-dir DIR``; its clients (senders, consumer, status
and verify requests) then connect over TLS, verifying against the directory's ``ca.pem`` or ``--tls-ca-file``.
Without it everything is plain, and ``--set`` may make the brokers serve TLS with ``tls_mode = "permissive"`` only
(``"enforcing"`` or ``tls_client_enable`` would cut them off from the plain name server: refused as a bad option).

Exit status 0 when nothing acknowledged was missing or lost, the logs are identical, acknowledgements resumed after
every fault and every node stopped with SIGTERM exited 0; 1 otherwise (the data directory is then kept for its
logs); 2 for a bad option.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import logging
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.table import Table

from client import (Message, PullStatus, SendFailedError, SendResult, SendStatus, open_admin, open_producer,
                    open_pull_consumer, open_push_consumer)
from dledger.service import get_raft_status
from raftmq.bench.common import add_tls_args, check_range, check_tls_args, make_dir, print_json
from raftmq.commands.dev import (GROUP, NODE_IDS, DevClusterError, LocalCluster, check_base_port, check_overrides,
                                 plan_ports)
from raftmq.commands.dev_tls import DevTLS, open_tls_dir, refuse_tls_overrides
from raftmq.commands.verify import verify_group
from raftmq.console import PipeConsole
from raftmq.runner import leaf_exceptions, run_interruptible
from remoting.config import ConfigError
from remoting.errors import RaftMQError
from remoting.message import parse_msg_id
from remoting.tls import client_context
from remoting.transport import open_remoting_client

log = logging.getLogger(__name__)

TOPIC = "ChaosTopic"
CONSUMER_GROUP = "chaos_consumer"
# Bounds that keep every wait finite: a failover and the leader lookup (a restarted node gets 60 s to be ready).
FAILOVER_BOUND_S = 30.0
LEADER_LOOKUP_S = 30.0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "chaos", help="kill, hang or restart nodes of a cluster of its own under load; check nothing acknowledged "
                      "is lost",
        description="Start a name server and a 3-node group (raftmq dev's layout) in a directory of their own, "
                    "produce and consume through them, and inject faults one after another: SIGKILL and restart, "
                    "SIGSTOP and SIGCONT, SIGTERM and restart, or SIGKILL and a restart with the data gone, of the "
                    "leader, a follower or a random node. Reports the gap to the first acknowledgement by another "
                    "node after each fault, then checks that every acknowledged message was consumed and that the "
                    "members' commit logs are identical. Exit 0 when they are, 1 otherwise.")
    parser.add_argument("--rounds", type=int, default=5, help="faults to inject, one after another (default 5)")
    parser.add_argument("--fault", choices=("kill", "stop", "restart", "rebuild"), default="kill",
                        help="kill: SIGKILL, then restart on the same data; stop: SIGSTOP, then SIGCONT; "
                             "restart: SIGTERM (a clean stop), then restart on the same data; "
                             "rebuild: SIGKILL, data moved aside, restart empty (default kill)")
    parser.add_argument("--target", choices=("leader", "follower", "random"), default="leader",
                        help="which node each fault hits (default leader)")
    parser.add_argument("--down-seconds", type=float, default=3.0,
                        help="how long a node stays killed or stopped (default 3)")
    parser.add_argument("--settle-seconds", type=float, default=3.0,
                        help="load before the first fault and after each recovery (default 3)")
    parser.add_argument("--senders", type=int, default=8, help="concurrent senders (default 8)")
    parser.add_argument("--pause-ms", type=float, default=2.0,
                        help="pause of each sender after an acknowledgement (default 2; 0 sends flat out)")
    parser.add_argument("--size", type=int, default=256, help="message body bytes (default 256)")
    parser.add_argument("--drain-seconds", type=float, default=60.0,
                        help="longest wait for the consumer to catch up and the logs to agree, and again for "
                             "reading the topic back (default 60)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the random choices (default: random)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where the cluster lives; must be new or empty (default: a new temporary directory)")
    parser.add_argument("--keep-data", action="store_true",
                        help="keep the data directory afterwards (it is always kept when the check fails)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="broker config override passed to every node, as raftmq dev's --set")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line")
    add_tls_args(parser)  # as bench's: here the cluster serves TLS too, with certificates made for it
    parser.add_argument("--tls-dir", metavar="DIR", default=None,
                        help="serve TLS with DIR's ca.pem, server.pem and server.key (made there when DIR is empty), "
                             "as raftmq dev --tls-dir; implies --tls (default with --tls: made under the data "
                             "directory)")
    parser.set_defaults(func=run)


class ChaosError(RuntimeError):
    """A step that did not finish within its bound (the cluster is then stopped and its logs kept)."""


def check_args(args: argparse.Namespace) -> None:
    check_range("--rounds", args.rounds, 1, 100)
    check_range("--down-seconds", args.down_seconds, 0, 600)
    check_range("--settle-seconds", args.settle_seconds, 0, 600)
    check_range("--senders", args.senders, 1, 256)
    check_range("--pause-ms", args.pause_ms, 0, 10_000)
    check_range("--size", args.size, 1, 4 * 1024 * 1024)
    check_range("--drain-seconds", args.drain_seconds, 1, 3600)
    check_base_port(0)  # a malformed RAFTMQ_PORT_RANGE, named before a data directory is made
    check_tls_args(args)
    if args.tls_dir is not None:
        args.tls = True
    elif args.tls_ca_file is not None:
        # The certificates chaos makes for itself are signed by a CA it makes too: no other file can vouch for them.
        raise ConfigError("--tls-ca-file needs --tls-dir: without it chaos serves certificates it makes itself, signed "
                          "by a CA of its own")
    if args.tls:
        refuse_tls_overrides(args.set, "--tls")
        if args.tls_dir is not None:
            args.tls_dir = open_tls_dir(args.tls_dir)  # checked (made when empty) before the data directory
    check_overrides(args.set, args.data_dir)
    from raftmq.commands.broker import parse_overrides
    tls = parse_overrides(args.set)
    if tls.get("tls_mode") == "enforcing" or tls.get("tls_client_enable") is True:
        # Its name server and its own clients (senders, consumer, status requests) speak plain TCP without --tls:
        # the brokers could neither register nor be reached, and the run would fail as a cluster never ready.
        raise ConfigError('--set tls_mode = "enforcing" or tls_client_enable = true: chaos\'s name server and '
                          'clients speak plain TCP; serve TLS everywhere with --tls (or --tls-dir), or with '
                          'tls_mode = "permissive" (and its cert and key), which serves both')
    if args.data_dir is not None and args.data_dir.exists():
        if not args.data_dir.is_dir():
            raise ConfigError(f"--data-dir {str(args.data_dir)!r} is not a directory")
        if any(args.data_dir.iterdir()):
            raise ConfigError(f"--data-dir {str(args.data_dir)!r} is not empty: chaos runs on a cluster of its "
                              f"own and would kill and rewrite what is there")


class Ledger:
    """What the load saw: every acknowledged message (unique id, time, the node that stored it), every failed
    send by error class, every send of unknown outcome, and how often each id was consumed.

    Acknowledged means answered SEND_OK. Any other status (FLUSH_SLAVE_TIMEOUT: the leader's Raft commit did not
    finish in time) leaves the outcome unknown: the message may be committed later, and consumed, or never. It is
    counted under ``failed`` by its status name and kept in ``unknown``; it is neither acknowledged nor lost, and
    never reported missing."""

    def __init__(self) -> None:
        self.acked: set[str] = set()
        self.ack_times: list[float] = []  # time.monotonic() of each acknowledgement, in order
        self.ack_nodes: list[str] = []    # the address of the node that stored it, same order
        self.failed: collections.Counter[str] = collections.Counter()
        self.unknown: set[str] = set()
        self.consumed: collections.Counter[str] = collections.Counter()

    def record(self, result: SendResult) -> None:
        """A send's answer: an acknowledgement when SEND_OK, an unknown outcome otherwise."""
        if result.send_status is SendStatus.SEND_OK:
            self.ack(result.msg_id, result.offset_msg_id)
        else:
            self.failed[result.send_status.name] += 1
            self.unknown.add(result.msg_id)

    def ack(self, msg_id: str, offset_msg_id: str) -> None:
        if not offset_msg_id:  # only a SEND_OK names where the message was stored
            raise ValueError(f"acknowledgement of {msg_id!r} without the id of the stored message (offset_msg_id)")
        (ip, port), _ = parse_msg_id(offset_msg_id)
        self.acked.add(msg_id)
        self.ack_times.append(time.monotonic())
        self.ack_nodes.append(f"{ip}:{port}")

    def first_ack_after(self, since: float, *, not_by: str) -> float | None:
        """Time of the first acknowledgement after ``since`` stored by a node other than ``not_by``."""
        for i in range(bisect.bisect_right(self.ack_times, since), len(self.ack_times)):
            if self.ack_nodes[i] != not_by:
                return self.ack_times[i]
        return None

    def acks_between(self, start: float, end: float) -> int:
        return bisect.bisect_right(self.ack_times, end) - bisect.bisect_right(self.ack_times, start)

    def longest_pause(self, start: float, end: float) -> float:
        """The longest stretch of ``[start, end]`` without an acknowledgement."""
        return self.longest_pause_span(start, end)[0]

    def longest_pause_span(self, start: float, end: float) -> tuple[float, float]:
        """``(length, beginning)`` of the longest stretch of ``[start, end]`` without an acknowledgement: when it
        began tells a failover's gap from a stall while the node was down or after it came back."""
        lo, hi = bisect.bisect_right(self.ack_times, start), bisect.bisect_right(self.ack_times, end)
        edges = [start, *self.ack_times[lo:hi], end]
        return max((b - a, a) for a, b in zip(edges, edges[1:]))

    def missing(self) -> set[str]:
        """Acknowledged and never consumed (what the drain waits for)."""
        return self.acked - self.consumed.keys()

    def lost(self, stored: set[str]) -> set[str]:
        """Acknowledged and not among the ids read back from the topic after the drain: consumption during the
        run proves delivery, not that the group kept the message (one lost after it was consumed passed)."""
        return self.acked - stored

    def duplicates(self) -> int:
        return sum(n - 1 for n in self.consumed.values() if n > 1)


async def _send_until(producer: Any, ledger: Ledger, stop: trio.Event, k: int, body: bytes,
                      pause_s: float) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        try:
            result = await producer.send(Message(TOPIC, body, keys=f"s{k}-{i}"))
        except (SendFailedError, RaftMQError) as e:
            ledger.failed[type(getattr(e, "last_error", None) or e).__name__] += 1
            await trio.sleep(0.01)
            continue
        ledger.record(result)
        if result.send_status is not SendStatus.SEND_OK:
            await trio.sleep(0.01)
            continue
        if pause_s:
            await trio.sleep(pause_s)


async def find_leader(rpc: Any, addr_of: dict[str, str], *, timeout_s: float) -> tuple[str, int]:
    """``(node id, term)`` of the group's leader, asking the nodes themselves: the one that says LEADER at the
    highest term. Waits (up to ``timeout_s``) while none does, as during an election."""
    with trio.move_on_after(timeout_s):
        while True:
            claims: list[tuple[int, str]] = []

            async def ask(nid: str, addr: str) -> None:
                try:
                    status, _ = await get_raft_status(rpc, addr, GROUP, timeout_s=1.0)
                except (RaftMQError, OSError):
                    return  # down, stopped or starting: not the leader now
                if status.get("role") == "LEADER":
                    claims.append((int(status["term"]), nid))

            async with trio.open_nursery() as nursery:
                for nid, addr in addr_of.items():
                    nursery.start_soon(ask, nid, addr)
            if claims:
                term, nid = max(claims)
                return nid, term
            await trio.sleep(0.1)
    raise ChaosError(f"no node of {GROUP} claimed leadership for {timeout_s:g} s")


class Chaos:
    def __init__(self, args: argparse.Namespace, cluster: LocalCluster, console: Console) -> None:
        self.args = args
        self.cluster = cluster
        self.console = console
        self.rng = random.Random(args.seed)
        self.ledger = Ledger()
        self.stopped: set[int] = set()  # PIDs we SIGSTOPped and have not continued yet
        self.addr_of: dict[str, str] = {}
        # Given to every client, TLS or not: a $RAFTMQ_TLS_ENABLE left in the environment must not decide how to
        # talk to a cluster whose every setting chaos chose.
        ca_file = args.tls_ca_file or (str(cluster.tls.ca_file) if cluster.tls is not None else "")
        self.client_tls: dict[str, Any] = {"tls_enable": cluster.tls is not None, "tls_ca_file": ca_file}
        self.tls_context = client_context(ca_file=ca_file) if cluster.tls is not None else None

    def _say(self, text: str) -> None:
        if not self.args.json:
            self.console.print(text, highlight=False, soft_wrap=True)

    async def run(self) -> dict[str, Any]:
        args, cluster, ledger = self.args, self.cluster, self.ledger
        # Abandoned on Ctrl-C (run_interruptible): run's finally stops what it started (LocalCluster.stop_all), and
        # that ends the wait; waited for, a node that never became ready held the Ctrl-C for a minute.
        await trio.to_thread.run_sync(cluster.start_all, abandon_on_cancel=True)
        assert cluster.namesrv is not None
        namesrv = cluster.namesrv.fields["listen"]
        self.addr_of = {nid: child.fields["listen"] for nid, child in cluster.nodes.items()}
        self._say(f"cluster: name server {namesrv}; {GROUP} nodes "
                  + ", ".join(f"{nid}={addr}" for nid, addr in self.addr_of.items())
                  + f"; logs in {cluster.logs}")
        await _create_topic(namesrv, self.client_tls)
        rounds: list[dict[str, Any]] = []
        stop = trio.Event()
        body = b"c" * args.size

        async def on_message(msg: Any) -> None:
            ledger.consumed[msg.msg_id] += 1

        async with open_remoting_client(tls_context=self.tls_context) as rpc, \
                open_producer(namesrv, producer_group="chaos_producer", send_msg_timeout_ms=3000,
                              retry_backoff_ms=20, **self.client_tls) as producer, \
                open_push_consumer(namesrv, topic=TOPIC, handler=on_message, consumer_group=CONSUMER_GROUP,
                                   consume_from_where="CONSUME_FROM_FIRST_OFFSET", rebalance_interval_ms=500,
                                   persist_consumer_offset_interval_ms=200, broker_suspend_max_time_ms=1000,
                                   **self.client_tls):
            async with trio.open_nursery() as nursery:
                for k in range(args.senders):
                    nursery.start_soon(_send_until, producer, ledger, stop, k, body, args.pause_ms / 1000)
                await trio.sleep(args.settle_seconds)
                for number in range(1, args.rounds + 1):
                    rounds.append(await self._round(rpc, number))
                stop.set()
            self._say(f"load stopped: {len(ledger.acked)} acknowledged; waiting for the consumer")
            drain_deadline = trio.current_time() + args.drain_seconds
            with trio.move_on_at(drain_deadline):
                while ledger.missing():
                    await trio.sleep(0.2)
            logs = await self._verify_logs(drain_deadline)
        self._say("reading every queue of the topic back")
        readback = await read_back(namesrv, self.client_tls, timeout_s=args.drain_seconds)
        return self._report(rounds, logs, readback)

    async def _round(self, rpc: Any, number: int) -> dict[str, Any]:
        args, ledger = self.args, self.ledger
        leader, term = await find_leader(rpc, self.addr_of, timeout_s=LEADER_LOOKUP_S)
        if args.target == "leader":
            victim = leader
        elif args.target == "follower":
            victim = self.rng.choice([nid for nid in NODE_IDS if nid != leader])
        else:
            victim = self.rng.choice(NODE_IDS)
        role = "leader" if victim == leader else "follower"
        victim_addr = self.addr_of[victim]
        child = self.cluster.nodes[victim]
        fault_at = time.monotonic()
        exit_status = None
        if args.fault == "restart":
            exit_status = await trio.to_thread.run_sync(child.stop, self.cluster.stop_timeout_s)
        elif args.fault in ("kill", "rebuild"):
            os.kill(child.pid, signal.SIGKILL)
            await trio.to_thread.run_sync(child.proc.wait)
            if args.fault == "rebuild":
                aside = self.cluster.logs.parent / "aside" / f"round{number}-{victim}"
                aside.mkdir(parents=True)
                for path in self.cluster.node_data_dirs(victim):
                    shutil.move(path, aside / path.name)
        else:
            os.kill(child.pid, signal.SIGSTOP)
            self.stopped.add(child.pid)
        self._say(f"round {number}: {args.fault} {role} {victim} ({victim_addr}, term {term})")
        first_ack = None
        if role == "leader":
            with trio.move_on_after(max(args.down_seconds, FAILOVER_BOUND_S)):
                while (first_ack := ledger.first_ack_after(fault_at, not_by=victim_addr)) is None:
                    if args.fault == "stop" and time.monotonic() >= fault_at + args.down_seconds:
                        break  # a short stop may end before an election: it resumes as the leader
                    await trio.sleep(0.01)
        await trio.sleep(max(0.0, fault_at + args.down_seconds - time.monotonic()))
        if args.fault in ("kill", "rebuild", "restart"):
            child.stop(self.cluster.stop_timeout_s)  # already dead: closes its log and output reader
            restarted = self.cluster.start_node(victim)
            await trio.to_thread.run_sync(restarted.wait_ready, 60.0, abandon_on_cancel=True)
        else:
            os.kill(child.pid, signal.SIGCONT)
            self.stopped.discard(child.pid)
        back_at = time.monotonic()
        await trio.sleep(self.args.settle_seconds)
        with trio.move_on_after(FAILOVER_BOUND_S):
            while ledger.acks_between(back_at, time.monotonic()) == 0:
                await trio.sleep(0.05)
        end_at = time.monotonic()
        resumed = ledger.acks_between(back_at, end_at) > 0
        # For the post-mortem of a group that stopped acknowledging: what each member says of itself now.
        statuses = None if resumed else await self._raft_statuses(rpc)
        pause, pause_began = ledger.longest_pause_span(fault_at, end_at)
        new_leader, new_term = await find_leader(rpc, self.addr_of, timeout_s=LEADER_LOOKUP_S)
        result = {
            "round": number, "fault": args.fault, "victim": victim, "role": role, "leader": leader, "term": term,
            "first_ack_by_another_s": None if first_ack is None else round(first_ack - fault_at, 3),
            "longest_pause_s": round(pause, 3),
            "longest_pause_began_s": round(pause_began - fault_at, 3),
            "back_s": round(back_at - fault_at, 3),
            "acked": ledger.acks_between(fault_at, end_at),
            "acks_resumed": resumed,
            "leader_after": new_leader, "term_after": new_term,
        }
        if exit_status is not None:
            result["exit_status"] = exit_status
        if statuses is not None:
            result["raft_status"] = statuses
        gap = result["first_ack_by_another_s"]
        self._say(f"  first ack by another node {'-' if gap is None else f'{gap:.3f} s'}, longest pause "
                  f"{result['longest_pause_s']:.3f} s; leader now {new_leader} (term {new_term})")
        return result

    async def _raft_statuses(self, rpc: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for nid, addr in self.addr_of.items():
            try:
                out[nid], _ = await get_raft_status(rpc, addr, GROUP, timeout_s=1.0)
            except (RaftMQError, OSError) as e:
                out[nid] = {"error": str(e)}
        return out

    async def _verify_logs(self, deadline: float) -> dict[str, Any]:
        """Compare the members' commit logs until every member reports the same non-zero applied end and every
        segment agrees, or ``deadline``: a member back from a fault may still be catching up on the last sends.
        With the load stopped nothing is in flight, so any difference in the ends is a member behind; accepting
        the comparison up to the smallest end passed a member that was empty (compared up to offset 0) or far
        behind. At the deadline the report names the member behind, in ``error`` and ``behind``."""
        addresses = list(self.addr_of.values())
        nid_of = {addr: nid for nid, addr in self.addr_of.items()}
        report: dict[str, Any] = {"identical": False, "error": "not compared"}
        while True:
            try:
                report = await verify_group(GROUP, addresses, timeout_s=5.0, tls_context=self.tls_context,
                                            max_lag_bytes=0)
            except (RaftMQError, OSError) as e:
                report = {"identical": False, "error": str(e)}
            else:
                behind = {nid_of.get(addr, addr): end for addr, end in report["lagging"].items()}
                error = None
                if behind:
                    error = "; ".join(f"member {nid} has applied up to {end:,}, another up to "
                                      f"{report['furthest']:,}" for nid, end in sorted(behind.items()))
                elif report["up_to"] == 0:
                    error = "every member's commit log is empty"
                report = {**report, "behind": behind, "error": error,
                          "identical": report["identical"] and error is None}
            if report["identical"] or trio.current_time() >= deadline:
                return report
            await trio.sleep(0.5)

    def continue_stopped(self) -> None:
        for pid in list(self.stopped):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.stopped.discard(pid)

    def _report(self, rounds: list[dict[str, Any]], logs: dict[str, Any], readback: ReadBack) -> dict[str, Any]:
        ledger = self.ledger
        missing = ledger.missing()
        lost = ledger.lost(readback.ids)
        lost_after_consumed = lost & ledger.consumed.keys()
        gaps = [r["first_ack_by_another_s"] for r in rounds if r["first_ack_by_another_s"] is not None]
        resumed = all(r["acks_resumed"] for r in rounds)
        clean_exits = all(r.get("exit_status", 0) == 0 for r in rounds)
        return {
            "fault": self.args.fault, "target": self.args.target, "tls": self.cluster.tls is not None, "rounds": rounds,
            "acked": len(ledger.acked), "failed_sends": sum(ledger.failed.values()),
            "failed_kinds": dict(ledger.failed), "unknown_outcome": len(ledger.unknown),
            "unknown_outcome_consumed": len(ledger.unknown & ledger.consumed.keys()),
            "consumed": len(ledger.consumed),
            "duplicates": ledger.duplicates(), "missing": len(missing), "missing_sample": sorted(missing)[:5],
            "read_back": len(readback.ids), "read_back_error": readback.error, "lost": len(lost),
            "lost_sample": sorted(lost)[:5], "lost_after_consumed": len(lost_after_consumed),
            "median_first_ack_by_another_s": round(statistics.median(gaps), 3) if gaps else None,
            "max_pause_s": max(r["longest_pause_s"] for r in rounds),
            "logs_identical": bool(logs.get("identical")),
            "logs_compared_up_to": logs.get("up_to"), "logs_error": logs.get("error"),
            "logs_behind": logs.get("behind", {}),
            "divergent_segments": [start for start, _ in logs.get("divergent", [])],
            "acks_resumed_after_every_fault": resumed, "clean_exits": clean_exits,
            "ok": (not missing and not lost and readback.error is None and bool(logs.get("identical")) and resumed
                   and clean_exits and bool(ledger.acked)),
        }


@dataclasses.dataclass(frozen=True)
class ReadBack:
    """The message ids found in the topic after the drain, and why the reading stopped short (None: every queue
    was read from its min to its max offset)."""

    ids: set[str]
    error: str | None


# Messages per pull of the read-back: the most a broker hands out per pull by default.
READ_BACK_BATCH = 32


async def read_back(namesrv: str, client_tls: dict[str, Any], *, timeout_s: float) -> ReadBack:
    """Every message id stored in the topic, each queue read from its min offset to its max with pulls of a fresh
    group (the pull consumer reads from the group's leader, and commits nothing), within ``timeout_s``. Run after
    the drain, with the load stopped: a message acknowledged and missing here was lost, consumed or not. Every
    request (the route, a queue's min and max offsets, a pull) that fails is retried every 0.2 s until the bound (a
    member may still be settling, a connection may close under us); the bound reached is reported with the last
    failure, as a proof not finished, so one failed request never costs the run its report."""
    ids: set[str] = set()
    problems: list[str] = []
    last_failure: str | None = None

    async def answered(what: str, request: Any, *args: Any) -> Any:
        nonlocal last_failure
        while True:
            try:
                return await request(*args)
            except RaftMQError as e:
                log.info("read-back %s failed, retrying: %s", what, e)
                last_failure = f"{what}: {e}"
                await trio.sleep(0.2)

    async def read_queue(consumer: Any, mq: Any) -> None:
        offset = await answered(f"min offset of queue {mq.queue_id}", consumer.min_offset, mq)
        end = await answered(f"max offset of queue {mq.queue_id}", consumer.max_offset, mq)
        while offset < end:
            result = await answered(f"pull of queue {mq.queue_id} at {offset}", consumer.pull, mq, offset,
                                    READ_BACK_BATCH)
            if result.status is PullStatus.FOUND:
                ids.update(msg.msg_id for msg in result.messages)
            elif result.status is PullStatus.OFFSET_ILLEGAL or result.next_begin_offset <= offset:
                # Below min (retention) or nothing where messages should be: the proof cannot be finished.
                problems.append(f"queue {mq.queue_id} answered {result.status.value} at offset {offset} of "
                                f"{result.min_offset}..{result.max_offset} (expected messages up to {end})")
                return
            offset = result.next_begin_offset

    with trio.move_on_after(timeout_s) as scope:
        async with open_pull_consumer(namesrv, consumer_group=f"chaos_readback_{uuid.uuid4().hex[:8]}",
                                      **client_tls) as consumer:
            queues = await answered(f"route of {TOPIC}", consumer.fetch_queues, TOPIC)
            async with trio.open_nursery() as nursery:
                for mq in queues:
                    nursery.start_soon(read_queue, consumer, mq)
    if scope.cancelled_caught:
        last = f" (last failure: {last_failure})" if last_failure else ""
        problems.append(f"not every queue was read back within {timeout_s:g} s{last}")
    return ReadBack(ids, "; ".join(problems) or None)


async def _create_topic(namesrv: str, client_tls: dict[str, Any], timeout_s: float = 30.0) -> None:
    async with open_admin(namesrv, **client_tls) as admin:
        with trio.move_on_after(timeout_s):
            while True:
                try:
                    if await admin.create_topic(TOPIC, read_queue_nums=4, write_queue_nums=4):
                        return
                except RaftMQError as e:
                    log.debug("create_topic not yet: %s", e)
                await trio.sleep(0.2)
    raise ChaosError(f"topic {TOPIC} could not be created within {timeout_s:g} s")


def print_report(console: Console, report: dict[str, Any], data_dir: Path | None) -> None:
    table = Table(title=f"raftmq chaos: {report['fault']} {report['target']}, {len(report['rounds'])} rounds",
                  header_style="bold", caption="gap: from the fault to the first ack stored by another node; "
                                               "pause: the longest time without any ack; at: when it began; "
                                               "back: when the node was back (both after the fault)")
    for column in ("round", "node", "role", "term", "gap", "pause", "at", "back", "acked", "leader after"):
        table.add_column(column, justify="right")
    for r in report["rounds"]:
        gap = r["first_ack_by_another_s"]
        table.add_row(str(r["round"]), r["victim"], r["role"], str(r["term"]), "-" if gap is None else f"{gap:.3f} s",
                      f"{r['longest_pause_s']:.3f} s", f"+{r['longest_pause_began_s']:.2f} s",
                      f"+{r['back_s']:.2f} s", f"{r['acked']:,}",
                      f"{r['leader_after']} (term {r['term_after']})")
    console.print(table)
    for r in report["rounds"]:
        if "raft_status" in r:
            console.print(f"round {r['round']}: acknowledgements did not resume; the members said then:",
                          highlight=False, soft_wrap=True)
            for nid, status in r["raft_status"].items():
                console.print(f"  {nid}: {status}", highlight=False, soft_wrap=True)
    median = report["median_first_ack_by_another_s"]
    kinds = ", ".join(f"{n} {kind}" for kind, n in report["failed_kinds"].items())
    console.print(f"acknowledged {report['acked']:,}, failed sends {report['failed_sends']:,}"
                  f"{f' ({kinds})' if kinds else ''}, consumed {report['consumed']:,} distinct, duplicates "
                  f"{report['duplicates']:,}, missing {report['missing']:,}", highlight=False, soft_wrap=True)
    if report["unknown_outcome"]:
        console.print(f"outcome unknown (answered, not SEND_OK; neither acknowledged nor lost): "
                      f"{report['unknown_outcome']:,}, {report['unknown_outcome_consumed']:,} of them consumed",
                      highlight=False, soft_wrap=True)
    console.print(f"read back from the topic: {report['read_back']:,} distinct, acknowledged and not stored "
                  f"{report['lost']:,} ({report['lost_after_consumed']:,} of them consumed before)"
                  f"{'' if report['read_back_error'] is None else '; ' + report['read_back_error']}",
                  highlight=False, soft_wrap=True)
    console.print(f"median gap to the first ack by another node: {'-' if median is None else f'{median:.3f} s'}; "
                  f"longest pause {report['max_pause_s']:.3f} s", highlight=False, soft_wrap=True)
    if report["logs_identical"]:
        console.print(f"commit logs: identical up to offset {report['logs_compared_up_to']:,}", highlight=False)
    else:
        console.print(f"commit logs: NOT identical (divergent segments {report['divergent_segments']}, "
                      f"{report['logs_error'] or 'compared'})", highlight=False)
    verdict = "PASS: nothing acknowledged was lost" if report["ok"] else "FAIL"
    if not report["ok"]:
        reasons = []
        if report["missing"]:
            reasons.append(f"{report['missing']} acknowledged messages never consumed, e.g. "
                           f"{', '.join(report['missing_sample'])}")
        if report["lost"]:
            reasons.append(f"{report['lost']} acknowledged messages not in the topic afterwards "
                           f"({report['lost_after_consumed']} of them consumed before), e.g. "
                           f"{', '.join(report['lost_sample'])}")
        if report["read_back_error"] is not None:
            reasons.append(f"the topic was not read back: {report['read_back_error']}")
        if not report["logs_identical"]:
            reasons.append("the commit logs differ")
        if not report["acks_resumed_after_every_fault"]:
            reasons.append("acknowledgements did not resume after a fault")
        if not report["acked"]:
            reasons.append("nothing was acknowledged")
        verdict += ": " + "; ".join(reasons)
    console.print(verdict, highlight=False, soft_wrap=True)
    if data_dir is not None:
        console.print(f"data and logs kept in {data_dir}", highlight=False)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    temporary = args.data_dir is None
    data_dir: Path = Path(tempfile.mkdtemp(prefix="raftmq-chaos-")) if temporary else args.data_dir
    make_dir(data_dir, "--data-dir")
    console = PipeConsole(stderr=args.json)
    if logging.getLogger().level >= logging.INFO:
        # The client's INFO lines narrate every failover (refused connections, moved routes): the report tells
        # it better. --log-level DEBUG brings them back.
        for name in ("client", "raftmq.commands.dev"):
            logging.getLogger(name).setLevel(logging.WARNING)
    tls: DevTLS | None = None
    if args.tls:
        tls = args.tls_dir if args.tls_dir is not None else open_tls_dir(data_dir / "tls", "--tls")
    cluster = LocalCluster(data_dir, plan_ports(data_dir, 0), overrides=args.set, tls=tls)
    chaos = Chaos(args, cluster, console)
    report: dict[str, Any] | None = None
    try:
        report = run_interruptible(chaos.run)
    except KeyboardInterrupt:
        print(f"raftmq chaos: interrupted; data and logs kept in {data_dir}", file=sys.stderr)
        raise
    except Exception as e:
        # trio wraps what fails inside a nursery in exception groups: look for ours among the leaves.
        leaves = leaf_exceptions(e)
        known = [x for x in leaves if isinstance(x, (ChaosError, DevClusterError))]
        if not known:
            raise
        print(f"raftmq chaos: error: {known[0]}", file=sys.stderr)
    finally:
        chaos.continue_stopped()  # a stopped process would sit on SIGTERM until the SIGKILL fallback
        cluster.stop_all()
    keep = args.keep_data or report is None or not report["ok"]
    if report is not None:
        if args.json:
            print_json(**report, data_dir=str(data_dir) if keep else None)
        else:
            print_report(console, report, data_dir if keep else None)
    elif keep:
        print(f"raftmq chaos: data and logs kept in {data_dir}", file=sys.stderr)
    if not keep and temporary:
        shutil.rmtree(data_dir, ignore_errors=True)
    elif not keep:
        for entry in data_dir.iterdir():  # a directory the caller gave: emptied, not removed
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    return 0 if report is not None and report["ok"] else 1
