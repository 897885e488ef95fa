"""``raftmq dledger-node --config node.toml``: one DLedger member, its commit log and its remoting port.

The process a DLedger group is tested and benchmarked with, without the broker's processors: one Raft member
(``dledger.open_dledger_group``) whose state machine is the message store (``state_machine =
"message_store"``, through ``broker.commit_log_machine``) or a plain ``dledger.ByteLog``; a remoting server on
the member's ``service_address`` answering

- ``SEND_MESSAGE`` (body = one record: an encoded message batch for the message store) with the Raft index
  and first phy_offset in ext, or NOT_LEADER with ext ``leader_addr`` (null while no leader is known, as a
  broker answers);
- ``FETCH_COMMIT_LOG`` / ``GET_RAFT_STATUS`` (``dledger.service``) for catching-up peers and ``raftmq verify``.

Config (TOML)::

    state_machine = "message_store"      # or "byte_log"
    [dledger]                            # dledger.config.DLedgerConfig
    group = "broker-a"
    self_id = "n0"
    secret = "..."                       # >= 16 characters, the same on every member
    data_dir = "data/n0/dledger"
    members = [{id = "n0", raft_address = "127.0.0.1:20911", service_address = "127.0.0.1:30911"}, ...]
    [store]                              # broker.store.StoreConfig (message_store only)
    store_dir = "data/n0/store"

Prints ``ready kind=dledger-node pid=... listen=HOST:PORT raft=HOST:PORT id=...`` once it serves.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import trio

from broker.commit_log_machine import CommitLogMachine
from broker.store import MessageStore, StoreConfig, StoreCorruptedError
from dledger import (AppendTimeoutError, ByteLog, DLedgerConfig, DLedgerError, DLedgerGroup, NotLeaderError,
                     RecordTooLargeError, open_dledger_group)
from dledger.service import DLedgerService, remote_fetch_range
from raftmq.runner import announce_ready, run_until_signalled, start_error
from remoting.codec import Frame, make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.config import ConfigError, bounded, check_fields, load_config, parse_host_port
from remoting.transport import open_remoting_client, serve_remoting

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DLedgerNodeConfig:
    state_machine: Literal["message_store", "byte_log"] = "message_store"
    # The logical segments the byte log's checksums are cut into, for `raftmq verify` as the message store's: at
    # most 1 TiB, as store.segment_size_bytes.
    byte_log_segment_size_bytes: int = bounded(64 << 20, min=4096, max=2 ** 40)
    max_frame_size_bytes: int = bounded(16 << 20, min=1 << 16, max=256 << 20)
    dledger: DLedgerConfig | None = None
    store: StoreConfig = dataclasses.field(default_factory=StoreConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.dledger is None:
            raise ConfigError("dledger-node config needs a [dledger] table: group, self_id, secret and members")
        if not self.dledger.self_member.service_address:
            raise ConfigError(f"dledger.members[{self.dledger.self_id}].service_address must be set: the node "
                              f"serves catch-up fetches there")


class NodeHandler:
    """SEND_MESSAGE appends one record; the dledger codes go to ``DLedgerService``."""

    def __init__(self, group: DLedgerGroup, service: DLedgerService, *, message_store: bool) -> None:
        self.group = group
        self.service = service
        self.message_store = message_store

    async def handle(self, request: Frame, conn: Any) -> Frame | None:
        if self.service.handles(request.code):
            return await self.service.handle(request, conn)
        if request.code != RequestCode.SEND_MESSAGE:
            return make_response(request, ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                                 remark=f"request code {request.code} is not served by a dledger node")
        try:
            appended = await self.group.append(request.body)
        except NotLeaderError as e:
            return make_response(request, ResponseCode.NOT_LEADER, remark=str(e),
                                 ext={"leader_addr": e.leader_addr})
        except RecordTooLargeError as e:
            return make_response(request, ResponseCode.MESSAGE_ILLEGAL, remark=str(e))
        except (AppendTimeoutError, DLedgerError) as e:
            return make_response(request, ResponseCode.SYSTEM_BUSY if e.retriable else ResponseCode.SYSTEM_ERROR,
                                 remark=str(e))
        result = appended.result
        if self.message_store:
            if not result.ok:
                return make_response(request, ResponseCode.MESSAGE_ILLEGAL,
                                     remark=result.remark or result.status.value)
            phy_offset = result.phy_offsets[0]
        else:
            phy_offset = result
        return make_response(request, ResponseCode.SUCCESS, ext={"index": appended.index, "phy_offset": phy_offset})


async def serve_dledger_node(config: DLedgerNodeConfig, *,
                             task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
    assert config.dledger is not None
    ledger = config.dledger
    host, port = parse_host_port(ledger.self_member.service_address, key="service_address")
    async with AsyncExitStack() as stack:
        if config.state_machine == "message_store":
            store = MessageStore.open(config.store)
            stack.callback(store.close)
            machine: Any = CommitLogMachine(store)
        else:
            byte_log = ByteLog(Path(ledger.data_dir) / "byte.log",
                               segment_size_bytes=config.byte_log_segment_size_bytes,
                               fsync=ledger.flush_disk_type == "SYNC_FLUSH")
            stack.callback(byte_log.close)
            machine = byte_log
            store = None
        async with trio.open_nursery() as nursery:
            if store is not None:
                await nursery.start(store.serve)
            async with open_remoting_client(max_frame_size=config.max_frame_size_bytes) as client, \
                    open_dledger_group(ledger, machine,
                                       fetch_range=remote_fetch_range(client, ledger.group, ledger.secret)) as group:
                handler = NodeHandler(group, DLedgerService(group), message_store=store is not None)
                async with trio.open_nursery() as inner:
                    bound = await inner.start(functools.partial(serve_remoting, handler, host, port,
                                                                max_frame_size=config.max_frame_size_bytes))
                    task_status.started(bound)
                    await trio.sleep_forever()


def register(subparsers) -> None:
    parser = subparsers.add_parser("dledger-node", help="run one member of a DLedger (Raft) group",
                                   description="Run one DLedger member with its commit log and remoting port. "
                                               "Prints one ready line once serving.")
    parser.add_argument("--config", type=str, metavar="FILE", required=True,
                        help="TOML file: state_machine, [dledger] (group, self_id, secret, members...), [store]")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(DLedgerNodeConfig, args.config)
    assert config.dledger is not None

    async def main(nursery: trio.Nursery) -> None:
        try:
            host, port = await nursery.start(functools.partial(serve_dledger_node, config))
        # StoreCorruptedError: message-store files that do not fit the config (a changed segment size), as the
        # broker reports them, where a traceback was.
        except* (OSError, StoreCorruptedError) as group:
            raise start_error(f"dledger-node {config.dledger.self_id} (listen "
                              f"{config.dledger.self_member.service_address}, raft "
                              f"{config.dledger.self_member.raft_address}) could not start", group) from None
        announce_ready("dledger-node", listen=f"{host}:{port}", raft=config.dledger.self_member.raft_address,
                       id=config.dledger.self_id)

    return run_until_signalled(main)
