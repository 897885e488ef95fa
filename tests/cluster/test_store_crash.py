"""SIGKILL crash test of the message store.

A child process (this module run as a script) appends batches continuously to one store directory, fsyncs
after each batch and prints ``durable <offset> <batches>``; every few batches it dispatches and writes a
checkpoint, so the kill lands anywhere: inside an append, a dispatch, a checkpoint write. The test kills it at
a random moment, reopens the store, and checks that every reported-durable record is intact, that no record is
corrupt or half a batch, and that ConsumeQueue and IndexFile agree with the commit log. The same directory is
reused for every round, so each round also recovers a store that was itself recovered.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest

from broker.store import MessageInput, MessageStore, StoreConfig, decode_record, encode_batch
from remoting.message import BLANK_MAGIC

BATCH = 8
QUEUES = 3
TOPIC = "CrashTopic"


def _config(store_dir: Path) -> StoreConfig:
    return StoreConfig(store_dir=store_dir, segment_size_bytes=512 * 1024, max_message_size=16 * 1024,
                       consume_queue_units_per_file=500, index_hash_slots=211, index_max_entries=2000,
                       hot_window_bytes=0)


def _body(n: int) -> bytes:
    return (f"<{n}>".encode() * 400)[:50 + (n * 37) % 1500]


def _batch(seq: int) -> bytes:
    msgs = [MessageInput(TOPIC, (seq * BATCH + i) % QUEUES, _body(seq * BATCH + i),
                         {"UNIQ_KEY": f"n{seq * BATCH + i}", "KEYS": f"b{seq}", "TAGS": f"t{i % 2}"},
                         born_timestamp=seq) for i in range(BATCH)]
    return encode_batch(msgs, ("127.0.0.1", 10911))


def _child(store_dir: str) -> None:
    store = MessageStore.open(_config(Path(store_dir)))
    seq = sum(store.get_max_offset_in_queue(TOPIC, q) for q in range(QUEUES)) // BATCH
    print(f"ready kind=store-writer start_seq={seq}", flush=True)
    while True:
        result = store.append_batch(_batch(seq), 1_700_000_000_000 + seq, store.max_phy_offset)
        assert result.ok, result
        seq += 1
        print(f"durable {store.flush()} {seq}", flush=True)
        if seq % 7 == 0:
            store.dispatch_pending()
        if seq % 23 == 0:
            store.flush_all()


def _verify(store: MessageStore, durable: int, durable_batches: int) -> int:
    assert store.max_phy_offset >= durable
    n = 0
    next_queue_offset = [0] * QUEUES
    pos = store.min_phy_offset
    while pos < store.max_phy_offset:
        raw = store.commit_log.read_raw(pos, 1)
        if int.from_bytes(raw[4:8], "big") == BLANK_MAGIC:
            pos += len(raw)
            continue
        view = decode_record(raw)  # checks the CRC
        assert view.phy_offset == pos and view.uniq_key == f"n{n}", (pos, n)
        assert view.body == _body(n) and view.queue_id == n % QUEUES
        assert view.queue_offset == next_queue_offset[view.queue_id]
        next_queue_offset[view.queue_id] += 1
        unit = store.dispatcher.queue(TOPIC, view.queue_id).unit(view.queue_offset)
        assert unit[:2] == (pos, view.size)
        pos += view.size
        n += 1
    assert n % BATCH == 0, "a batch survived only in part"
    assert n >= durable_batches * BATCH
    for q in range(QUEUES):
        assert store.get_max_offset_in_queue(TOPIC, q) == next_queue_offset[q]
    for probe in sorted({0, n - 1, *random.sample(range(n), min(n, 40))}):
        found = store.query_message(TOPIC, f"n{probe}", 2).messages
        assert [v.uniq_key for v in found] == [f"n{probe}"], probe
    batch_keys = store.query_message(TOPIC, f"b{n // BATCH - 1}", 20).messages
    assert len(batch_keys) == BATCH
    return n


@pytest.mark.slow
@pytest.mark.cluster
def test_sigkill_at_random_moments_loses_nothing_durable(tmp_path, spawn):
    rng = random.Random(20260522)
    store_dir = tmp_path / "store"
    rounds = 20
    records = 0
    killed_before_first_batch = 0
    for _ in range(rounds):
        proc = spawn([sys.executable, "-m", "tests.cluster.test_store_crash", str(store_dir)], ready_timeout_s=30)
        assert int(proc.fields["start_seq"]) * BATCH == records
        time.sleep(rng.uniform(0.02, 0.4))
        proc.kill()
        proc._reader.join(5)
        proc.proc.stdout.close()  # the reader is done; don't leave the pipe to the garbage collector
        durable, batches = 0, 0
        for line in proc.output:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "durable" and line.endswith("\n"):  # a whole line only
                durable, batches = int(parts[1]), int(parts[2])
        # A kill before the first fsync reported (the shortest sleeps, on a slow disk) is a crash point too:
        # nothing is promised, and the store must still open clean.
        with MessageStore.open(_config(store_dir)) as store:
            records = _verify(store, durable, batches)
        killed_before_first_batch += batches == 0
    assert killed_before_first_batch < rounds // 2, "the writer hardly ever reported a durable batch"
    assert records > rounds * BATCH


if __name__ == "__main__":
    _child(sys.argv[1])
