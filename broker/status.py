"""What a broker node says about itself: its registration with the name servers and its runtime info.

``registration_snapshot`` builds what each round of ``broker/registration.py`` sends (REGISTER_BROKER: role, term,
the topic table); ``runtime_info`` is GET_BROKER_RUNTIME_INFO's answer (``raftmq admin status``). Both only
read the node's parts and are kept apart from ``broker/node.py``, whose ``BrokerNode.registration_snapshot`` and
``BrokerNode.runtime_info`` call them, so the node holds the state and the rules that change it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from broker.registration import RegistrationSnapshot

if TYPE_CHECKING:
    from broker.node import BrokerNode

__all__ = ["registration_snapshot", "runtime_info", "VERSION"]

log = logging.getLogger(__name__)

VERSION = "raftmq-0.1.0"


def registration_snapshot(node: BrokerNode) -> RegistrationSnapshot:
    """What the node registers now. A topic stored by an older version that a name server would refuse is left
    out, with a warning once per topic and problem (``node._unregistrable_topics``). The topic part is the table's
    ``registration_topics``, built once per change of the table rather than per round (a round at 40,000 topics
    took a second, on the trio thread)."""
    node.refresh_metadata()
    role = node.group.role
    topics, problems = node.topics.registration_topics()
    for topic, problem in problems.items():
        if (topic, problem) not in node._unregistrable_topics:
            node._unregistrable_topics.add((topic, problem))
            fix = ("delete it (`raftmq admin delete-topic`)" if problem == "an illegal name" else
                   "update it (`raftmq admin create-topic` sets topic_sys_flag 0) or delete it")
            log.warning("topic %r has %s (stored by an older version) and is not registered; %s",
                        topic, problem, fix)
    return RegistrationSnapshot(
        cluster_name=node.config.cluster_name, broker_name=node.config.broker_name, broker_id=node.broker_id,
        broker_addr=node.broker_addr, role=role.value, term=node.group.term,
        data_version=node.topics.data_version, topic_configs=topics,
        heartbeat_timeout_ms=node.config.broker_not_active_timeout_ms,
        broker_permission=node.config.broker_permission)


def runtime_info(node: BrokerNode) -> dict[str, Any]:
    ledger = node.group.statistics()
    store = node.store.statistics()
    hold = node.hold.statistics()
    reg = node.registration.statistics()
    return {
        "version": VERSION, "pid": os.getpid(), "process_cpu_s": time.process_time(),
        "cluster_name": node.config.cluster_name,
        "broker_name": node.config.broker_name, "broker_id": node.broker_id, "broker_addr": node.broker_addr,
        "role": ledger.role.value, "term": ledger.term, "leader_id": ledger.leader_id,
        "leader_addr": node.leader_addr(), "committed_index": ledger.committed_index,
        "last_applied_index": ledger.last_applied_index, "serving_reads": ledger.serving_reads,
        "commit_log_min_offset": node.store.min_phy_offset, "commit_log_max_offset": node.store.max_phy_offset,
        "commit_log_flushed_offset": store.flushed_phy_offset, "dispatched_offset": store.dispatched_phy_offset,
        "consume_queues": store.consume_queues, "disk_usage_ratio": round(store.disk_usage_ratio, 4),
        "disk_full": store.disk_full,
        "topics": len(node.topics), "topic_data_version": node.topics.data_version,
        "consumer_groups": len(node.clients.consumer_groups), "client_connections":
            node.clients.connection_count(),
        "put_requests": node.put_requests, "put_messages": node.put_messages,
        "pulled_messages": node.pulled_messages,
        "scheduled_delivered": node.schedule.delivered, "scheduled_dropped": node.schedule.dropped,
        **node.transactions.statistics(),
        "appended_batches": ledger.appended_batches, "failed_batches": ledger.failed_batches,
        "busy_records": ledger.busy_records, "pre_votes": ledger.pre_votes,
        "long_polling_held": hold.held, "long_polling_resumed_by_arrival": hold.resumed_by_arrival,
        "long_polling_resumed_by_timeout": hold.resumed_by_timeout,
        "registrations_ok": reg.successes, "registrations_failed": reg.failures,
        "start_time_ms": node._started_ms, "uptime_ms": int(time.time() * 1000) - node._started_ms,
    }
