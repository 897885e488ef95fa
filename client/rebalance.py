"""Queue allocation across the members of a consumer group (clustering mode).

Every member computes the same answer on its own from the same two sorted lists (all queues of the topic, all
client ids of the group), so no coordinator is needed; members that briefly disagree (one has seen a join, the
other not yet) may both pull a queue for a moment, which at-least-once delivery tolerates.

Strategies (RocketMQ's AllocateMessageQueueStrategy), chosen with the push consumer's or the subscribe-mode lite
pull consumer's ``allocate_strategy``, by name or as a function of the signature of ``allocate_average``:

- ``AllocateMessageQueueAveragely`` (the default, ``allocate_average``): contiguous blocks, the first
  ``len(queues) % len(members)`` members take one extra queue.
- ``AllocateMessageQueueAveragelyByCircle`` (``allocate_average_by_circle``): dealt out like cards, queue ``i`` to
  member ``i % len(members)``, so each member's queues spread over the broker groups rather than sit in one.
- ``AllocateMessageQueueConsistentHash`` (``allocate_consistent_hash(virtual_node_count=10)``): each member is put
  on a ring at ``virtual_node_count`` points and a queue goes to the first point at or after its own; a join or a
  leave moves only the queues next to the points that changed, at the price of an uneven split. Points are the
  first four bytes of an MD5, as RocketMQ's (never Python's ``hash``, which differs from process to process and
  would give each member its own ring), of the same strings RocketMQ hashes (``"<client id>-<n>"`` and its
  ``MessageQueue.toString()``), so the answer is RocketMQ's for the same ids.
- ``AllocateMessageQueueByConfig`` (``allocate_by_config(queues)``): this member takes the queues it is given (of
  the topic being allocated: one list may name several topics' queues), whoever else is in the group; by name alone
  it has no queues, so it must be built with them. The push consumer pulls only those the topic's route has, and
  warns once about each other one.

RocketMQ's two machine-room strategies (AllocateMessageQueueByMachineRoom, AllocateMachineRoomNearby) are not
offered: they read a room from each broker name (``room@broker``) and each client, and a raftmq queue has no room.
It belongs to a Raft group whose leader, which serves its pulls, moves between the group's nodes, which may stand
in different rooms. A function of one's own can still place queues however a deployment needs.

Every member of a group must use the same strategy (and the same ``virtual_node_count``): each computes only its
own share, so members that differ leave queues to nobody or to two members. Nothing checks this, in RocketMQ
either: the members never tell each other their strategy.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import cbor2
import trio

from client.instance import raise_for_response
from client.message import MessageQueue
from remoting.codes import RequestCode
from remoting.errors import RaftMQError

if TYPE_CHECKING:
    from client.filter import Subscription
    from client.instance import ClientInstance

__all__ = ["AllocateStrategy", "ALLOCATE_STRATEGIES", "DEFAULT_ALLOCATE_STRATEGY", "allocate_average",
           "allocate_average_by_circle", "allocate_consistent_hash", "allocate_by_config", "resolve_allocate_strategy",
           "allocate_strategy_problem", "RebalanceDiff", "diff_assignment", "find_consumer_ids",
           "allocate_share", "consumer_heartbeat_data", "find_start_offsets", "member_ids"]

# (consumer_group, current_client_id, queues, client_ids) -> the queues current_client_id consumes.
AllocateStrategy = Callable[[str, str, Sequence[MessageQueue], Sequence[str]], list[MessageQueue]]

DEFAULT_ALLOCATE_STRATEGY = "AllocateMessageQueueAveragely"  # RocketMQ's default
DEFAULT_VIRTUAL_NODE_COUNT = 10  # RocketMQ's AllocateMessageQueueConsistentHash()


def _sorted_inputs(consumer_group: str, current_client_id: str, queues: Iterable[MessageQueue],
                   client_ids: Iterable[str]) -> tuple[list[MessageQueue], list[str]]:
    if not current_client_id:
        raise ValueError(f"consumer group {consumer_group!r}: current client id must not be empty")
    # Sorted as RocketMQ's RebalanceImpl sorts both lists before any strategy sees them (MessageQueue orders by
    # topic, broker name, queue id, as its compareTo; names are ASCII, so str order is Java's).
    return sorted(set(queues)), sorted(set(client_ids))


def allocate_average(consumer_group: str, current_client_id: str, queues: Iterable[MessageQueue],
                     client_ids: Iterable[str]) -> list[MessageQueue]:
    """The queues ``current_client_id`` should consume. Both inputs are sorted here, so callers may pass any
    order; a client id missing from ``client_ids`` (heartbeat not seen yet) gets nothing."""
    mq_all, cid_all = _sorted_inputs(consumer_group, current_client_id, queues, client_ids)
    if not mq_all or current_client_id not in cid_all:
        return []
    index = cid_all.index(current_client_id)
    n_mq, n_cid = len(mq_all), len(cid_all)
    mod = n_mq % n_cid
    if n_mq <= n_cid:
        average = 1
    elif mod > 0 and index < mod:
        average = n_mq // n_cid + 1
    else:
        average = n_mq // n_cid
    start = index * average if mod > 0 and index < mod else index * average + mod
    count = min(average, n_mq - start)
    return [mq_all[(start + i) % n_mq] for i in range(max(count, 0))]


def allocate_average_by_circle(consumer_group: str, current_client_id: str, queues: Iterable[MessageQueue],
                               client_ids: Iterable[str]) -> list[MessageQueue]:
    """RocketMQ's AllocateMessageQueueAveragelyByCircle: the ``k``-th of the sorted members takes the sorted
    queues ``k``, ``k + n``, ``k + 2n``... (``n`` members)."""
    mq_all, cid_all = _sorted_inputs(consumer_group, current_client_id, queues, client_ids)
    if current_client_id not in cid_all:
        return []
    return mq_all[cid_all.index(current_client_id)::len(cid_all)]


def _ring_point(key: str) -> int:
    # RocketMQ's ConsistentHashRouter.MD5Hash: the digest's first four bytes, big-endian, unsigned.
    return int.from_bytes(hashlib.md5(key.encode("utf-8")).digest()[:4], "big")


def _queue_key(mq: MessageQueue) -> str:
    # RocketMQ's MessageQueue.toString(), which its strategy hashes.
    return f"MessageQueue [topic={mq.topic}, brokerName={mq.broker_name}, queueId={mq.queue_id}]"


@dataclasses.dataclass(frozen=True, slots=True)
class ConsistentHashAllocation:
    """RocketMQ's AllocateMessageQueueConsistentHash with ``virtual_node_count`` points per member; build it with
    ``allocate_consistent_hash``."""

    virtual_node_count: int = DEFAULT_VIRTUAL_NODE_COUNT

    def __post_init__(self) -> None:
        count = self.virtual_node_count
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 10_000:
            # 0 put nobody on the ring (RocketMQ allows it: no queue is then consumed); past 10,000 the ring costs
            # more than it spreads.
            raise ValueError(f"virtual_node_count must be an integer within 1..10000, got {count!r}")

    def __call__(self, consumer_group: str, current_client_id: str, queues: Iterable[MessageQueue],
                 client_ids: Iterable[str]) -> list[MessageQueue]:
        mq_all, cid_all = _sorted_inputs(consumer_group, current_client_id, queues, client_ids)
        if current_client_id not in cid_all:
            return []
        ring: dict[int, str] = {}
        for cid in cid_all:
            for i in range(self.virtual_node_count):
                # Two points on one place: the later member (in sorted order) has it, as in RocketMQ's TreeMap.put.
                ring[_ring_point(f"{cid}-{i}")] = cid
        points = sorted(ring)
        mine = []
        for mq in mq_all:
            # The first point at or after the queue's (TreeMap.tailMap is inclusive), round to the first.
            at = bisect.bisect_left(points, _ring_point(_queue_key(mq)))
            if ring[points[at % len(points)]] == current_client_id:
                mine.append(mq)
        return mine


def allocate_consistent_hash(virtual_node_count: int = DEFAULT_VIRTUAL_NODE_COUNT) -> ConsistentHashAllocation:
    """RocketMQ's AllocateMessageQueueConsistentHash(virtualNodeCnt) as a strategy (10 points per member, as its
    default)."""
    return ConsistentHashAllocation(virtual_node_count)


@dataclasses.dataclass(frozen=True, slots=True)
class ConfiguredAllocation:
    """RocketMQ's AllocateMessageQueueByConfig; build it with ``allocate_by_config``."""

    queues: frozenset[MessageQueue]

    def __call__(self, consumer_group: str, current_client_id: str, queues: Iterable[MessageQueue],
                 client_ids: Iterable[str]) -> list[MessageQueue]:
        mq_all, _ = _sorted_inputs(consumer_group, current_client_id, queues, client_ids)
        # Those of the topic being allocated (RocketMQ returns the whole list, and its rebalance of one topic started
        # the queues of the others too), so one set may name the queues of several topics. A queue the route does
        # not have is still returned: the consumer warns about it, rather than drop a typo without a word.
        topics = {mq.topic for mq in mq_all}
        return sorted(mq for mq in self.queues if mq.topic in topics)


