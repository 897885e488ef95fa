"""Shared builders for the store tests: small configs, batches, and a whole-store byte comparison."""

from __future__ import annotations

import os
from pathlib import Path

from broker.store import MessageInput, MessageStore, StoreConfig, encode_batch

STORE_HOST = ("10.0.0.7", 10911)


def small_config(store_dir: Path, **overrides) -> StoreConfig:
    values = dict(store_dir=store_dir, segment_size_bytes=256 * 1024, max_message_size=16 * 1024,
                  consume_queue_units_per_file=64, index_hash_slots=97, index_max_entries=300,
                  flush_interval_ms=10, flush_consume_queue_interval_ms=20, hot_window_bytes=0)
    values.update(overrides)
    return StoreConfig(**values)


def make_batch(seq: int, count: int = 8, *, topic: str = "TopicTest", queues: int = 4, body_size: int = 300,
               tags: str | None = "TagA") -> bytes:
    msgs = []
    for i in range(count):
        n = seq * count + i
        props = {"KEYS": f"key-{n} common", "UNIQ_KEY": f"uniq-{n:08d}"}
        if tags:
            props["TAGS"] = tags if n % 3 else "TagB"
        body = (f"message {n} ".encode() * (body_size // 10 + 1))[:body_size]
        msgs.append(MessageInput(topic, n % queues, body, props, born_timestamp=1_700_000_000_000 + n,
                                 born_host=("192.168.1.2", 40000 + i)))
    return encode_batch(msgs, STORE_HOST)


def fill(store: MessageStore, batches: int, *, start_seq: int = 0, ts0: int = 1_700_000_000_000, **kw) -> None:
    for seq in range(start_seq, start_seq + batches):
        result = store.append_batch(make_batch(seq, **kw), ts0 + seq * 1000, store.max_phy_offset)
        assert result.ok, result


def tree_bytes(root: Path, sub: str) -> dict[str, bytes]:
    out = {}
    base = root / sub
    for dirpath, _, files in os.walk(base):
        for name in files:
            path = Path(dirpath) / name
            out[str(path.relative_to(base))] = path.read_bytes()
    return out
