"""Who is connected: RocketMQ's ConsumerManager and ProducerManager.

Clients send HEART_BEAT every few seconds with the producer and consumer groups they belong to. The broker keeps,
per consumer group, the live members (client id → connection, last heartbeat) and their subscriptions, answers
GET_CONSUMER_LIST_BY_GROUP from it, and tells the members of a group when membership changes so they rebalance at
once (NOTIFY_CONSUMER_IDS_CHANGED, oneway; clients also re-run rebalancing periodically, so a lost notification
costs only a delay). A member leaves on UNREGISTER_CLIENT, when its connection closes, or when it has been silent
for ``channel_expired_timeout_ms``.

What a client sends must not grow the tables past what its connections hold (RocketMQ keys both tables by
channel): a connection is one member of a group, so a heartbeat naming a new client id over a connection that
already carries another in that group replaces it, and a group whose last member left is forgotten, with the
subscriptions of topics no member subscribes to any more. Before, one connection sending heartbeats with a fresh
id each time added a member per heartbeat, listed to every member and rebalanced over, and every group and topic
ever named stayed for as long as the process ran.

Members of one group should subscribe alike. Each member pulls the queues it is given with its own expression, so
in a group whose members differ, a message only another member wants is skipped by the member whose queue holds
it (RocketMQ behaves the same and asks for one subscription per group). Nothing else would say so: the group's
subscription shown by consumerConnection is whichever member heartbeated last. So each member's subscriptions are
kept with its channel, listed per connection, and a difference is logged once at WARNING.

Membership is deliberately *not* replicated: it is soft state rebuilt by heartbeats, which clients send to every
node of a group they talk to, as RocketMQ's clients send to every broker of a route.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from broker.filter import SubscriptionParseError, TagFilter, parse_tag_expression
from broker.property_filter import parse_sql_expression
from broker.topic_config import TopicConfigError, validate_group_name, validate_topic_name
from remoting.message import CLIENT_ID_MAX_LENGTH
from remoting.sql_filter import SQL92, TAG, SqlFilter

log = logging.getLogger(__name__)

# RocketMQ 5's ConsumeType: push, pull (lite pull), and POP (the simple consumer).
CONSUME_TYPES = ("CONSUME_PASSIVELY", "CONSUME_ACTIVELY", "CONSUME_POP")
MESSAGE_MODELS = ("CLUSTERING", "BROADCASTING")
# RocketMQ's ConsumeFromWhere, its deprecated values included (older clients still send them).
CONSUME_FROM_WHERE = ("CONSUME_FROM_LAST_OFFSET", "CONSUME_FROM_FIRST_OFFSET", "CONSUME_FROM_TIMESTAMP",
                      "CONSUME_FROM_LAST_OFFSET_AND_FROM_MIN_WHEN_BOOT_FIRST", "CONSUME_FROM_MIN_OFFSET",
                      "CONSUME_FROM_MAX_OFFSET")


class HeartbeatError(ValueError):
    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class ExpressionParseError(HeartbeatError):
    """A subscription expression that does not parse as its ``expression_type`` says."""

    def __init__(self, message: str, *, expression_type: str) -> None:
        super().__init__(message, field="expression")
        self.expression_type = expression_type


@dataclasses.dataclass(frozen=True)
class SubscriptionData:
    topic: str
    expression: str
    sub_version: int
    filter: TagFilter  # matches all for SQL92
    expression_type: str = TAG
    sql_filter: SqlFilter | None = None  # SQL92's compiled expression


@dataclasses.dataclass(frozen=True)
class ConsumerData:
    consumer_group: str
    consume_type: str
    message_model: str
    consume_from_where: str
    subscriptions: tuple[SubscriptionData, ...]


@dataclasses.dataclass(frozen=True)
class HeartbeatData:
    client_id: str
    producer_groups: tuple[str, ...]
    consumers: tuple[ConsumerData, ...]


def _str(data: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or not value:
        raise HeartbeatError(f"{where}{key} must be a non-empty string, got {value!r}", field=key)
    return value


def client_id_problem(client_id: str) -> str | None:
    """What is wrong with a client id's length (HEART_BEAT and UNREGISTER_CLIENT), None when nothing."""
    if len(client_id) > CLIENT_ID_MAX_LENGTH:
        return f"is {len(client_id)} characters long; at most {CLIENT_ID_MAX_LENGTH} are allowed"
    return None


def _group(data: Mapping[str, Any], key: str, where: str) -> str:
    # The rule every other request naming a group is held to: a member must not join a group under a name that
    # GET_CONSUMER_LIST_BY_GROUP, offsets and pulls then refuse.
    group = _str(data, key, where)
    try:
        return validate_group_name(group, f"{where}{key}")
    except TopicConfigError as e:
        raise HeartbeatError(str(e), field=key) from None


