"""``raftmq bench KIND``: one module per benchmark under ``raftmq.bench``, each with ``register(subparsers)``."""

from __future__ import annotations

import importlib

BENCH_MODULES = (
    "raftmq.bench.rpc",
    "raftmq.bench.produce",
    "raftmq.bench.consume",
    "raftmq.bench.dledger",
    "raftmq.bench.store",
)


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="measure throughput and latency on this machine")
    kinds = parser.add_subparsers(dest="bench_kind", metavar="KIND", required=True)
    for name in BENCH_MODULES:
        importlib.import_module(name).register(kinds)
