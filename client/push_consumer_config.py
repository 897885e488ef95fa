"""What a push consumer is opened with, checked before anything starts: ``PushConsumerConfig`` (with
``CONSUME_FROM``, the starts a new queue may take), the handler and batch handler ``open_push_consumer`` is given
and how they must agree with the config, the BROADCASTING offset file the config names, and
``ConsumerStatistics``.

Separate from ``client/push_consumer.py`` (which re-exports every name here) because none of it runs while the
consumer consumes: it is the consumer's inputs and their checks, read once at open, and the lite pull consumer
shares ``CONSUME_FROM`` without importing the push consumer itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from client.consume_service import BatchHandler
from client.instance import HOUR_MS, ClientConfig
from client.message import DEFAULT_MAX_INFLATED_BODY, I32_MAX, I64_MAX, MAX_INFLATED_BODY, MessageExt
from client.offset_store import LocalFileOffsetStore
from client.rebalance import DEFAULT_ALLOCATE_STRATEGY, AllocateStrategy, allocate_strategy_problem
from client.trace import TRACE_TOPIC
from remoting.config import ConfigError, blank_dir_problem, bounded
from remoting.dirlock import DirectoryInUseError
from remoting.message import group_problem, topic_problem

__all__ = ["PushConsumerConfig", "ConsumerStatistics", "CONSUME_FROM", "Handler", "local_offset_store",
           "claim_offset_file", "check_handler", "check_batch", "check_orderly"]

Handler = Callable[[MessageExt], Awaitable[Any]]

CONSUME_FROM = ("CONSUME_FROM_LAST_OFFSET", "CONSUME_FROM_FIRST_OFFSET", "CONSUME_FROM_TIMESTAMP")


@dataclasses.dataclass(frozen=True)
class PushConsumerConfig(ClientConfig):
    consumer_group: str = bounded("DEFAULT_CONSUMER", check=group_problem)
    message_model: str = bounded("CLUSTERING", choices=("CLUSTERING", "BROADCASTING"))
    consume_from_where: str = bounded("CONSUME_FROM_LAST_OFFSET", choices=CONSUME_FROM)
    consume_timestamp_ms: int = bounded(0, min=0, max=I64_MAX,
                                        doc="start time for CONSUME_FROM_TIMESTAMP; 0: 30 min ago")
    pull_batch_size: int = bounded(32, min=1, max=1024)
    pull_threshold_for_queue: int = bounded(1000, min=1, max=65_535,  # RocketMQ's range
                                            doc="flow control: messages cached per queue")
    pull_threshold_size_for_queue_mib: int = bounded(100, min=1, max=1 << 20,
                                                     doc="flow control: MiB of message bodies cached per queue")
    # RocketMQ's consumeConcurrentlyMaxSpan and its range. Counted to the last offset pulled, not to the largest one
    # still cached as RocketMQ does, so that it bounds what a stuck message has handled again (client/process_queue.py).
    consume_concurrently_max_span: int = bounded(2000, min=1, max=65_535,
                                                 doc="concurrent handler form, flow control: a queue's pulls wait "
                                                     "while its offsets from the least one not yet consumed to the "
                                                     "last one pulled span more than this")
    # RocketMQ's pullInterval and its range.
    pull_interval_ms: int = bounded(0, min=0, max=65_535, doc="pause after a pull of a queue that found messages")
    # A Java int on the wire: the broker refuses every pull asking for more (and holds at most its own
    # long_polling_timeout_ms anyway).
    broker_suspend_max_time_ms: int = bounded(15_000, min=0, max=I32_MAX, doc="long-polling hold on the broker")
    rebalance_interval_ms: int = bounded(5_000, min=10, max=HOUR_MS)
    persist_consumer_offset_interval_ms: int = bounded(1_000, min=10, max=HOUR_MS)
    # 0 made every failing pull loop retry at once: one queue whose broker refused or could not be reached took a
    # core (RocketMQ waits 3000 ms; we retry sooner, a leader usually moves within a second; refusals in a row
    # double it up to 3000 ms: client.pull_consumer.failed_pull_delay).
    pull_time_delay_ms_when_exception: int = bounded(200, min=10, max=HOUR_MS,
                                                     doc="pause after a failed pull, before the next")
    # A Java int on the wire: the broker refused every send-back of a member asking for more, INVALID_REQUEST. -1
    # is never sent: PushConsumer.max_reconsume_times turns it into the count it means.
    max_reconsume_times: int = bounded(-1, min=-1, max=I32_MAX,
                                       doc="retries of a failed message before the dead letters (so this + 1 failures "
                                           "in all); -1: 16 (concurrent), unlimited (orderly)")
    # RocketMQ's consumeTimeout (minutes, 15). A day at most: a handler call longer than that is stuck, not slow.
    consume_timeout_min: int = bounded(15, min=1, max=1440,
                                       doc="concurrent handler form: a call running longer is cancelled and its "
                                           "message counts as failed")
    # RocketMQ's consumeThreadMin/consumeThreadMax (20/20, each 1..1000): its pool's threads are trio tasks here, and
    # a task costs nothing idle, so one bound is all there is to set.
    max_concurrent_handlers: int = bounded(20, min=1, max=1000,
                                           doc="concurrent handler form: handler calls running at once across all the "
                                               "consumer's queues; a queue's messages may then be handled side by "
                                               "side and finish out of order (orderly=True keeps order)")
    # RocketMQ's consumeMessageBatchMaxSize and its range. Only with batch_handler (open_push_consumer checks): a
    # handler written for one message must never be handed a list because a config file says so.
    consume_message_batch_max_size: int = bounded(1, min=1, max=1024,
                                                  doc="concurrent batch_handler form: most messages of one queue a "
                                                      "call gets; more than 1 needs batch_handler")
    reconsume_delay_ms: int = bounded(1_000, min=0, max=HOUR_MS)
    # An empty one put the offset files in the current directory (Path("") is ".").
    offset_store_dir: str = bounded(".raftmq-offsets", check=blank_dir_problem,
                                    doc="where BROADCASTING consumers keep offsets")
    check_crc: bool = bounded(False, doc="recompute each pulled body's crc32c")
    # A producer's few-KiB zlib bomb inflated to 256 MiB in every member, 32 a pull, before flow control saw a body.
    max_inflated_body_size_bytes: int = bounded(DEFAULT_MAX_INFLATED_BODY, min=1, max=MAX_INFLATED_BODY,
                                                doc="most a compressed body is inflated to; a larger one is "
                                                    "delivered as stored, compressed, and logged")
    orderly: bool = bounded(False, doc="handler form only: hold each queue's lock on the broker while consuming it, "
                                       "one message at a time, retrying a failed one before its successors")
    rebalance_lock_interval_ms: int = bounded(20_000, min=10, max=3_600_000,
                                              doc="orderly: how often held queue locks are renewed (sooner if the "
                                                  "broker's lock life is under three times this)")
    # RocketMQ clamps its suspendCurrentQueueTimeMillis to 10..30000 ms.
    suspend_current_queue_time_ms: int = bounded(1_000, min=10, max=30_000,
                                                 doc="orderly: pause of a queue whose handler raised, before the same "
                                                     "message is handled again")
    # RocketMQ's allocateMessageQueueStrategy (client/rebalance.py). A function is taken as it is: a TOML file can
    # only name one.
    allocate_strategy: str | AllocateStrategy = bounded(
        DEFAULT_ALLOCATE_STRATEGY, check=allocate_strategy_problem,
        doc="clustering: how the group's members split each topic's queues, by a RocketMQ strategy's name "
            "(client.rebalance.ALLOCATE_STRATEGIES) or a function like client.rebalance.allocate_average; every member "
            "of a group must use the same")
    # RocketMQ's enableMsgTrace / customizedTraceTopic (client/trace.py): each handler call's trace goes to
    # trace_topic; in the iterator form each message's, from __anext__ handing it out to its acknowledgement.
    enable_msg_trace: bool = bounded(False, doc="record each handler call's trace (iterator form: each message's, "
                                                "handed out and acknowledged) and send it to trace_topic")
    trace_topic: str = bounded(TRACE_TOPIC, check=topic_problem, doc="the topic traces go to")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.message_model == "BROADCASTING" and self.allocate_strategy != DEFAULT_ALLOCATE_STRATEGY:
            # RocketMQ ignores it there; set, it was meant to do something, and it would not.
            raise ConfigError(f"allocate_strategy is for CLUSTERING consumers (a BROADCASTING member consumes every "
                              f"queue), got {self.allocate_strategy!r} with message_model 'BROADCASTING'")
        if self.orderly and self.consume_message_batch_max_size > 1:
            # RocketMQ takes orderly batches, but fails them whole: a batch whose retries ran out for some of its
            # messages puts those in the dead letters and still hands them over again with the rest. One message
            # at a time keeps "this message failed" meaning one message.
            raise ConfigError(f"consume_message_batch_max_size is for the concurrent handler form (batch_handler); "
                              f"orderly=True handles one message at a time, got {self.consume_message_batch_max_size}")


@dataclasses.dataclass(frozen=True, slots=True)
class ConsumerStatistics:
    assigned_queues: int
    delivered: int
    rebalances: int
    pulls: int
    pull_errors: int
    cached: int
    cached_bytes: int
    # Concurrent handler form: handler calls running now (at most max_concurrent_handlers); else 0.
    handling: int = 0
    # Between suspend() and resume(): no queue is pulled.
    suspended: bool = False


def local_offset_store(config: PushConsumerConfig) -> LocalFileOffsetStore:
    """A BROADCASTING member's offset file, loaded; ``ConfigError`` naming ``offset_store_dir`` if it cannot be used
    (before, a directory that could not be created failed the first persist and took the consumer down)."""
    # Stable across restarts of the same member, so it resumes: the group and instance_name, not the address
    # (RocketMQ's ip@instanceName), which a container may be given afresh at every start, and which says nothing a
    # file in this host's directory needs. Every config, one built directly too, has had its instance_name checked
    # (client.instance.check_instance_name): it cannot put the file outside offset_store_dir.
    directory = Path(config.offset_store_dir)
    path = directory / f"{config.consumer_group}@{config.instance_name}.json"
    if not path.exists():
        # Earlier versions named the file by the address too, which was 127.0.0.1 unless client_ip was set: taken
        # over once, else an upgraded member would start again from consume_from_where.
        for ip in dict.fromkeys((config.client_ip, "127.0.0.1")):
            legacy = directory / f"{config.consumer_group}@{ip}@{config.instance_name}.json"
            if legacy.exists():
                with contextlib.suppress(OSError):  # then it starts afresh, as it would have without the file
                    os.replace(legacy, path)
                break
    try:
        return LocalFileOffsetStore(path)
    except ValueError as e:
        raise ConfigError(f"offset_store_dir {config.offset_store_dir!r} cannot keep the offsets: {e}") from None


# The offset files of this process's open BROADCASTING consumers: two members of a group with one instance_name
# (the default "DEFAULT" for both) wrote one file, each overwriting the other's offsets. The store's lock refuses
# them too; this set names the cause more plainly.
_claimed_offset_files: set[Path] = set()


@contextlib.contextmanager
def claim_offset_file(store: LocalFileOffsetStore | None, config: PushConsumerConfig) -> Iterator[None]:
    """Holds a BROADCASTING member's offset file for it while the block runs (``LocalFileOffsetStore.lock``, an OS
    lock a member in another process is refused by too, and that a killed member's exit releases), and lets it go
    when the block ends however it ends; ``ConfigError`` naming the file if another member holds it."""
    if store is None:
        yield
        return
    path = store.path.resolve()
    advice = f"give each member its own instance_name (now {config.instance_name!r}) or offset_store_dir"
    if path in _claimed_offset_files:
        raise ConfigError(f"another BROADCASTING consumer of group {config.consumer_group!r} in this process keeps its "
                          f"offsets in {str(path)!r}: {advice}")
    try:
        store.lock()
    except DirectoryInUseError as e:
        # Members in separate processes of one host, which the set above cannot see. Not kept apart by naming the
        # file after the pid: a member's file must outlive its restarts, so it is named after instance_name.
        raise ConfigError(f"{e}: each BROADCASTING member of group {config.consumer_group!r} on a host needs a file "
                          f"of its own, {advice}") from None
    except ValueError as e:
        raise ConfigError(f"offset_store_dir {config.offset_store_dir!r} cannot keep the offsets: {e}") from None
    _claimed_offset_files.add(path)
    try:
        yield
    finally:
        _claimed_offset_files.discard(path)
        store.close()


def check_orderly(config: PushConsumerConfig, handler: Handler | None) -> None:
    if config.orderly and handler is None:
        # The iterator hands out every queue's messages to one loop, the queues taking turns, and counts one as
        # consumed only when the next is asked for: it cannot hold a queue until its message is handled, nor retry
        # it before the next one, so it could not keep the promise.
        raise ValueError("orderly=True needs a handler (open_push_consumer(..., handler=async_fn, orderly=True)): "
                         "the iterator form cannot consume in order around a rebalance")


def check_batch(config: PushConsumerConfig, handler: Handler | None, batch_handler: BatchHandler | None) -> None:
    """``batch_handler`` (a sequence of messages a call) instead of ``handler``, never both; only it takes more than
    one message a call, so a handler written for one message is never handed a sequence."""
    if batch_handler is None:
        if config.consume_message_batch_max_size > 1:
            raise ConfigError(f"consume_message_batch_max_size {config.consume_message_batch_max_size} needs "
                              f"batch_handler= (an async function taking a sequence of messages): handler= and the "
                              f"iterator take one message at a time")
        return
    if handler is not None:
        raise ValueError("give handler= (one message a call) or batch_handler= (a sequence of messages), not both")
    if config.orderly:
        raise ValueError("orderly=True handles one message at a time: it takes handler=, not batch_handler=")


def check_handler(handler: Any, name: str = "handler", takes: str = "message") -> None:
    """A handler is an ``async def`` function or method, a ``functools.partial`` of one, or an object whose
    ``__call__`` is one, taking the message (a batch handler: the sequence of messages) as its one argument.
    Anything else failed each call, inside the consumer: every message was retried ``max_reconsume_times`` times,
    logged and skipped."""
    if not (inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(getattr(handler, "__call__", None))):
        raise TypeError(f"{name} must be an async function taking a {takes}, got {handler!r}")
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):
        return  # no signature to check (some builtins and extension types)
    try:
        signature.bind(None)
    except TypeError:
        raise TypeError(f"{name} must take the {takes} as its one argument, got {handler!r} with signature "
                        f"{signature}") from None
