"""The broker collector's output, parsed back with prometheus-client's own parser: a real store holding messages
and a node whose group is played by a fake (a leader, then a follower), so every figure is known exactly."""

from __future__ import annotations

import dataclasses
from typing import Any

from prometheus_client import generate_latest

from broker.config import BrokerConfig
from broker.metrics import broker_metrics_registry
from broker.node import OFFSET_TABLE, TOPIC_TABLE, BrokerNode
from broker.store import MessageStore
from broker.topic_config import TopicConfig
from dledger import DLedgerStatistics, Role
from remoting.config import config_from_mapping
from tests.metrics_scrape import parse_samples, value
from tests.unit.broker.stand_in import MetadataReads
from tests.unit.store.helpers import fill, small_config

MEMBERS = [{"id": f"n{i}", "raft_address": f"127.0.0.1:{20911 + i}", "service_address": f"127.0.0.1:{10911 + i}"}
           for i in (1, 2, 3)]


class Group(MetadataReads):
    """What the collector asks of a DLedger group: its statistics and its replicated tables."""

    def __init__(self, tables: dict[str, dict[str, Any]], stats: DLedgerStatistics) -> None:
        self.tables = tables
        self.stats = stats

    @property
    def is_leader(self) -> bool:
        return self.stats.role is Role.LEADER

    def statistics(self) -> DLedgerStatistics:
        return self.stats

    def metadata_generation(self, table: str) -> int:
        return 0

    def on_metadata_applied(self, callback: Any) -> None:
        pass


def _stats(role: Role) -> DLedgerStatistics:
    return DLedgerStatistics(
        group="broker-a", self_id="n2", role=role, term=7, leader_id="n2", committed_index=120,
        last_applied_index=118, end_offset=0, appended_records=40, appended_batches=12, failed_batches=1,
        in_flight_batches=2, pending_records=3, busy_records=4, applied_batches=15, duplicate_batches=0,
        rejected_batches=0, snapshots_written=2, snapshots_loaded=1, journal_flushes=0, pre_votes=5,
        leader_changes=3, log_entries_in_memory=9, catch_up_bytes=0, serving_reads=True,
        connected_peers=("n1", "n3"), rejoining=False)


def _node(tmp_path, store: MessageStore, role: Role) -> BrokerNode:
    config = config_from_mapping(BrokerConfig, {
        "cluster_name": "ProdCluster", "store": {"store_dir": str(tmp_path / "store")},
        "dledger": {"group": "broker-a", "self_id": "n2", "secret": "unit-test-secret-0123456789",
                    "members": MEMBERS, "data_dir": str(tmp_path / "dledger")}})
    topics = {"": 3, **{name: TopicConfig(topic_name=name, read_queue_nums=4, write_queue_nums=4).to_wire()
                        for name in ("TopicTest", "Other")}}
    offsets = {  # TopicTest holds 80 messages in each of its 4 queues (fill below)
        "cg\x01TopicTest\x010": 80, "cg\x01TopicTest\x011": 30, "cg\x01TopicTest\x012": 0,
        "late\x01TopicTest\x013": 75, "cg\x01Gone\x010": 5}  # a topic deleted since: no lag, still a group
    return BrokerNode(config, store, Group({TOPIC_TABLE: topics, OFFSET_TABLE: offsets}, _stats(role)), client=None)


def _samples(node: BrokerNode) -> dict[str, list[tuple[dict[str, str], float]]]:
    return parse_samples(generate_latest(broker_metrics_registry(node)).decode())