def allocate_by_config(queues: Iterable[MessageQueue]) -> ConfiguredAllocation:
    """RocketMQ's AllocateMessageQueueByConfig: this member consumes ``queues`` (of any of its topics), and only
    them, whatever the other members are. Give every queue to some member: nothing else will consume it."""
    if isinstance(queues, (str, bytes, MessageQueue)) or not isinstance(queues, Iterable):
        raise TypeError(f"allocate_by_config takes MessageQueue objects, e.g. [MessageQueue('TopicA', 'broker-a', 0)], "
                        f"got {queues!r}")
    given = list(queues)
    bad = [q for q in given if not isinstance(q, MessageQueue)]
    if bad:
        raise TypeError(f"allocate_by_config takes MessageQueue objects, got {bad[0]!r}")
    if not given:
        raise ValueError("allocate_by_config needs at least one queue: with none this member consumes nothing")
    return ConfiguredAllocation(frozenset(given))


# RocketMQ's class names, as a RocketMQ user names them. AllocateMessageQueueByConfig is not here: it needs queues.
ALLOCATE_STRATEGIES: dict[str, AllocateStrategy] = {
    "AllocateMessageQueueAveragely": allocate_average,
    "AllocateMessageQueueAveragelyByCircle": allocate_average_by_circle,
    "AllocateMessageQueueConsistentHash": allocate_consistent_hash(),
}


