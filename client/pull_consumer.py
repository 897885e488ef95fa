"""Pulling: the request/response layer every consumer uses, and the pull consumer on top of it.

``PullAPI`` turns PULL_MESSAGE and the offset requests into calls with typed answers. Reads go to the group's
leader; when it cannot be reached they fall back to the other nodes (followers serve pulls from their own
byte-identical store), so consumption continues through a failover. Offset commits only go to the leader,
because they are replicated through it.

The pull consumer (``open_pull_consumer``) leaves every decision to the caller: which queue, which offset,
when to commit (RocketMQ's ``DefaultLitePullConsumer`` in manual-assign mode).

A pulled body stored compressed is inflated up to the consumer's ``max_inflated_body_size_bytes`` (4 MiB, every
consumer's key; at most 256 MiB): one that would inflate further is logged at ERROR and delivered as stored, its
compression flag kept, so a producer's zlib bomb costs a consumer no more than that bound a message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import cbor2

from client.errors import SubscriptionRefusedError
from client.filter import TAG, MessageSelector, Subscription, parse_subscription
from client.instance import (
    ClientConfig, ClientInstance, build_config, open_client_nursery, open_remoting, raise_for_response,
)
from client.message import (DEFAULT_MAX_INFLATED_BODY, I32_MAX, I64_MAX, MAX_INFLATED_BODY, MessageExt, MessageQueue,
                            PullResult, PullStatus, RecordProperties, _PulledMessageExt, check_int_arg, check_queue,
                            decompressed_body)
from remoting.codes import RequestCode, ResponseCode
from remoting.config import bounded
from remoting.errors import NoPermissionError, RaftMQError, for_code
from remoting.message import COMPRESSED_FLAG, MessageFormatError, decode_records, group_problem

__all__ = ["PullAPI", "PullConsumerConfig", "PullConsumer", "open_pull_consumer", "to_message_ext", "log_failed_pull",
           "pull_should_wait"]

log = logging.getLogger(__name__)

# The config key of every consumer (push, lite pull, pull) that bounds what a pulled body inflates to; named in the
# error logged for a body that would inflate further.
MAX_INFLATED_BODY_KEY = "max_inflated_body_size_bytes"

# RocketMQ's PullSysFlag bits.
FLAG_COMMIT_OFFSET = 0x1
FLAG_SUSPEND = 0x2
FLAG_SUBSCRIPTION = 0x4

_PULL_STATUS = {
    ResponseCode.SUCCESS: PullStatus.FOUND,
    ResponseCode.PULL_NOT_FOUND: PullStatus.NO_NEW_MSG,
    ResponseCode.PULL_RETRY_IMMEDIATELY: PullStatus.NO_MATCHED_MSG,
    ResponseCode.PULL_OFFSET_MOVED: PullStatus.OFFSET_ILLEGAL,
}


def _power_of_ten(n: int) -> bool:
    while n % 10 == 0:
        n //= 10
    return n == 1


def pull_refused(error: RaftMQError) -> bool:
    """Whether a failed pull was refused, for as long as an operator leaves it so, rather than failed by something
    soon over (a leader moving, a connection lost). NO_PERMISSION is retriable for a send (another broker group may
    take it, as RocketMQ's producer retries it) but, for a pull, the node says the group, the topic or the node may
    not be read now: a stopped consumer group, a topic or node without read permission, an ACL."""
    return not error.retriable or isinstance(error, NoPermissionError)


def log_failed_pull(logger: logging.Logger, failures: int, mq: MessageQueue, offset: int, error: RaftMQError) -> None:
    """How a queue's pull task (push and lite pull consumers) reports its ``failures``-th failed pull in a row: a
    few in a row are a leader moving (DEBUG); a refusal, or a streak, is worth seeing: the first refusal, then the
    10th, 100th, ... failure in a row, each with its error."""
    if (failures == 1 and pull_refused(error)) or (failures >= 10 and _power_of_ten(failures)):
        logger.warning("pull failed %d time(s) in a row mq=%s offset=%d error=%s", failures, mq, offset, error)
    else:
        logger.debug("pull failed mq=%s offset=%d error=%s", mq, offset, error)


# RocketMQ's PULL_TIME_DELAY_MILLS_WHEN_EXCEPTION: the longest pause of a queue whose pulls are refused.
REFUSED_PULL_MAX_DELAY_S = 3.0


def failed_pull_delay(base_s: float, refusals: int, error: RaftMQError) -> float:
    """How long a queue's pull task (push and lite pull consumers) pauses after a failed pull, the ``refusals``-th
    refusal (``pull_refused``) in a row: ``base_s`` (``pull_time_delay_ms_when_exception``) when the failure is soon
    over (a leader moving, a connection lost), doubling with each refusal in a row up to RocketMQ's 3 s. A refusal
    lasts until an operator acts (a stopped consumer group, a topic no longer readable): at 200 ms each member pulled
    each of its queues five times a second for nothing."""
    if not pull_refused(error):
        return base_s
    return min(base_s * 2 ** min(refusals - 1, 16), max(base_s, REFUSED_PULL_MAX_DELAY_S))


class FailedPulls:
    """A queue's pull task's failed pulls in a row: each logged (``log_failed_pull``, by failures in a row) and
    paused after (``failed_pull_delay``, by refusals in a row: failures of a failover before a refusal do not
    lengthen its pause)."""

    __slots__ = ("base_s", "failures", "refusals")

    def __init__(self, base_s: float) -> None:
        self.base_s = base_s
        self.failures = self.refusals = 0

    def record(self, logger: logging.Logger, mq: MessageQueue, offset: int, error: RaftMQError) -> float:
        """Count and log one failed pull; returns the pause before the next."""
        self.failures += 1
        self.refusals = self.refusals + 1 if pull_refused(error) else 0
        log_failed_pull(logger, self.failures, mq, offset, error)
        return failed_pull_delay(self.base_s, self.refusals, error)

    def clear(self) -> None:
        """A pull went through: the streak is over."""
        self.failures = self.refusals = 0


def pull_should_wait(result: PullResult, offset: int, suspend_timeout_ms: int) -> bool:
    """Whether a queue's next pull, after ``result`` of the pull from ``offset``, should wait a moment rather than go
    at once: a follower that is behind says "retry" without moving on (no spinning on it), and an empty answer to a
    pull nothing held (``suspend_timeout_ms`` 0, no long polling asked for) asked again at once pulled an idle queue
    tens of thousands of times a second (RocketMQ's brokers hold such a pull a second)."""
    if result.status in (PullStatus.NO_MATCHED_MSG, PullStatus.OFFSET_ILLEGAL):
        return result.next_begin_offset <= offset
    return result.status is PullStatus.NO_NEW_MSG and not suspend_timeout_ms


def to_message_ext(view: Any, broker_name: str, *, max_size: int = MAX_INFLATED_BODY) -> MessageExt:
    """The ``MessageExt`` of a decoded record (a ``MessageView``), its body decompressed if it was stored so and
    inflates to at most ``max_size`` bytes (``decompressed_body``)."""
    body, sys_flag = view.body, view.sys_flag
    if sys_flag & COMPRESSED_FLAG:
        body, sys_flag = decompressed_body(body, sys_flag, view.topic, broker_name, view.queue_id, view.queue_offset,
                                           max_size)
    return MessageExt(view.topic, body, view.queue_id, view.queue_offset, broker_name, view.properties,
                      view.phy_offset, view.born_timestamp, view.store_timestamp, view.store_host,
                      view.reconsume_times, sys_flag, view.flag)


def _decompressed_message(topic: str, body: bytes, queue_id: int, queue_offset: int, broker_name: str,
                          properties: RecordProperties, phy: int, born_ts: int, store_ts: int, host: tuple[str, int],
                          reconsume: int, sys_flag: int, flag: int, max_size: int) -> MessageExt:
    body, sys_flag = decompressed_body(body, sys_flag, topic, broker_name, queue_id, queue_offset, max_size,
                                       MAX_INFLATED_BODY_KEY)
    return _PulledMessageExt(topic, body, queue_id, queue_offset, broker_name, properties, phy,  # type: ignore
                             born_ts, store_ts, host, reconsume, sys_flag, flag)


def _to_messages(records: list[tuple], broker_name: str,
                 max_inflated: int = MAX_INFLATED_BODY) -> tuple[MessageExt, ...]:
    """``MessageExt``s of ``decode_records`` tuples, properties decoded only when read. A message whose body is
    stored compressed (sys_flag bit 0x1, ``COMPRESSED_FLAG``) is built by ``_decompressed_message``, its body
    inflated to at most ``max_inflated`` bytes; any other costs one int test more than before: this runs for every
    consumed message (the consume bench, ~140k/s)."""
    new = _PulledMessageExt
    inflated = _decompressed_message
    return tuple([new(topic, body, queue_id, queue_offset, broker_name, RecordProperties(props), phy, born_ts,
                      store_ts, host, reconsume, sys_flag, flag)  # type: ignore[misc]
                  if not sys_flag & 1 else  # COMPRESSED_FLAG; a constant, not a name looked up per message
                  inflated(topic, body, queue_id, queue_offset, broker_name, RecordProperties(props), phy, born_ts,
                           store_ts, host, reconsume, sys_flag, flag, max_inflated)
                  for (topic, body, queue_id, queue_offset, props, phy, born_ts, store_ts, host, reconsume,
                       sys_flag, flag) in records])


class PullAPI:
    def __init__(self, instance: ClientInstance, consumer_group: str, *, check_crc: bool = False,
                 max_inflated_body_size_bytes: int = DEFAULT_MAX_INFLATED_BODY) -> None:
        check_int_arg(MAX_INFLATED_BODY_KEY, max_inflated_body_size_bytes, 1, MAX_INFLATED_BODY)
        self.instance = instance
        self.consumer_group = consumer_group
        # TCP already guards the bytes in transit and the store checks CRCs on recovery and replication, so
        # like RocketMQ's client we do not recompute each body's CRC unless asked.
        self.check_crc = check_crc
        self.max_inflated_body_size_bytes = max_inflated_body_size_bytes

    async def _read_invoke(self, mq: MessageQueue, code: int, ext: dict[str, Any], *, timeout_s: float | None = None,
                           ok=(ResponseCode.SUCCESS,)):
        """Invoke on the leader, then on the followers if the leader cannot be reached."""
        inst = self.instance
        if not inst.routes.replica_addrs(mq.broker_name):
            await inst.routes.get(mq.topic)
        last: BaseException | None = None
        for addr in inst.routes.replica_addrs(mq.broker_name):
            try:
                frame = await inst.invoke(addr, code, ext, timeout_s=timeout_s)
                return raise_for_response(frame, ok=ok, topic=mq.topic, broker_name=mq.broker_name)
            except RaftMQError as e:
                inst.on_error(e, mq.topic, mq.broker_name, addr)
                last = e
                if not e.refresh_route or getattr(e, "leader_addr", None):
                    raise
        if last is None:
            inst.master_addr(mq.broker_name)  # raises UnknownBrokerError naming the group
        assert last is not None
        raise last

    async def pull(self, mq: MessageQueue, offset: int, max_nums: int, *, subscription: Subscription | None = None,
                   commit_offset: int | None = None, suspend_timeout_ms: int = 0,
                   timeout_s: float | None = None) -> PullResult:
        check_int_arg("offset", offset, 0, I64_MAX)
        check_int_arg("max_nums", max_nums, 1, 1024)
        sub = subscription or parse_subscription(mq.topic, "*")
        sys_flag = FLAG_SUBSCRIPTION
        if suspend_timeout_ms > 0:
            sys_flag |= FLAG_SUSPEND
        if commit_offset is not None and commit_offset >= 0:
            sys_flag |= FLAG_COMMIT_OFFSET
        ext = {"consumer_group": self.consumer_group, "topic": mq.topic, "queue_id": mq.queue_id,
               "queue_offset": offset, "max_msg_nums": max_nums, "sys_flag": sys_flag,
               "commit_offset": commit_offset if commit_offset is not None else -1,
               "suspend_timeout_millis": suspend_timeout_ms, "subscription": sub.expression,
               "sub_version": sub.sub_version}
        if sub.expression_type != TAG:
            ext["expression_type"] = sub.expression_type  # absent means TAG: a tag pull's request is unchanged
        if timeout_s is None:
            timeout_s = self.instance.timeout_s + suspend_timeout_ms / 1000
        frame = await self._read_invoke(mq, RequestCode.PULL_MESSAGE, ext, timeout_s=timeout_s, ok=_PULL_STATUS)
        status = _PULL_STATUS[frame.code]
        fx = frame.ext
        messages: tuple[MessageExt, ...] = ()
        if status is PullStatus.FOUND and frame.body:
            try:
                records = decode_records(frame.body, check_crc=self.check_crc)
            except (MessageFormatError, ValueError) as e:
                raise _malformed(mq, "PULL_MESSAGE", f"its records cannot be read: {e}") from None
            # Tags codes can collide, so the broker's filter is a superset: check the tag strings here.
            messages = _to_messages(records, mq.broker_name, self.max_inflated_body_size_bytes)
            if not sub.matches_all:
                messages = tuple(m for m in messages if sub.matches(m.tags))
            if not messages:
                status = PullStatus.NO_MATCHED_MSG
        return PullResult(status, _answered_offset(mq, "PULL_MESSAGE", fx, "next_begin_offset", offset),
                          _answered_offset(mq, "PULL_MESSAGE", fx, "min_offset", 0),
                          _answered_offset(mq, "PULL_MESSAGE", fx, "max_offset", 0), messages)

    async def _offset_query(self, mq: MessageQueue, code: int, **extra: Any) -> int:
        frame = await self._read_invoke(mq, code, {"topic": mq.topic, "queue_id": mq.queue_id, **extra})
        return _answered_offset(mq, RequestCode(code).name, frame.ext, "offset", None)

    async def min_offset(self, mq: MessageQueue) -> int:
        return await self._offset_query(mq, RequestCode.GET_MIN_OFFSET)

    async def max_offset(self, mq: MessageQueue) -> int:
        return await self._offset_query(mq, RequestCode.GET_MAX_OFFSET)

    async def search_offset(self, mq: MessageQueue, timestamp_ms: int) -> int:
        return await self._offset_query(mq, RequestCode.SEARCH_OFFSET_BY_TIMESTAMP, timestamp=timestamp_ms)

    async def fetch_consume_offset(self, mq: MessageQueue) -> int | None:
        """The group's committed offset for ``mq``, or None if it never committed one."""
        ext = {"consumer_group": self.consumer_group, "topic": mq.topic, "queue_id": mq.queue_id}
        frame = await self._leader_invoke(mq, RequestCode.QUERY_CONSUMER_OFFSET, ext,
                                          ok=(ResponseCode.SUCCESS, ResponseCode.QUERY_NOT_FOUND))
        if frame.code == ResponseCode.QUERY_NOT_FOUND:
            return None
        ext = {"offset": frame.ext.get("offset", frame.ext.get("commit_offset", -1))}
        if type(ext["offset"]) is int and ext["offset"] == -1:  # none committed, as QUERY_NOT_FOUND
            return None
        return _answered_offset(mq, "QUERY_CONSUMER_OFFSET", ext, "offset", None)

    async def commit_consume_offset(self, mq: MessageQueue, offset: int) -> None:
        ext = {"consumer_group": self.consumer_group, "topic": mq.topic, "queue_id": mq.queue_id,
               "commit_offset": offset}
        await self._leader_invoke(mq, RequestCode.UPDATE_CONSUMER_OFFSET, ext)

    async def lock_batch(self, client_id: str, mqs: Sequence[MessageQueue]) -> tuple[set[MessageQueue], int]:
        """LOCK_BATCH_MQ of ``mqs`` (one broker group's) on that group's leader: the queues ``client_id`` holds now,
        and how long the broker keeps a lock without a renewal (ms)."""
        frame = await self._leader_invoke(mqs[0], RequestCode.LOCK_BATCH_MQ, {}, body=self._lock_body(client_id, mqs))
        try:
            entries = cbor2.loads(frame.body)["lock_ok_mq_set"]
            locked = {MessageQueue(str(e["topic"]), str(e["broker_name"]), int(e["queue_id"])) for e in entries}
            life_ms = frame.ext["rebalance_lock_max_live_time_ms"]
            # An infinite or huge life raised OverflowError in the renewal task (int(), then life_ms / 1000),
            # which expects RaftMQError, and ended the consumer.
            if type(life_ms) is not int or not 0 < life_ms <= I64_MAX:
                raise ValueError(f"rebalance_lock_max_live_time_ms must be 1..{I64_MAX}, got {life_ms!r}")
        except (KeyError, TypeError, ValueError, OverflowError, cbor2.CBORError) as e:
            raise for_code(ResponseCode.SYSTEM_ERROR, f"malformed LOCK_BATCH_MQ answer from broker group "
                                                      f"{mqs[0].broker_name}: {e}") from None
        return locked & set(mqs), life_ms

    async def unlock_batch(self, client_id: str, mqs: Sequence[MessageQueue]) -> None:
        await self._leader_invoke(mqs[0], RequestCode.UNLOCK_BATCH_MQ, {}, body=self._lock_body(client_id, mqs))

    def _lock_body(self, client_id: str, mqs: Sequence[MessageQueue]) -> bytes:
        return cbor2.dumps({"consumer_group": self.consumer_group, "client_id": client_id,
                            "mq_set": [{"topic": mq.topic, "broker_name": mq.broker_name, "queue_id": mq.queue_id}
                                       for mq in mqs]})

    async def _leader_invoke(self, mq: MessageQueue, code: int, ext: dict[str, Any], *, ok=(ResponseCode.SUCCESS,),
                             body: bytes = b""):
        inst = self.instance
        if inst.routes.master_addr(mq.broker_name) is None:
            await inst.routes.get(mq.topic)
        redirects = 3
        while True:
            addr = inst.master_addr(mq.broker_name)
            try:
                frame = await inst.invoke(addr, code, ext, body)
                return raise_for_response(frame, ok=ok, topic=mq.topic, broker_name=mq.broker_name)
            except RaftMQError as e:
                inst.on_error(e, mq.topic, mq.broker_name, addr)
                redirects -= 1
                if not getattr(e, "leader_addr", None) or redirects < 0:
                    raise

    async def send_back(self, mq: MessageQueue, msg: MessageExt, max_reconsume_times: int, *,
                        delay_level: int = 0) -> None:
        """CONSUMER_SEND_MSG_BACK of ``msg`` (pulled from ``mq``) to the leader of the group that stored it: the
        broker stores it again in the group's retry topic, delayed (``delay_level`` 0: its backoff), or in its
        dead-letter topic once ``max_reconsume_times`` is reached (``delay_level`` -1: at once)."""
        ext = {"offset": msg.phy_offset, "group": self.consumer_group, "delay_level": delay_level,
               "origin_msg_id": msg.msg_id, "origin_topic": msg.topic, "max_reconsume_times": max_reconsume_times}
        await self._leader_invoke(mq, RequestCode.CONSUMER_SEND_MSG_BACK, ext)

    async def check_subscription(self, sub: Subscription) -> bool:
        """RocketMQ's checkClientInBroker for one subscription, before it is consumed: CHECK_CLIENT_CONFIG to a node
        of each broker group serving ``sub.topic`` (a group's nodes in turn, leader first, until one answers; each
        judges by its own config, which a group's nodes should share). A TAG subscription sends nothing: every
        broker serves it. ``SubscriptionRefusedError`` for the first refusal; else True once every group accepted,
        False if the check could not be made everywhere: the topic has no route yet (RocketMQ skips it too), or no
        node of a group answered."""
        if sub.expression_type == TAG:
            return True
        inst = self.instance
        try:
            route = await inst.routes.get(sub.topic)
        except RaftMQError as e:
            log.info("subscription not checked yet, its topic has no route group=%s topic=%s error=%s",
                     self.consumer_group, sub.topic, e)
            return False
        body = cbor2.dumps({"client_id": inst.client_id, "consumer_group": self.consumer_group,
                            "subscription": {"topic": sub.topic, "expression": sub.expression,
                                             "expression_type": sub.expression_type,
                                             "sub_version": sub.sub_version}})
        checked = True
        for broker_name in sorted({mq.broker_name for mq in route.read_queues()}):
            for addr in inst.routes.replica_addrs(broker_name):
                try:
                    frame = await inst.invoke(addr, RequestCode.CHECK_CLIENT_CONFIG, None, body)
                except RaftMQError as e:
                    if not e.retriable:
                        raise  # the client closed under it, a protocol error: not about this node
                    inst.on_error(e, sub.topic, broker_name, addr)
                    log.debug("subscription check failed addr=%s error=%s", addr, e)
                    continue
                if frame.code != ResponseCode.SUCCESS:
                    # Any answer but SUCCESS, as RocketMQ's: REQUEST_CODE_NOT_SUPPORTED too, from a node older than
                    # the request, which cannot say whether it would serve the subscription.
                    refusal = for_code(frame.code, frame.remark)
                    raise SubscriptionRefusedError(
                        f"broker group {broker_name!r} refuses consumer group {self.consumer_group!r}'s "
                        f"{sub.expression_type} subscription of topic {sub.topic!r} (asked node {addr}): {refusal}",
                        topic=sub.topic, broker_name=broker_name, addr=addr, code=frame.code,
                        remark=frame.remark) from refusal
                break
            else:
                checked = False
                log.warning("subscription not checked, no node of the broker group answered group=%s topic=%s "
                            "broker_name=%s", self.consumer_group, sub.topic, broker_name)
        return checked

    async def fetch_subscribe_queues(self, topic: str) -> list[MessageQueue]:
        route = await self.instance.routes.refresh(topic)
        return route.read_queues()


def _malformed(mq: MessageQueue, request: str, problem: str) -> RaftMQError:
    return for_code(ResponseCode.SYSTEM_ERROR, f"malformed {request} answer from broker group {mq.broker_name!r} "
                                               f"for {mq.topic}:{mq.queue_id}: {problem}")


def _answered_offset(mq: MessageQueue, request: str, ext: Any, key: str, default: int | None) -> int:
    """An offset a broker answered, 0..I64_MAX: anything else (a negative, a text, none where one is due) raised
    ValueError, KeyError or TypeError in the push consumer's pull and rebalance tasks, which expect RaftMQError,
    and ended the consumer; or came back in the next pull, which refused it the same way."""
    value = ext.get(key, default)
    if type(value) is not int or not 0 <= value <= I64_MAX:
        raise _malformed(mq, request, f"{key} {value!r} is not an offset")
    return value


@dataclasses.dataclass(frozen=True)
class PullConsumerConfig(ClientConfig):
    consumer_group: str = bounded("DEFAULT_CONSUMER", check=group_problem)
    check_crc: bool = bounded(False, doc="recompute each pulled body's crc32c")
    max_inflated_body_size_bytes: int = bounded(DEFAULT_MAX_INFLATED_BODY, min=1, max=MAX_INFLATED_BODY,
                                                doc="most a compressed body is inflated to; a larger one is "
                                                    "delivered as stored, compressed, and logged")


class PullConsumer:
    """Explicit pulls: ``await consumer.pull(mq, offset, max_nums)``; offsets are the caller's to keep or commit."""

    def __init__(self, config: PullConsumerConfig, instance: ClientInstance) -> None:
        self.config = config
        self._instance = instance
        self._api = PullAPI(instance, config.consumer_group, check_crc=config.check_crc,
                            max_inflated_body_size_bytes=config.max_inflated_body_size_bytes)

    @property
    def client_id(self) -> str:
        return self._instance.client_id

    async def fetch_queues(self, topic: str) -> list[MessageQueue]:
        return await self._api.fetch_subscribe_queues(topic)

    async def pull(self, mq: MessageQueue, offset: int, max_nums: int = 32, *,
                   expression: str | MessageSelector = "*", block_ms: int = 0) -> PullResult:
        """Messages of ``mq`` from ``offset`` matching ``expression`` (tags, or ``MessageSelector.by_sql``);
        ``block_ms`` > 0 waits (long polling) for new ones."""
        check_queue("mq", mq)
        check_int_arg("block_ms", block_ms, 0, I32_MAX)  # a Java int on the wire; offset and max_nums: PullAPI.pull
        sub = parse_subscription(mq.topic, expression)
        return await self._api.pull(mq, offset, max_nums, subscription=sub, suspend_timeout_ms=block_ms)

    async def min_offset(self, mq: MessageQueue) -> int:
        return await self._api.min_offset(check_queue("mq", mq))

    async def max_offset(self, mq: MessageQueue) -> int:
        return await self._api.max_offset(check_queue("mq", mq))

    async def search_offset(self, mq: MessageQueue, timestamp_ms: int) -> int:
        check_int_arg("timestamp_ms", timestamp_ms, 0, I64_MAX)
        return await self._api.search_offset(check_queue("mq", mq), timestamp_ms)

    async def committed_offset(self, mq: MessageQueue) -> int | None:
        return await self._api.fetch_consume_offset(check_queue("mq", mq))

    async def commit(self, mq: MessageQueue, offset: int) -> None:
        check_int_arg("offset", offset, 0, I64_MAX)
        await self._api.commit_consume_offset(check_queue("mq", mq), offset)


@contextlib.asynccontextmanager
async def open_pull_consumer(namesrv: str | Sequence[str] | None = None,
                             **options: Any) -> AsyncIterator[PullConsumer]:
    if namesrv is not None:
        options["namesrv"] = namesrv
    config: PullConsumerConfig = build_config(PullConsumerConfig, options)
    async with open_remoting(config) as remoting:
        async with open_client_nursery() as nursery:
            instance = ClientInstance(config, remoting, nursery)
            instance.start_background()
            try:
                yield PullConsumer(config, instance)
            finally:
                instance.stop_background()
                instance.closed = True
                nursery.cancel_scope.cancel()