def test_the_leader_exports_raft_store_traffic_and_lag_with_rocketmq_names_and_labels(tmp_path):
    with MessageStore.open(small_config(tmp_path / "s")) as store:
        fill(store, 40)  # 320 messages of TopicTest, 80 in each of 4 queues
        store.dispatch_pending()
        node = _node(tmp_path, store, Role.LEADER)
        node.put_by_topic["TopicTest"] = [320, 96_000]
        node.pull_stats.add("cg", "TopicTest", 110, 40_000)
        node.pull_stats.add("late", "TopicTest", 75, 27_000)
        s = _samples(node)
        stats = store.statistics()

    every = {"cluster": "ProdCluster", "node_type": "broker", "node_id": "broker-a", "member_id": "n2"}
    for name, samples in s.items():
        if name.startswith(("rocketmq_", "raftmq_")):
            assert all(every.items() <= labels.items() for labels, _ in samples), name
    assert [value(s, "raftmq_raft_role", role=r) for r in ("LEADER", "FOLLOWER", "CANDIDATE")] == [1, 0, 0]
    assert value(s, "raftmq_raft_term") == 7 and value(s, "raftmq_raft_committed_index") == 120
    assert value(s, "raftmq_raft_applied_index") == 118 and value(s, "raftmq_raft_connected_peers") == 2
    assert value(s, "raftmq_raft_leader_changes_total") == 3 and value(s, "raftmq_raft_busy_records_total") == 4
    assert value(s, "raftmq_raft_pre_votes_total") == 5 and value(s, "raftmq_raft_serving_reads") == 1

    assert value(s, "rocketmq_storage_size_bytes") == stats.max_phy_offset - stats.min_phy_offset > 0
    assert value(s, "raftmq_store_commit_log_max_offset") == stats.max_phy_offset
    assert value(s, "rocketmq_storage_dispatch_behind_bytes") == 0
    assert value(s, "raftmq_store_consume_queues") == 4

    assert value(s, "rocketmq_topic_number") == 2
    assert value(s, "rocketmq_messages_in_total", topic="TopicTest") == 320
    assert value(s, "rocketmq_throughput_in_total", topic="TopicTest") == 96_000
    assert value(s, "rocketmq_messages_out_total", topic="TopicTest", consumer_group="cg") == 110
    assert value(s, "rocketmq_throughput_out_total", topic="TopicTest", consumer_group="late") == 27_000
    # Lag over the queues each group committed: cg 0 + 50 + 80; late 5; none for the deleted topic.
    assert value(s, "rocketmq_consumer_lag_messages", topic="TopicTest", consumer_group="cg") == 130
    assert value(s, "rocketmq_consumer_lag_messages", topic="TopicTest", consumer_group="late") == 5
    assert value(s, "rocketmq_consumer_lag_messages", topic="Gone") is None
    assert value(s, "rocketmq_consumer_group_number") == 2


def test_a_follower_exports_its_own_figures_but_no_lag(tmp_path):
    with MessageStore.open(small_config(tmp_path / "s")) as store:
        fill(store, 4)
        store.dispatch_pending()
        node = _node(tmp_path, store, Role.FOLLOWER)
        node.group.stats = dataclasses.replace(node.group.stats, leader_id="n1")
        s = _samples(node)
    assert [value(s, "raftmq_raft_role", role=r) for r in ("LEADER", "FOLLOWER", "CANDIDATE")] == [0, 1, 0]
    assert "rocketmq_consumer_lag_messages" not in s  # the leader's alone, so a sum over the group counts once
    assert value(s, "rocketmq_consumer_group_number") == 2 and value(s, "rocketmq_topic_number") == 2
    assert s.get("rocketmq_messages_in_total") is None  # nothing acknowledged here


def test_a_deleted_topics_send_and_pull_figures_go_with_it(tmp_path):
    # Before, they were exported until the process restarted, and every topic ever deleted kept its counts.
    with MessageStore.open(small_config(tmp_path / "s")) as store:
        node = _node(tmp_path, store, Role.LEADER)
        node.put_by_topic.update({"TopicTest": [3, 300], "Other": [1, 100]})
        node.pull_stats.add("cg", "TopicTest", 2, 200)
        node.pull_stats.add("cg", "Other", 1, 100)
        node.refresh_metadata()
        table = node.group.tables[TOPIC_TABLE]
        del table["Other"]
        table[""] = 4  # the table's data version, as a deletion moves it
        # A send answered just after the deletion counts again under the gone name: not exported either.
        node.refresh_metadata()
        node.put_by_topic["Other"] = [1, 50]
        s = _samples(node)
    assert set(node.put_by_topic) == {"TopicTest", "Other"} and set(node.pull_stats.totals()) == {("cg", "TopicTest")}
    assert value(s, "rocketmq_messages_in_total", topic="TopicTest") == 3
    assert value(s, "rocketmq_messages_in_total", topic="Other") is None
    assert value(s, "rocketmq_messages_out_total", topic="TopicTest", consumer_group="cg") == 2
    assert value(s, "rocketmq_messages_out_total", topic="Other", consumer_group="cg") is None
    node.refresh_metadata()  # nothing changed: nothing more is dropped
    assert set(node.put_by_topic) == {"TopicTest", "Other"}
