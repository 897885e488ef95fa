"""The simple consumer (RocketMQ 5's ``SimpleConsumer``): receive, then ack or change each message's invisible time.

    async with open_simple_consumer("127.0.0.1:9876", consumer_group="G", subscriptions={"T": "*"},
                                    await_duration_ms=2_000) as consumer:
        for msg in await consumer.receive(16, invisible_duration_ms=30_000):
            handle(msg)
            await consumer.ack(msg)

Built on the brokers' POP requests (``broker/processor/pop_message.py``). A received message is invisible to the
group for ``invisible_duration_ms``; one not acked by then is delivered again (to any member) with
``reconsume_times`` + 1, and after the subscription group's ``retry_max_times`` deliveries more it goes to the
group's dead-letter topic instead. The rules this module keeps:

* **Leaders only, round robin.** Each ``receive`` goes to the leader of one (topic, broker group) pair at a time, in
  turn: first a quick pass asking each pair without waiting, then, when none had anything, a long poll of up to
  ``await_duration_ms`` at the pair whose turn it is (RocketMQ's SimpleConsumer long-polls one queue too; a message
  arriving meanwhile at another group is found by the next ``receive``). NOT_LEADER is followed to the leader it
  names, a lost connection to the next node, as the other consumers do.
* **One failing pair stops no other.** A pair that fails in the quick pass (a retriable error, or its topic
  refused there: TOPIC_NOT_EXIST once deleted, NO_PERMISSION once not readable) is passed over, its route
  refreshed, and the long poll goes to the next pair that answered; ``receive`` raises only when every pair failed.
  A deleted topic made every receive raise, for good, and its other subscribed topics were never received.
* **No readable queue is a wait, not an answer.** When no subscribed topic has a readable queue in the cached routes
  (made write-only, routed with no queues), ``receive`` has the routes asked for again (at most once a second,
  however many receives ask, and never while a refresh is still out) until one has, for up to
  ``await_duration_ms``, before it returns []: a loop of receives must yield to the heartbeats and route refreshes,
  and see read permission come back. The refresh runs in the consumer's background, not in the receive: a name
  server that drops requests makes each query wait its request timeout, which no receive's wait may take on, and
  a refresh a short receive gave up would never land. The receive looks at the cached routes each time it wakes
  (the refresh landed, the next one is due, its deadline), as any refresh may have brought a readable queue.
  A subscribed topic no name server routes (not created yet; deleted, once its cached route is dropped:
  ``client/route.py``) keeps no other from being received: it is asked for in the background every
  ``poll_name_server_interval_ms``, and ``receive`` raises ``NoRouteError`` only when no subscribed topic has a
  route.
* **One ack or many.** ``ack(msg)`` acks one message and raises what went wrong; ``ack_batch(msgs)`` acks many with
  one BATCH_ACK_MESSAGE per broker group (one replicated write there, where each ``ack`` is one) and returns, per
  message, None or the error ``ack`` would have raised for it: one refused or expired handle must not hide whether
  the others were acked (RocketMQ 5's gRPC AckMessage answers per entry too). It raises only when a whole request
  fails; acking again is safe then, a message acked already answers None.
* **Handles are per delivery.** ``ack`` and ``change_invisible_duration`` take the message ``receive`` returned;
  ``change_invisible_duration`` returns the message with its new receipt handle, and only that one acks it from
  then on (the old handle is refused, ``NoMessageError``, as one whose invisible time is over is).
* **Membership.** The consumer heartbeats its group and subscriptions to every node routing its topics (consume
  type ``CONSUME_POP``, RocketMQ 5's), so the group is known and shown by ``raftmq admin``.
* Tags codes can collide: a message the broker's tag filter let through but whose tag the subscription does not
  want is acked here and not returned, as a pull consumer drops it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import cbor2
import trio

from client.errors import ClientClosedError
from client.filter import TAG, MessageSelector, Subscription, parse_subscription
from client.instance import (ClientConfig, ClientInstance, build_config, open_client_nursery, open_remoting,
                             raise_for_response)
from client.message import (DEFAULT_MAX_INFLATED_BODY, I32_MAX, MAX_INFLATED_BODY, MessageExt, check_int_arg)
from client.pull_consumer import _to_messages
from client.rebalance import consumer_heartbeat_data
from remoting.codec import Frame
from remoting.codes import RequestCode, ResponseCode
from remoting.config import bounded
from remoting.errors import RaftMQError, for_code
from remoting.message import (RETRY_GROUP_TOPIC_PREFIX, MessageFormatError, decode_records, group_problem,
                              split_pop_retry_topic)

__all__ = ["SimpleConsumer", "SimpleConsumerConfig", "ReceivedMessage", "open_simple_consumer"]

log = logging.getLogger(__name__)

MAX_RECEIVE = 32  # the brokers' most messages of one POP
MAX_BATCH_ACK = 1024  # the brokers' most receipt handles of one BATCH_ACK_MESSAGE
_FROM_WHERE = {"CONSUME_FROM_LAST_OFFSET": 1, "CONSUME_FROM_FIRST_OFFSET": 0}  # -> the POP's init_mode
# How often receives finding no readable queue (a write-only topic) ask the name servers for the routes again, at
# most (``poll_name_server_interval_ms`` if shorter): read permission coming back is seen within a second, and a
# loop of receives costs the name servers a query a second, not one per receive.
_NO_QUEUE_REFRESH_S = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class ReceivedMessage(MessageExt):
    """A received message: a ``MessageExt`` (its topic the subscribed one, also when it comes back from the group's
    retry topic) with the receipt handle that acks it."""

    receipt_handle: str = ""


@dataclasses.dataclass(frozen=True)
class SimpleConsumerConfig(ClientConfig):
    consumer_group: str = bounded("DEFAULT_CONSUMER", check=group_problem)
    await_duration_ms: int = bounded(5_000, min=0, max=I32_MAX,
                                     doc="how long a receive waits for a message when none is visible (0: not)")
    consume_from_where: str = bounded("CONSUME_FROM_LAST_OFFSET", choices=tuple(_FROM_WHERE),
                                      doc="where the group starts in a queue it never consumed: its last or first "
                                          "offset")
    check_crc: bool = bounded(False, doc="recompute each received body's crc32c")
    max_inflated_body_size_bytes: int = bounded(DEFAULT_MAX_INFLATED_BODY, min=1, max=MAX_INFLATED_BODY,
                                                doc="most a compressed body is inflated to; a larger one is "
                                                    "delivered as stored, compressed, and logged")


class SimpleConsumer:
    def __init__(self, config: SimpleConsumerConfig, instance: ClientInstance,
                 subscriptions: Mapping[str, Subscription]) -> None:
        self.config = config
        self._instance = instance
        self._subs = dict(subscriptions)
        self._turn = itertools.count()
        self._next_refresh_at = -math.inf  # when _wait_for_targets may ask the name servers again
        self._refreshed: trio.Event | None = None  # set once the last refresh _wait_for_targets started is over
        self._unrouted_retry_at: dict[str, float] = {}  # subscribed topic with no route -> when to ask again

    @property
    def client_id(self) -> str:
        return self._instance.client_id

    @property
    def subscriptions(self) -> dict[str, Subscription]:
        return dict(self._subs)

    def heartbeat_data(self) -> dict[str, Any]:
        return consumer_heartbeat_data(self.config.consumer_group, "CONSUME_POP", "CLUSTERING",
                                       self.config.consume_from_where, self._subs.values())

    # --- receive -----------------------------------------------------------------------------------------------
    async def receive(self, max_messages: int = 16, invisible_duration_ms: int = 30_000) -> list[ReceivedMessage]:
        """Up to ``max_messages`` (1..32) messages of the subscribed topics, each invisible to the group for
        ``invisible_duration_ms``; an empty list when none came within ``await_duration_ms``."""
        check_int_arg("max_messages", max_messages, 1, MAX_RECEIVE)
        check_int_arg("invisible_duration_ms", invisible_duration_ms, 1, I32_MAX)
        if self._instance.closed:
            raise ClientClosedError("the simple consumer is closed")
        poll_time_ms = self.config.await_duration_ms
        targets = await self._targets()
        if not targets:
            # Not [] at once: a ``while True: receive()`` loop would never yield to trio (no heartbeat, no route
            # refresh: the member drops out of its group and never sees read permission come back).
            deadline = trio.current_time() + poll_time_ms / 1000
            targets = await self._wait_for_targets(deadline)
            poll_time_ms = int((deadline - trio.current_time()) * 1000)  # what is left of this receive's wait
            if not targets:
                return []
        first = next(self._turn)
        failed: RaftMQError | None = None
        answered: list[tuple[str, str]] = []  # the targets that did not fail, in turn
        for i in range(len(targets)):
            topic, broker_name = targets[(first + i) % len(targets)]
            try:
                got = await self._pop(topic, broker_name, max_messages, invisible_duration_ms, 0)
            except RaftMQError as e:
                if not _target_failure(e):
                    raise
                log.debug("receive failed topic=%s broker_name=%s error=%s", topic, broker_name, e)
                failed = e
                continue
            if got:
                return got
            answered.append((topic, broker_name))
        if not answered:
            assert failed is not None
            raise failed  # no group answered: waiting at one would only fail again
        if poll_time_ms <= 0:
            return []
        topic, broker_name = answered[0]  # the one whose turn it is, or the next that answered
        try:
            return await self._pop(topic, broker_name, max_messages, invisible_duration_ms, poll_time_ms)
        except RaftMQError as e:
            if not _target_refused(e):
                raise
            # Deleted, or read permission taken, since the quick pass: the others answered, so this is no failure
            # of the receive; the next one's quick pass finds the target failing and polls another.
            log.debug("receive long poll refused topic=%s broker_name=%s error=%s", topic, broker_name, e)
            return []

    async def _targets(self) -> list[tuple[str, str]]:
        """The (topic, broker group) pairs holding readable queues of the subscribed topics, in a stable order.

        A topic not routed yet (or whose route was dropped, deleted: ``client/route.py``) is asked for here once; if
        that fails (not created yet, name servers silent) it is asked for again in the background (``refresh_soon``)
        every ``poll_name_server_interval_ms``, and the other topics are received meanwhile: one subscribed topic
        that did not exist yet made every receive raise, so no other topic was ever received. Only when no subscribed
        topic has a route is each asked here again, and the last failure raised."""
        routes = self._instance.routes
        topics = sorted(self._subs)
        nothing_routed = all(routes.cached(topic) is None for topic in topics)
        now = trio.current_time()
        interval_s = self.config.poll_name_server_interval_ms / 1000
        failed: RaftMQError | None = None
        for topic in topics:
            if routes.cached(topic) is not None:
                continue
            retry_at = self._unrouted_retry_at.get(topic)
            if retry_at is None or nothing_routed:
                try:
                    await routes.get(topic)
                    continue
                except RaftMQError as e:
                    failed = e
                    if retry_at is None or now >= retry_at:  # logged once per interval, however many receives
                        log.warning("subscribed topic has no route (not created yet?); the others are received, it is "
                                    "asked for again every %g s topic=%s error=%s", interval_s, topic, e)
                        self._unrouted_retry_at[topic] = now + interval_s
            elif now >= retry_at:
                self._unrouted_retry_at[topic] = now + interval_s
                self._instance.refresh_soon(topic)
        if failed is not None and all(routes.cached(topic) is None for topic in topics):
            raise failed
        return self._cached_targets()

    def _cached_targets(self) -> list[tuple[str, str]]:
        """``_targets`` from the cached routes only: a topic not routed yet has no readable queue known."""
        routes = self._instance.routes
        out = []
        for topic in sorted(self._subs):
            route = routes.cached(topic)
            if route is not None:
                out.extend((topic, name) for name in sorted({mq.broker_name for mq in route.read_queues()}))
        return out

    async def _wait_for_targets(self, deadline: float) -> list[tuple[str, str]]:
        """No subscribed topic has a readable queue in the cached routes (made write-only, or routed with no
        queues): have the routes refreshed, at most every ``_NO_QUEUE_REFRESH_S`` across receives and one refresh
        at a time, until one has, or until ``deadline``. Always yields to trio at least once."""
        while True:
            refreshed = self._refreshed
            if (refreshed is None or refreshed.is_set()) and trio.current_time() >= self._next_refresh_at:
                self._next_refresh_at = trio.current_time() + min(_NO_QUEUE_REFRESH_S,
                                                                  self.config.poll_name_server_interval_ms / 1000)
                if self._instance.closed:  # while this receive waited: its background takes no more tasks
                    raise ClientClosedError("the simple consumer is closed")
                refreshed = self._refreshed = trio.Event()
                self._instance.nursery.start_soon(self._refresh_routes, refreshed)
            with trio.move_on_at(deadline):  # past already with await_duration_ms=0: then one checkpoint
                if refreshed is not None and not refreshed.is_set():
                    await refreshed.wait()
                else:
                    await trio.sleep_until(self._next_refresh_at)
            targets = self._cached_targets()
            if targets or trio.current_time() >= deadline:
                return targets

    async def _refresh_routes(self, refreshed: trio.Event) -> None:
        routes = self._instance.routes
        try:
            for topic in sorted(self._subs):
                try:
                    await routes.refresh(topic)
                except RaftMQError as e:  # the route stands (a deleted topic's for a while); asked again next
                    log.info("route refresh for a topic with no readable queue failed topic=%s error=%s",
                             topic, e)
        finally:
            refreshed.set()

    async def _pop(self, topic: str, broker_name: str, max_messages: int, invisible_duration_ms: int,
                   poll_time_ms: int) -> list[ReceivedMessage]:
        sub = self._subs[topic]
        ext: dict[str, Any] = {"consumer_group": self.config.consumer_group, "topic": topic, "queue_id": -1,
                               "max_msg_nums": max_messages, "invisible_time_ms": invisible_duration_ms,
                               "poll_time_ms": poll_time_ms, "init_mode": _FROM_WHERE[self.config.consume_from_where],
                               "subscription": sub.expression}
        if sub.expression_type != TAG:
            ext["expression_type"] = sub.expression_type
        frame = await self._leader_invoke(broker_name, topic, RequestCode.POP_MESSAGE, ext,
                                          timeout_s=self._instance.timeout_s + poll_time_ms / 1000,
                                          ok=(ResponseCode.SUCCESS, ResponseCode.PULL_NOT_FOUND))
        if frame.code != ResponseCode.SUCCESS or not frame.body:
            return []
        handles = frame.ext.get("receipt_handles")
        try:
            records = decode_records(frame.body, check_crc=self.config.check_crc)
        except (MessageFormatError, ValueError) as e:
            raise _malformed(broker_name, topic, f"its records cannot be read: {e}") from None
        if (not isinstance(handles, list) or len(handles) != len(records)
                or not all(isinstance(h, str) and h for h in handles)):
            raise _malformed(broker_name, topic, f"{len(records)} records came with receipt handles {handles!r:.200}")
        out: list[ReceivedMessage] = []
        for msg, handle in zip(_to_messages(records, broker_name, self.config.max_inflated_body_size_bytes), handles):
            received = _received(msg, handle)
            if not sub.matches_all and not sub.matches(received.tags):
                await self._ack_unwanted(received)
                continue
            out.append(received)
        return out

    async def _ack_unwanted(self, msg: ReceivedMessage) -> None:
        try:
            await self.ack(msg)
        except RaftMQError as e:
            # Not acked, it comes back after its invisible time and is dropped again (or ends in the DLQ).
            log.info("unwanted message (tag %r) not acked topic=%s error=%s", msg.tags, msg.topic, e)

    # --- ack and change ----------------------------------------------------------------------------------------
    async def ack(self, msg: ReceivedMessage) -> None:
        """Acknowledge ``msg``: it is not delivered again. ``NoMessageError`` once its invisible time is over (it is
        delivered again) or its handle was superseded by ``change_invisible_duration``."""
        _check_received(msg)
        ext = {"consumer_group": self.config.consumer_group, "topic": msg.topic, "receipt_handle": msg.receipt_handle}
        await self._leader_invoke(msg.broker_name, msg.topic, RequestCode.ACK_MESSAGE, ext)

    async def ack_batch(self, msgs: Iterable[ReceivedMessage]) -> list[RaftMQError | None]:
        """Acknowledge ``msgs`` with one request per broker group (per 1,024 messages); per message, in order, None
        when it is acked (or was already), else the error ``ack`` would have raised for it: ``NoMessageError`` once
        its invisible time is over or its handle was superseded, ``InvalidRequestError`` for a handle the broker
        refuses. Raises only when a whole request fails (the broker group's leader cannot be reached, the request is
        refused): the acks of the requests answered before stand, and acking them all again is safe."""
        msgs = list(msgs)
        for msg in msgs:
            _check_received(msg)
        results: list[RaftMQError | None] = [None] * len(msgs)
        group = self.config.consumer_group
        for broker_name, indexes in _ack_batches(msgs):
            topic = msgs[indexes[0]].topic  # any of them: it finds the broker group's route
            body = cbor2.dumps([msgs[i].receipt_handle for i in indexes])
            frame = await self._leader_invoke(broker_name, topic, RequestCode.BATCH_ACK_MESSAGE,
                                              {"consumer_group": group}, body=body)
            for i, result in zip(indexes, _batch_ack_results(frame, broker_name, [msgs[i].topic for i in indexes])):
                results[i] = result
        return results

    async def change_invisible_duration(self, msg: ReceivedMessage, invisible_duration_ms: int) -> ReceivedMessage:
        """Make ``msg`` invisible for ``invisible_duration_ms`` from now; returns it with its new receipt handle,
        the one to ack it with from now on."""
        _check_received(msg)
        check_int_arg("invisible_duration_ms", invisible_duration_ms, 1, I32_MAX)
        ext = {"consumer_group": self.config.consumer_group, "topic": msg.topic, "receipt_handle": msg.receipt_handle,
               "invisible_time_ms": invisible_duration_ms}
        frame = await self._leader_invoke(msg.broker_name, msg.topic, RequestCode.CHANGE_MESSAGE_INVISIBLETIME, ext)
        handle = frame.ext.get("receipt_handle")
        if not isinstance(handle, str) or not handle:
            raise _malformed(msg.broker_name, msg.topic, f"receipt_handle {handle!r:.100} is not a handle")
        return dataclasses.replace(msg, receipt_handle=handle)

    # --- requests ----------------------------------------------------------------------------------------------
    async def _leader_invoke(self, broker_name: str, topic: str, code: int, ext: dict[str, Any], *, body: bytes = b"",
                             timeout_s: float | None = None, ok: Sequence[int] = (ResponseCode.SUCCESS,)) -> Frame:
        """Invoke on the group's leader, following NOT_LEADER's hint, or the next node after a lost connection,
        a few times before giving up with the last error."""
        inst = self._instance
        if inst.routes.master_addr(broker_name) is None:
            await inst.routes.get(topic)
        tries = len(inst.routes.replica_addrs(broker_name)) + 2
        while True:
            addr = inst.master_addr(broker_name)
            try:
                frame = await inst.invoke(addr, code, ext, body, timeout_s=timeout_s)
                return raise_for_response(frame, ok=ok, topic=topic, broker_name=broker_name)
            except RaftMQError as e:
                inst.on_error(e, topic, broker_name, addr)
                tries -= 1
                if not e.retriable or tries <= 0:
                    raise
                if not getattr(e, "leader_addr", None):
                    await trio.sleep(0.1)  # an election in progress: no node names a leader yet


def _target_refused(error: RaftMQError) -> bool:
    """Whether ``error`` refuses the topic at that broker group only: deleted (TOPIC_NOT_EXIST, which is not
    retriable) or not readable there (NO_PERMISSION). The route is refreshed (``on_error``); the other topics and
    groups are received meanwhile."""
    return getattr(error, "code", None) in (ResponseCode.TOPIC_NOT_EXIST, ResponseCode.NO_PERMISSION)


def _target_failure(error: RaftMQError) -> bool:
    """Whether ``error`` from one (topic, broker group) leaves the others to be asked: it is retriable, or refuses
    that topic there only (``_target_refused``). Anything else (the group unknown, a bad request) is raised."""
    return bool(error.retriable) or _target_refused(error)


def _received(msg: MessageExt, handle: str) -> ReceivedMessage:
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(MessageExt)}
    pop_retry = split_pop_retry_topic(msg.topic)
    if pop_retry is not None:
        values["topic"] = pop_retry[1]  # %RETRY%<group>+<topic>: the name says which topic it came back to
    return ReceivedMessage(**values, receipt_handle=handle)


def _check_received(msg: Any) -> None:
    if not isinstance(msg, ReceivedMessage) or not msg.receipt_handle:
        raise TypeError(f"msg must be a message receive() returned (a ReceivedMessage), got {type(msg).__name__}")


def _ack_batches(msgs: Sequence[ReceivedMessage]) -> list[tuple[str, list[int]]]:
    """The requests ``ack_batch`` sends: (broker group, indexes into ``msgs``), a broker group's messages in their
    order, at most ``MAX_BATCH_ACK`` a request; broker groups in the order their first message comes."""
    by_broker: dict[str, list[int]] = {}
    for i, msg in enumerate(msgs):
        by_broker.setdefault(msg.broker_name, []).append(i)
    return [(broker_name, indexes[start:start + MAX_BATCH_ACK]) for broker_name, indexes in by_broker.items()
            for start in range(0, len(indexes), MAX_BATCH_ACK)]


def _batch_ack_results(frame: Frame, broker_name: str, topics: Sequence[str]) -> list[RaftMQError | None]:
    """Per handle of a BATCH_ACK_MESSAGE answer (``topics``: its messages' topics, in order): None when acked, else
    the error its code names."""
    topic, count = topics[0], len(topics)
    try:
        entries = cbor2.loads(frame.body)
    except Exception as e:  # cbor2 raises several unrelated types on garbage
        raise _malformed(broker_name, topic, f"its batch ack answer is not CBOR: {e}") from None
    if not isinstance(entries, list) or len(entries) != count:
        raise _malformed(broker_name, topic, f"{count} receipt handles were answered with {entries!r:.200}")
    out: list[RaftMQError | None] = []
    for entry, entry_topic in zip(entries, topics):
        code = entry.get("code") if isinstance(entry, dict) else None
        if type(code) is not int:
            raise _malformed(broker_name, topic, f"a batch ack entry has no response code: {entry!r:.200}")
        remark = entry.get("remark")
        out.append(None if code == ResponseCode.SUCCESS else
                   for_code(code, remark if isinstance(remark, str) else None, topic=entry_topic,
                            broker_name=broker_name))
    return out


def _malformed(broker_name: str, topic: str, problem: str) -> RaftMQError:
    return for_code(ResponseCode.SYSTEM_ERROR, f"malformed POP answer from broker group {broker_name!r} for topic "
                                               f"{topic!r}: {problem}")


def _parse_subscriptions(subscriptions: Any) -> dict[str, Subscription]:
    if not isinstance(subscriptions, Mapping) or not subscriptions:
        raise ValueError(f"subscriptions must be a non-empty mapping of topic -> tag expression or MessageSelector, "
                         f"got {subscriptions!r:.100}")
    out = {}
    for topic, expression in subscriptions.items():
        if not isinstance(topic, str) or topic.startswith(RETRY_GROUP_TOPIC_PREFIX):
            raise ValueError(f"subscriptions: {topic!r:.100} is not a topic to subscribe to (retry topics are read "
                             f"with their topic)")
        if expression is not None and not isinstance(expression, (str, MessageSelector)):
            raise ValueError(f"subscriptions[{topic!r}] must be a tag expression or a MessageSelector, got "
                             f"{expression!r:.100}")
        out[topic] = parse_subscription(topic, expression)
    return out


@contextlib.asynccontextmanager
async def open_simple_consumer(namesrv: str | Sequence[str] | None = None, *, subscriptions: Mapping[str, Any],
                               **options: Any) -> AsyncIterator[SimpleConsumer]:
    """A ``SimpleConsumer`` of ``options['consumer_group']`` for ``subscriptions`` (topic -> tag expression or
    ``MessageSelector``); other options are ``SimpleConsumerConfig``'s."""
    subs = _parse_subscriptions(subscriptions)
    if namesrv is not None:
        options["namesrv"] = namesrv
    config: SimpleConsumerConfig = build_config(SimpleConsumerConfig, options)
    async with open_remoting(config) as remoting:
        async with open_client_nursery() as nursery:
            instance = ClientInstance(config, remoting, nursery)
            consumer = SimpleConsumer(config, instance, subs)
            instance.heartbeat_data = consumer.heartbeat_data
            for topic in subs:
                try:
                    await instance.routes.get(topic)  # so the first heartbeat reaches the topics' nodes
                except RaftMQError as e:
                    log.info("subscribed topic has no route yet topic=%s error=%s", topic, e)
            instance.start_background()
            try:
                yield consumer
            finally:
                instance.stop_background()
                instance.closed = True
                nursery.cancel_scope.cancel()