def allocate_strategy_problem(strategy: object) -> str | None:
    """What is wrong with ``strategy`` as an ``allocate_strategy``, None if nothing (a config ``check``)."""
    if isinstance(strategy, str):
        if strategy in ALLOCATE_STRATEGIES:
            return None
        if strategy == "AllocateMessageQueueByConfig":
            return ("needs the queues to take: pass allocate_strategy=client.rebalance.allocate_by_config([...]) "
                    "instead of the name")
        return f"must be one of {', '.join(map(repr, ALLOCATE_STRATEGIES))} or a function"
    if not callable(strategy):
        return f"must be one of {', '.join(map(repr, ALLOCATE_STRATEGIES))} or a function"
    if inspect.iscoroutinefunction(strategy) or inspect.iscoroutinefunction(getattr(strategy, "__call__", None)):
        # Called inside the rebalance, which does not await it: it would return a coroutine, never a queue.
        return "must be a plain function, not an async one"
    try:
        signature = inspect.signature(strategy)
    except (TypeError, ValueError):
        return None  # nothing to check (some builtins)
    try:
        signature.bind("group", "client", [], [])
    except TypeError:
        return (f"must take (consumer_group, current_client_id, queues, client_ids) as allocate_average does, not "
                f"{signature}")
    return None


def resolve_allocate_strategy(strategy: str | AllocateStrategy) -> AllocateStrategy:
    """The function ``strategy`` names (or ``strategy`` itself); ``ValueError`` naming a bad one."""
    problem = allocate_strategy_problem(strategy)
    if problem is not None:
        raise ValueError(f"allocate_strategy {problem}, got {strategy!r}")
    if isinstance(strategy, str):
        return ALLOCATE_STRATEGIES[strategy]
    return strategy


@dataclasses.dataclass(frozen=True, slots=True)
class RebalanceDiff:
    added: tuple[MessageQueue, ...]
    removed: tuple[MessageQueue, ...]

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed)


def diff_assignment(current: Iterable[MessageQueue], wanted: Sequence[MessageQueue]) -> RebalanceDiff:
    cur, want = set(current), set(wanted)
    return RebalanceDiff(tuple(sorted(want - cur)), tuple(sorted(cur - want)))


# -- what the push consumer and the lite pull consumer's subscribe mode share --------------------------------------
async def member_ids(instance: ClientInstance, consumer_group: str, topic: str, client_id: str) -> list[str]:
    """``find_consumer_ids``, asked again after a heartbeat to every node when ``client_id`` is not among them: a
    node that had not met this member yet (a new topic's group, a restarted node) learns of it first."""
    cids = await find_consumer_ids(instance, consumer_group, topic)
    if client_id not in cids:
        await instance.send_heartbeat_to_all()
        cids = await find_consumer_ids(instance, consumer_group, topic)
    return cids


