"""LOCK_BATCH_MQ and UNLOCK_BATCH_MQ: the queue locks orderly consumers hold (``broker/rebalance_lock.py``).

Both are writes (the leader answers; a change of holder is replicated before the answer). The request is RocketMQ's
LockBatchRequestBody as a CBOR map, in the body or, like a heartbeat, inline in ``ext``::

    {"consumer_group": "cg", "client_id": "10.0.0.5@123#18f3c2a9b1e-5c0ffee1#DEFAULT#1",
     "mq_set": [{"topic": "T", "broker_name": "broker-a", "queue_id": 0}, ...]}

Only a queue of a topic this group has, below its read queue count, is locked; the others are left out of the answer
as queues another member holds are (a member renewing the queues of a topic deleted a moment ago loses them, as it
would at its next rebalance). Holders are replicated state: before, any name was locked, and one client asking for
16,384 made-up queues a request wrote 160,000 entries to the group's log and snapshots in 5 s, each kept for a lock's
life. ``broker_name`` may be left out; when given it must be this group's, whose leader alone can lock its queues.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import cbor2

from broker.consumer_manager import client_id_problem
from broker.processor.base import get_group, get_str, invalid, legal_topic, request_data
from broker.rebalance_lock import QueueKey
from remoting.codec import Frame, make_response
from remoting.codes import ResponseCode
from remoting.message import I32

if TYPE_CHECKING:
    from broker.node import BrokerNode

# Far more than the queues one member holds (a topic has at most 1024 per group); bounds one request's work.
MAX_LOCK_QUEUES = 16_384


def parse_lock_request(request: Frame, broker_name: str) -> tuple[str, str, list[QueueKey]]:
    """``(consumer_group, client_id, [(topic, queue_id)])`` of a lock or unlock request, or INVALID_REQUEST naming
    the field (``mq_set[3].queue_id``)."""
    data = request_data(request)
    if not isinstance(data, Mapping):
        raise invalid("body", f"must be a CBOR map {{consumer_group, client_id, mq_set}}, got {type(data).__name__}")
    group = get_group(data)
    client_id = get_str(data, "client_id")
    problem = client_id_problem(client_id)
    if problem:
        raise invalid("client_id", problem)
    mq_set = data.get("mq_set")
    if mq_set is None:
        raise invalid("mq_set", "is required")
    if not isinstance(mq_set, list):
        raise invalid("mq_set", f"must be a list of queues {{topic, broker_name, queue_id}}, got {mq_set!r}")
    if len(mq_set) > MAX_LOCK_QUEUES:
        raise invalid("mq_set", f"holds {len(mq_set)} queues; at most {MAX_LOCK_QUEUES} are allowed")
    return group, client_id, [_queue(entry, f"mq_set[{i}]", broker_name) for i, entry in enumerate(mq_set)]


def _queue(entry: Any, where: str, broker_name: str) -> QueueKey:
    if not isinstance(entry, Mapping):
        raise invalid(where, f"must be a map {{topic, broker_name, queue_id}}, got {entry!r}")
    topic = entry.get("topic")
    if not isinstance(topic, str) or not topic:
        raise invalid(f"{where}.topic", f"must be a non-empty string, got {topic!r}")
    legal_topic(f"{where}.topic", topic)
    queue_id = entry.get("queue_id")
    if isinstance(queue_id, bool) or not isinstance(queue_id, int) or not 0 <= queue_id <= I32[1]:
        raise invalid(f"{where}.queue_id", f"must be an integer within 0..{I32[1]}, got {queue_id!r}")
    name = entry.get("broker_name")
    if name is not None and name != broker_name:
        raise invalid(f"{where}.broker_name", f"names broker group {name!r}, but this is {broker_name!r}: a queue is "
                                              f"locked on its own group's leader")
    return topic, queue_id


class QueueLockProcessor:
    def __init__(self, node: BrokerNode) -> None:
        self.node = node

    async def lock_batch_mq(self, request: Frame, conn: Any) -> Frame:
        """Body of the answer: ``{"lock_ok_mq_set": [{topic, broker_name, queue_id}]}``, every queue of the request
        the client holds now; ext ``rebalance_lock_max_live_time_ms``, how long each lasts without a renewal."""
        node = self.node
        if not node.is_leader():
            raise node.not_leader()
        broker_name = node.config.broker_name
        group, client_id, queues = parse_lock_request(request, broker_name)
        locked = await node.lock_queues(group, client_id, [q for q in queues if self._exists(*q)])
        body = cbor2.dumps({"lock_ok_mq_set": [{"topic": t, "broker_name": broker_name, "queue_id": q}
                                               for t, q in locked]})
        return make_response(request, ResponseCode.SUCCESS, body=body,
                             ext={"rebalance_lock_max_live_time_ms": node.config.rebalance_lock_max_live_time_ms})

    def _exists(self, topic: str, queue_id: int) -> bool:
        config = self.node.topic(topic)  # read queues: the ones consumers are given (and write <= read)
        return config is not None and queue_id < config.read_queue_nums

    async def unlock_batch_mq(self, request: Frame, conn: Any) -> Frame | None:
        """Releases the client's own locks among the queues named (another client's are left alone). May be
        oneway; the answer's ext ``unlocked`` counts the locks released."""
        node = self.node
        if not node.is_leader():
            raise node.not_leader()
        group, client_id, queues = parse_lock_request(request, node.config.broker_name)
        released = await node.unlock_queues(group, client_id, queues)
        return None if request.is_oneway else make_response(request, ResponseCode.SUCCESS,
                                                            ext={"unlocked": len(released)})
