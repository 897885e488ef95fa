"""The route table of a name server: RocketMQ's RouteInfoManager, sans-IO.

Rules this module keeps (design §1):

* A name server holds only what broker nodes told it; it never persists anything and never talks to another
  name server. Every node registers with every name server, so two name servers converge on their own.
* A broker *group* is one Raft group, named by ``broker_name`` and belonging to one cluster. Its *nodes* are
  numbered 1, 2, 3 …; ``0`` is reserved for "the current master" in routes, as RocketMQ's ``MASTER_ID``.
* The master is the node claiming LEADER with the highest Raft term. Each group remembers the highest term any
  LEADER claim ever carried (``leader_term_seen``): a claim below it is stale, because Raft guarantees that a
  majority has moved past that term, so a leader of the older term can commit nothing. A stale claimer is listed
  as a replica under its node id, and it never becomes master again, even after the newer leader leaves.
* Queue data (topics with queue counts and permissions) come from the master's registration; while a group has
  no master they come from the node with the highest ``data_version``, so readers keep a route during an
  election. Each registration carries the full topic set, so a topic missing from it is gone from that group.
* A node silent for its own ``heartbeat_timeout_ms`` (sent in its registration, as RocketMQ 5's
  ``heartbeatTimeoutMillis``; ``broker_expired_ms`` for a registration without one) is evicted by
  ``scan_not_active``: only the broker knows how often it registers. A closed registration connection
  evicts at once the nodes whose latest registration came over it (and only those: a node that has since
  registered over a new connection stays). A group whose last node leaves disappears, with its queue data; a
  topic with no queue data left disappears.
* A broker node registers over a connection of its own, so one connection registers at most
  ``MAX_NODES_PER_CONNECTION`` nodes (a registration of one more is refused): the table is then bounded by the
  open connections, each of which evicts its nodes when it closes. Before, one connection registering a fresh
  broker name each time, each with a heartbeat timeout of a day, grew the table for a day.
* A node id belongs to one address at a time. A registration of an id that another address holds, over a live
  connection and unexpired, is refused (``RouteConflictError`` on ``broker_id``): the two are different nodes
  whose configs list ``dledger.members`` in different orders, and each used to overwrite the other's entry, so a
  live group lost its master in routes. Only a leader claim that would be master takes the id over (the group
  must keep its master in routes; the node it displaces is refused in turn until it is gone).
* Over one connection, a registration whose ``registration_sequence`` is below the node's last one is older news
  that overtook it in the broker (two rounds waiting on one reconnect wake in either order): it keeps the node
  alive but changes nothing else. A new connection starts the count afresh (a restarted broker counts from 1).

Nothing here reads a clock or a socket: callers pass ``now_ms`` and an opaque, hashable ``conn_key``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable, Mapping
from typing import Any, Literal

log = logging.getLogger(__name__)

__all__ = [
    "MASTER_ID", "ROLES", "Role", "TopicConfig", "Registration", "RegisterResult", "QueueData", "BrokerData",
    "TopicRouteData", "NodeStatus", "ClusterInfo", "EvictedNode", "RouteStatistics", "RouteConflictError",
    "RouteInfoManager",
]

MASTER_ID = 0
MAX_NODES_PER_CONNECTION = 64  # a broker process registers one; tests and tools that stand in for a few, more
Role = Literal["LEADER", "FOLLOWER", "CANDIDATE"]
ROLES: tuple[str, ...] = ("LEADER", "FOLLOWER", "CANDIDATE")


@dataclasses.dataclass(frozen=True, slots=True)
class TopicConfig:
    """What a broker group says about one of its topics (RocketMQ's TopicConfig, minus the name)."""

    read_queue_nums: int
    write_queue_nums: int
    perm: int
    topic_sys_flag: int = 0
    order: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Registration:
    """One REGISTER_BROKER request, already validated."""

    cluster_name: str
    broker_name: str
    broker_id: int
    broker_addr: str
    role: Role
    term: int
    data_version: int
    topic_configs: Mapping[str, TopicConfig]
    # Evict the node after this long without a registration; None: the name server's broker_expired_ms.
    heartbeat_timeout_ms: int | None = None
    # Grows with every snapshot the broker process registers (brokers before 2026-11-29 send none): over one
    # connection, a registration numbered below the node's last one is older news that arrived late.
    registration_sequence: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RegisterResult:
    """What the name server answers a registering node: who it considers the master of the node's group.
    ``ignored`` (not on the wire: the node is answered as usual) says the table kept the node's newer registration
    and took this one only as a sign of life, so what it carried must not be cached as the node's."""

    master_addr: str | None
    master_id: int | None
    master_term: int | None
    ignored: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {"master_addr": self.master_addr, "master_id": self.master_id, "master_term": self.master_term}


@dataclasses.dataclass(frozen=True, slots=True)
class QueueData:
    broker_name: str
    read_queue_nums: int
    write_queue_nums: int
    perm: int
    topic_sys_flag: int
    order: bool

    def to_wire(self) -> dict[str, Any]:
        return {"broker_name": self.broker_name, "read_queue_nums": self.read_queue_nums,
                "write_queue_nums": self.write_queue_nums, "perm": self.perm,
                "topic_sys_flag": self.topic_sys_flag, "order": self.order}


@dataclasses.dataclass(frozen=True, slots=True)
class BrokerData:
    """A group's addresses as clients see them: ``broker_addrs[0]`` is the master, other keys are node ids."""

    cluster: str
    broker_name: str
    broker_addrs: Mapping[int, str]

    def to_wire(self) -> dict[str, Any]:
        # String keys, as RocketMQ's JSON has them: a client in any language reads them the same way.
        return {"cluster": self.cluster, "broker_name": self.broker_name,
                "broker_addrs": {str(k): v for k, v in sorted(self.broker_addrs.items())}}


@dataclasses.dataclass(frozen=True, slots=True)
class TopicRouteData:
    queue_datas: tuple[QueueData, ...]
    broker_datas: tuple[BrokerData, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"queue_datas": [q.to_wire() for q in self.queue_datas],
                "broker_datas": [b.to_wire() for b in self.broker_datas]}


@dataclasses.dataclass(frozen=True, slots=True)
class NodeStatus:
    broker_id: int
    broker_addr: str
    role: str
    term: int
    data_version: int
    is_master: bool
    last_update_age_ms: int
    heartbeat_timeout_ms: int

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterInfo:
    """RocketMQ's ClusterInfo (brokerAddrTable + clusterAddrTable), plus every node's own claim."""

    broker_addr_table: Mapping[str, BrokerData]
    cluster_addr_table: Mapping[str, tuple[str, ...]]
    nodes: Mapping[str, tuple[NodeStatus, ...]]

    def to_wire(self) -> dict[str, Any]:
        return {
            "broker_addr_table": {name: b.to_wire() for name, b in sorted(self.broker_addr_table.items())},
            "cluster_addr_table": {c: list(names) for c, names in sorted(self.cluster_addr_table.items())},
            "nodes": {name: [n.to_wire() for n in ns] for name, ns in sorted(self.nodes.items())},
        }


@dataclasses.dataclass(frozen=True, slots=True)
class EvictedNode:
    cluster_name: str
    broker_name: str
    broker_id: int
    broker_addr: str
    reason: Literal["expired", "connection_closed", "unregistered"]


@dataclasses.dataclass(frozen=True, slots=True)
class RouteStatistics:
    clusters: int
    broker_names: int
    nodes: int
    topics: int
    registrations: int
    evictions: int  # nodes removed for any reason: every value of ``removals``
    removals: Mapping[str, int]  # nodes removed, by reason: expired, connection_closed, unregistered


class RouteConflictError(ValueError):
    """A registration contradicts the table in a way only an operator can fix (e.g. one broker name claimed
    by two clusters); ``field`` names the offending request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(slots=True)
class _Node:
    broker_id: int
    broker_addr: str
    role: str
    term: int
    data_version: int
    topic_configs: Mapping[str, TopicConfig]
    last_update_ms: int
    conn_key: Hashable | None
    heartbeat_timeout_ms: int
    registration_sequence: int | None = None


@dataclasses.dataclass(slots=True)
class _Group:
    cluster_name: str
    broker_name: str
    nodes: dict[int, _Node] = dataclasses.field(default_factory=dict)
    leader_term_seen: int = -1
    master_id: int | None = None
    topic_configs: Mapping[str, TopicConfig] = dataclasses.field(default_factory=dict)

    def master(self) -> _Node | None:
        return self.nodes.get(self.master_id) if self.master_id is not None else None

    def broker_data(self) -> BrokerData:
        addrs: dict[int, str] = {}
        for node_id, node in self.nodes.items():
            addrs[MASTER_ID if node_id == self.master_id else node_id] = node.broker_addr
        return BrokerData(self.cluster_name, self.broker_name, addrs)


class RouteInfoManager:
    """The whole route table of one name server. Not thread-safe; one trio task drives it."""

    def __init__(self, *, broker_expired_ms: int = 120_000) -> None:
        if broker_expired_ms <= 0:
            raise ValueError(f"broker_expired_ms must be > 0, got {broker_expired_ms}")
        self.broker_expired_ms = broker_expired_ms
        self._groups: dict[str, _Group] = {}
        self._clusters: dict[str, set[str]] = {}
        self._topic_queue_table: dict[str, dict[str, QueueData]] = {}
        self._by_conn: dict[Hashable, set[tuple[str, int]]] = {}
        self._registrations = 0
        self._removals = {"expired": 0, "connection_closed": 0, "unregistered": 0}
        self._generation = 0

    @property
    def generation(self) -> int:
        """Grows whenever any route could have changed (membership, addresses, masters, queue data) and never
        otherwise: a heartbeat that changes nothing leaves it alone, so callers may cache encoded routes."""
        return self._generation

    # ---- writes ------------------------------------------------------------------------------------------

    def register_broker(self, reg: Registration, *, now_ms: int, conn_key: Hashable | None = None
                        ) -> RegisterResult:
        linked = self._by_conn.get(conn_key, ()) if conn_key is not None else ()
        if len(linked) >= MAX_NODES_PER_CONNECTION and (reg.broker_name, reg.broker_id) not in linked:
            raise RouteConflictError(
                "broker_name",
                f"this connection already registered {len(linked)} broker nodes, the most one may; node "
                f"{reg.broker_id} of {reg.broker_name!r} must register over a connection of its own")
        group = self._groups.get(reg.broker_name)
        holder = group.nodes.get(reg.broker_id) if group is not None else None
        if holder is not None:
            assert group is not None
            if holder.broker_addr != reg.broker_addr:
                self._check_id_holder(group, holder, reg, now_ms, conn_key)
            if (conn_key is not None and holder.conn_key == conn_key and reg.registration_sequence is not None
                    and holder.registration_sequence is not None
                    and reg.registration_sequence < holder.registration_sequence):
                log.debug("older registration ignored broker_name=%s broker_id=%d registration_sequence=%d "
                          "latest=%d", reg.broker_name, reg.broker_id, reg.registration_sequence,
                          holder.registration_sequence)
                holder.last_update_ms = now_ms  # it still shows the process is alive
                self._registrations += 1
                master = group.master()
                return (RegisterResult(None, None, None, ignored=True) if master is None
                        else RegisterResult(master.broker_addr, master.broker_id, master.term, ignored=True))
        if group is not None and group.cluster_name != reg.cluster_name:
            others = set(group.nodes) - {reg.broker_id}
            if others:
                raise RouteConflictError(
                    "cluster_name",
                    f"broker name {reg.broker_name!r} already belongs to cluster {group.cluster_name!r} "
                    f"(nodes {sorted(others)}), so node {reg.broker_id} cannot register it in cluster "
                    f"{reg.cluster_name!r}")
            # The group's only node moved to another cluster: follow it.
            self._clusters_discard(group.cluster_name, group.broker_name)
            group.cluster_name = reg.cluster_name
            self._generation += 1
        if group is None:
            group = self._groups[reg.broker_name] = _Group(reg.cluster_name, reg.broker_name)
            log.info("broker group joined cluster=%s broker_name=%s", reg.cluster_name, reg.broker_name)
        self._clusters.setdefault(reg.cluster_name, set()).add(reg.broker_name)

        timeout_ms = reg.heartbeat_timeout_ms or self.broker_expired_ms
        node = group.nodes.get(reg.broker_id)
        if node is None:
            node = group.nodes[reg.broker_id] = _Node(
                reg.broker_id, reg.broker_addr, reg.role, reg.term, reg.data_version, reg.topic_configs,
                now_ms, conn_key, timeout_ms, reg.registration_sequence)
            self._generation += 1
            log.info("node registered broker_name=%s broker_id=%d broker_addr=%s role=%s term=%d",
                     reg.broker_name, reg.broker_id, reg.broker_addr, reg.role, reg.term)
        else:
            if node.broker_addr != reg.broker_addr:
                self._generation += 1
            if node.broker_addr != reg.broker_addr or node.role != reg.role:
                log.info("node changed broker_name=%s broker_id=%d broker_addr=%s role=%s term=%d",
                         reg.broker_name, reg.broker_id, reg.broker_addr, reg.role, reg.term)
            self._unlink_conn(node.conn_key, reg.broker_name, reg.broker_id)
            node.broker_addr, node.role, node.term = reg.broker_addr, reg.role, reg.term
            node.data_version, node.topic_configs = reg.data_version, reg.topic_configs
            node.last_update_ms, node.conn_key, node.heartbeat_timeout_ms = now_ms, conn_key, timeout_ms
            node.registration_sequence = reg.registration_sequence
        if conn_key is not None:
            self._by_conn.setdefault(conn_key, set()).add((reg.broker_name, reg.broker_id))
        if reg.role == "LEADER" and reg.term > group.leader_term_seen:
            group.leader_term_seen = reg.term
        elif reg.role == "LEADER" and reg.term < group.leader_term_seen:
            log.warning("stale leader claim broker_name=%s broker_id=%d term=%d leader_term_seen=%d",
                        reg.broker_name, reg.broker_id, reg.term, group.leader_term_seen)
        self._registrations += 1
        self._refresh_group(group)
        master = group.master()
        if master is None:
            return RegisterResult(None, None, None)
        return RegisterResult(master.broker_addr, master.broker_id, master.term)

    def _check_id_holder(self, group: _Group, holder: _Node, reg: Registration, now_ms: int,
                         conn_key: Hashable | None) -> None:
        """Refuse ``reg``, which names ``holder``'s id from another address, while ``holder`` is live: registered
        over another connection that is open (the table forgets a node whose connection closed) and not expired.
        A holder registered without a connection (an embedding that passes none) has no liveness to judge: its
        address follows the newest registration, as before."""
        if now_ms - holder.last_update_ms > holder.heartbeat_timeout_ms:
            return  # silent past its timeout: gone, not yet scanned
        if holder.conn_key is None or holder.conn_key == conn_key:
            return  # no connection to judge, or the same one (the same process: its address changed)
        would_master = (reg.role == "LEADER" and reg.term >= group.leader_term_seen
                        and not (holder.role == "LEADER" and holder.term >= reg.term))
        if would_master:
            log.warning("node id taken over by a leader claim broker_name=%s broker_id=%d broker_addr=%s term=%d "
                        "previous_addr=%s previous_role=%s; list dledger.members in the same order on every node",
                        reg.broker_name, reg.broker_id, reg.broker_addr, reg.term, holder.broker_addr, holder.role)
            return
        age_ms = max(0, now_ms - holder.last_update_ms)
        raise RouteConflictError(
            "broker_id",
            f"broker_id {reg.broker_id} of group {reg.broker_name!r} is held by {holder.broker_addr} (registered "
            f"{age_ms} ms ago over a live connection), so {reg.broker_addr} cannot register it: a node's broker_id "
            f"is its 1-based position in dledger.members, so list the members in the same order in every node's "
            f"config and restart the nodes whose order differs (if {holder.broker_addr} is gone, the name server "
            f"forgets it when its connection closes or {holder.heartbeat_timeout_ms} ms after its last "
            f"registration)")

    def unregister_broker(self, cluster_name: str, broker_name: str, broker_id: int,
                          broker_addr: str | None = None) -> EvictedNode | None:
        """Remove one node (a clean shutdown). With ``broker_addr`` the node is removed only if it is still
        registered at that address, so a late unregister of an old incarnation cannot evict its successor."""
        group = self._groups.get(broker_name)
        if group is None or group.cluster_name != cluster_name:
            return None
        node = group.nodes.get(broker_id)
        if node is None or (broker_addr is not None and node.broker_addr != broker_addr):
            return None
        return self._remove_node(group, node, "unregistered")

    def scan_not_active(self, now_ms: int) -> list[EvictedNode]:
        """Evict every node whose last registration is older than its heartbeat timeout."""
        stale = [(group, node) for group in self._groups.values() for node in group.nodes.values()
                 if node.last_update_ms < now_ms - node.heartbeat_timeout_ms]
        return [self._remove_node(group, node, "expired") for group, node in stale]

    def connection_closed(self, conn_key: Hashable) -> list[EvictedNode]:
        """Evict the nodes whose latest registration came over the connection ``conn_key``."""
        evicted = []
        for broker_name, broker_id in sorted(self._by_conn.pop(conn_key, ())):
            group = self._groups.get(broker_name)
            node = group.nodes.get(broker_id) if group else None
            if group is not None and node is not None and node.conn_key == conn_key:
                evicted.append(self._remove_node(group, node, "connection_closed"))
        return evicted

    # ---- reads -------------------------------------------------------------------------------------------

    def pickup_topic_route(self, topic: str) -> TopicRouteData | None:
        queues = self._topic_queue_table.get(topic)
        if not queues:
            return None
        names = sorted(queues)
        return TopicRouteData(tuple(queues[name] for name in names),
                              tuple(self._groups[name].broker_data() for name in names))

    def cluster_info(self, now_ms: int) -> ClusterInfo:
        nodes = {
            name: tuple(NodeStatus(n.broker_id, n.broker_addr, n.role, n.term, n.data_version,
                                   n.broker_id == g.master_id, max(0, now_ms - n.last_update_ms),
                                   n.heartbeat_timeout_ms)
                        for _, n in sorted(g.nodes.items()))
            for name, g in self._groups.items()
        }
        return ClusterInfo({name: g.broker_data() for name, g in self._groups.items()},
                           {c: tuple(sorted(names)) for c, names in self._clusters.items()}, nodes)

    def topic_list(self) -> list[str]:
        return sorted(self._topic_queue_table)

    def statistics(self) -> RouteStatistics:
        return RouteStatistics(len(self._clusters), len(self._groups),
                               sum(len(g.nodes) for g in self._groups.values()), len(self._topic_queue_table),
                               self._registrations, sum(self._removals.values()), dict(self._removals))

    # ---- internals ---------------------------------------------------------------------------------------

    def _remove_node(self, group: _Group, node: _Node, reason: Literal["expired", "connection_closed",
                                                                             "unregistered"]) -> EvictedNode:
        del group.nodes[node.broker_id]
        self._generation += 1
        self._unlink_conn(node.conn_key, group.broker_name, node.broker_id)
        self._removals[reason] += 1
        log.info("node removed reason=%s broker_name=%s broker_id=%d broker_addr=%s heartbeat_timeout_ms=%d",
                 reason, group.broker_name, node.broker_id, node.broker_addr, node.heartbeat_timeout_ms)
        if group.nodes:
            self._refresh_group(group)
        else:
            del self._groups[group.broker_name]
            self._clusters_discard(group.cluster_name, group.broker_name)
            self._set_queue_data(group.broker_name, group.topic_configs, {})
            log.info("broker group left cluster=%s broker_name=%s", group.cluster_name, group.broker_name)
        return EvictedNode(group.cluster_name, group.broker_name, node.broker_id, node.broker_addr, reason)

    def _refresh_group(self, group: _Group) -> None:
        """Re-elect the master and re-derive the group's queue data after any change to its nodes."""
        claims = [n for n in group.nodes.values() if n.role == "LEADER" and n.term >= group.leader_term_seen]
        master_id: int | None = None
        if claims:
            best = max(n.term for n in claims)
            tied = sorted(n.broker_id for n in claims if n.term == best)
            # Raft allows one leader per term; two equal claims mean a misconfigured group. Keep the sitting
            # master if it is one of them, so routes do not flap between the two.
            master_id = group.master_id if group.master_id in tied else tied[0]
            if len(tied) > 1:
                log.warning("two leader claims in one term broker_name=%s term=%d broker_ids=%s",
                            group.broker_name, best, tied)
        if master_id != group.master_id:
            log.info("master changed broker_name=%s master_id=%s previous=%s term=%s", group.broker_name,
                     master_id, group.master_id, group.nodes[master_id].term if master_id is not None else None)
            group.master_id = master_id
            self._generation += 1
        source = group.master()
        if source is None:
            source = max(group.nodes.values(), key=lambda n: (n.data_version, n.term, -n.broker_id))
        if source.topic_configs is not group.topic_configs and source.topic_configs != group.topic_configs:
            self._set_queue_data(group.broker_name, group.topic_configs, source.topic_configs)
            self._generation += 1
        # Keep the source's own dict even when equal: the next heartbeat then compares by identity.
        group.topic_configs = source.topic_configs

    def _set_queue_data(self, broker_name: str, old: Mapping[str, TopicConfig],
                        configs: Mapping[str, TopicConfig]) -> None:
        for topic in old:
            if topic not in configs:
                queues = self._topic_queue_table.get(topic)
                if queues is not None and queues.pop(broker_name, None) is not None and not queues:
                    del self._topic_queue_table[topic]
        for topic, c in configs.items():
            self._topic_queue_table.setdefault(topic, {})[broker_name] = QueueData(
                broker_name, c.read_queue_nums, c.write_queue_nums, c.perm, c.topic_sys_flag, c.order)

    def _unlink_conn(self, conn_key: Hashable | None, broker_name: str, broker_id: int) -> None:
        if conn_key is None:
            return
        members = self._by_conn.get(conn_key)
        if members is not None:
            members.discard((broker_name, broker_id))
            if not members:
                del self._by_conn[conn_key]

    def _clusters_discard(self, cluster_name: str, broker_name: str) -> None:
        names = self._clusters.get(cluster_name)
        if names is not None:
            names.discard(broker_name)
            if not names:
                del self._clusters[cluster_name]
