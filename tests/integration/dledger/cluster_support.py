"""Three ``raftmq dledger-node`` processes on 127.0.0.1 for the cluster tests (tests/cluster/test_dledger_*).

``DLedgerCluster`` writes one TOML per member, starts/kills members by PID through the ``spawn`` fixture, finds
the leader with GET_RAFT_STATUS and appends with leader following; ``verify_stores`` reopens every member's
message store after the processes are gone and checks every acknowledged message is on every member and the
commit logs are byte-identical.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from broker.store import MessageInput, MessageStore, StoreConfig, encode_batch
from dledger.service import get_raft_status
from raftmq.bench.dledger import make_members, write_node_config
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError
from tests.procs import raftmq_argv

STORE = {"segment_size_bytes": 1 << 20, "max_message_size": 64 * 1024, "flush_interval_ms": 50}
FAST_ELECTIONS = {"election_timeout_min_ms": 150, "election_timeout_max_ms": 400, "heartbeat_interval_ms": 30,
                  "connection_timeout_ms": 1000, "leader_fallback_timeout_ms": 1000}


def message(tag: str, i: int, size: int = 200) -> bytes:
    body = (f"{tag}-{i:06d}-".encode() * (size // 16 + 1))[:size]
    return encode_batch([MessageInput(topic="DLedgerTest", queue_id=i % 4, body=body,
                                      born_host=("127.0.0.1", 4000))], ("127.0.0.1", 10911))


def body_of(record: bytes) -> bytes:
    from broker.store import decode_batch
    return decode_batch(record)[1][0].body


@dataclass
class Acked:
    phy_offset: int
    body: bytes
    started: float
    finished: float


@dataclass
class DLedgerCluster:
    spawn: object
    base_dir: Path
    dledger: dict = field(default_factory=lambda: dict(FAST_ELECTIONS))
    group: str = "dl-test"

    def __post_init__(self) -> None:
        self.members = make_members(3)
        self.secret = secrets.token_hex(16)
        self.procs: dict[str, object] = {}
        self.leader_hint: str | None = None
        self.paths = {m.id: write_node_config(self.base_dir / f"{m.id}.toml", self_id=m.id, members=self.members,
                                              secret=self.secret, base_dir=self.base_dir, group=self.group,
                                              store=STORE, **self.dledger)
                      for m in self.members}

    @property
    def ids(self) -> list[str]:
        return [m.id for m in self.members]

    def address(self, member_id: str) -> str:
        return next(m.service_address for m in self.members if m.id == member_id)

    def start(self, member_id: str):
        proc = self.spawn(raftmq_argv("dledger-node", "--config", str(self.paths[member_id])), ready_timeout_s=30)
        self.procs[member_id] = proc
        return proc

    def start_all(self) -> None:
        for member_id in self.ids:
            self.start(member_id)

    def kill(self, member_id: str) -> None:
        self.procs[member_id].kill()

    def describe(self) -> str:
        """Each member's state, with the last lines a stopped one printed: what a failure message needs."""
        parts = []
        for member_id in self.ids:
            proc = self.procs.get(member_id)
            if proc is None:
                parts.append(f"{member_id}: never started")
            elif proc.alive:
                parts.append(f"{member_id}: running pid={proc.pid}")
            else:
                tail = "".join(proc.output[-8:])
                parts.append(f"{member_id}: exited rc={proc.proc.returncode}, last output:\n{tail}")
        return "\n".join(parts)

    def alive(self) -> list[str]:
        return [k for k, p in self.procs.items() if p.alive]

    async def status(self, client, member_id: str) -> dict:
        status, _ = await get_raft_status(client, self.address(member_id), self.group, timeout_s=1.0)
        return status

    async def wait_leader(self, client, timeout_s: float = 10.0) -> str:
        with trio.fail_after(timeout_s):
            while True:
                for member_id in self.alive():
                    try:
                        status = await self.status(client, member_id)
                    except (RaftMQError, OSError):
                        continue
                    if status["role"] == "LEADER":
                        self.leader_hint = member_id
                        return member_id
                await trio.sleep(0.05)

    async def append(self, client, record: bytes, *, timeout_s: float = 10.0) -> Acked:
        """Append with leader following: NOT_LEADER and dead connections move on to another member."""
        started = time.monotonic()
        with trio.fail_after(timeout_s):
            while True:
                target = self.leader_hint or self.ids[0]
                try:
                    response = await client.invoke(self.address(target), make_request(RequestCode.SEND_MESSAGE,
                                                                                       body=record), timeout_s=3.0)
                except (RaftMQError, OSError):
                    self._next_hint(target)
                    await trio.sleep(0.01)
                    continue
                if response.code == ResponseCode.SUCCESS:
                    return Acked(response.ext["phy_offset"], body_of(record), started, time.monotonic())
                if response.code == ResponseCode.NOT_LEADER:
                    leader_addr = response.ext.get("leader_addr") or ""
                    hinted = next((m.id for m in self.members if m.service_address == leader_addr), None)
                    if hinted and hinted != target and hinted in self.alive():
                        self.leader_hint = hinted
                    else:
                        self._next_hint(target)
                await trio.sleep(0.01)

    @asynccontextmanager
    async def writing(self, client, acked: list[Acked], tag: str = "w", *, writers: int = 8,
                      timeout_s: float = 5.0) -> AsyncIterator[None]:
        """``writers`` tasks append (leader following, failures retried) until the block ends; every
        acknowledged append goes to ``acked``. Appends still in flight at the end are abandoned, never counted."""
        async def writer(w: int) -> None:
            i = 0
            while True:
                i += 1
                try:
                    acked.append(await self.append(client, message(f"{tag}{w}", i), timeout_s=timeout_s))
                except (RaftMQError, trio.TooSlowError):
                    await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            for w in range(writers):
                nursery.start_soon(writer, w)
            yield
            nursery.cancel_scope.cancel()

    def _next_hint(self, failed: str) -> None:
        ids = self.ids
        self.leader_hint = ids[(ids.index(failed) + 1) % len(ids)]

    async def wait_converged(self, client, min_end_offset: int, timeout_s: float = 20.0) -> int:
        with trio.fail_after(timeout_s):
            while True:
                try:
                    ends = [int((await self.status(client, m))["end_offset"]) for m in self.ids]
                except (RaftMQError, OSError):
                    ends = [-1]
                if len(set(ends)) == 1 and ends[0] >= min_end_offset:
                    return ends[0]
                await trio.sleep(0.1)

    def verify_stores(self, acked: list[Acked]) -> int:
        """All processes must be stopped. Returns the common end offset."""
        checksums = []
        ends = []
        for member_id in self.ids:
            store = MessageStore.open(StoreConfig(store_dir=self.base_dir / member_id / "store", **STORE))
            try:
                for a in acked:
                    view = store.look_message_by_offset(a.phy_offset)
                    assert view is not None and view.body == a.body, \
                        f"acknowledged message at {a.phy_offset} missing or different on {member_id}"
                ends.append(store.max_phy_offset)
                checksums.append(store.segment_checksums(store.max_phy_offset))
            finally:
                store.close()
        assert len(set(ends)) == 1, f"members end at different offsets: {ends}"
        assert all(c == checksums[0] for c in checksums), "commit logs differ between members"
        return ends[0]
