"""``raftmq bench store``: the message store alone, in this process: append, dispatch, read, recovery.

For each flush mode a fresh store in a temporary directory (removed afterwards) receives ``--messages``
messages of ``--size`` bytes in batches of ``--batch`` (``append_batch``, as the Raft apply path calls it; the
remainder of ``--messages`` over ``--batch`` goes in one last, shorter batch), spread over ``--queues`` queues of
one topic, each message with TAGS, KEYS and UNIQ_KEY properties:

* append: ASYNC_FLUSH appends back to back while a flusher thread runs ``flush_all`` every
  ``flush_interval_ms`` (what ``serve`` does). SYNC_FLUSH adds a group-commit thread that fdatasyncs whatever
  was appended since its last sync, and the appender keeps at most ``--sync-inflight`` batches not yet durable
  (as that many producers waiting in ``wait_flushed`` would); ``--sync-inflight 1`` is one fsync per batch.
* dispatch: building ConsumeQueue units and IndexFile entries for everything appended (the reput task).
* read: every queue read sequentially through the ConsumeQueue, 32 messages per pull, each pull's records
  joined into one body as a pull response would send them.
* recovery: ``MessageStore.open`` after a clean close (checkpoint) and after the checkpoint is deleted (the last
  segments verified record by record).

Rates are given per wall-clock second and per CPU-second of this process (``time.process_time``): on a
shared machine the second says what the code costs, the first what the machine gave it. RSS is sampled before
and after each phase: the store releases mapped pages behind a hot window after every
flush, so it must not grow with the amount stored. The run is bounded by ``--messages``.

Example: ``raftmq bench store --size 1024 --batch 64 --messages 2000000``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import psutil

from broker.store import GetMessageStatus, MessageInput, MessageStore, StoreConfig, encode_batch
from raftmq.bench.common import check_range, print_json, print_table
from raftmq.console import PipeConsole
from remoting.config import ConfigError, blank_dir_problem

__all__ = ["register", "run", "StoreBenchResult", "bench_mode"]

TOPIC = "BenchTopic"
_DISTINCT_BATCHES = 16
_MB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class StoreBenchResult:
    mode: str
    messages: int
    message_bytes: int
    append_msgs_per_s: float
    append_mb_per_s: float
    append_msgs_per_cpu_s: float
    dispatch_msgs_per_s: float
    dispatch_msgs_per_cpu_s: float
    read_msgs_per_s: float
    read_msgs_per_cpu_s: float
    read_mb_per_s: float
    recover_clean_ms: float
    recover_no_checkpoint_ms: float
    commit_log_bytes: int
    fdatasyncs: int
    rss_start_mb: float
    rss_after_append_mb: float
    rss_after_dispatch_mb: float
    rss_after_read_mb: float


def register(subparsers) -> None:
    parser = subparsers.add_parser("store", help="message store throughput: append, dispatch, read, recovery",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="message body bytes (default 1024)")
    parser.add_argument("--batch", type=int, default=64, help="messages per append_batch (default 64)")
    parser.add_argument("--messages", type=int, default=2_000_000, help="messages per mode (default 2,000,000)")
    parser.add_argument("--queues", type=int, default=8, help="queues of the topic (default 8)")
    parser.add_argument("--modes", default="ASYNC_FLUSH,SYNC_FLUSH",
                        help="comma-separated flush modes (default ASYNC_FLUSH,SYNC_FLUSH)")
    parser.add_argument("--segment-size-mb", type=int, default=1024, help="commit-log segment size (default 1024)")
    parser.add_argument("--dir", default=None, help="parent of the temporary store directory (default: system)")
    parser.add_argument("--sync-inflight", type=int, default=8,
                        help="SYNC_FLUSH: batches appended but not yet durable at most (default 8)")
    parser.add_argument("--json", action="store_true", help="print one JSON line per mode instead of tables")
    parser.set_defaults(func=run)


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / _MB


def _batches(size: int, batch: int, queues: int, count: int = _DISTINCT_BATCHES) -> list[bytes]:
    out = []
    for b in range(count):
        msgs = []
        for i in range(batch):
            n = b * batch + i
            msgs.append(MessageInput(TOPIC, n % queues, os.urandom(size),
                                     {"TAGS": f"Tag{n % 4}", "KEYS": f"order-{n}", "UNIQ_KEY": f"{n:032X}"},
                                     born_timestamp=1_700_000_000_000 + n, born_host=("127.0.0.1", 50000)))
        out.append(encode_batch(msgs, ("127.0.0.1", 10911)))
    return out


class _GroupCommit:
    """SYNC_FLUSH's group commit on a thread: one fdatasync covers every append before it."""

    def __init__(self, store: MessageStore) -> None:
        self.store = store
        self.syncs = 0
        self.cond = threading.Condition()
        self.stop = False
        self.thread = threading.Thread(target=self._run, name="bench-group-commit", daemon=True)

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.stop and self.store.max_phy_offset <= self.store.flushed_phy_offset:
                    self.cond.wait(0.01)
                if self.stop:
                    return
            self.store.flush()
            self.syncs += 1
            with self.cond:
                self.cond.notify_all()

    def wait_flushed(self, offset: int) -> None:
        with self.cond:
            self.cond.notify_all()
            while self.store.flushed_phy_offset < offset:
                self.cond.wait(0.01)

    def __enter__(self) -> _GroupCommit:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        self.thread.join()


