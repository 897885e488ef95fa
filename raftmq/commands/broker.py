"""``raftmq broker --config broker.toml``: one broker node (one member of a broker group) until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import functools
import logging
import tomllib

import trio

from raftmq.runner import Drain, announce_ready, run_until_signalled, start_error
from remoting.config import ConfigError

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "broker", help="run a broker node (one member of a 3-node broker group)",
        description="Run one broker node: a member of its group's Raft group serving producers and consumers. "
                    "Prints one ready line once listening; SIGTERM/SIGINT stop it cleanly.")
    parser.add_argument("--config", type=str, metavar="FILE", required=True,
                        help="broker TOML: cluster_name, namesrv_addrs, [store], [dledger] (see docs/operations.md)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (dotted, TOML value syntax), "
                             "e.g. --set long_polling_timeout_ms=500")
    parser.add_argument("--rejoin", action="store_true",
                        help="this member was started empty to rejoin its group (its data lost or moved aside): "
                             "it neither votes nor stands for election until it has heard from a leader "
                             "(docs/operations.md, 'Rebuilding a member')")
    parser.set_defaults(func=run)


def parse_overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set needs KEY=VALUE, got {pair!r}")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value
    return out


def run(args: argparse.Namespace) -> int:
    # Imported here so `raftmq --help` and the other commands do not pay for (or depend on) the broker stack.
    from broker.config import load_broker_config
    from broker.node import serve_broker
    from broker.store import StoreCorruptedError

    overrides = parse_overrides(args.set)
    if args.rejoin:
        overrides["dledger.rejoin"] = True
    config = load_broker_config(args.config, overrides)
    if config.acl_enable:
        from broker.acl import acl_file_path, load_acl_file

        # Before anything is opened: a missing or bad ACL file is the one-line ConfigError naming the entry.
        load_acl_file(acl_file_path(config))

    async def main(nursery: trio.Nursery) -> Drain:
        nodes = []
        try:
            host, port = await nursery.start(functools.partial(serve_broker, config, on_serving=nodes.append))
        # StoreCorruptedError: store files that do not fit the config (a changed segment or consume queue size),
        # a traceback before; its message says what to do.
        except* (OSError, StoreCorruptedError) as group:
            raise start_error(f"broker {config.broker_name} node {config.broker_id} (listen "
                              f"{config.listen_address}, raft {config.dledger.self_member.raft_address}) "
                              f"could not start", group) from None
        node = nodes[0]
        # metrics= only with metrics_listen set: the bound address (its port 0 resolved), for `raftmq dev` and tests.
        metrics = {"metrics": "%s:%d" % node.metrics_address} if node.metrics_address else {}
        announce_ready("broker", listen=f"{host}:{port}", broker_name=config.broker_name,
                       broker_id=config.broker_id, raft=config.dledger.self_member.raft_address, **metrics)
        return node.hand_over_leadership

    return run_until_signalled(main)
