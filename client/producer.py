"""The producer: ``async with open_producer(namesrv=...) as producer: await producer.send(msg)``.

Sending rules (RocketMQ's ``DefaultMQProducerImpl.sendDefaultImpl``, adapted to Raft groups):
- Pick a queue round-robin, avoiding groups the fault tracker marks slow or failed, and on a retry the group
  that just failed, so a retry goes to another group where one exists.
- A NOT_LEADER answer with a leader address is a *redirect*, not a failure: the same queue is tried at once at
  that address (bounded by ``max_redirects``), and the route is refreshed in the background. Once the redirects
  run out, the answer is a retriable failure like any other: the retry picks a queue of another group.
- A retriable failure (connection lost, timeout, busy, no leader yet) is retried up to ``retry_times`` times
  with a short growing pause, all within the send's deadline; anything else is raised at once. The one exception:
  when the only group the send may use (its queue pinned by ``queue`` or ``sharding_key``, or the only group with
  writable queues) is electing a leader (NOT_LEADER without a hint, connection refused or lost), the send waits
  for the new leader, trying every ``retry_backoff_ms`` until its deadline; those tries are counted apart ("N of
  them waiting for a leader to be elected" in ``SendFailedError``) and spend no retry.
- The deadline (``send_msg_timeout_ms`` or ``timeout_s``) covers the route too: the name-server query of a topic
  not cached yet, and the cluster-info query of the stand-in route of a topic no name server knows (which the
  first send creates on the brokers). A deadline that passes there raises ``SendFailedError`` as any other.
- ``send_oneway`` is not retried; it returns once its message is queued on the leader's connection, and raises
  ``RequestTimeoutError`` if that (its route fetched first, a stand-in route for a topic no name server knows, as
  ``send``'s) takes longer than ``send_msg_timeout_ms`` (a stopped leader's queue stays full);
  the time it took, or its failure, is told to the fault tracker as a send's is, so the next oneway avoids a group
  whose leader left one waiting.
- Concurrency is the caller's: start many ``send`` calls at once (from a nursery); they share
  one connection per node, with many requests in flight on it.
- Closing (leaving ``open_producer``'s block) refuses new sends at once (``ClientClosedError``: not sent), then waits
  up to ``send_msg_timeout_ms`` (shielded: also when the block ends by cancellation) for the sends already in flight,
  auto batches included, to be answered, and only then closes the connections. A send whose request went out and
  was still unanswered then fails with ``SendFailedError`` saying its outcome is unknown (it may be stored): not
  ``ClientClosedError``, which a caller reads as "not sent", and sends again (300 sends closed 20 ms after they
  began: 44 got "closed", all 300 were stored).
- A single send (``send``, ``send_oneway``, a half message) whose body has at least ``compress_msg_body_over_howmuch``
  bytes (4 KiB) carries it zlib-compressed (``compress_level`` 5) with sys_flag COMPRESSED_FLAG, if that is smaller
  (RocketMQ's tryToCompressMessage). The store keeps it so, on every node; consumers inflate it. A batch, and an
  auto-batched send, is not compressed, as in RocketMQ. max_message_size_bytes limits the body given, before
  compression, as RocketMQ's client does.

Transactions (RocketMQ's TransactionMQProducer as an option of the one producer, since it only adds a listener to
a producer's sends): ``open_producer(..., transaction_listener=listener)`` enables ``send_in_transaction``, which
sends the message as a half message (property TRAN_MSG, sys flag PREPARED; as any single send, with retries),
runs ``listener.execute`` and sends END_TRANSACTION with its outcome to the current leader of the group that
stored the half (followed by broker name, NOT_LEADER hints included). The same producer answers the broker's
CHECK_TRANSACTION_STATE with ``listener.check`` in a task of its own (a connection's reader must not wait for it),
at most ``transaction_check_concurrency`` at a time. An END that fails is logged, not raised: the broker checks
back (``broker/transaction.py``).

Request-reply (RocketMQ 4.6's DefaultMQProducer.request): ``await producer.request(msg, timeout_s=...)`` sends
``msg`` as a single send stamped with CORRELATION_ID (fresh), REPLY_TO_CLIENT (this client's id), TTL (the timeout
in ms) and CLUSTER (its broker group's cluster, from the route: RocketMQ's broker stamps it on every message, which
would cost raftmq's send path a property rewrite), and returns the reply as a ``MessageExt``. The consumer that
gets the request answers with ``send(create_reply_message(msg, body))``: a producer sends a reply as
SEND_REPLY_MESSAGE to a group of the cluster's reply topic (picked as any send's queue, as RocketMQ does); that
group's leader stores it and pushes it to this client over the connection this producer's heartbeats came on
(PUSH_REPLY_MESSAGE_TO_CLIENT, ``broker/processor/reply.py``). So before a request goes out, every leader of the
reply topic's route (and of the request's) has had a heartbeat over the connection now open to it
(``ClientInstance.heartbeat_needed``), as RocketMQ's prepareSendRequest heartbeats before a first request. The
waiting requests are ``PendingRequests``, by correlation id: an entry lives as long as its ``request`` call, so a
timeout or a cancellation leaves nothing behind, and a reply nothing waits for is dropped (logged at INFO).
There is no callback form (RocketMQ's request(msg, RequestCallback, timeout)): a caller that wants to go on while a
reply comes starts the ``request`` in a task of its own nursery, which also bounds how long it may run.
``PendingRequests``, ``read_reply`` (a pushed reply's reading) and ``prepare_request`` (cluster, queue, heartbeats)
live in ``client/request_reply.py``, as they need no producer; ``PendingRequests`` and ``read_reply`` are
re-exported here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import trio

from client.accumulator import ProduceAccumulator
from client.errors import ClientClosedError, MessageTooLargeError, NoRouteError, ReplyTimeoutError, SendFailedError
from client.instance import (
    HOUR_MS, ClientConfig, ClientInstance, ServerRequests, build_config, now_ms, open_client_nursery, open_remoting,
    raise_for_response,
)
from client.message import (MAX_INFLATED_BODY, PROPERTY_UNIQ_KEY, Message, MessageExt, MessageQueue, SendResult,
                            SendStatus, _NewSendResult, batch_entry_overhead, check_queue, check_seconds,
                            is_reply_message, new_uniq_key)
# Request-reply's parts that need no producer; PendingRequests and read_reply re-exported, as they were defined here.
from client.request_reply import PendingRequests, prepare_request, read_reply
from client.route import TopicPublishInfo
from client.send_ext import SendExt, SendExtEncoder, ext_fields
from client.trace import TRACE_TOPIC, open_trace_dispatcher
from client.transaction import (TransactionListener, TransactionSendResult, TransactionState, end_transaction_ext,
                                read_check_request)
from remoting.codec import Frame
from remoting.codes import RequestCode, ResponseCode
from remoting.config import ConfigError, bounded
from remoting.errors import (ConnectError, ConnectionClosedError, NotLeaderError, RaftMQError, RequestTimeoutError,
                             for_code)
from remoting.message import (BATCH_HEAD, COMPRESSED_FLAG, I32, MAX_PROPERTIES_SIZE, PROPERTY_PRODUCER_GROUP,
                              PROPERTY_TRANSACTION_PREPARED, TIMER_PROPERTIES, TRANSACTION_PREPARED_TYPE,
                              MessageFormatError,
                              check_topic, encode_uniform_batch, group_problem, ip_bytes, topic_problem)
from remoting.message import (PROPERTY_CLUSTER, PROPERTY_CORRELATION_ID, PROPERTY_MESSAGE_REPLY_TO_CLIENT,
                              PROPERTY_MESSAGE_TTL)

__all__ = ["ProducerConfig", "Producer", "open_producer", "open_producer_from_config", "PendingRequests",
           "read_reply"]

log = logging.getLogger(__name__)

_SEND_STATUS = {
    ResponseCode.SUCCESS: SendStatus.SEND_OK,
    ResponseCode.FLUSH_DISK_TIMEOUT: SendStatus.FLUSH_DISK_TIMEOUT,
    ResponseCode.FLUSH_SLAVE_TIMEOUT: SendStatus.FLUSH_SLAVE_TIMEOUT,
    ResponseCode.SLAVE_NOT_AVAILABLE: SendStatus.SLAVE_NOT_AVAILABLE,
}


# Errors that mean "this group's leader is changing", not "this group is broken".
_LEADER_IN_FLUX = (NotLeaderError, ConnectError, ConnectionClosedError)

# END_TRANSACTION answers that are outcomes, not failures: done now, or decided before (broker/transaction.py).
_END_OK = (ResponseCode.SUCCESS, ResponseCode.TRANSACTION_SHOULD_COMMIT, ResponseCode.TRANSACTION_SHOULD_ROLLBACK,
           ResponseCode.TRANSACTION_STATE_UNKNOW)


# The frame header of a send besides its properties (codes, ids, topic, group, timestamps): a few hundred bytes.
_FRAME_HEADER_ALLOWANCE_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class ProducerConfig(ClientConfig):
    producer_group: str = bounded("DEFAULT_PRODUCER", check=group_problem)
    send_msg_timeout_ms: int = bounded(3_000, min=1, max=HOUR_MS, doc="deadline of one send, retries included")
    retry_times_when_send_failed: int = bounded(2, min=0, max=100)
    max_redirects: int = bounded(5, min=0, max=100, doc="NOT_LEADER redirects followed per send")
    retry_backoff_ms: int = bounded(50, min=0, max=60_000, doc="pause before the n-th retry: n * retry_backoff_ms")
    max_message_size_bytes: int = bounded(4 * 1024 * 1024, min=1, max=MAX_INFLATED_BODY)  # as a store's max
    send_latency_fault_enable: bool = True
    default_topic_queue_nums: int = bounded(4, min=1, max=1024,
                                            doc="queues per group of a topic created by its first send (at most "
                                                "the broker's default_topic_queue_nums)")
    # RocketMQ 5's autoBatch (client/accumulator.py): concurrent send() calls share batch requests.
    auto_batch: bool = False
    auto_batch_max_messages: int = bounded(64, min=1, max=1024, doc="messages per auto batch")
    auto_batch_max_bytes: int = bounded(64 * 1024, min=1024, max=4 * 1024 * 1024,
                                        doc="bodies + properties per auto batch; a bigger message goes alone")
    auto_batch_max_keys: int = bounded(1024, min=1, max=1 << 20,
                                       doc="index keys (each message's UNIQ_KEY and keys of KEYS) per auto batch; a "
                                           "message with more goes in a batch of its own")
    auto_batch_max_in_flight: int = bounded(2, min=1, max=64,
                                            doc="batches of one topic/queue in flight before messages wait")
    auto_batch_max_delay_ms: int = bounded(10, min=0, max=10_000,
                                           doc="longest a message waits for a batch slot (batchMaxDelayMs)")
    transaction_check_concurrency: int = bounded(16, min=1, max=1024,
                                                 doc="broker checks of local transactions answered at once "
                                                     "(TransactionListener.check)")
    # RocketMQ's compressMsgBodyOverHowmuch and compressLevel: a single send's body this long or longer is sent and
    # stored zlib-compressed (sys_flag COMPRESSED_FLAG) when that makes it smaller. 0 tries every body; the
    # maximum turns it off. Batches (send_batch, auto_batch) are never compressed, as RocketMQ's.
    compress_msg_body_over_howmuch: int = bounded(4096, min=0, max=I32[1],
                                                  doc="bytes from which a single send's body is compressed")
    compress_level: int = bounded(5, min=0, max=9, doc="zlib level of compressed bodies")
    max_pending_requests: int = bounded(10_000, min=1, max=1_000_000,
                                        doc="requests (Producer.request) waiting for their replies at once; one more "
                                            "raises TooManyRequestsError")
    # RocketMQ's enableMsgTrace / customizedTraceTopic (client/trace.py): each send's trace goes to trace_topic.
    enable_msg_trace: bool = bounded(False, doc="record each send's trace and send it to trace_topic")
    trace_topic: str = bounded(TRACE_TOPIC, check=topic_problem, doc="the topic traces go to")

    def __post_init__(self) -> None:
        super().__post_init__()
        # A send of the largest message taken must fit one frame: its body (or batch body), properties and header.
        # With a smaller max_frame_size_bytes such sends failed at the connection, "frame of N bytes exceeds ...".
        need = self.max_message_size_bytes + MAX_PROPERTIES_SIZE + _FRAME_HEADER_ALLOWANCE_BYTES
        if self.max_frame_size_bytes < need:
            raise ConfigError(f"max_frame_size_bytes must be >= {need} (a message of max_message_size_bytes "
                              f"{self.max_message_size_bytes} with its properties and header), got "
                              f"{self.max_frame_size_bytes}")


@dataclasses.dataclass(slots=True)
class ProducerStatistics:
    sent: int = 0
    failed: int = 0
    retries: int = 0
    redirects: int = 0
    auto_batches: int = 0  # requests that carried auto-batched sends


def _oneway_timeout(addr: str, code: int, timeout_s: float) -> RequestTimeoutError:
    error = RequestTimeoutError(addr, timeout_s, code)
    # Its own words: no answer was awaited, and nothing was sent.
    error.args = (f"the oneway request code {int(code)} to {addr} was not sent within send_msg_timeout_ms "
                  f"({timeout_s:g} s): no connection opened, or the connection's write queue stayed full (the node "
                  f"reads nothing: stopped, or cut off)",)
    return error


def _route_timeout(topic: str, timeout_s: float, what: str) -> trio.TooSlowError:
    """What a send reports (as ``SendFailedError.last_error``) when its deadline passed while the name servers were
    asked for ``what`` it needed."""
    return trio.TooSlowError(f"send timed out after {timeout_s:.3f}s while fetching {what} of topic {topic!r} from "
                             f"the name servers")


class Producer:
    def __init__(self, config: ProducerConfig, instance: ClientInstance,
                 transaction_listener: TransactionListener | None = None) -> None:
        self.config = config
        self._instance = instance
        self._listener = transaction_listener
        self._check_limiter = trio.CapacityLimiter(config.transaction_check_concurrency)
        self._stats = ProducerStatistics()
        self._ext = SendExtEncoder(config.producer_group)
        self._accumulator = ProduceAccumulator(self, instance.nursery) if config.auto_batch else None
        self._pending = PendingRequests(config.max_pending_requests)
        self._closing = False  # close() began: new sends are refused, those in flight finish
        self._sending = 0  # calls in _send_with_retries
        self._idle: trio.Event | None = None  # set when the last send in flight ends, while close waits for it
        # Per topic on a stand-in route, the groups that answered a send on it (_stand_in_answered).
        self._stand_in_groups: dict[str, set[str]] = {}
        instance.heartbeat_data = lambda: {"producers": [{"producer_group": config.producer_group}],
                                           "consumers": []}

    @property
    def client_id(self) -> str:
        return self._instance.client_id

    @property
    def routes(self):
        return self._instance.routes

    def statistics(self) -> ProducerStatistics:
        stats = dataclasses.replace(self._stats)
        if self._accumulator is not None:
            stats.auto_batches = self._accumulator.batches_sent
        return stats

    # -- public API -----------------------------------------------------------------------------------------------
    async def send(self, message: Message, *, queue: MessageQueue | None = None, sharding_key: str | None = None,
                   timeout_s: float | None = None) -> SendResult:
        """Send and wait until the group committed it. ``queue`` pins the queue (no retry elsewhere);
        ``sharding_key`` picks one queue by hash, so equal keys stay in order (ordered send). With
        ``auto_batch`` the message may travel in one request with other concurrent sends (its own result all
        the same)."""
        self._check(message)
        self._check_routing(message.topic, queue, sharding_key, timeout_s)
        reply = is_reply_message(message)  # create_reply_message's: the broker pushes it to its requester
        if self._accumulator is not None and not reply and self._accumulator.takes(message):
            result = await self._accumulator.send(message, queue, sharding_key, timeout_s)
            if result is not None:
                return result
        body, sys_flag = self._single_body(message)
        if sys_flag:
            ext, uniq = self._flagged_ext(message, sys_flag)
        else:
            ext, uniq = self._ext.single(message, now_ms())
        return await self._send_with_retries(message.topic,
                                             RequestCode.SEND_REPLY_MESSAGE if reply else RequestCode.SEND_MESSAGE,
                                             ext, lambda mq, addr: body, (uniq,), queue, sharding_key, timeout_s,
                                             parked=_parked(message))

    async def send_batch(self, messages: Sequence[Message], *, queue: MessageQueue | None = None,
                         timeout_s: float | None = None) -> SendResult:
        """Send several messages of one topic as one request, stored consecutively in one queue."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError(f"send_batch expects a sequence of Message, got {type(messages).__name__}")
        if not messages:
            raise ValueError("send_batch needs at least one message")
        topic: str | None = None
        uniq_list = []
        items = []
        # One pass: each message checked, then encoded; the routing arguments once messages[0]'s topic is known.
        for i, m in enumerate(messages):
            self._check(m)
            if is_reply_message(m):
                raise ValueError(f"send_batch: messages[{i}] is a reply (create_reply_message); a reply goes alone "
                                 f"(send), so that the broker pushes it to its requester")
            if m.delay_level:
                raise ValueError(f"send_batch: messages[{i}].delay_level is {m.delay_level}; delayed messages go "
                                 f"one by one (send), as RocketMQ's batches")
            if m.topic != topic:
                if topic is not None:
                    raise ValueError(f"send_batch messages must share one topic: messages[{i}].topic is "
                                     f"{m.topic!r}, messages[0].topic is {topic!r}")
                topic = m.topic
                self._check_routing(topic, queue, None, timeout_s)
            try:
                item, uniq = m.batch_item()
            except MessageFormatError as e:
                raise ValueError(f"send_batch: messages[{i}]: {e}") from None
            uniq_list.append(uniq)
            items.append(item)
        assert topic is not None  # messages is not empty
        # The broker takes a batch body up to its max message size, as the encoded batch, headers included; beyond
        # the frame size the connection refused it ("frame of N bytes exceeds the maximum frame size").
        try:
            overhead = batch_entry_overhead(topic)
        except MessageFormatError as e:
            raise ValueError(f"send_batch: {e}") from None
        size = BATCH_HEAD.size + sum(len(body) + len(props) for body, props, _ in items) + len(items) * overhead
        if size > self.config.max_message_size_bytes:
            raise MessageTooLargeError(
                f"send_batch: {len(items)} messages take {size} bytes as one batch, more than max_message_size_bytes "
                f"{self.config.max_message_size_bytes}: send them in smaller batches", topic=topic,
                max_size=self.config.max_message_size_bytes)
        return await self._send_encoded_batch(topic, items, tuple(uniq_list), queue, None, timeout_s)

    async def _send_encoded_batch(self, topic: str, items: list[tuple[bytes, bytes, int]], uniqs: tuple[str, ...],
                                  queue: MessageQueue | None, sharding_key: str | None,
                                  timeout_s: float | None) -> SendResult:
        """One SEND_BATCH_MESSAGE of checked ``(body, encoded properties, flag)`` items (``send_batch`` and the
        auto-batch accumulator)."""
        born = now_ms()
        try:
            topic_bytes = check_topic(topic)
            client_host = (ip_bytes(self.config.client_ip, "client_ip"), 0)
        except MessageFormatError as e:
            raise ValueError(f"send_batch: {e}") from None

        def _body(mq: MessageQueue, addr: str) -> bytes:
            # Encoded once per attempt (the queue may change), with every field already checked.
            return encode_uniform_batch(topic_bytes, mq.queue_id, items, born, client_host, client_host)

        return await self._send_with_retries(topic, RequestCode.SEND_BATCH_MESSAGE, self._ext.batch(topic, born),
                                             _body, uniqs, queue, sharding_key, timeout_s)

    async def send_in_transaction(self, message: Message, arg: Any = None, *,
                                  timeout_s: float | None = None) -> TransactionSendResult:
        """Send ``message`` as a half message, run the listener's ``execute(message, arg)`` and end the transaction
        with its outcome (an exception in ``execute`` is UNKNOWN: the broker checks back). Consumers get the message
        only once it is committed. Not for delayed messages, nor batches. A failed half send raises (``execute``
        does not run); a failed END is logged, the broker then checks back."""
        if self._listener is None:
            raise ValueError("send_in_transaction needs a producer opened with transaction_listener=... (its check "
                             "answers the broker about transactions left unknown)")
        self._check(message)
        if is_reply_message(message):
            raise ValueError("send_in_transaction: the message is a reply (create_reply_message); send it with send")
        if message.delay_level:
            raise ValueError(f"send_in_transaction: Message.delay_level is {message.delay_level}; a transactional "
                             f"message may not be delayed (RocketMQ refuses it too)")
        if timer := [name for name in TIMER_PROPERTIES if name in message.properties]:
            raise ValueError(f"send_in_transaction: the message has a delivery time ({timer[0]}: Message."
                             f"deliver_time_ms or delay_ms); a transactional message may not be delayed (RocketMQ 5 "
                             f"refuses it too)")
        self._check_routing(message.topic, None, None, timeout_s)
        body, sys_flag = self._single_body(message)
        group = self.config.producer_group
        props = message.wire_properties()
        uniq = props.setdefault(PROPERTY_UNIQ_KEY, new_uniq_key())
        props[PROPERTY_TRANSACTION_PREPARED] = "true"
        props[PROPERTY_PRODUCER_GROUP] = group
        fields = ext_fields(group, message.topic, 0, now_ms(), message.flag, props, False)
        fields["sys_flag"] = TRANSACTION_PREPARED_TYPE | sys_flag
        half = await self._send_with_retries(message.topic, RequestCode.SEND_MESSAGE, SendExt(None, None, fields),
                                             lambda mq, addr: body, (uniq,), None, None, timeout_s, parked=True)
        state = await self._local_state(self._listener.execute, message, arg)
        ext = end_transaction_ext(group, uniq, half.offset_msg_id, half.queue_offset, state, from_check=False)
        try:
            await self._end_transaction(half.message_queue.broker_name, message.topic, ext)
        except RaftMQError as e:
            log.warning("end of transaction not delivered; the broker checks back transaction_id=%s state=%s "
                        "error=%s", uniq, state.value, e)
        return TransactionSendResult(half.send_status, half.msg_id, half.offset_msg_id, half.message_queue,
                                     half.queue_offset, half.msg_ids, state, uniq)

    async def send_oneway(self, message: Message, *, queue: MessageQueue | None = None) -> None:
        """Fire and forget: no acknowledgement, no retry; a lost connection loses the message. Returns once the
        message is queued on the leader's connection; one not queued within ``send_msg_timeout_ms`` of the call
        (no route yet, no connection yet, or one whose peer stopped reading, its write queue full) raises the retriable
        ``RequestTimeoutError`` having sent nothing, as RocketMQ's invokeOneway times out waiting for its
        semaphore. (Unbounded, it blocked for as long as a stalled leader kept its connection open.) A topic no
        name server knows is sent to as ``send`` sends to it, so that the broker creates it."""
        timeout = self.config.send_msg_timeout_ms / 1000
        deadline = trio.current_time() + timeout
        self._check(message)
        self._check_routing(message.topic, queue, None, None)
        body, sys_flag = self._single_body(message)
        props = message.wire_properties()
        props.setdefault(PROPERTY_UNIQ_KEY, new_uniq_key())
        info = await self._oneway_publish_info(message.topic, deadline, timeout)
        if queue is not None and queue not in info.queues:
            # No answer comes back to refuse it: the broker would drop the message without a word.
            groups = {mq.broker_name: mq.queue_id + 1 for mq in info.queues}  # queue ids run 0..n-1 per group
            raise ValueError(f"queue {queue} is not a write queue of topic {message.topic!r} (its route has "
                             f"{', '.join(f'{n} on {b}' for b, n in sorted(groups.items())) or 'none'})")
        faults = self._instance.faults if self.config.send_latency_fault_enable else None
        mq = queue or info.select(faults)
        ext = ext_fields(self.config.producer_group, message.topic, mq.queue_id, now_ms(), message.flag, props, False)
        ext["sys_flag"] = sys_flag
        if info.stand_in:  # as send's (_send_with_retries); with no answer to wait for, no refresh follows
            ext["default_topic_queue_nums"] = self.config.default_topic_queue_nums
        addr = self._instance.master_addr(mq.broker_name)
        code = RequestCode.SEND_REPLY_MESSAGE if is_reply_message(message) else RequestCode.SEND_MESSAGE
        started = trio.current_time()  # trio's clock, as the deadline
        try:
            # The connection sees this deadline as its wait's (remoting/connection.py): a wait for room that runs
            # out on a silent connection closes it, and meanwhile the leader watch counts the wait as a request.
            with trio.move_on_at(deadline) as waited:
                await self._instance.invoke_oneway(addr, code, ext, body)
            if waited.cancelled_caught:
                raise _oneway_timeout(addr, code, timeout)
        except RaftMQError as e:
            # Told to the fault tracker as a send's failure is (RocketMQ's sendDefaultImpl does for oneway too):
            # the next oneway picked a group whose leader had just left a send waiting its whole timeout.
            if faults is not None:
                faults.update(mq.broker_name, (trio.current_time() - started) * 1000,
                              isolation=bool(e.refresh_route) and not getattr(e, "leader_addr", None))
            self._instance.on_error(e, message.topic, mq.broker_name, addr)
            raise
        if faults is not None:
            faults.update(mq.broker_name, (trio.current_time() - started) * 1000, isolation=False)

    def _stand_in_answered(self, info: TopicPublishInfo, topic: str, broker_name: str) -> None:
        """A send on ``topic``'s stand-in route was answered by group ``broker_name``, which now holds the topic.
        The route is refreshed once every group of the stand-in has answered one: refreshed at the first answer, it
        named that group alone, and a producer sending slowly never created the topic on the others (all of its
        capacity on one group)."""
        if len(self._stand_in_groups) > 1024 and topic not in self._stand_in_groups:
            self._stand_in_groups.clear()  # stand-ins the periodic refresh replaced meanwhile: none is kept for long
        groups = self._stand_in_groups.setdefault(topic, set())
        groups.add(broker_name)
        if groups >= {mq.broker_name for mq in info.queues}:
            del self._stand_in_groups[topic]
            self._instance.refresh_soon(topic)

    async def _oneway_publish_info(self, topic: str, deadline: float, timeout_s: float) -> TopicPublishInfo:
        """The route of a oneway send, fetched within its ``deadline`` (trio's clock): a topic no name server knows
        gets the stand-in route ``send`` gives it (``install_default_route``), so the oneway send creates it, as
        RocketMQ's sendOneway does. Raises ``RequestTimeoutError`` (as a oneway not queued in time) if the name
        servers take the whole deadline."""
        routes = self._instance.routes
        info = routes.cached_publish_info(topic)
        if info is not None:
            return info
        with trio.move_on_at(deadline):
            try:
                return await routes.publish_info(topic)
            except NoRouteError:
                if routes.cached(topic) is not None:
                    raise  # routed, with no writable queue: nothing to create
                await self._instance.install_default_route(topic, self.config.default_topic_queue_nums)
                return await routes.publish_info(topic)
        addrs = ",".join(routes.namesrv_addrs)
        error = RequestTimeoutError(addrs, timeout_s, RequestCode.GET_ROUTEINFO_BY_TOPIC)
        error.args = (f"the oneway send to topic {topic!r} was not sent within send_msg_timeout_ms ({timeout_s:g} "
                      f"s): the name servers ({addrs}) did not give its route in time",)
        raise error

    async def request(self, message: Message, *, timeout_s: float | None = None) -> MessageExt:
        """Send ``message`` as a request and return its reply (RocketMQ's DefaultMQProducer.request): the consumer
        that gets it answers with ``create_reply_message(msg, body)`` and a producer's ``send``. ``timeout_s``
        (default ``send_msg_timeout_ms``) bounds the whole, the send included; no reply within it raises
        ``ReplyTimeoutError`` (a reply that comes later is dropped), a send that fails raises as ``send`` does, and
        ``max_pending_requests`` requests already waiting raise ``TooManyRequestsError``. Concurrent requests (from
        a nursery) each get their own reply."""
        self._check(message)
        self._check_routing(message.topic, None, None, timeout_s)
        if is_reply_message(message):
            raise ValueError("request: the message is a reply (create_reply_message); send it with send")
        timeout = timeout_s if timeout_s is not None else self.config.send_msg_timeout_ms / 1000
        deadline = trio.current_time() + timeout
        topic = message.topic
        with trio.move_on_at(deadline):  # its route fetches and heartbeats count against the timeout too
            cluster, queue = await self._prepare_request(topic)
        if trio.current_time() >= deadline:
            raise ReplyTimeoutError(f"request to topic {topic!r} not sent: its {timeout:g} s went by while the "
                                    f"routes were fetched", topic=topic, correlation_id=None, timeout_s=timeout)
        body, sys_flag = self._single_body(message)
        props = message.wire_properties()
        uniq = props.setdefault(PROPERTY_UNIQ_KEY, new_uniq_key())
        correlation_id = str(uuid.uuid4())  # RocketMQ's CorrelationIdUtil: a random UUID
        props[PROPERTY_CORRELATION_ID] = correlation_id
        props[PROPERTY_MESSAGE_REPLY_TO_CLIENT] = self.client_id
        props[PROPERTY_MESSAGE_TTL] = str(int(timeout * 1000))
        props[PROPERTY_CLUSTER] = cluster
        fields = ext_fields(self.config.producer_group, topic, 0, now_ms(), message.flag, props, False)
        fields["sys_flag"] = sys_flag
        # Waiting before the send: the reply may come back before the send's own answer does.
        with self._pending.expect(correlation_id) as pending:
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                raise ReplyTimeoutError(f"request to topic {topic!r} not sent: its {timeout:g} s went by while the "
                                        f"routes were fetched", topic=topic, correlation_id=correlation_id,
                                        timeout_s=timeout)
            try:
                await self._send_request(message, SendExt(None, None, fields), body, uniq, queue, remaining)
            except RaftMQError:
                # An attempt whose answer was lost may have stored the request, and its reply come meanwhile.
                if pending.reply is None:
                    raise
                return pending.reply
            with trio.move_on_at(deadline):
                return await pending.wait()
        raise ReplyTimeoutError(f"request to topic {topic!r} was sent, but no reply came within {timeout:g} s "
                                f"(correlation id {correlation_id})", topic=topic, correlation_id=correlation_id,
                                timeout_s=timeout)

    async def _send_request(self, message: Message, ext: SendExt, body: bytes, uniq: str, queue: MessageQueue | None,
                            timeout_s: float) -> SendResult:
        """The send of ``request``'s ``message`` (``ext`` its fields, stamped; ``body`` as it goes). A method of its
        own so that a traced producer records its Pub (``client/trace_producer.py``), as RocketMQ's send hook sees a
        request's send, with no trace test on a plain producer's path."""
        return await self._send_with_retries(message.topic, RequestCode.SEND_MESSAGE, ext, lambda mq, addr: body,
                                             (uniq,), queue, None, timeout_s)

    async def _prepare_request(self, topic: str) -> tuple[str, MessageQueue | None]:
        """``(cluster, queue)`` of a request to ``topic``, its leaders heartbeated (``prepare_request``). A method,
        so that a test can stand in for it on one producer."""
        return await prepare_request(self._instance, topic, self.config.default_topic_queue_nums,
                                     self.config.send_latency_fault_enable)

    def _on_reply(self, request: Frame) -> str | None:
        """PUSH_REPLY_MESSAGE_TO_CLIENT: the reply completes the request waiting for it. Runs in the connection's
        reader, so it only hands the reply over. Returns what is malformed (answered INVALID_REQUEST), else None
        (SUCCESS, also for a reply nothing waits for, as RocketMQ answers)."""
        try:
            # Bounded by this producer's own max_message_size_bytes: a reply comes from a producer of its kind.
            reply = read_reply(request.ext, request.body, self.config.max_message_size_bytes,
                               "max_message_size_bytes")
        except ValueError as e:
            log.warning("malformed reply push ignored error=%s", e)
            return f"malformed reply: {e}"
        correlation_id = reply.properties[PROPERTY_CORRELATION_ID]
        if not self._pending.complete(correlation_id, reply):
            log.info("reply dropped: no request waits for it (timed out, or answered already) correlation_id=%s "
                     "broker_name=%s", correlation_id, reply.broker_name)
        return None

    async def fetch_publish_queues(self, topic: str) -> list[MessageQueue]:
        return list((await self.routes.publish_info(topic)).queues)

    # -- internals ------------------------------------------------------------------------------------------------
    def _check(self, message: Message) -> None:
        """The message's own rules. The body's size is that of the body given, compressed or not, as RocketMQ's
        Validators.checkMessage: so no consumer ever inflates a body past the limit its producer had."""
        if self._closing or self._instance.closed:
            raise ClientClosedError("the producer is closed")
        if not isinstance(message, Message):
            raise TypeError(f"send expects a Message, got {type(message).__name__}")
        message.validate()
        if not message.body:
            raise ValueError(f"the message body of topic {message.topic!r} is empty (RocketMQ refuses it too)")
        if len(message.body) > self.config.max_message_size_bytes:
            raise MessageTooLargeError(
                f"message body of {len(message.body)} bytes exceeds max_message_size_bytes "
                f"{self.config.max_message_size_bytes}", topic=message.topic,
                max_size=self.config.max_message_size_bytes)

    def _single_body(self, message: Message) -> tuple[bytes, int]:
        """``(body, sys_flag bits)`` a single send carries (RocketMQ's tryToCompressMessage): a body of at least
        ``compress_msg_body_over_howmuch`` bytes zlib-compressed with COMPRESSED_FLAG, if that makes it smaller
        (RocketMQ keeps whatever zlib returns: an incompressible body would then be stored larger and inflated by
        every consumer for nothing). Compressed once per send, not per attempt; ``message.body`` is left as it is,
        so ``execute`` and the caller see what they gave."""
        body = message.body
        sys_flag = 0
        if len(body) >= self.config.compress_msg_body_over_howmuch:
            packed = zlib.compress(body, self.config.compress_level)
            if len(packed) < len(body):
                body, sys_flag = packed, COMPRESSED_FLAG
        return body, sys_flag

    def _flagged_ext(self, message: Message, sys_flag: int) -> tuple[SendExt, str]:
        """The ext of a SEND_MESSAGE with ``sys_flag`` bits, and its UNIQ_KEY. SendExtEncoder's pre-encoded bytes
        carry sys_flag 0, so this one goes as a map (as a half message's), a microsecond of encoding beside the
        compression that set the bits."""
        props = message.wire_properties()
        uniq = props.setdefault(PROPERTY_UNIQ_KEY, new_uniq_key())
        fields = ext_fields(self.config.producer_group, message.topic, 0, now_ms(), message.flag, props, False)
        fields["sys_flag"] = sys_flag
        return SendExt(None, None, fields), uniq

    @staticmethod
    def _check_routing(topic: str, queue: Any, sharding_key: Any, timeout_s: Any) -> None:
        """The optional arguments of a send, before anything is sent: a wrong one would otherwise surface as an
        AttributeError deep inside (or, for a queue of another topic, store the message where nobody looks)."""
        if queue is not None:
            check_queue("queue", queue)
            if queue.topic != topic:
                raise ValueError(f"queue {queue} is a queue of topic {queue.topic!r}, not of the message's topic "
                                 f"{topic!r}")
        if sharding_key is not None and not isinstance(sharding_key, str):
            raise TypeError(f"sharding_key must be a string, got {sharding_key!r}")
        if queue is not None and sharding_key is not None:
            # Both pick the queue: the pinned one won and the key was ignored without a word.
            raise ValueError(f"give queue or sharding_key, not both (got queue {queue} and sharding_key "
                             f"{sharding_key!r})")
        if timeout_s is not None:
            check_seconds("timeout_s", timeout_s)

    @staticmethod
    async def _local_state(run: Any, *args: Any) -> TransactionState:
        """What ``execute`` or ``check`` says; an exception or another value is UNKNOWN (logged)."""
        try:
            state = await run(*args)
        except Exception:
            log.exception("local transaction failed; counted as UNKNOWN")
            return TransactionState.UNKNOWN
        if not isinstance(state, TransactionState):
            log.error("transaction listener returned %r, not a TransactionState; counted as UNKNOWN", state)
            return TransactionState.UNKNOWN
        return state

    async def _end_transaction(self, broker_name: str, topic: str, ext: dict[str, Any]) -> Frame:
        """END_TRANSACTION to the current leader of ``broker_name``, following NOT_LEADER hints and retrying what
        is retriable within ``send_msg_timeout_ms``."""
        inst = self._instance
        deadline = time.monotonic() + self.config.send_msg_timeout_ms / 1000
        attempts = 0
        while True:
            addr = inst.master_addr(broker_name)
            try:
                frame = await inst.invoke(addr, RequestCode.END_TRANSACTION, ext,
                                          timeout_s=max(deadline - time.monotonic(), 0.001))
                raise_for_response(frame, ok=_END_OK, broker_name=broker_name)
            except RaftMQError as e:
                inst.on_error(e, topic, broker_name, addr)
                attempts += 1
                if not e.retriable or attempts > self.config.max_redirects + self.config.retry_times_when_send_failed \
                        or time.monotonic() >= deadline:
                    raise
                if not getattr(e, "leader_addr", None):
                    await self._backoff(attempts, deadline)
                continue
            if frame.code != ResponseCode.SUCCESS:
                log.info("transaction ended before transaction_id=%s answer=%s", ext["transaction_id"], frame.remark)
            return frame

    def _on_check(self, request: Frame) -> None:
        """CHECK_TRANSACTION_STATE from a broker: answered from a task, so the connection reads on meanwhile."""
        try:
            # A check runs transaction_check_concurrency at a time: a zlib bomb's 256 MiB each would add up.
            group, broker_name, half_offset, message = read_check_request(
                request.ext, request.body, self.config.max_message_size_bytes, "max_message_size_bytes")
        except ValueError as e:
            log.warning("malformed transaction check ignored error=%s", e)
            return
        if group != self.config.producer_group or self._listener is None:
            log.warning("transaction check not answered: this producer of group %r has no transaction listener for "
                        "group %r transaction_id=%s", self.config.producer_group, group, message.msg_id)
            return
        self._instance.nursery.start_soon(self._answer_check, broker_name, half_offset, message)

    async def _answer_check(self, broker_name: str, half_offset: int, message: Any) -> None:
        assert self._listener is not None
        async with self._check_limiter:
            state = await self._local_state(self._listener.check, message)
        await self._end_checked(broker_name, half_offset, message, state)

    async def _end_checked(self, broker_name: str, half_offset: int, message: MessageExt,
                           state: TransactionState) -> None:
        """END_TRANSACTION answering a check of the half ``message`` with ``state`` (logged if not delivered: the
        broker checks again). A method of its own so that a traced producer records its EndTransaction first
        (``client/trace_producer.py``), as RocketMQ's checkTransactionState runs its hook."""
        ext = end_transaction_ext(self.config.producer_group, message.msg_id, message.offset_msg_id, half_offset,
                                  state, from_check=True)
        try:
            await self._end_transaction(broker_name, message.topic, ext)
        except RaftMQError as e:
            log.warning("answer to a transaction check not delivered transaction_id=%s error=%s", message.msg_id, e)

    async def _send_with_retries(self, topic: str, code: int, ext: SendExt, body_for, uniqs: tuple[str, ...],
                                 queue: MessageQueue | None, sharding_key: str | None,
                                 timeout_s: float | None, *, parked: bool = False) -> SendResult:
        # Counted, so that closing waits for it (_wait_sends).
        self._sending += 1
        try:
            return await self._send_attempts(topic, code, ext, body_for, uniqs, queue, sharding_key, timeout_s,
                                             parked)
        finally:
            self._sending -= 1
            self._send_ended()

    def _send_ended(self) -> None:
        """A send (or an auto batch) ended: wakes a close waiting for the last of them."""
        if self._idle is not None and not self._sending and not (self._accumulator and self._accumulator.busy):
            self._idle.set()

    async def _wait_sends(self) -> None:
        """Refuse new sends, and wait until those in flight (auto batches included, their waiting messages sent at
        once) are answered or fail. The caller bounds it."""
        self._closing = True
        if self._accumulator is not None:
            self._accumulator.close()
        while self._sending or (self._accumulator is not None and self._accumulator.busy):
            self._idle = trio.Event()
            await self._idle.wait()
        self._idle = None

    async def _send_attempts(self, topic: str, code: int, ext: SendExt, body_for, uniqs: tuple[str, ...],
                             queue: MessageQueue | None, sharding_key: str | None,
                             timeout_s: float | None, parked: bool) -> SendResult:
        inst = self._instance
        timeout = timeout_s if timeout_s is not None else self.config.send_msg_timeout_ms / 1000
        deadline = time.monotonic() + timeout
        faults = inst.faults if self.config.send_latency_fault_enable else None
        pinned = queue is not None or sharding_key is not None
        last_broker: str | None = None
        last_error: BaseException | None = None
        attempts = 0
        leader_waits = 0  # attempts that failed while the only group this send may use had no leader
        redirects = 0
        redirected = False  # the last attempt was answered NOT_LEADER and its hint is followed with the same queue
        unanswered = False  # an attempt went out and got no answer (it may be stored)
        auto_routed = False
        mq: MessageQueue | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                info = inst.routes.cached_publish_info(topic)
                if info is None:
                    # The deadline covers the route: a silent name server held a send its request timeout (3 s)
                    # per name server, whatever the send's own deadline.
                    with trio.move_on_after(remaining):
                        info = await inst.routes.publish_info(topic)
                    if info is None:
                        # An earlier attempt's error, if any, says more than the lookup that outlived the deadline.
                        last_error = last_error or _route_timeout(topic, timeout, "the route")
                        break
                if queue is not None:
                    mq = queue
                elif sharding_key is not None:
                    qs = info.queues
                    if not qs:
                        info.select(None)  # raises NoRouteError naming the topic
                    mq = qs[zlib.crc32(sharding_key.encode()) % len(qs)]
                elif mq is None or not redirected:
                    # Every attempt but a redirect picks again, avoiding the group that just failed: one whose
                    # redirects ran out (two nodes naming each other as leader, a stale leader in a partition) is
                    # left for another group, as a failed one is, instead of following the same hint again.
                    mq = info.select(faults, last_broker if not pinned else None)
                redirected = False
                addr = inst.master_addr(mq.broker_name)
            except RaftMQError as e:
                last_error = e
                if isinstance(e, NoRouteError) and not auto_routed and inst.routes.cached(topic) is None:
                    auto_routed = True
                    try:
                        with trio.move_on_after(max(deadline - time.monotonic(), 0)) as waited:
                            await inst.install_default_route(topic, self.config.default_topic_queue_nums)
                        if waited.cancelled_caught:
                            last_error = _route_timeout(topic, timeout, "the cluster info, to auto-create the topic")
                            break
                        continue
                    except RaftMQError as e2:
                        last_error = e2
                attempts += 1
                if not last_error.retriable or attempts > self.config.retry_times_when_send_failed:
                    break
                await self._backoff(attempts, deadline)
                continue
            started = time.monotonic()
            remaining = deadline - started  # what the route lookup left of it
            if remaining <= 0:
                last_error = last_error or _route_timeout(topic, timeout, "the route")
                break
            stand_in = info.stand_in
            try:
                # On a stand-in route, the broker creates the topic with at most our default_topic_queue_nums: with
                # its own (larger) one, sends went to queues it had not got; with a smaller one, ordered keys moved.
                attempt_ext = (ext.for_stand_in(mq.queue_id, self.config.default_topic_queue_nums) if stand_in
                               else ext.for_queue(mq.queue_id))
                frame = await inst.invoke(addr, code, attempt_ext, body_for(mq, addr), timeout_s=remaining)
                if stand_in:
                    self._stand_in_answered(info, topic, mq.broker_name)
                status = _SEND_STATUS.get(frame.code)
                if status is None:
                    # The field a refusal names (INVALID_REQUEST's ``field``) too: an auto batch tells by it whether
                    # the broker refused the batch or a message of it (client/accumulator.py).
                    field = frame.ext.get("field")
                    raise_for_response(frame, topic=topic, broker_name=mq.broker_name,
                                       **({"field": field} if type(field) is str else {}))
            except RaftMQError as e:
                if isinstance(e, (ConnectionClosedError, RequestTimeoutError)):
                    unanswered = True
                latency_ms = (time.monotonic() - started) * 1000
                isolation = bool(e.refresh_route) and not getattr(e, "leader_addr", None)
                if faults is not None:
                    faults.update(mq.broker_name, latency_ms, isolation=isolation)
                inst.on_error(e, topic, mq.broker_name, addr)
                last_error = e
                hint = getattr(e, "leader_addr", None)
                if hint and hint != addr and redirects < self.config.max_redirects:
                    redirects += 1
                    redirected = True
                    self._stats.redirects += 1
                    continue
                if e.retriable and isinstance(e, _LEADER_IN_FLUX) and (
                        pinned or len({q.broker_name for q in info.queues}) <= 1):
                    # The only group we may use is electing a leader: a new one usually answers within a second
                    # or two, so wait for it until the deadline instead of spending the retry budget in
                    # milliseconds. Only groups with writable queues count: a read-only group in the route (or one
                    # with no queues) is no other group to retry on, and the send failed in 150 ms.
                    leader_waits += 1
                    self._stats.retries += 1
                    await trio.sleep(min(self.config.retry_backoff_ms / 1000, max(deadline - time.monotonic(), 0)))
                    continue
                attempts += 1
                if not e.retriable or attempts > self.config.retry_times_when_send_failed:
                    break
                self._stats.retries += 1
                last_broker = mq.broker_name
                await self._backoff(attempts, deadline)
                continue
            if faults is not None:
                faults.update(mq.broker_name, (time.monotonic() - started) * 1000, isolation=False)
            self._stats.sent += len(uniqs)
            return self._result(frame, status, mq, uniqs, parked)
        self._stats.failed += len(uniqs)
        if last_error is None:
            last_error = trio.TooSlowError(f"send timed out after {timeout:.3f}s")
        if unanswered and inst.closed:
            # Closing waited send_msg_timeout_ms for this send; an attempt's request went out and was not answered:
            # "closed" would read as "not sent", and sending it again could store it twice.
            raise SendFailedError(f"sending to topic {topic!r}: the producer closed before an attempt's request was "
                                  f"answered, send_msg_timeout_ms after it began closing: the outcome is unknown (the "
                                  f"message may be stored; sent again, it may be stored twice)",
                                  attempts=attempts + leader_waits, last_error=last_error,
                                  topic=topic) from last_error
        if isinstance(last_error, RaftMQError) and not last_error.retriable:
            if unanswered:
                # Refused now, but an earlier attempt went out unanswered and may be stored: the refusal is not the
                # outcome (an auto batch refused as a batch would be sent again in halves, and stored twice).
                raise SendFailedError(f"sending to topic {topic!r}: an earlier attempt's request was not answered (the "
                                      f"message may be stored), and the last attempt was refused: {last_error}",
                                      attempts=attempts + leader_waits, last_error=last_error,
                                      topic=topic) from last_error
            raise last_error
        waits = f" ({leader_waits} of them waiting for a leader to be elected)" if leader_waits else ""
        raise SendFailedError(f"sending to topic {topic!r} failed after {attempts + leader_waits} attempt(s){waits} "
                              f"and {redirects} redirect(s): {last_error}", attempts=attempts + leader_waits,
                              last_error=last_error, topic=topic) from last_error

    async def _backoff(self, attempt: int, deadline: float) -> None:
        pause = min(attempt * self.config.retry_backoff_ms / 1000, max(deadline - time.monotonic(), 0))
        if pause > 0:
            await trio.sleep(pause)

    @staticmethod
    def _result(frame, status: SendStatus, mq: MessageQueue, uniqs: tuple[str, ...],
                parked: bool = False) -> SendResult:
        """The SendResult of the answer ``frame`` to a send to ``mq``. Its queue is the answer's ``queue_id`` (a
        broker may place a message elsewhere in its topic), unless the message is ``parked``: a half message, a
        delayed or a timer one waits in a queue of a system topic (the half queue, a schedule queue), whose id the
        broker answers, and is bound for ``mq``, as RocketMQ's SendResult names it. Its ``queue_offset`` is the
        one answered: the offset in that system queue."""
        ext = frame.ext
        offset_msg_id = ext.get("msg_id") or ""
        if type(offset_msg_id) is list and all(type(i) is str for i in offset_msg_id):
            offset_msg_id = ",".join(offset_msg_id)
        queue_id = ext.get("queue_id", mq.queue_id)
        queue_offset = ext.get("queue_offset", -1)
        if type(offset_msg_id) is not str or type(queue_id) is not int or type(queue_offset) is not int:
            # Not a broker's answer: an AttributeError from it ended the auto-batching producer's task group.
            raise for_code(ResponseCode.SYSTEM_ERROR, f"malformed answer to a send from broker group "
                                                      f"{mq.broker_name!r}: msg_id {offset_msg_id!r}, queue_id "
                                                      f"{queue_id!r}, queue_offset {queue_offset!r}")
        if queue_id != mq.queue_id and not parked:
            mq = MessageQueue(mq.topic, mq.broker_name, queue_id)
        return _NewSendResult(status, ",".join(uniqs) if len(uniqs) > 1 else uniqs[0], offset_msg_id, mq,
                              queue_offset, uniqs)


