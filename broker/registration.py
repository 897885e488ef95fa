"""Registration with the name servers: every node, every name server, periodically and at once on a change.

Each node sends REGISTER_BROKER (schema in docs/protocol.md, "Name server requests") with its Raft role and
term and the group's topic configs (each perm limited by the node's ``broker_permission``), every
``register_interval_ms`` and immediately when ``trigger()`` is called: on a role change (so routes name the new
leader as master within one round trip, not a period) and once the node's replicated topic table has moved past
the one it last registered (on a follower too: while its group has no master, a name server routes the group's
topics from the followers' registrations); a change of ``broker_permission`` (UPDATE_BROKER_CONFIG) registers
with every name server before it is answered. Name servers never talk
to each other, so a failure to reach one does not delay the others: each name server has a registration task of
its own (its own period, woken by ``trigger()``, its own ``register_timeout_ms``), and a round run inline by a
change waits for them together at most ``INLINE_WAIT_S``, the ones not answered by then going on in the background.
(One round for all of them made a name server that hangs, a paused VM or a host dropping packets, stretch every
period by ``register_timeout_ms``, past the others' ``broker_not_active_timeout_ms`` so that they evicted the node,
delay a role change's registration, and hold every auto-created topic's first send until the producer's timeout,
though the message was stored.) A clean shutdown unregisters.

A name server keeps nothing on disk: restarted, it knows no node until each registers again, and until then it
routes a cluster's topics on the groups that did (a client that asks it leaves the others' queues unused and
unconsumed; ``raftmq admin create-topic`` asking it found no group, or only those). So a name server is
registered with again within ``RECONNECT_INTERVAL_S`` once its connection closes (it stopped or restarted; the
name server evicts a node whose registration connection closes, the same signal the other way round) and, after
a failed registration, every ``RECONNECT_INTERVAL_S`` until one succeeds, instead of at the next period.

Rounds overlap (the periodic or triggered one, the reconnect task's, one run inline by a topic change or a
permission update), and two of them waiting on the same reconnect are woken in either order: a snapshot taken as
FOLLOWER at term 6 could reach a name server after the one taken as LEADER at term 7, which then routed the group
without its master until the next period (30 s). So every snapshot is numbered as it is taken
(``registration_sequence``, counted per process), and a name server ignores a registration numbered below the
last one it took from the node over the same connection.

The body carries the whole topic table, so its size is bounded where topics are created, not here: the node refuses
a topic that would take the body past ``registration_body_budget(max_frame_size)`` (``node._check_topic_room``),
and name servers must take frames at least as large as the node's ``max_frame_size`` (both 16 MiB by default).
Past a name server's frame limit, every registration of the node was refused and the group left every route. A
table already past the budget (stored under a larger ``max_frame_size``) is still registered whole, with a warning
once it is: a name server whose limit it passes refuses it, and no topic is created until enough are deleted.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import ssl
from collections.abc import Callable, Mapping
from typing import Any

import cbor2
import trio

from broker.topic_config import PERM_READ_WRITE
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError
from remoting.transport import open_connection

log = logging.getLogger(__name__)

RECONNECT_INTERVAL_S = 1.0
# How long a round run inline (a topic change, a permission update) waits for the name servers before it answers:
# well below a producer's send timeout (3 s), above a healthy name server's few milliseconds.
INLINE_WAIT_S = 1.0
# What a REGISTER_BROKER frame holds besides its body: the 8-byte prefix and the header (code, opaque, flag, version
# and an ext of two names of at most 127 characters, an IPv4 address and port, a role and a few integers: under
# 600 bytes), with room for fields to come.
REGISTRATION_HEADROOM_BYTES = 4096


def registration_body_budget(max_frame_size: int) -> int:
    """The largest registration body a node with ``max_frame_size`` sends within its frame limit: what its topic
    table may take (``TopicConfigTable.registration_body_bytes``)."""
    return max_frame_size - REGISTRATION_HEADROOM_BYTES


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
    # Read-only: the node shares one object between its rounds until its topic table changes.
    topic_configs: Mapping[str, dict[str, Any]]
    heartbeat_timeout_ms: int
    broker_permission: int = PERM_READ_WRITE

    def ext(self) -> dict[str, Any]:
        return {"cluster_name": self.cluster_name, "broker_name": self.broker_name, "broker_id": self.broker_id,
                "broker_addr": self.broker_addr, "role": self.role, "term": self.term,
                "data_version": self.data_version, "heartbeat_timeout_ms": self.heartbeat_timeout_ms}

    def body(self) -> bytes:
        # A node that is not read|write registers every topic with its perm ANDed with the node's (RocketMQ's
        # registerBrokerAll): routes then say what the node allows, so producers leave a read-only group's queues
        # and consumers a write-only one's. Read|write leaves each perm as it is, its inherit bit too.
        mask = None if self.broker_permission == PERM_READ_WRITE else self.broker_permission
        return cbor2.dumps({topic: {"read_queue_nums": c["read_queue_nums"],
                                    "write_queue_nums": c["write_queue_nums"],
                                    "perm": c["perm"] if mask is None else c["perm"] & mask,
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
                 *, interval_ms: int, timeout_ms: int,
                 tls_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None,
                 max_body_bytes: int | None = None) -> None:
        self._client = client
        # registration_body_budget of the node: a body past it is still sent, with a warning as it goes past.
        self._max_body_bytes = max_body_bytes
        self._over_budget = False
        # The pooled client's TLS (the node's tls_client_enable), for unregister_all's connections of their own.
        self._tls_context = tls_context
        self._addrs = namesrv_addrs
        self._snapshot = snapshot
        self._interval_s = interval_ms / 1000
        self._timeout_s = timeout_ms / 1000
        self._wakes = {addr: trio.Event() for addr in namesrv_addrs}  # each name server's task's
        self._nursery: trio.Nursery | None = None  # serve's: inline rounds' registrations outlive their callers
        self._rounds = 0
        self._successes = 0
        self._failures = 0
        self._last_master: str | None = None
        # Name servers whose last registration succeeded (over the pooled connection: one that closes since means
        # the name server went away), and the failures in a row of the others.
        self._registered: set[str] = set()
        self._failing: dict[str, int] = {}
        # The topic table's data_version each name server was last sent (registered_data_version).
        self._sent_versions: dict[str, int] = {}
        # Numbers each snapshot in the order taken; the name servers keep the newest (module docstring).
        self._sequence = itertools.count(1)
        # (topic_configs, broker_permission, body) of the last body encoded: rounds share it while the node's topic
        # table, and so the snapshot's topic_configs object, is the same. Encoding 40,000 topics took 50 ms, once
        # per name server and round before.
        self._body: tuple[Mapping[str, dict[str, Any]], int, bytes] | None = None
        self.registered_once = trio.Event()

    def statistics(self) -> RegistrationStatistics:
        return RegistrationStatistics(self._rounds, self._successes, self._failures, self._last_master)

    @property
    def registered_data_version(self) -> int | None:
        """The oldest topic table's data_version a name server was last sent (None until each was sent one): the
        node triggers a round while it trails its table. Per name server: one kept by the reconnect task or its own
        task would otherwise vouch for the others, which then waited out their period with the old table."""
        if not self._sent_versions or len(self._sent_versions) < len(self._addrs):
            return None  # one not sent yet (or no name server at all: nothing to register with)
        return min(self._sent_versions.values())

    def trigger_behind(self, data_version: int) -> None:
        """Register now with each name server last sent a topic table other than ``data_version`` (or none): the
        others, up to date, are left to their period (a hung one, behind for as long as it hangs, would otherwise
        have every other name server registered with again at every look)."""
        for addr in self._addrs:
            if self._sent_versions.get(addr) != data_version:
                self._wakes[addr].set()

    def trigger(self) -> None:
        """Register with every name server now (safe to call often; rounds coalesce per name server)."""
        for wake in self._wakes.values():
            wake.set()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if not self._addrs:
            task_status.started()
            log.warning("no name server configured (namesrv_addrs is empty); clients will not find this node")
            await trio.sleep_forever()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                nursery.start_soon(self._serve_reconnect)
                for addr in self._addrs:
                    nursery.start_soon(self._serve_one, addr)
        finally:
            self._nursery = None  # closed: a round run inline after it (a change finishing at shutdown) waits itself

    async def _serve_one(self, addr: str) -> None:
        """Register with ``addr`` every ``register_interval_ms``, and at once when triggered."""
        while True:
            self._wakes[addr] = trio.Event()
            snap, sequence = self._numbered_snapshot()
            self._rounds += 1
            await self._register_one(addr, snap, sequence)
            with trio.move_on_after(self._interval_s):
                await self._wakes[addr].wait()

    async def _serve_reconnect(self) -> None:
        """Register again with each name server whose last registration failed or whose connection has closed
        since, every ``RECONNECT_INTERVAL_S`` (a task of its own: a name server that hangs here holds up no periodic
        or triggered round)."""
        while True:
            await trio.sleep(RECONNECT_INTERVAL_S)
            connections = self._client.connections()
            lost = [addr for addr in self._addrs
                    if addr in self._failing or (addr in self._registered and addr not in connections)]
            if not lost:
                continue
            for addr in lost:
                if addr not in self._failing:
                    log.info("connection to a name server closed, registering again namesrv=%s", addr)
                    self._registered.discard(addr)
            snap, sequence = self._numbered_snapshot()
            async with trio.open_nursery() as nursery:
                for addr in lost:
                    nursery.start_soon(self._register_one, addr, snap, sequence)

    def _numbered_snapshot(self) -> tuple[RegistrationSnapshot, int]:
        # Taken and numbered in one step, with no checkpoint between: the numbers follow the snapshots' order.
        return self._snapshot(), next(self._sequence)

    async def register_all(self) -> None:
        """Register with every name server now, for a change that is answered once it is registered: waits for them
        all, at most ``INLINE_WAIT_S`` once the service serves (the rest go on in its nursery, not cancelled)."""
        snap, sequence = self._numbered_snapshot()
        self._rounds += 1
        if self._nursery is None:  # not serving (a test, or before start): wait for them all
            async with trio.open_nursery() as nursery:
                for addr in self._addrs:
                    nursery.start_soon(self._register_one, addr, snap, sequence)
            return
        pending = len(self._addrs)
        done = trio.Event()

        async def one(addr: str) -> None:
            nonlocal pending
            try:
                await self._register_one(addr, snap, sequence)
            finally:
                pending -= 1
                if not pending:
                    done.set()

        for addr in self._addrs:
            self._nursery.start_soon(one, addr)
        with trio.move_on_after(INLINE_WAIT_S):
            await done.wait()

    async def _register_one(self, addr: str, snap: RegistrationSnapshot, sequence: int) -> None:
        self._sent_versions[addr] = snap.data_version
        ext = snap.ext()
        ext["registration_sequence"] = sequence
        request = make_request(RequestCode.REGISTER_BROKER, ext=ext, body=self._body_of(snap))
        try:
            response = await self._client.invoke(addr, request, timeout_s=self._timeout_s)
        except RaftMQError as e:
            self._failed(addr, str(e))
            return
        except BaseException:
            # Cancelled: a round run inline by a request (a topic change) whose client went away. Counted neither
            # way, the name server kept the old topic table until the next periodic round (30 s); marked, the
            # reconnect task registers again within a second.
            self._registered.discard(addr)
            self._failing.setdefault(addr, 0)
            raise
        if response.code != ResponseCode.SUCCESS:
            self._failed(addr, f"refused with code {response.code}: {response.remark}")
            return
        self._successes += 1
        self._registered.add(addr)
        failed = self._failing.pop(addr, 0)
        if failed:
            log.info("registered again namesrv=%s failed_attempts=%d", addr, failed)
        master = response.ext.get("master_addr")
        if master != self._last_master:
            log.info("name server sees master namesrv=%s master_addr=%s role=%s term=%d", addr, master, snap.role,
                     snap.term)
            self._last_master = master
        self.registered_once.set()

    def _body_of(self, snap: RegistrationSnapshot) -> bytes:
        cached = self._body
        if cached is not None and cached[0] is snap.topic_configs and cached[1] == snap.broker_permission:
            return cached[2]
        body = snap.body()
        self._body = (snap.topic_configs, snap.broker_permission, body)
        over = self._max_body_bytes is not None and len(body) > self._max_body_bytes
        if over and not self._over_budget:
            log.warning("registration body is %d bytes with %d topics, over its budget of %d (max_frame_size less "
                        "%d): it is still sent, but a name server with a smaller frame limit refuses every "
                        "registration, and no topic is created until topics are deleted", len(body),
                        len(snap.topic_configs), self._max_body_bytes, REGISTRATION_HEADROOM_BYTES)
        elif self._over_budget and not over:
            log.info("registration body is %d bytes, within its budget of %d again", len(body),
                     self._max_body_bytes)
        self._over_budget = over
        return body

    def _failed(self, addr: str, reason: str) -> None:
        self._failures += 1
        self._registered.discard(addr)
        n = self._failing[addr] = self._failing.get(addr, 0) + 1
        # Retried every second while it lasts: the first failure, then the 10th, 100th, ... in a row are warnings.
        level = logging.WARNING if str(n).rstrip("0") == "1" else logging.DEBUG
        log.log(level, "registration failed namesrv=%s failures_in_a_row=%d error=%s", addr, n, reason)

    async def unregister_all(self) -> None:
        """Tell every name server this node is going away (call it shielded: it runs during shutdown)."""
        snap = self._snapshot()
        ext = {"cluster_name": snap.cluster_name, "broker_name": snap.broker_name, "broker_id": snap.broker_id,
               "broker_addr": snap.broker_addr}

        async def _one(addr: str) -> None:
            # A connection of its own: on shutdown the pooled ones are being torn down with their nursery.
            try:
                async with open_connection(addr, connect_timeout_s=min(self._timeout_s, 1.0),
                                           tls_context=self._tls_context) as conn:
                    await conn.invoke(make_request(RequestCode.UNREGISTER_BROKER, ext=ext),
                                      timeout_s=min(self._timeout_s, 1.0))
                log.info("unregistered namesrv=%s", addr)
            except RaftMQError as e:
                log.info("unregister failed namesrv=%s error=%s", addr, e)

        async with trio.open_nursery() as nursery:
            for addr in self._addrs:
                nursery.start_soon(_one, addr)