def parse_subscription_data(data: Any, where: str, *, field: str) -> SubscriptionData:
    """One subscription map (a HEART_BEAT consumer's, CHECK_CLIENT_CONFIG's), its expression parsed by its type.
    ``where`` prefixes the messages (``consumers[0].subscriptions[1].``); ``field`` names the map itself when it is
    no map. An expression that does not parse is ``ExpressionParseError``, so CHECK_CLIENT_CONFIG can answer it
    as RocketMQ does (SUBSCRIPTION_PARSE_FAILED) where the heartbeat calls it malformed."""
    if not isinstance(data, Mapping):
        raise HeartbeatError(f"{where[:-1]} must be a map, got {data!r}", field=field)
    topic = _str(data, "topic", where)
    try:
        validate_topic_name(topic)
    except TopicConfigError as e:
        raise HeartbeatError(f"{where}{e}", field="topic") from None
    expression = data.get("expression", "*")
    # Absent or empty is TAG, as RocketMQ's ExpressionType.isTagType. A SQL92 subscription is taken (and
    # parsed) whatever enable_property_filter says: it is the group's pulls (and CHECK_CLIENT_CONFIG, which the
    # consumer sends first) a broker without it refuses.
    expression_type = data.get("expression_type") or TAG
    if expression_type not in (TAG, SQL92):
        raise HeartbeatError(f"{where}expression_type must be {TAG} or {SQL92}, got "
                             f"{str(expression_type)[:40]!r}", field="expression_type")
    sql_filter = None
    try:
        if expression_type == SQL92:
            sql_filter = parse_sql_expression(expression)
            tag_filter = parse_tag_expression(None)
        else:
            tag_filter = parse_tag_expression(expression)
    except SubscriptionParseError as e:
        raise ExpressionParseError(f"{where}expression: {e}", expression_type=expression_type) from None
    version = data.get("sub_version", 0)
    if isinstance(version, bool) or not isinstance(version, int):
        raise HeartbeatError(f"{where}sub_version must be an integer, got {version!r}", field="sub_version")
    return SubscriptionData(topic, sql_filter.expression if sql_filter else tag_filter.expression, version,
                            tag_filter, expression_type, sql_filter)


def parse_heartbeat(body: Any) -> HeartbeatData:
    """Validate a decoded HEART_BEAT body (schema in docs/protocol.md)."""
    if not isinstance(body, Mapping):
        raise HeartbeatError(f"heartbeat body must be a CBOR map, got {type(body).__name__}", field="body")
    client_id = _str(body, "client_id", "")
    problem = client_id_problem(client_id)
    if problem:
        # Unbounded, one heartbeat's id was kept per group, listed to every member and logged at each join.
        raise HeartbeatError(f"client_id {client_id[:40]!r}... {problem}", field="client_id")
    producers = body.get("producers", [])
    consumers = body.get("consumers", [])
    if not isinstance(producers, list) or not isinstance(consumers, list):
        raise HeartbeatError("heartbeat producers and consumers must be lists", field="producers")
    producer_groups = []
    for i, p in enumerate(producers):
        if not isinstance(p, Mapping):
            raise HeartbeatError(f"producers[{i}] must be a map, got {p!r}", field="producers")
        producer_groups.append(_group(p, "producer_group", f"producers[{i}]."))
    parsed_consumers = []
    for i, c in enumerate(consumers):
        where = f"consumers[{i}]."
        if not isinstance(c, Mapping):
            raise HeartbeatError(f"consumers[{i}] must be a map, got {c!r}", field="consumers")
        group = _group(c, "consumer_group", where)
        consume_type = _str(c, "consume_type", where, "CONSUME_PASSIVELY")
        if consume_type not in CONSUME_TYPES:
            raise HeartbeatError(f"{where}consume_type must be one of {', '.join(CONSUME_TYPES)}, got "
                                 f"{consume_type!r}", field="consume_type")
        model = _str(c, "message_model", where, "CLUSTERING")
        if model not in MESSAGE_MODELS:
            raise HeartbeatError(f"{where}message_model must be one of {', '.join(MESSAGE_MODELS)}, got "
                                 f"{model!r}", field="message_model")
        where_from = _str(c, "consume_from_where", where, "CONSUME_FROM_LAST_OFFSET")
        if where_from not in CONSUME_FROM_WHERE:
            raise HeartbeatError(f"{where}consume_from_where must be one of {', '.join(CONSUME_FROM_WHERE)}, got "
                                 f"{where_from[:80]!r}", field="consume_from_where")
        subs_raw = c.get("subscriptions", [])
        if not isinstance(subs_raw, list):
            raise HeartbeatError(f"{where}subscriptions must be a list, got {subs_raw!r}", field="subscriptions")
        subs = [parse_subscription_data(s, f"{where}subscriptions[{j}].", field="subscriptions")
                for j, s in enumerate(subs_raw)]
        parsed_consumers.append(ConsumerData(group, consume_type, model, where_from, tuple(subs)))
    return HeartbeatData(client_id, tuple(producer_groups), tuple(parsed_consumers))