def _parked(message: Message) -> bool:
    """Whether the broker parks ``message`` in a schedule queue until due (a delay level, a timer property): the
    answer to its send names that queue, not the topic's queue it is bound for. A timer already due is stored where
    it was sent, the answer naming that queue anyway."""
    return bool(message.delay_level) or any(name in message.properties for name in TIMER_PROPERTIES)


@contextlib.asynccontextmanager
async def open_producer(namesrv: str | Sequence[str] | None = None, *,
                        transaction_listener: TransactionListener | None = None,
                        **options: Any) -> AsyncIterator[Producer]:
    """Open a producer. ``namesrv`` is "host:port[;host:port]"; other options are ``ProducerConfig`` fields.
    ``transaction_listener`` (``client.TransactionListener``) enables ``send_in_transaction`` and answers the
    brokers' checks of this producer group's transactions."""
    if namesrv is not None:
        options["namesrv"] = namesrv
    config: ProducerConfig = build_config(ProducerConfig, options)
    async with open_producer_from_config(config, transaction_listener=transaction_listener) as producer:
        yield producer


@contextlib.asynccontextmanager
async def open_producer_from_config(config: ProducerConfig, *,
                                    transaction_listener: TransactionListener | None = None) -> AsyncIterator[Producer]:
    """``open_producer`` with a built ``ProducerConfig``. With ``enable_msg_trace`` the producer is a
    ``TracedProducer`` (``client/trace_producer.py``), its traces sent by an inner producer of their own, which is
    flushed and closed after it."""
    if transaction_listener is not None:
        for name in ("execute", "check"):
            if not callable(getattr(transaction_listener, name, None)):
                raise TypeError(f"transaction_listener must have async methods execute(msg, arg) and check(msg); "
                                f"{transaction_listener!r} has no {name}")
    async with contextlib.AsyncExitStack() as stack:
        dispatcher = (await stack.enter_async_context(open_trace_dispatcher(config, config.trace_topic))
                      if config.enable_msg_trace else None)
        producer = await stack.enter_async_context(_open(config, transaction_listener, dispatcher))
        yield producer


