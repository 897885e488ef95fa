"""What the admin client answers with, and how it reads the answers off the wire: the frozen result dataclasses
(``ClusterInfo``, ``ConsumeStats``, ``SubscriptionGroup``...) and the readers that check every field of an answer
before one is built.

Apart from ``client/admin.py`` (``AdminClient``, ``open_admin``), which re-exports every result class and
``SUBSCRIPTION_GROUP_FIELDS``: these are pure (no trio, no connection), so the shapes of the answers can be read and
tested without the requests that fetch them. A reader raises ``TypeError``/``KeyError``/``ValueError`` on what is
not as it should be; ``reading`` turns those into the peer's SYSTEM_ERROR naming the request.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import cbor2

from client.message import MessageQueue
from client.route import parse_broker_addr_table
from remoting.codes import ResponseCode
from remoting.errors import for_code
from remoting.message import I32, I64

__all__ = ["BrokerConfigUpdate", "ClusterInfo", "ConsumeStats", "ConsumerConnection", "ConsumerRunningInfo",
           "DelayLevelProgress", "GroupDeletion", "GroupOffsetClone", "OffsetReset", "ProcessQueueInfo",
           "ProducerConnection", "QueueConsumeStats", "SubscriptionGroup", "SubscriptionGroupUpdate",
           "SUBSCRIPTION_GROUP_FIELDS", "TopicConsumeStatus", "TopicPermUpdate", "TopicQueueStatus",
           "reading", "int_field", "opt_int_field", "str_field", "rate_field", "names_field",
           "parse_cluster_info", "parse_consumer_running_info", "parse_subscription_group"]

# The fields update_subscription_group sets: bool, or the (lo, hi) of an integer, as the brokers hold them
# (broker/subscription_group.py; retry_queue_nums 0, RocketMQ's "drop what is sent back", is refused there).
SUBSCRIPTION_GROUP_FIELDS: Mapping[str, Any] = {
    "consume_enable": bool, "consume_from_min_enable": bool, "consume_broadcast_enable": bool,
    "retry_queue_nums": (1, 1024), "retry_max_times": (0, I32[1]), "broker_id": (0, I64[1]),
    "which_broker_when_consume_slowly": (0, I64[1]), "notify_consumer_ids_changed_enable": bool,
}


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterInfo:
    """``broker_addrs[broker_name][broker_id] = addr`` (id 0: the leader) and ``clusters[cluster] = names``."""

    broker_addrs: Mapping[str, Mapping[int, str]]
    clusters: Mapping[str, tuple[str, ...]]
    nodes: Mapping[str, Any]

    def master_addr(self, broker_name: str) -> str | None:
        return self.broker_addrs.get(broker_name, {}).get(0)


@dataclasses.dataclass(frozen=True, slots=True)
class TopicPermUpdate:
    """What ``update_topic_perm`` did to a topic on one broker group: its permission before and after (the same
    when it was already that: nothing was written) and the rest of its config, kept as it was."""

    broker_name: str
    previous_perm: int
    perm: int
    read_queue_nums: int
    write_queue_nums: int
    order: bool
    topic_sys_flag: int

    @property
    def changed(self) -> bool:
        return self.perm != self.previous_perm


@dataclasses.dataclass(frozen=True, slots=True)
class BrokerConfigUpdate:
    """What ``update_broker_config`` did on one node: each key's value after (``values``) and before
    (``previous``), as the node holds them (an integer, a boolean...)."""

    addr: str
    values: Mapping[str, Any]
    previous: Mapping[str, Any]

    @property
    def changed(self) -> dict[str, Any]:
        """The keys whose value changed, with their new value."""
        return {k: v for k, v in self.values.items() if self.previous.get(k) != v}


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
    consume_tps: float = 0.0  # messages a second the group pulled over the last minute, from every node

    @property
    def total_lag(self) -> int:
        return sum(q.lag for q in self.queues)


@dataclasses.dataclass(frozen=True, slots=True)
class TopicQueueStatus:
    """One queue of a topic (RocketMQ's topicStatus): the offsets it holds and when its last message was stored
    (ms; None for an empty queue)."""

    queue: MessageQueue
    min_offset: int
    max_offset: int
    last_update_timestamp: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class DelayLevelProgress:
    """One delay level of a broker group (RocketMQ's delayOffset table, GET_ALL_DELAY_OFFSET): its delay, how far
    delivery went in its schedule queue (``delivered_offset``, the next offset to deliver) and where the queue
    ends (``max_offset``)."""

    level: int
    delay_ms: int
    delivered_offset: int
    max_offset: int

    @property
    def waiting(self) -> int:
        """Delayed messages of this level not delivered yet."""
        return max(0, self.max_offset - self.delivered_offset)


@dataclasses.dataclass(frozen=True, slots=True)
class ConsumerConnection:
    """A consumer group's online members (RocketMQ's consumerConnection): ``connections`` maps each member's
    client id to its address as its group leader sees it; ``subscriptions`` maps topic to tag expression, and
    ``member_subscriptions`` does so for each member (client id) on its own. ``consume_type`` is how the members
    consume, as their heartbeats say: ``CONSUME_PASSIVELY`` (push consumers), ``CONSUME_ACTIVELY`` (lite pull
    consumers in subscribe mode), ``CONSUME_POP`` (simple consumers); "" when no member is online."""

    consumer_group: str
    message_model: str
    consume_from_where: str
    subscriptions: Mapping[str, str]
    connections: Mapping[str, str]
    member_subscriptions: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    consume_type: str = ""

    def differing_topics(self) -> dict[str, dict[str, str]]:
        """Topics the members subscribe to with different expressions, each with ``{client id: expression}``.
        Each member pulls the queues it is given with its own expression, so in such a group a message only
        another member wants is skipped: members of one group should subscribe alike."""
        by_topic: dict[str, dict[str, str]] = {}
        for client_id, subs in self.member_subscriptions.items():
            for topic, expression in subs.items():
                by_topic.setdefault(topic, {})[client_id] = expression
        return {topic: members for topic, members in sorted(by_topic.items()) if len(set(members.values())) > 1}


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessQueueInfo:
    """One queue a consumer holds, in its running info (RocketMQ's ProcessQueueInfo): the messages it caches (pulled,
    not yet consumed: their count, body bytes, least and greatest offsets, None when none), the offset its offset
    store holds to commit (None: none yet), whether it holds the queue's broker-side lock (orderly) or pauses it,
    and when (ms) it last pulled and consumed from it (None: not since it was opened)."""

    queue: MessageQueue
    committed_offset: int | None
    cached_msg_count: int
    cached_msg_bytes: int
    cached_msg_min_offset: int | None
    cached_msg_max_offset: int | None
    locked: bool
    paused: bool
    last_pull_timestamp: int | None
    last_consume_timestamp: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class TopicConsumeStatus:
    """A consumer's rates on one topic over the last minute (RocketMQ's ConsumeStatus): messages pulled a second and
    a pull's mean time (long polls included), messages its handler calls consumed and failed a second and a call's
    mean time, and the messages that failed over the last hour."""

    pull_tps: float
    pull_rt_ms: float
    consume_ok_tps: float
    consume_failed_tps: float
    consume_rt_ms: float
    consume_failed_msgs: int


@dataclasses.dataclass(frozen=True, slots=True)
class ConsumerRunningInfo:
    """What one online consumer says it is doing (RocketMQ's ConsumerRunningInfo, ``mqadmin consumerStatus``):
    ``properties`` (its config and statistics; ``consume_type``, ``message_model``, ``consume_orderly``,
    ``consumer_start_timestamp``...), ``subscriptions`` (topic -> expression), every queue it holds, per topic its
    rates, and its task dump when asked for (``jstack``). ``broker_name``: the broker group that relayed it."""

    consumer_group: str
    client_id: str
    broker_name: str
    properties: Mapping[str, Any]
    subscriptions: Mapping[str, str]
    queues: tuple[ProcessQueueInfo, ...]
    status: Mapping[str, TopicConsumeStatus]
    jstack: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class GroupOffsetClone:
    """What ``clone_group_offset`` did (mqadmin cloneGroupOffset): each queue's offset ``dest_group`` now has and had
    (``previous``, None: none), and per broker group the online members of ``dest_group`` told to pull from there."""

    src_group: str
    dest_group: str
    topic: str
    offsets: Mapping[MessageQueue, int]
    previous: Mapping[MessageQueue, int | None]
    consumer_ids: Mapping[str, tuple[str, ...]]


@dataclasses.dataclass(frozen=True, slots=True)
class ProducerConnection:
    """RocketMQ's producerConnection: the producers of a group online on any broker group, by client id, with the
    address each connects from and the broker groups that hear its heartbeats."""

    producer_group: str
    connections: dict[str, str]  # client id -> its address as a broker sees it
    broker_names: dict[str, tuple[str, ...]]  # client id -> broker groups it heartbeats to


@dataclasses.dataclass(frozen=True, slots=True)
class GroupDeletion:
    """What ``delete_group`` removed: per broker group, how many queues' offsets the consumer group had there,
    the broker groups its retry topic was deleted from, and those its subscription group config was."""

    consumer_group: str
    removed_offsets: dict[str, int]
    retry_topic_deleted_from: tuple[str, ...]
    config_removed_from: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class OffsetReset:
    """What ``reset_offset`` did: each queue's new ``offsets`` and ``previous`` ones (None: nothing committed),
    and per group the ``consumer_ids`` of the online members told to pull from the new offsets."""

    consumer_group: str
    offsets: Mapping[MessageQueue, int]
    previous: Mapping[MessageQueue, int | None]
    consumer_ids: Mapping[str, tuple[str, ...]]


@dataclasses.dataclass(frozen=True, slots=True)
class SubscriptionGroup:
    """A consumer group's config on one broker group (RocketMQ's SubscriptionGroupConfig). The brokers act on
    ``consume_enable`` (false: its pulls are refused), ``consume_broadcast_enable``, ``retry_max_times`` (when a
    send-back names no limit), ``retry_queue_nums`` (of its retry topic, when first created) and
    ``notify_consumer_ids_changed_enable``; the other fields are stored and shown only."""

    broker_name: str
    group_name: str
    consume_enable: bool
    consume_from_min_enable: bool
    consume_broadcast_enable: bool
    retry_queue_nums: int
    retry_max_times: int
    broker_id: int
    which_broker_when_consume_slowly: int
    notify_consumer_ids_changed_enable: bool

    def fields(self) -> dict[str, Any]:
        """The config's fields by name (``SUBSCRIPTION_GROUP_FIELDS``' order)."""
        return {name: getattr(self, name) for name in SUBSCRIPTION_GROUP_FIELDS}


@dataclasses.dataclass(frozen=True, slots=True)
class SubscriptionGroupUpdate:
    """What ``update_subscription_group`` did on one broker group: the config now and before (None: created)."""

    broker_name: str
    config: SubscriptionGroup
    previous: SubscriptionGroup | None

    @property
    def changed(self) -> dict[str, tuple[Any, Any]]:
        """field -> (before, after) of the fields that changed (none for a group created)."""
        if self.previous is None:
            return {}
        before, after = self.previous.fields(), self.config.fields()
        return {k: (before[k], v) for k, v in after.items() if before[k] != v}


def parse_subscription_group(broker_name: str, data: Any) -> SubscriptionGroup:
    if not isinstance(data, Mapping):
        raise TypeError(f"subscription group {data!r} is not a map")
    values: dict[str, Any] = {}
    for name, kind in SUBSCRIPTION_GROUP_FIELDS.items():
        value = data[name]
        if kind is bool and type(value) is not bool:
            raise TypeError(f"{name} {value!r} is not true or false")
        values[name] = value if kind is bool else int_field(value, name)
    return SubscriptionGroup(broker_name, str_field(data["group_name"], "group_name"), **values)


_PROPERTY_TYPES = (str, int, float, bool, type(None))


def parse_consumer_running_info(broker_name: str, data: Any) -> ConsumerRunningInfo:
    """A GET_CONSUMER_RUNNING_INFO answer (client/running_info.py draws it) relayed by ``broker_name``."""
    if not isinstance(data, Mapping):
        raise TypeError(f"running info {type(data).__name__} is not a map")
    properties = data["properties"]
    if not isinstance(properties, Mapping) or not all(isinstance(k, str) and isinstance(v, _PROPERTY_TYPES)
                                                      for k, v in properties.items()):
        raise TypeError("properties is not a map of names to scalars")
    subscriptions = {str_field(s["topic"], "topic"): str_field(s["expression"], "expression")
                     for s in data["subscriptions"]}
    queues = []
    for row in data["queues"]:
        flags = [row[k] for k in ("locked", "paused")]
        if not all(type(f) is bool for f in flags):
            raise TypeError(f"locked/paused {flags!r} are not true or false")
        queues.append(ProcessQueueInfo(
            MessageQueue(str_field(row["topic"], "topic"), str_field(row["broker_name"], "broker_name"),
                         int_field(row["queue_id"], "queue_id")),
            opt_int_field(row["committed_offset"], "committed_offset"),
            int_field(row["cached_msg_count"], "cached_msg_count"),
            int_field(row["cached_msg_bytes"], "cached_msg_bytes"),
            opt_int_field(row["cached_msg_min_offset"], "cached_msg_min_offset"),
            opt_int_field(row["cached_msg_max_offset"], "cached_msg_max_offset"), *flags,
            opt_int_field(row["last_pull_timestamp"], "last_pull_timestamp"),
            opt_int_field(row["last_consume_timestamp"], "last_consume_timestamp")))
    status = {}
    for topic, rates in data["status"].items():
        status[str_field(topic, "topic")] = TopicConsumeStatus(
            *(_rate_value(rates[k], k) for k in ("pull_tps", "pull_rt_ms", "consume_ok_tps", "consume_failed_tps",
                                                 "consume_rt_ms")),
            int_field(rates["consume_failed_msgs"], "consume_failed_msgs"))
    jstack = data.get("jstack")
    if jstack is not None:
        str_field(jstack, "jstack")
    return ConsumerRunningInfo(str_field(data["consumer_group"], "consumer_group"),
                               str_field(data["client_id"], "client_id"), broker_name, dict(properties),
                               dict(sorted(subscriptions.items())), tuple(sorted(queues, key=lambda q: q.queue)),
                               dict(sorted(status.items())), jstack)


def _rate_value(value: Any, key: str) -> float:
    if type(value) not in (int, float) or not 0 <= value < float("inf"):
        raise TypeError(f"{key} {value!r} is not a rate")
    return float(value)


def parse_cluster_info(data: Mapping[str, Any]) -> ClusterInfo:
    brokers = parse_broker_addr_table(data)
    clusters = {c: names_field(names, "cluster_addr_table entry")
                for c, names in data.get("cluster_addr_table", {}).items()}
    nodes = data.get("nodes", {})
    if not isinstance(nodes, Mapping):
        raise TypeError(f"nodes is a {type(nodes).__name__}, not a map")
    return ClusterInfo(brokers, clusters, nodes)


@contextlib.contextmanager
def reading(request: str, source: str) -> Iterator[None]:
    """Reads an answer: what it holds that cannot be read as it should (not CBOR, a field missing or of another
    type, records that are no records) is that peer's SYSTEM_ERROR naming the request and the peer. A bare
    KeyError or CBORDecodeError came out of the admin call instead (from the CLI, a traceback)."""
    try:
        yield
    except (cbor2.CBORError, KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise for_code(ResponseCode.SYSTEM_ERROR,
                       f"malformed {request} answer from {source}: {type(e).__name__}: {e}") from None


def int_field(value: Any, key: str) -> int:
    if type(value) is not int:
        raise TypeError(f"{key} {value!r} is not an integer")
    return value


def opt_int_field(value: Any, key: str) -> int | None:
    return None if value is None else int_field(value, key)


def str_field(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{key} {value!r} is not a text")
    return value


def rate_field(value: Any) -> float:
    """A consume TPS: a finite number, at least 0 (a text or NaN was added up into the total, or raised)."""
    if type(value) not in (int, float) or not 0 <= value < float("inf"):
        raise TypeError(f"consume_tps {value!r} is not a rate")
    return float(value)


def names_field(value: Any, key: str) -> tuple[str, ...]:
    """A list of texts (a text itself was taken one character per item)."""
    if type(value) is not list or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{key} {value!r} is not a list of texts")
    return tuple(value)
