"""A consumer's running info (RocketMQ's ConsumerRunningInfo), as ``raftmq admin consumer-status`` shows it: the
answer to GET_CONSUMER_RUNNING_INFO (307), which a broker relays from an admin to one online member of a group over
the connection that member heartbeats on (``broker/processor/client_manage.py``).

The rules:

- **What it holds** (the wire map is ``docs/protocol.md``'s "GET_CONSUMER_RUNNING_INFO"): ``properties``, every field
  of the consumer's config (the ACL secret key only as ``<set>``), its statistics and RocketMQ's own entries (consume
  type: ``CONSUME_PASSIVELY`` for a push consumer, ``CONSUME_ACTIVELY`` for a lite pull one; orderly or not; start
  time; client version); ``subscriptions``; one row per queue it holds with that queue's cache (messages, bytes,
  least and greatest offsets cached), the offset its offset store holds to commit, whether it holds the queue's
  lock (orderly) or pauses it, and when it last pulled and consumed from it; and per subscribed topic the rates of
  the last minute (``status``) and, asked for, ``jstack``: where every trio task of the process waits.
- **Read, never changed, never waited for.** The answer is drawn from the consumer's state as it is when asked, in
  the reader of the connection the request came on: nothing in it awaits.
- **Rates over the last minute** (RocketMQ's ConsumerStatsManager): pull TPS (messages pulled a second) and RT (a
  pull's), both of the pulls that found messages only, as RocketMQ's incPullTPS and incPullRT (a long poll that
  found none is held up to its suspend time: counted, it showed an idle consumer's pull RT in seconds; every
  answered pull still sets when its queue was last pulled); consume OK and failed TPS (handler calls' messages) and
  RT (a call's), and the messages that failed over the last hour. ``ConsumeStatsRecorder`` counts them per topic in
  one-second buckets, bounded by the window.
- **Counted through the consumer's hook** (``client/consume_hook.py``): ``attach_push_consumer`` /
  ``attach_lite_pull_consumer`` subscribe the recorder to it when the consumer is opened; message trace subscribes
  its tracer to the same hook.
- **Bounded.** The task dump is cut at ``JSTACK_MAX_CHARS``; the rest is one row per queue held and one per topic.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import trio

from client.consume_hook import ConsumeCall, ConsumeHook
from client.message import MessageQueue

if TYPE_CHECKING:
    from client.listener import ReconsumeLater
    from client.lite_pull_consumer import LitePullConsumer
    from client.push_consumer import PushConsumer

__all__ = ["ConsumeStatsRecorder", "attach_push_consumer", "attach_lite_pull_consumer",
           "push_running_info", "lite_pull_running_info", "task_dump", "config_properties", "JSTACK_MAX_CHARS"]

WINDOW_S = 60  # the rates' window, as RocketMQ's per-minute statistics
FAILED_WINDOW_MIN = 60  # consume_failed_msgs: the last hour's, as RocketMQ's
JSTACK_MAX_CHARS = 256 * 1024  # a frame stays far under the 16 MiB maximum with thousands of tasks
_FRAMES_PER_TASK = 12  # a task's innermost frames shown (where it waits); outer ones are its callers

RunningInfo = Callable[[bool], dict[str, Any]]



def _client_version() -> str:
    try:
        return f"raftmq {importlib.metadata.version('raftmq')}"
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "raftmq (not installed)"


class _TopicStats:
    """One topic's buckets: ``seconds`` ``[second, pulls, pulled, pull_rt_s, calls, consume_rt_s, ok, failed]`` of the
    last ``WINDOW_S`` seconds (``pulls``: those that found messages), ``minutes`` ``[minute, failed]`` of the last
    hour."""

    __slots__ = ("seconds", "minutes")

    def __init__(self) -> None:
        self.seconds: collections.deque[list[Any]] = collections.deque()
        self.minutes: collections.deque[list[int]] = collections.deque()

    def bucket(self, now: float) -> list[Any]:
        second = int(now)
        seconds = self.seconds
        if seconds and seconds[-1][0] == second:
            return seconds[-1]
        bucket = [second, 0, 0, 0.0, 0, 0.0, 0, 0]
        seconds.append(bucket)
        while seconds[0][0] <= second - WINDOW_S:
            seconds.popleft()
        return bucket

    def failed(self, now: float, count: int) -> None:
        minute = int(now // 60)
        minutes = self.minutes
        if not minutes or minutes[-1][0] != minute:
            minutes.append([minute, 0])
            while minutes[0][0] <= minute - FAILED_WINDOW_MIN:
                minutes.popleft()
        minutes[-1][1] += count


class ConsumeStatsRecorder:
    """Per topic, a consumer's pulls and handler calls over the last minute, and when it last pulled and consumed
    from each queue (RocketMQ's ConsumerStatsManager). ``clock`` is monotonic seconds, ``wall`` the time of day in
    seconds: the timestamps shown are the time of day."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._wall = wall
        self.started = clock()
        self.started_ms = int(wall() * 1000)
        self._topics: dict[str, _TopicStats] = {}
        self.last_pull: dict[MessageQueue, float] = {}  # monotonic
        self.last_consume: dict[MessageQueue, float] = {}

    def _stats(self, topic: str) -> _TopicStats:
        stats = self._topics.get(topic)
        if stats is None:
            stats = self._topics[topic] = _TopicStats()
        return stats

    def pulled(self, mq: MessageQueue, started: float, messages: int | None) -> None:
        """A pull of ``mq`` sent at ``started`` (``clock``) was answered, having found ``messages`` messages (None:
        none found, so it is not timed nor counted, only when ``mq`` was last pulled is)."""
        now = self.clock()
        self.last_pull[mq] = now
        if messages is None:
            return
        bucket = self._stats(mq.topic).bucket(now)
        bucket[1] += 1
        bucket[2] += messages
        bucket[3] += now - started

    def consumed(self, mq: MessageQueue, started: float | None, ok: int, failed: int) -> None:
        """A handler call on messages of ``mq`` started at ``started`` (None: not timed) consumed ``ok`` of them and
        failed ``failed``."""
        # Once per handler call: the current second's bucket without a call when it is there already.
        now = self.clock()
        stats = self._topics.get(mq.topic) or self._stats(mq.topic)
        seconds = stats.seconds
        bucket = seconds[-1] if seconds and seconds[-1][0] == int(now) else stats.bucket(now)
        if started is not None:
            bucket[4] += 1
            bucket[5] += now - started
        bucket[6] += ok
        bucket[7] += failed
        if failed:
            stats.failed(now, failed)
        self.last_consume[mq] = now

    def call_ended(self, call: ConsumeCall, failure: ReconsumeLater | None, ok: int) -> None:
        """``ConsumeHook.call_ended``'s subscriber: a timed handler call, ``ok`` of its messages consumed."""
        self.consumed(call.mq, call.started, ok, len(call.msgs) - ok)

    def handed_out(self, mq: MessageQueue, messages: int) -> None:
        """``ConsumeHook.handed_out``'s subscriber: consumed, not timed."""
        self.consumed(mq, None, messages, 0)

    def status(self, topic: str) -> dict[str, float | int]:
        """``topic``'s rates over the last minute (over the time since the start, in the first minute)."""
        now = self.clock()
        stats = self._topics.get(topic)
        elapsed = max(1.0, min(float(WINDOW_S), now - self.started))
        pulls = pulled = calls = ok = failed = failed_hour = 0
        pull_rt = consume_rt = 0.0
        if stats is not None:
            since = int(now) - WINDOW_S
            for second, n_pulls, n_pulled, rt, n_calls, call_rt, n_ok, n_failed in stats.seconds:
                if second > since:
                    pulls, pulled, pull_rt = pulls + n_pulls, pulled + n_pulled, pull_rt + rt
                    calls, consume_rt, ok, failed = calls + n_calls, consume_rt + call_rt, ok + n_ok, failed + n_failed
            minute = int(now // 60)
            failed_hour = sum(n for m, n in stats.minutes if m > minute - FAILED_WINDOW_MIN)
            if not failed_hour and not any(b[0] > since for b in stats.seconds):
                del self._topics[topic]  # nothing left to tell: a topic unsubscribed long ago holds nothing
        return {"pull_tps": round(pulled / elapsed, 2),
                "pull_rt_ms": round(pull_rt / pulls * 1000, 2) if pulls else 0.0,
                "consume_ok_tps": round(ok / elapsed, 2), "consume_failed_tps": round(failed / elapsed, 2),
                "consume_rt_ms": round(consume_rt / calls * 1000, 2) if calls else 0.0,
                "consume_failed_msgs": failed_hour}

    def timestamp_ms(self, at: float | None) -> int | None:
        """The time of day (ms) of the monotonic ``at``."""
        if at is None:
            return None
        return int((self._wall() - (self.clock() - at)) * 1000)


def attach_push_consumer(consumer: PushConsumer) -> RunningInfo:
    """Count ``consumer``'s pulls and handler calls from now on (subscribed to its ``consume_hook()``); returns what
    answers GET_CONSUMER_RUNNING_INFO for it (``ServerRequests.on_consumer_running_info``)."""
    recorder = _subscribed_recorder(consumer.consume_hook())
    return lambda jstack: push_running_info(consumer, recorder, jstack=jstack)


def attach_lite_pull_consumer(consumer: LitePullConsumer) -> RunningInfo:
    """``attach_push_consumer`` for a lite pull consumer: what ``poll`` hands out counts as consumed."""
    recorder = _subscribed_recorder(consumer.consume_hook())
    return lambda jstack: lite_pull_running_info(consumer, recorder, jstack=jstack)


def _subscribed_recorder(hook: ConsumeHook) -> ConsumeStatsRecorder:
    recorder = ConsumeStatsRecorder(clock=hook.clock)  # the calls' and pulls' ``started`` are read from it
    hook.subscribe(pulled=recorder.pulled, call_ended=recorder.call_ended, handed_out=recorder.handed_out)
    return recorder


def config_properties(config: Any) -> dict[str, Any]:
    """Every field of a client config as a scalar (a list joined by ``;``, an allocate function by its name); a field
    kept out of the config's repr (the ACL secret key) only as ``<set>`` or ``""``: what is shown goes to admins."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if not field.repr:
            value = "<set>" if value else ""
        elif isinstance(value, (tuple, list)):
            value = ";".join(map(str, value))
        elif callable(value):
            value = getattr(value, "__qualname__", None) or repr(value)
        elif not isinstance(value, (str, int, float, bool)) and value is not None:
            value = str(value)
        out[field.name] = value
    return out


def _subscription_rows(subs: Iterable[Any]) -> list[dict[str, Any]]:
    return [{"topic": s.topic, "expression": s.expression, "expression_type": s.expression_type,
             "sub_version": s.sub_version} for s in sorted(subs, key=lambda s: s.topic)]


def _queue_row(recorder: ConsumeStatsRecorder, mq: MessageQueue, offsets: Sequence[int], cached_bytes: int,
               committed: int | None, *, locked: bool, paused: bool) -> dict[str, Any]:
    """``offsets``: those cached, in increasing order."""
    return {"topic": mq.topic, "broker_name": mq.broker_name, "queue_id": mq.queue_id, "committed_offset": committed,
            "cached_msg_count": len(offsets), "cached_msg_bytes": cached_bytes,
            "cached_msg_min_offset": offsets[0] if offsets else None,
            "cached_msg_max_offset": offsets[-1] if offsets else None, "locked": locked, "paused": paused,
            "last_pull_timestamp": recorder.timestamp_ms(recorder.last_pull.get(mq)),
            "last_consume_timestamp": recorder.timestamp_ms(recorder.last_consume.get(mq))}


def _forget_gone(recorder: ConsumeStatsRecorder, held: Iterable[MessageQueue]) -> None:
    # The last pull and consume times of queues no longer held: bounded by the queues held now.
    keep = set(held)
    for table in (recorder.last_pull, recorder.last_consume):
        for mq in [mq for mq in table if mq not in keep]:
            del table[mq]


def push_running_info(consumer: PushConsumer, recorder: ConsumeStatsRecorder, *, jstack: bool = False
                      ) -> dict[str, Any]:
    config = consumer.config
    orderly = consumer._orderly
    locks = orderly.locks if orderly is not None else None
    form = "handler" if consumer._handler is not None else (
        "batch_handler" if consumer._batch_handler is not None else "iterator")
    properties = {**config_properties(config), **dataclasses.asdict(consumer.statistics()),
                  "consume_type": "CONSUME_PASSIVELY", "consume_orderly": config.orderly, "consume_form": form,
                  "effective_max_reconsume_times": consumer.max_reconsume_times,
                  "consumer_start_timestamp": recorder.started_ms, "client_version": _client_version()}
    pqs = dict(consumer._pqs)
    queues = []
    for mq, pq in sorted(pqs.items()):
        offsets = list(pq.msgs)  # increasing: a queue's offsets are put in order (client/process_queue.py)
        queues.append(_queue_row(recorder, mq, offsets, pq.msg_bytes, consumer._offsets.read_cached(mq),
                                 locked=locks is not None and locks.trusted(mq), paused=consumer._suspended))
    _forget_gone(recorder, pqs)
    return _running_info(config.consumer_group, consumer.client_id, properties, consumer._subs.values(), queues,
                         recorder, jstack)


def lite_pull_running_info(consumer: LitePullConsumer, recorder: ConsumeStatsRecorder, *, jstack: bool = False
                           ) -> dict[str, Any]:
    config = consumer.config
    properties = {**config_properties(config), **dataclasses.asdict(consumer.statistics()),
                  "consume_type": "CONSUME_ACTIVELY", "message_model": "CLUSTERING", "consume_orderly": False,
                  "mode": consumer.mode or "", "consumer_start_timestamp": recorder.started_ms,
                  "client_version": _client_version()}
    held = dict(consumer._queues)
    queues = []
    for mq, aq in sorted(held.items()):
        offsets = [m.queue_offset for m in aq.msgs]
        queues.append(_queue_row(recorder, mq, offsets, aq.msg_bytes, consumer._offsets.read_cached(mq),
                                 locked=False, paused=mq in consumer._paused))
    _forget_gone(recorder, held)
    return _running_info(config.consumer_group, consumer.client_id, properties, consumer._subs.values(), queues,
                         recorder, jstack)


def _running_info(group: str, client_id: str, properties: Mapping[str, Any], subs: Iterable[Any],
                  queues: list[dict[str, Any]], recorder: ConsumeStatsRecorder, jstack: bool) -> dict[str, Any]:
    subscriptions = _subscription_rows(subs)
    # Every subscribed topic, as RocketMQ lists one (zeros before its first pull), and any other this consumer
    # pulls (a lite pull consumer's assigned topics have no subscription unless given an expression).
    topics = sorted({s["topic"] for s in subscriptions} | {q["topic"] for q in queues})
    return {"consumer_group": group, "client_id": client_id, "properties": dict(properties),
            "subscriptions": subscriptions, "queues": queues,
            "status": {topic: recorder.status(topic) for topic in topics},
            "jstack": task_dump() if jstack else None}


def task_dump(max_chars: int = JSTACK_MAX_CHARS) -> str:
    """Where every task of this trio run waits, as a tree (RocketMQ's jstack of a consumer's process): each task's
    name and its innermost frames, its children indented under it. Cut at ``max_chars``."""
    lines: list[str] = []
    size = 0

    def add(line: str) -> bool:
        nonlocal size
        size += len(line) + 1
        if size > max_chars:
            return False
        lines.append(line)
        return True

    def walk(task: trio.lowlevel.Task, depth: int) -> bool:
        pad = "  " * depth
        if not add(f"{pad}task {task.name}"):
            return False
        frames = list(task.iter_await_frames())
        for frame, lineno in frames[-_FRAMES_PER_TASK:]:
            where = os.sep.join(frame.f_code.co_filename.split(os.sep)[-2:])
            if not add(f"{pad}    at {frame.f_code.co_name} ({where}:{lineno})"):
                return False
        return all(walk(child, depth + 1) for nursery in task.child_nurseries for child in nursery.child_tasks)

    if not walk(trio.lowlevel.current_root_task(), 0):
        lines.append(f"... cut at {max_chars} characters")
    return "\n".join(lines)