class _Flusher:
    """What ``serve``'s flush task does, on a thread: ``flush_all`` every interval (releases the GIL in
    fdatasync)."""

    def __init__(self, store: MessageStore, interval_s: float) -> None:
        self.store, self.interval_s = store, interval_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-flusher", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.store.flush_all()

    def __enter__(self) -> _Flusher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def bench_mode(mode: str, *, size: int, batch: int, messages: int, queues: int, segment_size_mb: int,
               parent: str | None, sync_inflight: int = 8) -> StoreBenchResult:
    root = Path(tempfile.mkdtemp(prefix="raftmq-bench-store-", dir=parent))
    try:
        cfg = StoreConfig(store_dir=root, segment_size_bytes=segment_size_mb * _MB, flush_disk_type=mode,
                          max_message_size=max(size, 1024))
        # Whole batches, then what is left in one short batch: rounding --messages down to a multiple of --batch
        # measured fewer messages than asked for (and --messages below --batch were a whole batch).
        batches = _batches(size, batch, queues)
        rounds, rest = divmod(messages, batch)
        tail = [_batches(size, rest, queues, 1)[0]] if rest else []
        total = messages
        rss0 = _rss_mb()
        store = MessageStore.open(cfg)
        sync = mode == "SYNC_FLUSH"
        syncs = 0
        with _Flusher(store, cfg.flush_interval_ms / 1000.0):
            with _GroupCommit(store) if sync else contextlib.nullcontext() as group:
                pending: deque[int] = deque()
                plan = [batches[r % _DISTINCT_BATCHES] for r in range(rounds)] + tail
                t0, c0 = time.perf_counter(), time.process_time()
                for r, encoded in enumerate(plan):
                    result = store.append_batch(encoded, 1_700_000_000_000 + r, store.max_phy_offset)
                    if not result.ok:
                        raise RuntimeError(f"append failed: {result.status.value} {result.remark}")
                    if group is not None:
                        pending.append(result.end_phy_offset)
                        if len(pending) >= sync_inflight:
                            group.wait_flushed(pending.popleft())
                if group is not None:
                    group.wait_flushed(store.max_phy_offset)
                    syncs = group.syncs
                append_s = time.perf_counter() - t0
                append_cpu_s = time.process_time() - c0
            rss_append = _rss_mb()
            t0, c0 = time.perf_counter(), time.process_time()
            while store.dispatched_phy_offset < store.max_phy_offset:
                store.dispatch_pending(max_bytes=cfg.dispatch_chunk_bytes)
            dispatch_s = time.perf_counter() - t0
            dispatch_cpu_s = time.process_time() - c0
            rss_dispatch = _rss_mb()
            t0, c0 = time.perf_counter(), time.process_time()
            read, read_bytes = 0, 0
            for q in range(queues):
                offset = 0
                while True:
                    got = store.get_messages(TOPIC, q, offset, 32, 4 * _MB)
                    if got.status is not GetMessageStatus.FOUND:
                        break
                    read_bytes += len(b"".join(got.messages))
                    read += got.message_count
                    offset = got.next_begin_offset
            read_s = time.perf_counter() - t0
            read_cpu_s = time.process_time() - c0
            rss_read = _rss_mb()
        if read != total:
            raise RuntimeError(f"read {read} messages back, appended {total}")
        cl_bytes = store.max_phy_offset
        store.close()
        t0 = time.perf_counter()
        MessageStore.open(cfg).close()
        recover_clean_ms = (time.perf_counter() - t0) * 1000
        (root / "checkpoint").unlink()
        t0 = time.perf_counter()
        MessageStore.open(cfg).close()
        recover_raw_ms = (time.perf_counter() - t0) * 1000
        record = cl_bytes / total
        return StoreBenchResult(mode, total, size, total / append_s, total * record / append_s / _MB,
                                total / append_cpu_s, total / dispatch_s, total / dispatch_cpu_s, read / read_s,
                                read / read_cpu_s, read_bytes / read_s / _MB, recover_clean_ms,
                                recover_raw_ms, cl_bytes, syncs, rss0, rss_append, rss_dispatch, rss_read)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    check_range("--size", args.size, 1, 4 * _MB)
    check_range("--batch", args.batch, 1, 100_000)
    check_range("--messages", args.messages, 1, 100_000_000)
    check_range("--queues", args.queues, 1, 1024)
    check_range("--sync-inflight", args.sync_inflight, 1, 10_000)
    check_range("--segment-size-mb", args.segment_size_mb, 8, 4096)
    modes = [m.strip().upper() for m in args.modes.split(",") if m.strip()]
    for m in modes or [args.modes]:  # an empty list measured nothing and exited 0
        if m not in ("ASYNC_FLUSH", "SYNC_FLUSH"):
            raise ConfigError(f"--modes must list ASYNC_FLUSH and/or SYNC_FLUSH, got {m!r}")
        if modes.count(m) > 1:  # measured twice, as two rows of one table
            raise ConfigError(f"--modes names {m} more than once, got {args.modes!r}")
    if args.dir is not None and (problem := blank_dir_problem(args.dir)):  # mkdtemp(dir="") is the cwd too
        raise ConfigError(f"--dir {problem}, got {args.dir!r}")
    if args.dir is not None and not Path(args.dir).is_dir():  # was a traceback from tempfile.mkdtemp
        raise ConfigError(f"--dir {str(args.dir)!r} is not an existing directory")
    console = PipeConsole()
    for mode in modes:
        result = bench_mode(mode, size=args.size, batch=args.batch, messages=args.messages, queues=args.queues,
                            segment_size_mb=args.segment_size_mb, parent=args.dir,
                            sync_inflight=args.sync_inflight)
        if args.json:
            print_json(store=result)
            continue
        print_table(console, f"store {mode}: {result.messages:,} x {args.size} B, batch {args.batch}", [
            ("append msgs/s", result.append_msgs_per_s), ("append MB/s (records)", result.append_mb_per_s),
            ("append msgs per CPU-second", result.append_msgs_per_cpu_s),
            ("dispatch msgs/s (ConsumeQueue + IndexFile)", result.dispatch_msgs_per_s),
            ("dispatch msgs per CPU-second", result.dispatch_msgs_per_cpu_s),
            ("read msgs/s (via ConsumeQueue)", result.read_msgs_per_s), ("read MB/s", result.read_mb_per_s),
            ("read msgs per CPU-second", result.read_msgs_per_cpu_s),
            ("recovery ms (checkpoint)", result.recover_clean_ms),
            ("recovery ms (no checkpoint)", result.recover_no_checkpoint_ms),
            ("commit log bytes", result.commit_log_bytes), ("group-commit fdatasyncs", result.fdatasyncs),
            ("RSS MB before", result.rss_start_mb),
            ("RSS MB after append", result.rss_after_append_mb),
            ("RSS MB after dispatch", result.rss_after_dispatch_mb),
            ("RSS MB after read", result.rss_after_read_mb),
        ])
    return 0
