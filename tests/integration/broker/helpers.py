"""In-process broker nodes (single-member or 3-member groups) and a name server, on 127.0.0.1."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import cbor2
import trio

from broker.config import BrokerConfig
from broker.node import serve_broker
from dledger.member_auth import MemberSigner
from namesrv import NamesrvConfig, serve_namesrv
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.config import config_from_mapping
from remoting.transport import open_remoting_client
from tests.procs import free_port

SECRET = "broker-integration-secret-0123456789"


def broker_configs(tmp_path: Path, namesrv_addr: str | list[str] | None, n: int = 1,
                   **overrides: Any) -> list[BrokerConfig]:
    members = [{"id": f"n{i + 1}", "raft_address": f"127.0.0.1:{free_port()}",
                "service_address": f"127.0.0.1:{free_port()}"} for i in range(n)]
    configs = []
    for m in members:
        data: dict[str, Any] = {
            "namesrv_addrs": ([namesrv_addr] if isinstance(namesrv_addr, str) else list(namesrv_addr or [])),
            "store": {"store_dir": str(tmp_path / m["id"] / "store"), "segment_size_bytes": 8 << 20},
            "dledger": {"group": "broker-a", "self_id": m["id"], "secret": SECRET, "members": members,
                        "data_dir": str(tmp_path / m["id"] / "dledger"), "election_timeout_min_ms": 200,
                        "election_timeout_max_ms": 500, "heartbeat_interval_ms": 40,
                        "connection_timeout_ms": 1000, "leader_fallback_timeout_ms": 1000},
        }
        for key, value in overrides.items():
            target = data
            *parents, leaf = key.split(".")
            for p in parents:
                target = target.setdefault(p, {})
            target[leaf] = value
        configs.append(config_from_mapping(BrokerConfig, data))
    return configs


async def start_namesrv(nursery: trio.Nursery) -> str:
    host, port = await nursery.start(functools.partial(serve_namesrv, NamesrvConfig(listen="127.0.0.1:0")))
    return f"{host}:{port}"


async def start_broker(nursery: trio.Nursery, config: BrokerConfig) -> str:
    host, port = await nursery.start(functools.partial(serve_broker, config))
    return f"{host}:{port}"


async def call(client: Any, addr: str, code: int, ext: dict | None = None, body: bytes = b"",
               timeout_s: float = 5.0):
    return await client.invoke(addr, make_request(code, ext=ext or {}, body=body), timeout_s=timeout_s)


async def member_call(client: Any, addr: str, code: int, ext: dict | None = None, timeout_s: float = 5.0):
    """``call`` signed as a member of the group (``MemberSignature`` with ``SECRET``): FETCH_COMMIT_LOG is served to
    members only."""
    request = MemberSigner(SECRET).sign(make_request(code, ext=ext or {}))
    return await client.invoke(addr, request, timeout_s=timeout_s)


async def ready_leader_among(nodes: dict[str, Any], scopes: dict[str, trio.CancelScope]) -> str:
    """The id of the node of ``nodes`` (in-process ``BrokerNode``s, each run in its cancel scope of ``scopes``) that
    leads with its no-op applied, of those not cancelled; at most 15 s."""
    with trio.fail_after(15):
        while True:
            for nid, node in nodes.items():
                if not scopes[nid].cancel_called and node.group.is_ready_leader:
                    return nid
            await trio.sleep(0.05)


async def wait_leader(client: Any, addr: str) -> None:
    """Until the node at ``addr`` reports itself LEADER (GET_BROKER_RUNTIME_INFO), at most 10 s."""
    with trio.fail_after(10):
        while True:
            r = await call(client, addr, RequestCode.GET_BROKER_RUNTIME_INFO)
            if r.code == ResponseCode.SUCCESS and cbor2.loads(r.body)["role"] == "LEADER":
                return
            await trio.sleep(0.05)


async def start_leading_node(nursery: trio.Nursery, tmp_path: Path, **overrides: Any) -> tuple[str, str]:
    """A name server and a one-member broker group (config ``overrides``) whose node leads; (name server address,
    broker address)."""
    namesrv = await start_namesrv(nursery)
    (config,) = broker_configs(tmp_path, namesrv, **overrides)
    addr = await start_broker(nursery, config)
    async with open_remoting_client() as client:
        await wait_leader(client, addr)
    return namesrv, addr
