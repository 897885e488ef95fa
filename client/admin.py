"""The admin client: topics, routes, cluster info and consumer progress (the everyday part of RocketMQ's mqadmin).

Topic changes go to the *leader* of each broker group (replicated there through Raft, then re-registered with
the name servers by the broker itself), so ``create_topic`` returns once every group has committed it. Which
groups: the ones of ``cluster`` (or explicit ``broker_names``), from the name servers' cluster info.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import cbor2
import trio

from client.errors import ClientError
from client.instance import (
    ClientConfig, ClientInstance, build_config, open_remoting, raise_for_response,
)
from client.message import MessageQueue
from client.route import PERM_READ, PERM_WRITE, TopicRouteData, parse_route
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RaftMQError

__all__ = ["AdminClient", "ClusterInfo", "ConsumeStats", "QueueConsumeStats", "open_admin"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterInfo:
    """``broker_addrs[broker_name][broker_id] = addr`` (id 0: the leader) and ``clusters[cluster] = names``."""

    broker_addrs: Mapping[str, Mapping[int, str]]
    clusters: Mapping[str, tuple[str, ...]]
    nodes: Mapping[str, Any]

    def master_addr(self, broker_name: str) -> str | None:
        return self.broker_addrs.get(broker_name, {}).get(0)


@dataclasses.dataclass(frozen=True, slots=True)
class QueueConsumeStats:
    """One queue's progress: ``broker_offset`` is the queue's max offset (where the next message goes),
    ``consumer_offset`` the group's committed offset (None: nothing committed yet), ``lag`` the messages still
    stored that the group has not consumed, ``last_timestamp`` the store time (ms) of the last one it consumed."""

    queue: MessageQueue
    broker_offset: int
    consumer_offset: int | None
    lag: int
    last_timestamp: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class ConsumeStats:
    """A consumer group's progress over every queue it consumes (RocketMQ's ``consumerProgress``)."""

    consumer_group: str
    queues: tuple[QueueConsumeStats, ...]
    consumer_ids: Mapping[str, tuple[str, ...]]  # broker_name -> members heartbeating to that group's leader

    @property
    def total_lag(self) -> int:
        return sum(q.lag for q in self.queues)


def _parse_cluster_info(data: Mapping[str, Any]) -> ClusterInfo:
    brokers = {name: {int(k): str(v) for k, v in b.get("broker_addrs", {}).items()}
               for name, b in data.get("broker_addr_table", {}).items()}
    clusters = {c: tuple(names) for c, names in data.get("cluster_addr_table", {}).items()}
    return ClusterInfo(brokers, clusters, data.get("nodes", {}))


class AdminClient:
    def __init__(self, instance: ClientInstance) -> None:
        self._instance = instance

    async def cluster_info(self) -> ClusterInfo:
        frame = await self._instance.invoke_namesrv(RequestCode.GET_BROKER_CLUSTER_INFO)
        return _parse_cluster_info(cbor2.loads(frame.body) if frame.body else frame.ext)

    async def list_topics(self) -> list[str]:
        frame = await self._instance.invoke_namesrv(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER)
        data = cbor2.loads(frame.body) if frame.body else frame.ext
        return sorted(data.get("topic_list", []))

    async def get_route(self, topic: str) -> TopicRouteData:
        frame = await self._instance.invoke_namesrv(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
        return parse_route(topic, cbor2.loads(frame.body) if frame.body else frame.ext)

    async def _target_masters(self, cluster: str | None, broker_names: Sequence[str] | None) -> dict[str, str]:
        info = await self.cluster_info()
        if broker_names:
            names = list(broker_names)
        elif cluster is not None:
            if cluster not in info.clusters:
                raise ClientError(f"cluster {cluster!r} is not known to the name servers "
                                  f"(known: {', '.join(sorted(info.clusters)) or 'none'})", cluster=cluster)
            names = list(info.clusters[cluster])
        else:
            names = sorted(info.broker_addrs)
        out = {}
        for name in names:
            addr = info.master_addr(name)
            if not addr:
                raise ClientError(f"broker group {name!r} has no leader registered with the name servers",
                                  broker_name=name)
            out[name] = addr
        if not out:
            raise ClientError("no broker group is registered with the name servers")
        return out

    async def _to_leaders(self, masters: Mapping[str, str], code: int, ext: dict[str, Any]) -> None:
        async def _one(name: str, addr: str) -> None:
            for _ in range(4):
                frame = await self._instance.invoke(addr, code, ext, timeout_s=10.0)
                if frame.code == ResponseCode.NOT_LEADER and frame.ext.get("leader_addr"):
                    addr = frame.ext["leader_addr"]
                    continue
                raise_for_response(frame, topic=ext.get("topic"), broker_name=name)
                return

        async with trio.open_nursery() as nursery:
            for name, addr in masters.items():
                nursery.start_soon(_one, name, addr)

    async def create_topic(self, topic: str, *, read_queue_nums: int = 8, write_queue_nums: int = 8,
                           perm: int = PERM_READ | PERM_WRITE, cluster: str | None = None,
                           broker_names: Sequence[str] | None = None, order: bool = False,
                           wait_route_s: float = 5.0) -> TopicRouteData | None:
        """Create or update ``topic`` on every group of ``cluster`` (default: all); waits until the name servers
        route it (up to ``wait_route_s``) and returns that route."""
        for name, value in (("read_queue_nums", read_queue_nums), ("write_queue_nums", write_queue_nums)):
            if not 1 <= value <= 1024:
                raise ValueError(f"{name} must be within 1..1024, got {value}")
        masters = await self._target_masters(cluster, broker_names)
        await self._to_leaders(masters, RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": topic, "read_queue_nums": read_queue_nums, "write_queue_nums": write_queue_nums,
            "perm": perm, "topic_sys_flag": 0, "order": order})
        with trio.move_on_after(wait_route_s):
            while True:
                try:
                    route = await self.get_route(topic)
                    if {q.broker_name for q in route.queue_datas} >= set(masters):
                        return route
                except RaftMQError as e:
                    log.debug("route not there yet topic=%s error=%s", topic, e)
                await trio.sleep(0.05)
        return None

    async def delete_topic(self, topic: str, *, cluster: str | None = None,
                           broker_names: Sequence[str] | None = None) -> None:
        masters = await self._target_masters(cluster, broker_names)
        await self._to_leaders(masters, RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": topic})

    async def consume_stats(self, consumer_group: str, *, topic: str | None = None,
                            cluster: str | None = None) -> ConsumeStats:
        """The progress of ``consumer_group``: on every group of ``topic``'s route, or without a topic on every
        group of ``cluster`` (default: all), every topic it has committed offsets for. Each group's leader
        answers, so commits not yet replicated count too. No queue at all means the group consumes nothing
        there (never committed, and no member subscribed to ``topic``)."""
        if not consumer_group:
            raise ValueError("consume_stats needs a consumer group")
        if topic:
            route = await self.get_route(topic)
            info = await self.cluster_info()
            masters = {}
            for name in sorted({q.broker_name for q in route.queue_datas}):
                addr = info.master_addr(name)
                if not addr:
                    raise ClientError(f"broker group {name!r} has no leader registered with the name servers",
                                      broker_name=name)
                masters[name] = addr
        else:
            masters = await self._target_masters(cluster, None)
        ext = {"consumer_group": consumer_group, "topic": topic or ""}
        answers: dict[str, Any] = {}

        async def _one(name: str, addr: str) -> None:
            frame = raise_for_response(await self._instance.invoke(addr, RequestCode.GET_CONSUME_STATS, ext,
                                                                   timeout_s=10.0),
                                       topic=topic, broker_name=name)
            answers[name] = cbor2.loads(frame.body) if frame.body else {}

        async with trio.open_nursery() as nursery:
            for name, addr in masters.items():
                nursery.start_soon(_one, name, addr)
        queues = []
        for name in sorted(answers):
            for row in answers[name].get("offsets", []):
                queues.append(QueueConsumeStats(MessageQueue(row["topic"], name, int(row["queue_id"])),
                                                int(row["broker_offset"]), row.get("consumer_offset"),
                                                int(row["lag"]), row.get("last_timestamp")))
        queues.sort(key=lambda q: (q.queue.topic, q.queue.broker_name, q.queue.queue_id))
        return ConsumeStats(consumer_group, tuple(queues),
                            {name: tuple(a.get("consumer_ids", [])) for name, a in sorted(answers.items())})

    async def broker_status(self, addr: str) -> dict[str, Any]:
        frame = raise_for_response(await self._instance.invoke(addr, RequestCode.GET_BROKER_RUNTIME_INFO))
        return dict(cbor2.loads(frame.body)) if frame.body else dict(frame.ext)


@contextlib.asynccontextmanager
async def open_admin(namesrv: str | Sequence[str] | None = None, **options: Any) -> AsyncIterator[AdminClient]:
    if namesrv is not None:
        options["namesrv"] = namesrv
    config: ClientConfig = build_config(ClientConfig, options)
    async with open_remoting(config) as remoting:
        async with trio.open_nursery() as nursery:
            instance = ClientInstance(config, remoting, nursery)
            try:
                yield AdminClient(instance)
            finally:
                instance.closed = True
                nursery.cancel_scope.cancel()
