"""``raftmq bench dledger``: committed appends/s on a local 3-member DLedger group (design §4).

Member n0 runs inside the benchmark process, as a broker's member would: its trio loop runs the load
(``--concurrency`` appends of one ``--size``-byte message in flight: ``append_nowait`` chains answered in the
commit callback, as the broker's send path does; ``--api task`` runs a trio task per in-flight append awaiting
``group.append`` instead) and pysyncobj's tick task (no tick thread: ``dledger.group`` ticks it from trio), so
what is measured is the load and the replication sharing one thread, as in a broker. Members n1 and
n2 are ``raftmq dledger-node`` processes. n0 starts first and so wins the first election (its deadline has
passed when the first peer connects).

Printed: committed msgs/s and MB/s, p50/p99 commit latency (append call to acknowledgement), resident memory
of every member at the end, and each member's Raft term at the start and end of the measurement (a moving term
means spurious elections). Also ``make_members`` / ``write_node_config``, used by the cluster tests.
"""

from __future__ import annotations

import argparse
import array
import functools
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import trio
from rich.console import Console
from broker.commit_log_machine import CommitLogMachine
from broker.store import MessageInput, MessageStore, StoreConfig, encode_batch
from dledger import ByteLog, DLedgerConfig, MemberAddress, open_dledger_group
from dledger.service import DLedgerService, get_raft_status, transfer_leadership
from raftmq.bench.common import (check_range, make_dir, print_json, print_table, show_progress, spawn_ready_process,
                                 summarize_latencies)
from raftmq.console import PipeConsole
from raftmq.ports import free_port, port_range
from raftmq.runner import run_interruptible
from remoting.config import ConfigError, parse_host_port
from remoting.errors import RaftMQError
from remoting.transport import open_remoting_client, serve_remoting

log = logging.getLogger(__name__)

__all__ = ["make_members", "write_node_config", "register", "run"]


def make_members(n: int = 3) -> tuple[MemberAddress, ...]:
    return tuple(MemberAddress(id=f"n{i}", raft_address=f"127.0.0.1:{free_port()}",
                               service_address=f"127.0.0.1:{free_port()}") for i in range(n))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {value!r} to TOML")