def _ids_on(channels: Mapping[str, ClientChannel], conn: Any) -> list[str]:
    """The client ids of ``channels`` whose heartbeats came over ``conn``."""
    return [client_id for client_id, ch in channels.items() if ch.conn is conn]


@dataclasses.dataclass
class ClientChannel:
    client_id: str
    conn: Any  # remoting ServerConnection
    last_update_s: float
    subscriptions: dict[str, str] = dataclasses.field(default_factory=dict)  # a consumer's topic -> expression


@dataclasses.dataclass
class ConsumerGroupInfo:
    consumer_group: str
    consume_type: str = "CONSUME_PASSIVELY"
    message_model: str = "CLUSTERING"
    consume_from_where: str = "CONSUME_FROM_LAST_OFFSET"
    channels: dict[str, ClientChannel] = dataclasses.field(default_factory=dict)
    subscriptions: dict[str, SubscriptionData] = dataclasses.field(default_factory=dict)
    # topic -> the expressions its members differed in when that was last logged
    differing: dict[str, frozenset[str]] = dataclasses.field(default_factory=dict)


class ClientManager:
    """Producer and consumer membership of one broker node. ``on_consumer_ids_changed(group, conns)`` is called
    after a consumer group's member set changed, with the connections of the remaining members."""

    def __init__(self, *, channel_expired_timeout_ms: int = 120_000,
                 on_consumer_ids_changed: Callable[[str, list[Any]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._expire_s = channel_expired_timeout_ms / 1000
        self._notify = on_consumer_ids_changed or (lambda group, conns: None)
        self._clock = clock
        self.consumer_groups: dict[str, ConsumerGroupInfo] = {}
        self.producer_groups: dict[str, dict[str, ClientChannel]] = {}

    def heartbeat(self, data: HeartbeatData, conn: Any) -> None:
        now = self._clock()
        for group in data.producer_groups:
            channels = self.producer_groups.setdefault(group, {})
            if data.client_id not in channels:
                for client_id in _ids_on(channels, conn):
                    del channels[client_id]
            channels[data.client_id] = ClientChannel(data.client_id, conn, now)
        for consumer in data.consumers:
            info = self.consumer_groups.get(consumer.consumer_group)
            if info is None:
                info = self.consumer_groups[consumer.consumer_group] = ConsumerGroupInfo(consumer.consumer_group)
            info.consume_type = consumer.consume_type
            info.message_model = consumer.message_model
            info.consume_from_where = consumer.consume_from_where
            for sub in consumer.subscriptions:
                old = info.subscriptions.get(sub.topic)
                if old is None or sub.sub_version >= old.sub_version:
                    info.subscriptions[sub.topic] = sub
            expressions = {sub.topic: sub.expression for sub in consumer.subscriptions}
            channel = info.channels.get(data.client_id)
            dropped: set[str] = set(channel.subscriptions) if channel is not None else set()
            if channel is None or channel.conn is not conn:
                joined = channel is None
                if joined:
                    for client_id in _ids_on(info.channels, conn):
                        dropped.update(info.channels.pop(client_id).subscriptions)
                        log.info("consumer left consumer_group=%s client_id=%s reason=replaced by client_id %s "
                                 "on the same connection", consumer.consumer_group, client_id, data.client_id)
                info.channels[data.client_id] = ClientChannel(data.client_id, conn, now, expressions)
                if joined:
                    log.info("consumer joined consumer_group=%s client_id=%s members=%d",
                             consumer.consumer_group, data.client_id, len(info.channels))
                    self._changed(info)
            else:
                channel.last_update_s = now
                channel.subscriptions = expressions
            self._forget_unsubscribed(info, dropped - expressions.keys())
            self._check_alike(info, expressions)

    def unregister(self, client_id: str, producer_group: str | None, consumer_group: str | None) -> None:
        if producer_group:
            self.producer_groups.get(producer_group, {}).pop(client_id, None)
        if consumer_group:
            info = self.consumer_groups.get(consumer_group)
            channel = info.channels.pop(client_id, None) if info is not None else None
            if info is not None and channel is not None:
                log.info("consumer left consumer_group=%s client_id=%s reason=unregister", consumer_group,
                         client_id)
                self._forget_unsubscribed(info, channel.subscriptions.keys())
                if not info.channels:
                    del self.consumer_groups[consumer_group]
                self._changed(info)

    def connection_closed(self, conn: Any) -> None:
        self._remove_where(lambda ch: ch.conn is conn, "connection closed")

    def scan_expired(self) -> None:
        deadline = self._clock() - self._expire_s
        self._remove_where(lambda ch: ch.last_update_s < deadline, "expired")

    def _remove_where(self, pred: Callable[[ClientChannel], bool], reason: str) -> None:
        # Also forgets groups left empty by an earlier UNREGISTER_CLIENT of a producer, which keeps them until now.
        for group, channels in list(self.producer_groups.items()):
            for client_id in [cid for cid, ch in channels.items() if pred(ch)]:
                del channels[client_id]
            if not channels:
                del self.producer_groups[group]
        for info in list(self.consumer_groups.values()):
            gone = [cid for cid, ch in info.channels.items() if pred(ch)]
            dropped: set[str] = set()
            for client_id in gone:
                dropped.update(info.channels.pop(client_id).subscriptions)
                log.info("consumer left consumer_group=%s client_id=%s reason=%s", info.consumer_group,
                         client_id, reason)
            self._forget_unsubscribed(info, dropped)
            if not info.channels:
                del self.consumer_groups[info.consumer_group]
            if gone:
                self._changed(info)

    @staticmethod
    def _forget_unsubscribed(info: ConsumerGroupInfo, topics: Iterable[str]) -> None:
        """Drop the group's subscription of each of ``topics`` that no member subscribes to any more: a pull
        without an expression then matches all, as one of a group that never subscribed."""
        for topic in topics:
            if not any(topic in ch.subscriptions for ch in info.channels.values()):
                info.subscriptions.pop(topic, None)
                info.differing.pop(topic, None)

    @staticmethod
    def _check_alike(info: ConsumerGroupInfo, expressions: Mapping[str, str]) -> None:
        for topic in expressions:
            seen = frozenset(ch.subscriptions[topic] for ch in info.channels.values() if topic in ch.subscriptions)
            if len(seen) < 2:
                info.differing.pop(topic, None)
            elif info.differing.get(topic) != seen:
                info.differing[topic] = seen
                members = ", ".join(f"{cid} {ch.subscriptions[topic]!r}" for cid, ch in sorted(info.channels.items())
                                    if topic in ch.subscriptions)
                log.warning("members of consumer group %r subscribe to topic %r differently (%s): each pulls the "
                            "queues it is given with its own expression, so messages only another member wants "
                            "are skipped; give every member of a group the same subscription",
                            info.consumer_group, topic, members)

    def _changed(self, info: ConsumerGroupInfo) -> None:
        self._notify(info.consumer_group, [ch.conn for ch in info.channels.values()])

    def now(self) -> float:
        """The clock heartbeats are stamped with."""
        return self._clock()

    def consumer_ids(self, consumer_group: str) -> list[str]:
        info = self.consumer_groups.get(consumer_group)
        return sorted(info.channels) if info else []

    def find_subscription(self, consumer_group: str, topic: str) -> SubscriptionData | None:
        info = self.consumer_groups.get(consumer_group)
        return info.subscriptions.get(topic) if info else None

    def find_consumer_connection(self, consumer_group: str, client_id: str) -> Any | None:
        """The open connection the member ``client_id`` of ``consumer_group`` heartbeats on (RocketMQ's
        ConsumerGroupInfo.findChannel), None when it is no member here or its connection has closed."""
        info = self.consumer_groups.get(consumer_group)
        channel = info.channels.get(client_id) if info is not None else None
        if channel is None or getattr(channel.conn, "closed", False):
            return None
        return channel.conn

    def find_producer_connection(self, client_id: str) -> Any | None:
        """The open connection of the producer ``client_id`` (RocketMQ's ProducerManager.findChannel), whichever
        of its groups it heartbeated; the latest heartbeat's if it named several over different connections."""
        found: ClientChannel | None = None
        for channels in self.producer_groups.values():
            channel = channels.get(client_id)
            if channel is not None and not channel.conn.closed and (
                    found is None or channel.last_update_s > found.last_update_s):
                found = channel
        return found.conn if found is not None else None

    def connection_count(self) -> int:
        conns = {id(ch.conn) for info in self.consumer_groups.values() for ch in info.channels.values()}
        conns |= {id(ch.conn) for chans in self.producer_groups.values() for ch in chans.values()}
        return len(conns)
