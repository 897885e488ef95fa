"""A name server's Prometheus metrics: one collector reading the route table and the processor's two counts at
scrape time (nothing is counted for the metrics on the request path but the route queries, one int each).

Every series carries ``node_type="namesrv"`` and ``node_id`` (the address the name server listens on); no
``cluster``: one name server serves every cluster that registers with it. docs/operations.md ("Metrics") lists
every family with its meaning.
"""

from __future__ import annotations

from collections.abc import Iterator

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from namesrv.processor import NamesrvProcessor
from namesrv.route_info import ROLES
from remoting.metrics_http import MetricFamilies, metrics_registry

__all__ = ["NamesrvCollector", "namesrv_metrics_registry"]


def namesrv_metrics_registry(processor: NamesrvProcessor, node_id: str) -> CollectorRegistry:
    return metrics_registry(NamesrvCollector(processor, node_id))


class NamesrvCollector:
    def __init__(self, processor: NamesrvProcessor, node_id: str) -> None:
        self.processor = processor
        self._families = MetricFamilies(node_type="namesrv", node_id=node_id)

    def collect(self) -> Iterator[Metric]:
        f = self._families
        route_info = self.processor.route_info
        stats = route_info.statistics()
        info = route_info.cluster_info(int(trio.current_time() * 1000))
        yield f.gauge("raftmq_namesrv_clusters", "clusters with a registered broker node", stats.clusters)
        yield f.gauge("raftmq_namesrv_broker_groups", "broker groups (broker names) with a registered node",
                      stats.broker_names)
        yield f.gauge("raftmq_namesrv_broker_groups_without_master",
                      "broker groups no registered node leads: their topics are routed for reads only",
                      sum(1 for nodes in info.nodes.values() if not any(node.is_master for node in nodes)))
        brokers = f.gauge("raftmq_namesrv_brokers", "registered broker nodes, by the Raft role they registered with",
                          labels=["role"])
        by_role = dict.fromkeys(ROLES, 0)
        for nodes in info.nodes.values():
            for node in nodes:
                by_role[node.role] += 1
        for role, count in by_role.items():
            f.add(brokers, count, role)
        yield brokers
        yield f.gauge("raftmq_namesrv_topics", "topics routed (served by at least one broker group)", stats.topics)
        yield f.counter("raftmq_namesrv_registrations_total", "broker registrations accepted", stats.registrations)
        removals = f.counter("raftmq_namesrv_node_removals_total",
                             "broker nodes removed from the table, by reason (expired: silent past its heartbeat "
                             "timeout; connection_closed: its registration connection closed; unregistered: a "
                             "clean shutdown)", labels=["reason"])
        for reason, count in stats.removals.items():
            f.add(removals, count, reason)
        yield removals
        queries = f.counter("raftmq_namesrv_route_queries_total", "topic route queries, by result",
                            labels=["result"])
        f.add(queries, self.processor.route_queries - self.processor.route_misses, "found")
        f.add(queries, self.processor.route_misses, "not_found")
        yield queries
