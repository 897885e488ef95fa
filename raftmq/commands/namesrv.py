"""``raftmq namesrv [--config namesrv.toml] [--listen HOST:PORT]``: one name server until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import functools
import logging

import trio

from namesrv import load_namesrv_config, serve_namesrv
from raftmq.runner import announce_ready, run_until_signalled, start_error

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser("namesrv", help="run a name server (stateless route registry)",
                                   description="Run a name server: brokers register with it, clients ask it "
                                               "for topic routes. Prints one ready line once listening.")
    parser.add_argument("--config", type=str, metavar="FILE",
                        help="TOML file (keys: listen, metrics_listen, broker_expired_ms, scan_interval_ms, "
                             "max_frame_size_bytes, tls_mode, tls_cert_file, tls_key_file, tls_ca_file, "
                             "tls_need_client_auth)")
    parser.add_argument("--listen", metavar="HOST:PORT",
                        help="address to listen on, wins over the file (default 127.0.0.1:9876; port 0 = any)")
    parser.add_argument("--metrics-listen", metavar="HOST:PORT",
                        help="serve Prometheus metrics (GET /metrics) there, wins over the file (default: none; "
                             "port 0 = any)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Config errors surface here, before anything listens; cli.py turns them into exit status 2.
    config = load_namesrv_config(args.config, listen=args.listen, metrics_listen=args.metrics_listen)

    async def main(nursery: trio.Nursery) -> None:
        metrics: dict[str, str] = {}
        try:
            host, port = await nursery.start(functools.partial(
                serve_namesrv, config, on_metrics_serving=lambda bound: metrics.update(metrics="%s:%d" % bound)))
        except* OSError as group:
            raise start_error(f"cannot listen on {config.listen}", group) from None
        announce_ready("namesrv", listen=f"{host}:{port}", **metrics)

    return run_until_signalled(main)