async def find_consumer_ids(instance: ClientInstance, consumer_group: str, topic: str) -> list[str]:
    """The client ids of ``consumer_group``'s members as a node of a broker group serving ``topic`` knows them
    (GET_CONSUMER_LIST_BY_GROUP): the first node that answers well; [] if none does."""
    route = await instance.routes.get(topic)
    log = logging.getLogger(__name__)
    for b in route.broker_datas:
        for addr in instance.routes.replica_addrs(b.broker_name):
            try:
                frame = await instance.invoke(addr, RequestCode.GET_CONSUMER_LIST_BY_GROUP,
                                              {"consumer_group": consumer_group})
                raise_for_response(frame, topic=topic, broker_name=b.broker_name)
            except RaftMQError as e:
                instance.on_error(e, topic, b.broker_name, addr)
                continue
            ids = frame.ext.get("consumer_id_list")
            if ids is None and frame.body:
                try:
                    decoded = cbor2.loads(frame.body)
                except Exception:  # noqa: BLE001 - cbor2 reports bad input as several exception types
                    decoded = frame.body  # not a list: refused below
                ids = decoded.get("consumer_id_list") if isinstance(decoded, Mapping) else decoded
            if ids is not None and not (type(ids) is list and all(type(i) is str for i in ids)):
                # A ValueError or TypeError from it ended the rebalance task, and the consumer with it: the
                # next node is asked instead.
                log.warning("malformed GET_CONSUMER_LIST_BY_GROUP answer addr=%s ids=%r", addr, ids)
                continue
            return list(ids or ())
    return []


def allocate_share(strategy: AllocateStrategy, consumer_group: str, client_id: str, topic: str,
                   mqs: Sequence[MessageQueue], cids: Sequence[str], *, warned: set[MessageQueue],
                   log: logging.Logger, strategy_name: object = None) -> list[MessageQueue] | None:
    """``client_id``'s share of ``topic``'s queues ``mqs`` by ``strategy``, or None (logged on ``log``) if the
    strategy failed: the topic's queues then stay as they are, as RocketMQ's rebalanceByTopic leaves them. Queues
    the strategy names that the route does not have are left out, warned about once each (``warned`` remembers)."""
    shown = strategy if strategy_name is None else strategy_name
    try:
        result = list(strategy(consumer_group, client_id, sorted(mqs), sorted(cids)))
    except Exception:
        # A function of the user's: whatever it raises must not end the rebalance task, and the consumer with it.
        log.exception("allocate strategy failed, the queues stay as they are group=%s topic=%s strategy=%r",
                      consumer_group, topic, shown)
        return None
    bad = next((q for q in result if not isinstance(q, MessageQueue)), None)
    if bad is not None:
        log.error("allocate strategy returned %r, not a MessageQueue; the queues stay as they are group=%s "
                  "topic=%s strategy=%r", bad, consumer_group, topic, shown)
        return None
    known = set(mqs)
    # Queues of other topics are expected (allocate_by_config may name several topics' queues): taken by theirs.
    strays = sorted(q for q in set(result) - known if q.topic == topic and q not in warned)
    if strays:
        warned.update(strays)
        log.warning("allocate strategy named queues the topic's route does not have, not pulled (said once each) "
                    "group=%s queues=%s", consumer_group, ", ".join(map(str, strays)))
    return [q for q in result if q in known]


def consumer_heartbeat_data(consumer_group: str, consume_type: str, message_model: str, consume_from_where: str,
                            subscriptions: Iterable[Subscription]) -> dict[str, object]:
    """A consumer's HEART_BEAT data (``ClientInstance.heartbeat_data``): membership of ``consumer_group`` with
    ``consume_type`` ``CONSUME_PASSIVELY`` (push) or ``CONSUME_ACTIVELY`` (lite pull, subscribe mode)."""
    return {"producers": [], "consumers": [{
        "consumer_group": consumer_group, "consume_type": consume_type, "message_model": message_model,
        "consume_from_where": consume_from_where,
        "subscriptions": [{"topic": s.topic, "expression": s.expression, "expression_type": s.expression_type,
                           "sub_version": s.sub_version} for s in subscriptions]}]}


async def find_start_offsets(queues: Sequence[MessageQueue], start_offset: Callable[[MessageQueue], Any],
                             logger: logging.Logger) -> dict[MessageQueue, int]:
    """Where each of ``queues`` (newly allocated) starts, asked all at once with ``start_offset(mq)`` before the
    rebalance returns (RocketMQ's computePullFromWhere before the first pull); a queue whose offset cannot be found
    now is logged and left out (its pull task retries), holding up none of the others. The push and the lite pull
    consumer's subscribe mode share it."""
    starts: dict[MessageQueue, int] = {}

    async def one(mq: MessageQueue) -> None:
        try:
            starts[mq] = await start_offset(mq)
        except RaftMQError as e:
            logger.info("cannot find start offset mq=%s error=%s", mq, e)

    async with trio.open_nursery() as nursery:
        for mq in queues:
            nursery.start_soon(one, mq)
    return starts