@contextlib.asynccontextmanager
async def _open(config: ProducerConfig, transaction_listener: TransactionListener | None,
                dispatcher: Any) -> AsyncIterator[Producer]:
    server_requests = ServerRequests()
    async with open_remoting(config, server_requests) as remoting:
        async with open_client_nursery() as nursery:
            instance = ClientInstance(config, remoting, nursery)
            instance.start_background()
            if dispatcher is None:
                producer = Producer(config, instance, transaction_listener)
            else:
                # Here, not at the top: that module's class is a Producer.
                from client.trace_producer import TracedProducer

                producer = TracedProducer(config, instance, transaction_listener, dispatcher)
            server_requests.on_check_transaction = producer._on_check
            server_requests.on_reply_message = producer._on_reply
            try:
                yield producer
            finally:
                instance.stop_background()
                # New sends are refused at once (ClientClosedError: not sent); those in flight are answered first, as
                # closing under them told "closed" to callers whose messages were stored. Shielded, as the block may
                # end by cancellation, and bounded as one send is.
                with trio.move_on_after(config.send_msg_timeout_ms / 1000) as scope:
                    scope.shield = True
                    await producer._wait_sends()
                with trio.move_on_after(1) as scope:
                    scope.shield = True
                    await instance.unregister(config.producer_group, None)
                instance.closed = True
                nursery.cancel_scope.cancel()