def write_node_config(path: Path, *, self_id: str, members: Sequence[MemberAddress], secret: str,
                      base_dir: Path, group: str = "broker-a", state_machine: str = "message_store",
                      store: dict[str, Any] | None = None, **dledger: Any) -> Path:
    """A ``raftmq dledger-node`` TOML for member ``self_id`` with its data under ``base_dir/self_id``."""
    lines = [f"state_machine = {_toml_value(state_machine)}", "", "[dledger]",
             f"group = {_toml_value(group)}", f"self_id = {_toml_value(self_id)}",
             f"secret = {_toml_value(secret)}", f"data_dir = {_toml_value(base_dir / self_id / 'dledger')}"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in dledger.items()]
    lines.append("members = [" + ", ".join(
        f'{{id = "{m.id}", raft_address = "{m.raft_address}", service_address = "{m.service_address}"}}'
        for m in members) + "]")
    store_table = {"store_dir": base_dir / self_id / "store"}
    store_table.update(store or {})
    lines += ["", "[store]"] + [f"{k} = {_toml_value(v)}" for k, v in store_table.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def register(subparsers) -> None:
    parser = subparsers.add_parser("dledger", help="committed appends/s on a local 3-member Raft group")
    parser.add_argument("--size", type=int, default=1024, help="message body bytes (default 1024)")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds (default 30)")
    parser.add_argument("--warmup-seconds", type=float, default=2.0, help="load before measuring (default 2)")
    parser.add_argument("--concurrency", type=int, default=512, help="appends in flight (default 512)")
    parser.add_argument("--batch", type=int, default=1,
                        help="messages per append, as a broker's SEND_BATCH_MESSAGE (default 1)")
    parser.add_argument("--api", choices=["nowait", "task"], default="nowait",
                        help="nowait (default): append_nowait chains answered in the commit callback, as the "
                             "broker's send path does; task: one trio task per in-flight append awaiting "
                             "group.append")
    parser.add_argument("--state-machine", choices=["message_store", "byte_log"], default="message_store",
                        help="what the group replicates into (default message_store)")
    parser.add_argument("--flush-disk-type", choices=["ASYNC_FLUSH", "SYNC_FLUSH"], default="ASYNC_FLUSH")
    parser.add_argument("--data-dir", type=Path, help="where the members keep their data; must be new or empty "
                                                      "(default: a temporary directory, removed afterwards)")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    parser.set_defaults(func=run)


def _record(size: int, batch: int, state_machine: str) -> bytes:
    bodies = [os.urandom(size) for _ in range(batch)]
    if state_machine == "byte_log":
        return b"".join(bodies)
    return encode_batch([MessageInput(topic="BenchTopic", queue_id=0, body=body, born_host=("127.0.0.1", 1))
                         for body in bodies], ("127.0.0.1", 10911))


async def _bench(args: argparse.Namespace, base_dir: Path, console: Console) -> dict[str, Any]:
    members = make_members(3)
    secret = secrets.token_hex(16)
    tuning = {"flush_disk_type": args.flush_disk_type}
    store_settings = {"segment_size_bytes": 256 << 20, "flush_disk_type": args.flush_disk_type}
    cfg = DLedgerConfig(group="bench", self_id="n0", members=members, secret=secret,
                        data_dir=base_dir / "n0" / "dledger", **tuning)
    if args.state_machine == "message_store":
        store = MessageStore.open(StoreConfig(store_dir=base_dir / "n0" / "store", **store_settings))
        machine: Any = CommitLogMachine(store)
    else:
        store = None
        machine = ByteLog(base_dir / "n0" / "byte.log")
    followers = []
    record = _record(args.size, args.batch, args.state_machine)
    latencies = array.array("q")  # 8 bytes a sample: n0's RSS is measured with them in memory
    done = 0
    try:
        async with trio.open_nursery() as nursery:
            if store is not None:
                await nursery.start(store.serve)
            async with open_dledger_group(cfg, machine) as group, open_remoting_client() as client:
                host, port = parse_host_port(cfg.self_member.service_address)
                await nursery.start(serve_remoting, DLedgerService(group), host, port)
                for m in members[1:]:
                    path = write_node_config(base_dir / f"{m.id}.toml", self_id=m.id, members=members,
                                             secret=secret, base_dir=base_dir, group="bench",
                                             state_machine=args.state_machine, store=store_settings, **tuning)
                    followers.append(await trio.to_thread.run_sync(
                        spawn_ready_process, ["--log-level", "WARNING", "dledger-node", "--config", str(path)]))
                with trio.fail_after(30):
                    await group.wait_leader()
                    while group.leader_id != "n0":
                        # The load runs in n0's process (as a broker's front end runs in its member's): take
                        # leadership over rather than measure a follower forwarding nothing.
                        leader = group.member_address(group.leader_id) if group.leader_id else None
                        if leader is None or not leader.service_address:
                            await group.wait_changed()
                            continue
                        try:
                            await transfer_leadership(client, leader.service_address, "bench", "n0", timeout_s=5.0)
                        except RaftMQError as e:  # e.g. the leader's port not serving yet: ask again
                            log.warning("leadership transfer to n0 failed, retrying: %s", e)
                            await trio.sleep(0.2)
                    await group.wait_ready_leader()

                measuring = False
                stop_at = trio.current_time() + args.warmup_seconds + args.seconds

                async def load() -> None:
                    nonlocal done
                    while trio.current_time() < stop_at:
                        t0 = time.perf_counter_ns()
                        await group.append(record, timeout_s=10.0)
                        if measuring:
                            latencies.append(time.perf_counter_ns() - t0)
                            done += args.batch

                # The broker's send path: append_nowait from the connection's reader, answered in the commit
                # callback; each of --concurrency chains issues its next append from the previous one's callback.
                chains_done = trio.Event()
                chains = [args.concurrency]
                failures: list[BaseException] = []

                def issue() -> None:
                    group.append_nowait(record, functools.partial(appended, time.perf_counter_ns()), timeout_s=10.0)

                def appended(t0: int, pending: Any) -> None:
                    nonlocal done
                    if pending.error is not None:
                        failures.append(pending.error)
                    elif measuring:
                        latencies.append(time.perf_counter_ns() - t0)
                        done += args.batch
                    if not failures and trio.current_time() < stop_at:
                        issue()
                        return
                    chains[0] -= 1
                    if chains[0] == 0:
                        chains_done.set()

                async def load_nowait() -> None:
                    for _ in range(args.concurrency):
                        issue()
                    await chains_done.wait()
                    if failures:
                        raise RuntimeError(f"{len(failures)} appends failed, first: {failures[0]!r}")

                async def terms() -> dict[str, int]:
                    out = {"n0": group.term}
                    for m in members[1:]:
                        status, _ = await get_raft_status(client, m.service_address, "bench")
                        out[m.id] = int(status["term"])
                    return out

                async with trio.open_nursery() as load_nursery:
                    if args.api == "task":
                        for _ in range(args.concurrency):
                            load_nursery.start_soon(load)
                    else:
                        load_nursery.start_soon(load_nowait)
                    await trio.sleep(args.warmup_seconds)
                    terms_start = await terms()
                    procs = {"n0": psutil.Process()}
                    procs.update({m.id: psutil.Process(f.pid) for m, f in zip(members[1:], followers)})
                    cpu_start = {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}
                    measuring = True
                    t_start = time.perf_counter()
                    progress = trio.CancelScope()

                    async def _progress() -> None:
                        with progress:
                            await show_progress(console, "dledger", args.seconds, lambda: done)

                    load_nursery.start_soon(_progress)
                    await trio.sleep(args.seconds)
                    measuring = False
                    elapsed = time.perf_counter() - t_start
                    measured = done
                    cpu_used = {k: sum(p.cpu_times()[:2]) - cpu_start[k] for k, p in procs.items()}
                    progress.cancel()
                terms_end = await terms()
                stats = group.statistics()
                end_offset = stats.end_offset
                with trio.move_on_after(10):
                    while True:
                        offsets = [int((await get_raft_status(client, m.service_address, "bench"))[0]["end_offset"])
                                   for m in members[1:]]
                        if all(o >= end_offset for o in offsets):
                            break
                        await trio.sleep(0.1)
                follower_status = {m.id: (await get_raft_status(client, m.service_address, "bench"))[0]
                                   for m in members[1:]}
                rss = {"n0": psutil.Process().memory_info().rss}
                for m, f in zip(members[1:], followers):
                    rss[m.id] = psutil.Process(f.pid).memory_info().rss
                nursery.cancel_scope.cancel()
    finally:
        for f in followers:
            f.stop()
        if store is not None:
            store.close()
        else:
            machine.close()
    lat = summarize_latencies(latencies)
    return {
        "state_machine": args.state_machine, "api": args.api, "size": args.size, "batch": args.batch,
        "concurrency": args.concurrency,
        "seconds": round(elapsed, 3), "messages": measured, "msgs_per_s": measured / elapsed,
        "mb_per_s": measured * args.size / elapsed / 1e6, "latency": lat,
        "rss_mb": {k: round(v / 2**20, 1) for k, v in rss.items()}, "term_start": terms_start,
        "term_end": terms_end, "term_unchanged": terms_start == terms_end,
        "cpu_us_per_msg": {k: round(v / max(1, measured) * 1e6, 1) for k, v in cpu_used.items()},
        "batches": stats.appended_batches, "records_per_batch": stats.appended_records / max(1, stats.appended_batches),
        "failed_batches": stats.failed_batches, "log_entries_in_memory": stats.log_entries_in_memory,
        "snapshots_written": stats.snapshots_written,
        # A follower that fell behind the leader's compacted log gets a snapshot and copies commit-log bytes.
        "follower_snapshots_loaded": {k: int(v["snapshots_loaded"]) for k, v in follower_status.items()},
        "follower_catch_up_bytes": {k: int(v["catch_up_bytes"]) for k, v in follower_status.items()},
    }


def run(args: argparse.Namespace) -> int:
    check_range("--size", args.size, 1, 32 * 1024)
    check_range("--seconds", args.seconds, 0.5, 3600)
    check_range("--concurrency", args.concurrency, 1, 20_000)
    check_range("--batch", args.batch, 1, 1024)
    check_range("--warmup-seconds", args.warmup_seconds, 0, 600)
    if args.size * args.batch > 96 * 1024:
        raise ConfigError(f"--size x --batch must stay within 96 KiB per append, got {args.size * args.batch}")
    try:
        port_range()
    except ValueError as e:  # a malformed RAFTMQ_PORT_RANGE, named before anything starts
        raise ConfigError(str(e)) from None
    if args.data_dir is not None:
        # An earlier run's members left their Raft logs and terms there under another secret and other ports:
        # the new group never elected n0 and the bench gave up after 30 s with a trio.TooSlowError traceback.
        try:
            used = args.data_dir.is_dir() and any(args.data_dir.iterdir())
        except OSError as e:
            raise ConfigError(f"--data-dir {str(args.data_dir)!r} cannot be read: {e.strerror or e}") from None
        if used:
            raise ConfigError(f"--data-dir {str(args.data_dir)!r} is not empty: the bench starts a new group of its "
                              f"own and cannot run on what an earlier one left there")
        make_dir(args.data_dir, "--data-dir")
    console = PipeConsole()
    base_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="raftmq-bench-dledger-"))
    try:
        result = run_interruptible(_bench, args, base_dir, console)
    finally:
        if args.data_dir is None:
            shutil.rmtree(base_dir, ignore_errors=True)
    if args.json:
        print_json(**result)
        return 0
    lat = result["latency"]
    print_table(console, f"dledger: {result['state_machine']}, {args.size} B x {args.batch} per append, "
                         f"concurrency {args.concurrency}, api {args.api}", [
        ("committed msgs/s", result["msgs_per_s"]), ("MB/s", result["mb_per_s"]),
        ("messages", result["messages"]), ("p50 commit latency ms", lat.p50_ms),
        ("p99 commit latency ms", lat.p99_ms), ("max commit latency ms", lat.max_ms),
        ("records per batch", result["records_per_batch"]), ("failed batches", result["failed_batches"]),
        ("term at start", str(result["term_start"])), ("term at end", str(result["term_end"])),
        ("term unchanged", str(result["term_unchanged"])),
        ("RSS MB per member", str(result["rss_mb"])),
        ("CPU us per message per member", str(result["cpu_us_per_msg"])),
        ("raft log entries in memory", result["log_entries_in_memory"]),
        ("snapshots written (n0)", result["snapshots_written"]),
        ("snapshots loaded by followers", str(result["follower_snapshots_loaded"])),
        ("catch-up bytes copied by followers", str(result["follower_catch_up_bytes"])),
    ])
    return 0
