"""Registration with the name servers: every node, every name server, periodically and at once on a change.

Each node sends REGISTER_BROKER (schema in docs/protocol.md, "Name server requests") with its Raft role and
term and the group's topic configs, every ``register_interval_ms`` and immediately when ``trigger()`` is called:
on a role change (so routes name the new leader as master within one round trip, not a period) and once the
node's replicated topic table has moved past the one it last registered (on a follower too: while its group has
no master, a name server routes the group's topics from the followers' registrations). Name servers never talk
to each other, so a failure to reach one does not delay the others: each round registers with all of them
concurrently, each under its own timeout. A clean shutdown unregisters.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import cbor2
import trio

from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError
from remoting.transport import open_connection

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RegistrationSnapshot:
    """What one registration says; built fresh for every round by the node."""

    cluster_name: str
    broker_name: str
    broker_id: int
    broker_addr: str
    role: str
    term: int
    data_version: int
    topic_configs: dict[str, dict[str, Any]]

    def ext(self) -> dict[str, Any]:
        return {"cluster_name": self.cluster_name, "broker_name": self.broker_name, "broker_id": self.broker_id,
                "broker_addr": self.broker_addr, "role": self.role, "term": self.term,
                "data_version": self.data_version}

    def body(self) -> bytes:
        return cbor2.dumps({topic: {"read_queue_nums": c["read_queue_nums"],
                                    "write_queue_nums": c["write_queue_nums"], "perm": c["perm"],
                                    "topic_sys_flag": c.get("topic_sys_flag", 0), "order": c.get("order", False)}
                            for topic, c in self.topic_configs.items()})


@dataclasses.dataclass(frozen=True)
class RegistrationStatistics:
    rounds: int
    successes: int
    failures: int
    last_master_addr: str | None


class RegistrationService:
    def __init__(self, client: Any, namesrv_addrs: tuple[str, ...], snapshot: Callable[[], RegistrationSnapshot],
                 *, interval_ms: int, timeout_ms: int) -> None:
        self._client = client
        self._addrs = namesrv_addrs
        self._snapshot = snapshot
        self._interval_s = interval_ms / 1000
        self._timeout_s = timeout_ms / 1000
        self._wake = trio.Event()
        self._rounds = 0
        self._successes = 0
        self._failures = 0
        self._last_master: str | None = None
        # The topic table's data_version that the last round carried (None before the first round).
        self.registered_data_version: int | None = None
        self.registered_once = trio.Event()

    def statistics(self) -> RegistrationStatistics:
        return RegistrationStatistics(self._rounds, self._successes, self._failures, self._last_master)

    def trigger(self) -> None:
        """Register with every name server now (safe to call often; rounds coalesce)."""
        self._wake.set()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        if not self._addrs:
            log.warning("no name server configured (namesrv_addrs is empty); clients will not find this node")
            await trio.sleep_forever()
        while True:
            self._wake = trio.Event()
            await self.register_all()
            with trio.move_on_after(self._interval_s):
                await self._wake.wait()

    async def register_all(self) -> None:
        snap = self._snapshot()
        self._rounds += 1
        self.registered_data_version = snap.data_version
        async with trio.open_nursery() as nursery:
            for addr in self._addrs:
                nursery.start_soon(self._register_one, addr, snap)

    async def _register_one(self, addr: str, snap: RegistrationSnapshot) -> None:
        request = make_request(RequestCode.REGISTER_BROKER, ext=snap.ext(), body=snap.body())
        try:
            response = await self._client.invoke(addr, request, timeout_s=self._timeout_s)
        except RaftMQError as e:
            self._failures += 1
            log.warning("registration failed namesrv=%s error=%s", addr, e)
            return
        if response.code != ResponseCode.SUCCESS:
            self._failures += 1
            log.warning("registration refused namesrv=%s code=%s remark=%s", addr, response.code, response.remark)
            return
        self._successes += 1
        master = response.ext.get("master_addr")
        if master != self._last_master:
            log.info("name server sees master namesrv=%s master_addr=%s role=%s term=%d", addr, master, snap.role,
                     snap.term)
            self._last_master = master
        self.registered_once.set()

    async def unregister_all(self) -> None:
        """Tell every name server this node is going away (call it shielded: it runs during shutdown)."""
        snap = self._snapshot()
        ext = {"cluster_name": snap.cluster_name, "broker_name": snap.broker_name, "broker_id": snap.broker_id,
               "broker_addr": snap.broker_addr}

        async def _one(addr: str) -> None:
            # A connection of its own: on shutdown the pooled ones are being torn down with their nursery.
            try:
                async with open_connection(addr, connect_timeout_s=min(self._timeout_s, 1.0)) as conn:
                    await conn.invoke(make_request(RequestCode.UNREGISTER_BROKER, ext=ext),
                                      timeout_s=min(self._timeout_s, 1.0))
                log.info("unregistered namesrv=%s", addr)
            except RaftMQError as e:
                log.info("unregister failed namesrv=%s error=%s", addr, e)

        async with trio.open_nursery() as nursery:
            for addr in self._addrs:
                nursery.start_soon(_one, addr)
