"""A broker node's Prometheus metrics: one collector that reads, at scrape time, what the node counts anyway.

Rules this module keeps:

* **Nothing on the hot path.** No prometheus-client ``Counter``: its ``inc()`` takes a lock, and the send path
  runs at ~30k messages a second on two cores. ``BrokerCollector.collect()`` reads the node's own figures when
  Prometheus asks: the DLedger and store statistics, the topic table, the replicated offset table, the queues'
  max offsets, the pull totals (``broker/pull_stats.py``) and the per-topic send counts (``put_by_topic``, one
  dict update per send request in ``processor/send_message.py``). Counters start at 0 when the process starts, as
  every Prometheus counter does; ``rate()`` and ``increase()`` handle the reset.
* **RocketMQ 5's names where one exists** (``rocketmq_messages_in_total``, ``rocketmq_consumer_lag_messages``,
  ...), ``raftmq_raft_*`` for the Raft member, ``raftmq_broker_*`` and ``raftmq_store_*`` for the rest. Every
  series carries ``cluster``, ``node_type="broker"``, ``node_id`` (the broker name, as in RocketMQ, whose node is
  a master and its slaves) and ``member_id`` (which member of the group's Raft group: ours).
* **Counted once per group.** A send is acknowledged, and so counted, by the leader only, and the consumer lag
  is exported by the leader only: summed over a group's three members, each message and each queue counts once.
  A pull is counted by the member that served it (followers serve reads), under a group that member's
  subscription-group table holds: a group deleted takes its pull series, and pulls under a name the table does not
  hold are exported once the group's config is applied there (``broker/pull_stats.py``).

docs/operations.md ("Metrics") lists every family with its meaning.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from broker.offset_manager import consumer_lag
from dledger import Role
from remoting.metrics_http import MetricFamilies, metrics_registry

if TYPE_CHECKING:
    from broker.node import BrokerNode

__all__ = ["BrokerCollector", "broker_metrics_registry"]


# DLedgerStatistics fields exported as they are: (metric, "gauge" or "counter", help, field).
_RAFT_FIGURES = (
    ("raftmq_raft_term", "gauge", "Raft term this member is in", "term"),
    ("raftmq_raft_committed_index", "gauge", "index of the last Raft entry this member knows committed",
     "committed_index"),
    ("raftmq_raft_applied_index", "gauge", "index of the last Raft entry applied to this member's store",
     "last_applied_index"),
    ("raftmq_raft_leader_changes_total", "counter",
     "leaders this member learnt of, each of a new term (itself too): elections it saw won", "leader_changes"),
    ("raftmq_raft_serving_reads", "gauge", "1 when this member serves reads (not copying a commit log from a peer)",
     "serving_reads"),
    ("raftmq_raft_rejoining", "gauge", "1 while this member, started to rejoin, waits to hear from a leader (no "
                                       "vote, no candidacy)", "rejoining"),
    ("raftmq_raft_appended_records_total", "counter", "records (message batches, metadata changes) this member "
                                                      "appended as leader", "appended_records"),
    ("raftmq_raft_appended_batches_total", "counter", "Raft entries (group-commit batches) this member proposed as "
                                                      "leader and saw committed", "appended_batches"),
    ("raftmq_raft_failed_batches_total", "counter", "proposed entries that failed (leadership lost, timeout)",
     "failed_batches"),
    ("raftmq_raft_busy_records_total", "counter", "records refused SYSTEM_BUSY, the group overloaded "
                                                  "(dledger.max_queue_wait_ms)", "busy_records"),
    ("raftmq_raft_in_flight_batches", "gauge", "entries proposed and not yet committed", "in_flight_batches"),
    ("raftmq_raft_pending_records", "gauge", "records waiting for a batch", "pending_records"),
    ("raftmq_raft_applied_batches_total", "counter", "entries this member applied to its store", "applied_batches"),
    ("raftmq_raft_duplicate_batches_total", "counter", "entries skipped at apply, already in the store (a journal "
                                                       "replay)", "duplicate_batches"),
    ("raftmq_raft_rejected_batches_total", "counter", "entries refused at apply, not starting at the store's end",
     "rejected_batches"),
    ("raftmq_raft_snapshots_written_total", "counter", "Raft snapshots (log compactions) written",
     "snapshots_written"),
    ("raftmq_raft_snapshots_loaded_total", "counter", "Raft snapshots loaded (a lagging member sent one)",
     "snapshots_loaded"),
    ("raftmq_raft_journal_flushes_total", "counter", "syncs of the Raft journal (dledger.flush_disk_type SYNC_FLUSH)",
     "journal_flushes"),
    ("raftmq_raft_pre_votes_total", "counter", "pre-vote rounds this member began: its election timer fired",
     "pre_votes"),
    ("raftmq_raft_log_entries_in_memory", "gauge", "Raft entries held in memory until the next compaction",
     "log_entries_in_memory"),
    ("raftmq_raft_catch_up_bytes_total", "counter", "commit-log bytes this member copied from a peer",
     "catch_up_bytes"),
)


def broker_metrics_registry(node: BrokerNode) -> CollectorRegistry:
    return metrics_registry(BrokerCollector(node))


class BrokerCollector:
    def __init__(self, node: BrokerNode) -> None:
        self.node = node
        config = node.config
        assert config.dledger is not None
        self._families = MetricFamilies(cluster=config.cluster_name, node_type="broker", node_id=config.broker_name,
                                        member_id=config.dledger.self_id)

    def collect(self) -> Iterator[Metric]:
        yield from self._raft()
        yield from self._store()
        yield from self._broker()
        yield from self._topics_and_groups()

    def _raft(self) -> Iterator[Metric]:
        f = self._families
        stats = self.node.group.statistics()
        role = f.gauge("raftmq_raft_role", "1 for the Raft role this member has now, 0 for the others",
                       labels=["role"])
        for each in Role:
            f.add(role, 1 if stats.role is each else 0, each.value)
        yield role
        yield f.gauge("raftmq_raft_connected_peers", "members this one has a Raft connection with now",
                      len(stats.connected_peers))
        for name, kind, doc, field in _RAFT_FIGURES:
            yield getattr(f, kind)(name, doc, float(getattr(stats, field)))

    def _store(self) -> Iterator[Metric]:
        f = self._families
        store = self.node.store.statistics()
        end = store.max_phy_offset
        yield f.gauge("rocketmq_storage_size_bytes", "commit-log bytes this member holds (its max offset minus its "
                                                     "min offset; consume queues and index files not counted)",
                      end - store.min_phy_offset)
        yield f.gauge("rocketmq_storage_flush_behind_bytes", "commit-log bytes written but not yet flushed to disk",
                      end - store.flushed_phy_offset)
        yield f.gauge("rocketmq_storage_dispatch_behind_bytes", "commit-log bytes not yet dispatched to consume "
                                                                "queues and index files",
                      end - store.dispatched_phy_offset)
        yield f.gauge("raftmq_store_commit_log_max_offset", "end of this member's commit log (bytes); equal on "
                                                           "every member once applied", end)
        yield f.gauge("raftmq_store_consume_queues", "consume queues (topic, queue id) this member holds",
                      store.consume_queues)
        yield f.gauge("raftmq_store_index_files", "index files this member holds", store.index_files)
        yield f.gauge("raftmq_store_disk_usage_ratio", "used fraction of the store's disk", store.disk_usage_ratio)
        yield f.gauge("raftmq_store_disk_full", "1 when the disk passed store.disk_reject_ratio: sends are refused",
                      int(store.disk_full))

    def _broker(self) -> Iterator[Metric]:
        f = self._families
        node = self.node
        hold = node.hold.statistics()
        registration = node.registration.statistics()
        yield f.counter("raftmq_broker_put_requests_total", "send requests (and internal appends: retries sent "
                                                            "back, delayed deliveries) acknowledged as leader",
                        node.put_requests)
        yield f.counter("raftmq_broker_put_messages_total", "messages those requests stored", node.put_messages)
        yield f.counter("raftmq_broker_pulled_messages_total", "messages this member returned to pulls",
                        node.pulled_messages)
        yield f.counter("raftmq_broker_long_polling_held_total", "pull and POP requests held until a message arrives "
                                                                 "or they time out, each once", hold.held)
        resumed = f.counter("raftmq_broker_long_polling_resumed_total", "held pulls answered, by what woke them",
                            labels=["reason"])
        f.add(resumed, hold.resumed_by_arrival, "arrival")
        f.add(resumed, hold.resumed_by_timeout, "timeout")
        yield resumed
        registrations = f.counter("raftmq_broker_registrations_total", "registrations with a name server, by "
                                                                       "outcome", labels=["result"])
        f.add(registrations, registration.successes, "success")
        f.add(registrations, registration.failures, "failure")
        yield registrations
        scheduled = f.counter("raftmq_broker_scheduled_messages_total", "delayed messages whose time came, by "
                                                                        "outcome (dropped: unreadable)",
                              labels=["outcome"])
        f.add(scheduled, node.schedule.delivered, "delivered")
        f.add(scheduled, node.schedule.dropped, "dropped")
        yield scheduled
        yield f.gauge("raftmq_broker_client_connections", "client connections (producers and consumers) that sent "
                                                          "this member a heartbeat", node.clients.connection_count())
        yield f.gauge("rocketmq_producer_connections", "producer clients that sent this member a heartbeat",
                      len({client for chans in node.clients.producer_groups.values() for client in chans}))

    def _topics_and_groups(self) -> Iterator[Metric]:
        f = self._families
        node = self.node
        yield f.gauge("rocketmq_topic_number", "topics in the group's topic table (retry, dead-letter and system "
                                               "topics too)", len(node.topics))
        messages_in = f.counter("rocketmq_messages_in_total", "messages producers sent to the topic, acknowledged by "
                                                              "this member as leader", labels=["topic"])
        bytes_in = f.counter("rocketmq_throughput_in_total", "bytes of those sends' bodies (a batch's body holds "
                                                             "its messages' headers too)", labels=["topic"])
        topics = node.topics
        # A send answered just after its topic was deleted counts again under the gone name; it is not exported.
        for topic, (messages, size) in node.put_by_topic.items():
            if topic in topics:
                f.add(messages_in, messages, topic)
                f.add(bytes_in, size, topic)
        yield messages_in
        yield bytes_in
        messages_out = f.counter("rocketmq_messages_out_total", "messages this member returned to the consumer "
                                                                "group's pulls of the topic (groups in its "
                                                                "subscription-group table)",
                                 labels=["topic", "consumer_group"])
        bytes_out = f.counter("rocketmq_throughput_out_total", "bytes of those messages (whole stored records)",
                              labels=["topic", "consumer_group"])
        for (group, topic), (messages, size) in node.pull_stats.totals().items():
            if topic in topics:
                f.add(messages_out, messages, topic, group)
                f.add(bytes_out, size, topic, group)
        yield messages_out
        yield bytes_out
        connections = f.gauge("rocketmq_consumer_connections", "members of the consumer group that sent this "
                                                               "member a heartbeat", labels=["consumer_group"])
        for group, info in node.clients.consumer_groups.items():
            f.add(connections, len(info.channels), group)
        yield connections
        yield from self._offsets()

    def _offsets(self) -> Iterator[Metric]:
        f = self._families
        node = self.node
        store = node.store
        groups: set[str] = set()
        lags: dict[tuple[str, str], int] = {}
        leader = node.is_leader()
        for group, topic, queue_id, offset in node.committed_offsets():
            groups.add(group)
            if leader and node.topics.get(topic) is not None:
                lag = consumer_lag(store.get_max_offset_in_queue(topic, queue_id),
                                   store.get_min_offset_in_queue(topic, queue_id), offset)
                lags[(group, topic)] = lags.get((group, topic), 0) + lag
        yield f.gauge("rocketmq_consumer_group_number", "consumer groups with an offset in the group's replicated "
                                                        "offset table", len(groups))
        lag_family = f.gauge("rocketmq_consumer_lag_messages",
                             "messages stored and not yet consumed by the group, over the topic's queues it has "
                             "committed an offset for, from the replicated offset table (consumer_offset_flush_"
                             "interval_ms behind the commits); exported by the leader only",
                             labels=["topic", "consumer_group"])
        for (group, topic), lag in lags.items():
            f.add(lag_family, lag, topic, group)
        yield lag_family

