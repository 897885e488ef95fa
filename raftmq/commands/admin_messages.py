"""``raftmq admin``'s message commands: send test messages, read a topic's messages, show one by queue and offset,
show one's trace (RocketMQ's mqadmin sendMessage, consumeMessage / printMsgByQueue, queryMsgByOffset,
queryMsgTraceById), and the message rows and tables every message command prints (query-msg-id and query-msg-key
too).

    raftmq admin send-message TOPIC --body TEXT|--body-file PATH [--keys K1,K2] [--tags TAG]
                              [--broker NAME --queue N] [--count N] [--delay-level N]        (sendMessage)
    raftmq admin consume-message TOPIC [--broker NAME [--queue N]] [--offset N | --begin-ms MS] [--end-ms MS]
                                 [--count N] [--tags EXPR] [--group GROUP] [--body-file-dir DIR]   (consumeMessage)
    raftmq admin query-msg-offset TOPIC --broker NAME --queue N --offset N [--body-file PATH]  (queryMsgByOffset)
    raftmq admin query-msg-trace --msg-id ID [--trace-topic T]                       (queryMsgTraceById)

Their rules, which ``admin.py`` (registration, the checks every command shares, ``run``) does not know:
- They go through the ordinary clients: ``open_producer`` sends (routing, retries, NOT_LEADER redirects as any
  application's), ``open_pull_consumer`` reads (leader first, followers when it is down). No new wire request.
- consume-message and query-msg-offset only read: a pull consumer sends no heartbeat (it joins no group, so no
  group rebalances) and these pulls carry no commit flag, so no consumer group's offset moves. The group the pulls
  name (``TOOLS_CONSUMER``, RocketMQ's tools group, unless ``--group``) shows only in the brokers' pull statistics.
- Everything is bounded: at most ``MAX_MESSAGES`` messages, and the whole command by ``--timeout`` (``run``'s
  deadline). The loops stop a little before it, so what was sent or read by then is reported, with exit 1.
- Refusals are ``ClientError``s: ``run`` prints their sentence (and its notes) and exits 1.

This module imports nothing of ``admin.py``; ``admin.py`` imports it (one way, as the packages import).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.table import Table
from rich.text import Text

from broker.delay_level import MAX_DELAY_LEVELS
from client import open_producer, open_pull_consumer
from client.admin import AdminClient
from client.errors import ClientError
from client.filter import parse_subscription
from client.message import I32_MAX, I64_MAX, Message, MessageExt, MessageQueue, PullStatus, SendResult
from client.producer import ProducerConfig
from client.pull_consumer import PullConsumer
from client.trace import TRACE_TOPIC, TraceContext
from remoting.config import ConfigError
from remoting.errors import RaftMQError
from remoting.message import KEY_SEPARATOR, topic_problem

__all__ = ["COMMANDS", "MAX_MESSAGES", "register", "check", "print_result", "message_data", "print_message",
           "check_body_file", "utc"]

MAX_MESSAGES = 10_000  # sent or read by one command: a smoke test or a look, not a bulk copy (bench is for that)
BODY_PREVIEW_BYTES = 512  # of a body shown in one message's table; --body-file and --json carry it whole
ROW_PREVIEW_BYTES = 80  # of a body shown in a row of consume-message's table
PULL_BATCH = 256  # messages asked for per pull (the brokers cap it at their max_transfer_count)
# consume-message holds what it read until it prints it, as one JSON line with --json: --count alone let 10,000
# messages of 4 MiB (40 GiB) be read into memory. It stops once the bodies read reach this, saying so.
MAX_READ_BYTES = 64 * 1024 * 1024
TOOLS_PRODUCER_GROUP = "TOOLS_PRODUCER"
TOOLS_CONSUMER_GROUP = "TOOLS_CONSUMER"  # RocketMQ's MixAll.TOOLS_CONSUMER_GROUP
# The producer's own limit (client and brokers default to the same): a bigger --body-file is a bad argument.
MAX_BODY_BYTES = next(f.default for f in dataclasses.fields(ProducerConfig) if f.name == "max_message_size_bytes")
# How long before run()'s deadline the loops stop: closing a producer says goodbye to the brokers (up to 1 s), and
# a deadline reached there would end in run()'s bare "no answer" instead of what was done.
_CLOSE_MARGIN_S = 1.5


def register(add_command: Callable[..., argparse.ArgumentParser]) -> None:
    send = add_command("send-message", help="send test messages through the ordinary producer (as any "
                                            "application's: routing, retries, leader redirects)",
                       description=f"Send --count messages (one after another) to TOPIC as producer group "
                                   f"{TOOLS_PRODUCER_GROUP}, and print each one's send status, ids and where it "
                                   f"was stored. A send that fails stops the rest (exit 1, saying how many went).")
    send.add_argument("topic")
    body = send.add_mutually_exclusive_group(required=True)
    body.add_argument("--body", metavar="TEXT", help="the body, as UTF-8")
    body.add_argument("--body-file", metavar="PATH", help="the body, this file's bytes")
    send.add_argument("--keys", metavar="K1,K2", help="the messages' keys (KEYS), separated by commas")
    send.add_argument("--tags", metavar="TAG", help="the messages' tag")
    _add_queue(send, "send to this queue only (--broker NAME --queue N), no retry elsewhere; default: the "
                     "producer picks queues round-robin")
    send.add_argument("--count", type=int, default=1, metavar="N", help=f"messages to send, one after another "
                                                           f"(1..{MAX_MESSAGES}, default 1)")
    send.add_argument("--delay-level", type=int, default=0, metavar="N",
                      help="deliver that long after storing (1-based into the brokers' message_delay_level, "
                           "1s 5s 10s 30s 1m ... by default; 0, the default: at once)")

    consume = add_command("consume-message", help="read a topic's messages with a pull consumer, committing no "
                                                   "offset: no consumer group moves (mqadmin consumeMessage)",
                          description="Read messages of every queue of TOPIC (or of --broker, or one --queue), "
                                      "queue after queue, from each queue's oldest message kept (or --offset, or "
                                      "the first stored at or after --begin-ms) up to its end, --end-ms or --count "
                                      "messages in all. Read only: no offset is committed and no member joins a "
                                      "group, so no consumer group moves or rebalances; the queues table says "
                                      "where each queue was read to (--offset NEXT goes on from there).")
    consume.add_argument("topic")
    _add_queue(consume, "only the queues of this group (--broker NAME), or one queue (with --queue N); default: "
                        "every queue of the topic")
    start = consume.add_mutually_exclusive_group()
    start.add_argument("--offset", type=int, metavar="N",
                       help="from this offset of the queue --queue names (default: each queue's oldest message kept)")
    start.add_argument("--begin-ms", type=int, metavar="MS",
                       help="from the first message stored at or after this time (ms since the epoch), in each queue")
    consume.add_argument("--end-ms", type=int, metavar="MS",
                         help="up to the last message stored at or before this time (ms since the epoch)")
    consume.add_argument("--count", type=int, default=32, metavar="N",
                         help=f"most messages, over every queue read (1..{MAX_MESSAGES}, default 32)")
    consume.add_argument("--tags", metavar="EXPR", help="only messages with these tags: TAG or TAG1||TAG2 "
                                                        "(default: every message)")
    consume.add_argument("--group", default=TOOLS_CONSUMER_GROUP,
                         help=f"the consumer group the pulls name (default {TOOLS_CONSUMER_GROUP}): only the "
                              f"brokers' pull statistics count them; its offsets are neither read nor committed")
    consume.add_argument("--body-file-dir", metavar="DIR", help="also write each body to DIR/<offset msg id>")

    by_offset = add_command("query-msg-offset", help="one message by its queue and queue offset "
                                                      "(mqadmin queryMsgByOffset)")
    by_offset.add_argument("topic")
    by_offset.add_argument("--broker", required=True, metavar="NAME", help="the queue's broker group")
    by_offset.add_argument("--queue", type=int, required=True, metavar="N", help="the queue id")
    by_offset.add_argument("--offset", type=int, required=True, metavar="N", help="the queue offset")
    by_offset.add_argument("--body-file", metavar="PATH", help="also write the message body to this file")

    trace = add_command("query-msg-trace", help="a message's trace: who sent it, where it was stored, who consumed "
                                                "it and how (mqadmin queryMsgTraceById)",
                        description="Find the trace contexts traced producers and push consumers (enable_msg_trace) "
                                    "sent to the trace topic for the message whose unique id (SendResult.msg_id) is "
                                    "--msg-id, by key, and print them oldest first: its Pub (producer group, client "
                                    "and store host, cost, status), then each handler call's SubBefore and SubAfter "
                                    "(consumer group, client host, reconsume times, cost, status).")
    trace.add_argument("--msg-id", required=True, metavar="ID", help="the traced message's unique id (msg id)")
    trace.add_argument("--trace-topic", default=TRACE_TOPIC, metavar="T",
                       help=f"the topic the traces went to (the clients' trace_topic; default {TRACE_TOPIC})")


def _add_queue(parser: argparse.ArgumentParser, text: str) -> None:
    parser.add_argument("--broker", metavar="NAME", help=text)
    parser.add_argument("--queue", type=int, metavar="N", help="the queue id, with --broker")


# -- argument checks (ConfigError: exit 2) -----------------------------------------------------------------------


def check(args: argparse.Namespace) -> None:
    """The checks of the message commands; admin's ``_check`` has done the shared ones (names, --timeout)."""
    command = args.admin_command
    if command == "query-msg-trace":
        _check_trace(args)
        return
    if args.queue is not None:
        if args.broker is None:
            raise ConfigError(f"--queue {args.queue} needs --broker: queue ids are per broker group")
        if not 0 <= args.queue <= I32_MAX:
            raise ConfigError(f"--queue must be within 0..{I32_MAX}, got {args.queue}")
    if command == "send-message":
        _check_send(args)
    elif command == "consume-message":
        _check_consume(args)
    elif command == "query-msg-offset":
        if not 0 <= args.offset <= I64_MAX:
            raise ConfigError(f"--offset must be within 0..{I64_MAX}, got {args.offset}")
        if args.body_file is not None:
            check_body_file(args.body_file)


def _check_trace(args: argparse.Namespace) -> None:
    if not args.msg_id:
        raise ConfigError("--msg-id must not be empty")
    if KEY_SEPARATOR in args.msg_id:  # found by key: no key holds one
        raise ConfigError(f"--msg-id {args.msg_id[:80]!r} holds a space; a msg id has none")
    problem = topic_problem(args.trace_topic)
    if problem:
        raise ConfigError(f"--trace-topic {args.trace_topic[:80]!r} {problem}")


def _check_send(args: argparse.Namespace) -> None:
    if args.broker is not None and args.queue is None:
        raise ConfigError(f"--broker {args.broker!r} needs --queue: a send goes to one queue (without both, the "
                          f"producer picks the queues)")
    if not 1 <= args.count <= MAX_MESSAGES:
        raise ConfigError(f"--count must be within 1..{MAX_MESSAGES}, got {args.count}")
    if not 0 <= args.delay_level <= MAX_DELAY_LEVELS:
        raise ConfigError(f"--delay-level must be within 0..{MAX_DELAY_LEVELS} (0: not delayed; the brokers' "
                          f"message_delay_level has 18 levels by default), got {args.delay_level}")
    if args.body is not None:
        if not args.body:
            raise ConfigError("--body must not be empty: the brokers refuse an empty body")
        args.body_bytes = args.body.encode("utf-8", errors="surrogateescape")  # bytes a shell passed undecoded
    else:
        args.body_bytes = _read_body_file(args.body_file)
    if len(args.body_bytes) > MAX_BODY_BYTES:
        raise ConfigError(f"--body of {len(args.body_bytes)} bytes exceeds the producer's max_message_size_bytes "
                          f"{MAX_BODY_BYTES}")
    args.key_list = None
    if args.keys is not None:
        args.key_list = [k.strip() for k in args.keys.split(",")]
        if not all(args.key_list):
            raise ConfigError(f"--keys {args.keys!r} has an empty key: give keys separated by commas, K1,K2")
        spaced = next((k for k in args.key_list if KEY_SEPARATOR in k), None)
        if spaced is not None:  # stored split on spaces: the key would be found as two others, never as itself
            raise ConfigError(f"--keys: key {spaced!r} holds a space; keys are stored split on spaces, so "
                              f"separate them with commas")
    if args.tags is not None and (not args.tags or args.tags != args.tags.strip() or "|" in args.tags
                                  or args.tags == "*"):
        # No subscription could name such a tag: only '*' subscribers would ever see the messages.
        raise ConfigError(f"--tags {args.tags!r} cannot be named by a tag expression (not empty, no '|', no "
                          f"leading or trailing whitespace, not '*')")
    try:  # what remains to refuse (the properties' encoded size), worded by Message itself
        Message(args.topic, args.body_bytes, tags=args.tags, keys=args.key_list, delay_level=args.delay_level)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"the message cannot be sent: {e}") from None


def _read_body_file(value: str) -> bytes:
    path = Path(value)
    if not value:
        raise ConfigError("--body-file must name a file, got ''")
    if not path.is_file():
        raise ConfigError(f"--body-file {value!r} is " + ("a directory, not a file" if path.is_dir() else
                                                          "no file that exists"))
    try:
        size = path.stat().st_size
        if size > MAX_BODY_BYTES:  # before reading it whole
            raise ConfigError(f"--body-file {value!r} holds {size} bytes, more than the producer's "
                              f"max_message_size_bytes {MAX_BODY_BYTES}")
        body = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"--body-file {value!r} cannot be read: {e.strerror or e}") from None
    if not body:
        raise ConfigError(f"--body-file {value!r} is empty: the brokers refuse an empty body")
    return body


def _check_consume(args: argparse.Namespace) -> None:
    if not 1 <= args.count <= MAX_MESSAGES:
        raise ConfigError(f"--count must be within 1..{MAX_MESSAGES}, got {args.count}")
    if args.offset is not None:
        if args.queue is None:
            raise ConfigError(f"--offset {args.offset} needs --broker and --queue: offsets are per queue")
        if not 0 <= args.offset <= I64_MAX:
            raise ConfigError(f"--offset must be within 0..{I64_MAX}, got {args.offset}")
    begin = 0 if args.begin_ms is None else args.begin_ms
    end = I64_MAX if args.end_ms is None else args.end_ms
    if not 0 <= begin <= end <= I64_MAX:
        raise ConfigError(f"--begin-ms and --end-ms must satisfy 0 <= begin <= end <= {I64_MAX}, got "
                          f"{args.begin_ms} and {args.end_ms}")
    try:
        parse_subscription(args.topic, args.tags)
    except ValueError as e:  # worded for a subscription: name the argument as the usage does
        text = str(e)
        for said, flag in (("tag expression ", "--tags "), ("topic ", "TOPIC ")):
            if text.startswith(said):
                text = flag + text.removeprefix(said)
        raise ConfigError(text) from None
    if args.body_file_dir is not None:
        if not args.body_file_dir:
            raise ConfigError("--body-file-dir must name a directory, got ''")
        if not Path(args.body_file_dir).is_dir():
            raise ConfigError(f"--body-file-dir {args.body_file_dir!r} is no directory that exists")
        if not os.access(args.body_file_dir, os.W_OK | os.X_OK):
            raise ConfigError(f"--body-file-dir {args.body_file_dir!r} is not writable")


def check_body_file(value: str) -> None:
    """``--body-file``: where the body will be written once the message is found; a path it cannot be written
    to is a bad argument, not something to learn after the query (an empty one was silently ignored)."""
    path = Path(value)
    if not value:
        raise ConfigError("--body-file must name a file, got ''")
    if path.is_dir():
        raise ConfigError(f"--body-file {value!r} is a directory, not a file")
    if not path.parent.is_dir():
        raise ConfigError(f"--body-file {value!r}: directory {str(path.parent)!r} does not exist")


# -- the commands ------------------------------------------------------------------------------------------------


def _stop_at(args: argparse.Namespace) -> float:
    """When a loop stops sending or reading: run()'s --timeout deadline, less the time to close and report."""
    return trio.current_effective_deadline() - min(_CLOSE_MARGIN_S, args.timeout / 4)


def _send_row(result: SendResult) -> dict[str, Any]:
    mq = result.message_queue
    return {"send_status": result.send_status.value, "msg_id": result.msg_id, "offset_msg_id": result.offset_msg_id,
            "broker_name": mq.broker_name, "queue_id": mq.queue_id, "queue_offset": result.queue_offset}


def _sent_so_far(sent: Sequence[SendResult], count: int) -> str:
    last = sent[-1]
    return (f"{len(sent)} of {count} message(s) were sent before it; the last: offset msg id {last.offset_msg_id}, "
            f"{last.message_queue.broker_name} queue {last.message_queue.queue_id} offset {last.queue_offset}")


async def _send_message(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    queue = None
    if args.broker is not None:
        queue = MessageQueue(args.topic, args.broker, args.queue)
        # The producer would name only the group it cannot find; this names the queues there are.
        _check_queue_of(queue, (await admin.get_route(args.topic)).write_queues(), "write")
    sent: list[SendResult] = []
    async with open_producer(args.namesrv, producer_group=TOOLS_PRODUCER_GROUP) as producer:
        with trio.move_on_at(_stop_at(args)) as scope:
            for _ in range(args.count):  # one at a time: a pinned queue keeps them in the order sent
                message = Message(args.topic, args.body_bytes, tags=args.tags, keys=args.key_list,
                                  delay_level=args.delay_level)
                try:
                    sent.append(await producer.send(message, queue=queue))
                except RaftMQError as e:
                    if sent:
                        e.add_note(_sent_so_far(sent, args.count))
                    raise
    if scope.cancelled_caught:
        raise ClientError(f"{len(sent)} of {args.count} message(s) sent within --timeout {args.timeout:g} s"
                          + (f"; the last: offset msg id {sent[-1].offset_msg_id}" if sent else ""),
                          topic=args.topic)
    return {"topic": args.topic, "delay_level": args.delay_level, "sent": [_send_row(r) for r in sent]}


def _check_queue_of(mq: MessageQueue, queues: Sequence[MessageQueue], kind: str) -> None:
    if mq in queues:
        return
    mine = [q.queue_id for q in queues if q.broker_name == mq.broker_name]
    if mine:
        raise ClientError(f"queue {mq.queue_id} is no {kind} queue of topic {mq.topic!r} on broker group "
                          f"{mq.broker_name!r} (its {kind} queues: 0..{max(mine)})", topic=mq.topic,
                          broker_name=mq.broker_name)
    groups = sorted({q.broker_name for q in queues})
    raise ClientError(f"topic {mq.topic!r} has no {kind} queue on broker group {mq.broker_name!r} (it has "
                      f"{kind} queues on: {', '.join(groups) or 'none'})", topic=mq.topic, broker_name=mq.broker_name)


async def _consume_message(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    found: list[MessageExt] = []
    ranges: list[dict[str, Any]] = []
    budget = {"bytes": MAX_READ_BYTES}
    async with open_pull_consumer(args.namesrv, consumer_group=args.group) as consumer:
        queues = await consumer.fetch_queues(args.topic)  # its read queues: what consumers are given
        if args.queue is not None:
            named = MessageQueue(args.topic, args.broker, args.queue)
            _check_queue_of(named, queues, "read")
            queues = [named]
        elif args.broker is not None:
            wanted = [q for q in queues if q.broker_name == args.broker]
            if not wanted:
                _check_queue_of(MessageQueue(args.topic, args.broker, 0), queues, "read")
            queues = wanted
        if not queues:
            raise ClientError(f"topic {args.topic!r} has no readable queue", topic=args.topic)
        with trio.move_on_at(_stop_at(args)) as scope:
            for mq in queues:
                if len(found) >= args.count or budget["bytes"] <= 0:
                    break
                start = await _start_offset(consumer, mq, args)
                # Recorded before reading, so a stop at --timeout still says where this queue got to.
                ranges.append({"broker_name": mq.broker_name, "queue_id": mq.queue_id, "from_offset": start,
                               "next_offset": start, "max_offset": None})
                await _read_queue(consumer, mq, args, found, ranges[-1], budget)
    if scope.cancelled_caught:
        where = (f"; {ranges[-1]['broker_name']} queue {ranges[-1]['queue_id']} was read up to offset "
                 f"{ranges[-1]['next_offset']}" if ranges else "")
        raise ClientError(f"{len(found)} message(s) of up to {args.count} read within --timeout {args.timeout:g} s"
                          f"{where}; raise --timeout or narrow the range", topic=args.topic)
    messages = [message_data(m) for m in found]
    if args.body_file_dir is not None:
        for m, row in zip(found, messages):
            row["body_file"] = _write_body(os.path.join(args.body_file_dir, m.offset_msg_id), m.body,
                                           "--body-file-dir")
    # Past the byte budget: the queues after it were not read, and --offset NEXT goes on from where it stopped.
    return {"topic": args.topic, "messages": messages, "queues": ranges,
            "stopped_at_bytes": MAX_READ_BYTES if budget["bytes"] <= 0 else None}


async def _start_offset(consumer: PullConsumer, mq: MessageQueue, args: argparse.Namespace) -> int:
    if args.offset is not None:
        low, high = await consumer.min_offset(mq), await consumer.max_offset(mq)
        if not low <= args.offset <= high:
            raise ClientError(f"--offset {args.offset} is outside {mq.broker_name} queue {mq.queue_id} of "
                              f"{mq.topic!r}, which {_holds(low, high)}", topic=mq.topic, broker_name=mq.broker_name)
        return args.offset
    if args.begin_ms is not None:
        return await consumer.search_offset(mq, args.begin_ms)
    return await consumer.min_offset(mq)


def _holds(low: int, high: int) -> str:
    return f"holds offsets {low}..{high - 1}" if high > low else f"holds no message (its next offset is {high})"


async def _read_queue(consumer: PullConsumer, mq: MessageQueue, args: argparse.Namespace, found: list[MessageExt],
                      progress: dict[str, Any], budget: dict[str, int]) -> None:
    """Messages of ``mq`` from ``progress["next_offset"]`` into ``found``, until the queue's end, --end-ms, --count
    or ``budget["bytes"]`` of bodies (counted down); ``progress`` follows where it got to. Never commits:
    ``PullConsumer.pull`` sends no commit flag."""
    offset = progress["next_offset"]
    while len(found) < args.count:
        result = await consumer.pull(mq, offset, min(args.count - len(found), PULL_BATCH),
                                     expression=args.tags or "*")
        progress["max_offset"] = result.max_offset
        if result.status is PullStatus.NO_NEW_MSG:
            return
        for m in result.messages:
            if args.end_ms is not None and m.store_timestamp > args.end_ms:
                return  # a queue's messages are stored in time order: the rest are later still
            found.append(m)
            offset = progress["next_offset"] = m.queue_offset + 1
            budget["bytes"] -= len(m.body)
            if len(found) >= args.count or budget["bytes"] <= 0:
                return
        # Skipped by the tag filter, or removed by retention: the broker says where to go on.
        if result.next_begin_offset <= offset and not result.messages:
            return  # no way forward (guards a loop on an answer that does not move)
        offset = progress["next_offset"] = max(offset, result.next_begin_offset)


async def _query_msg_offset(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    mq = MessageQueue(args.topic, args.broker, args.queue)
    async with open_pull_consumer(args.namesrv, consumer_group=TOOLS_CONSUMER_GROUP) as consumer:
        _check_queue_of(mq, await consumer.fetch_queues(args.topic), "read")
        result = await consumer.pull(mq, args.offset, 1)
    message = next((m for m in result.messages if m.queue_offset == args.offset), None)
    if message is None:
        raise ClientError(f"no message at offset {args.offset} of {mq.broker_name} queue {mq.queue_id} of "
                          f"{mq.topic!r}, which {_holds(result.min_offset, result.max_offset)}", topic=mq.topic,
                          broker_name=mq.broker_name)
    if args.body_file is not None:
        _write_body(args.body_file, message.body, "--body-file")
    return {"messages": [message_data(message)]}


def _write_body(path: str, body: bytes, flag: str) -> str:
    try:
        with open(path, "wb") as f:
            f.write(body)
    except OSError as e:
        raise ClientError(f"could not write the body to {flag} {path!r}: {e.strerror or e}") from None
    return path


async def _query_msg_trace(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    contexts = await admin.query_msg_trace(args.msg_id, trace_topic=args.trace_topic)
    if not contexts:
        raise ClientError(f"no trace of message {args.msg_id!r} in trace topic {args.trace_topic!r} (was it sent or "
                          f"consumed with enable_msg_trace, and with this trace_topic?)", topic=args.trace_topic)
    return {"msg_id": args.msg_id, "trace_topic": args.trace_topic, "traces": [_trace_data(c) for c in contexts]}


def _trace_data(ctx: TraceContext) -> dict[str, Any]:
    data = dataclasses.asdict(ctx)
    data["trace_type"] = ctx.trace_type.value
    data["msg_type"] = ctx.msg_type.name
    return data


COMMANDS = {"send-message": _send_message, "consume-message": _consume_message,
            "query-msg-offset": _query_msg_offset, "query-msg-trace": _query_msg_trace}


# -- output ------------------------------------------------------------------------------------------------------


def message_data(m: MessageExt) -> dict[str, Any]:
    """A message as every message command's --json gives it: every field, the body whole in base64."""
    return {"msg_id": m.msg_id, "offset_msg_id": m.offset_msg_id, "topic": m.topic, "broker_name": m.broker_name,
            "queue_id": m.queue_id, "queue_offset": m.queue_offset, "tags": m.tags, "keys": m.keys,
            "properties": dict(m.properties), "born_timestamp": m.born_timestamp,
            "store_timestamp": m.store_timestamp, "store_host": f"{m.store_host[0]}:{m.store_host[1]}",
            "phy_offset": m.phy_offset, "reconsume_times": m.reconsume_times, "flag": m.flag,
            "sys_flag": m.sys_flag, "body_size": len(m.body), "body_base64": base64.b64encode(m.body).decode()}


def utc(ms: int | None) -> str:
    if ms is None:
        return "-"
    try:
        return datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S.%f")[:-3]
    except (ValueError, OverflowError, OSError):
        # A producer may set any born_timestamp 0..2^63-1 and the broker keeps it: past year 9999 datetime raised
        # out of the table and the command ended in a traceback.
        return f"{ms} ms (not a date)"


def _preview(body: bytes, limit: int) -> str:
    # Text as text, anything else (control characters, bytes that are not UTF-8) escaped, so a binary body
    # cannot garble the terminal.
    text = body[:limit].decode("utf-8", errors="backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text) + (" …" if len(body) > limit else "")


def print_message(console: Console, m: dict[str, Any]) -> None:
    table = Table(title=f"message {m['msg_id']}", header_style="bold", show_header=False)
    table.add_column("field")
    table.add_column("value")
    rows = [("topic", m["topic"]), ("group", m["broker_name"]), ("queue", str(m["queue_id"])),
            ("queue offset", str(m["queue_offset"])), ("msg id", m["msg_id"]), ("offset msg id", m["offset_msg_id"]),
            ("tags", m["tags"] or ""), ("keys", " ".join(m["keys"])),
            ("properties", ", ".join(f"{k}={v}" for k, v in sorted(m["properties"].items()))),
            ("born (UTC)", utc(m["born_timestamp"])), ("stored (UTC)", utc(m["store_timestamp"])),
            ("store host", m["store_host"]), ("commit-log offset", str(m["phy_offset"])),
            ("reconsume times", str(m["reconsume_times"])), ("body bytes", str(m["body_size"])),
            ("body", _preview(base64.b64decode(m["body_base64"]), BODY_PREVIEW_BYTES))]
    for key, value in rows:
        table.add_row(key, Text(value))
    console.print(table)


def print_result(console: Console, command: str, data: dict[str, Any]) -> None:
    if command == "send-message":
        # A delayed send's result names the topic's queue it was sent to (SendResult keeps it) and the offset in the
        # schedule queue it waits in: its offset in the topic is known only once it is delivered.
        delayed = (f" with delay level {data['delay_level']} (queue: the topic's queue it is delivered to; queue "
                   f"offset: in the schedule queue it waits in until due)" if data["delay_level"] else "")
        table = Table(title=f"{len(data['sent'])} message(s) sent to {data['topic']}{delayed}", header_style="bold")
        for column in ("#", "status", "msg id", "offset msg id", "group", "queue", "queue offset"):
            table.add_column(column, justify="right" if column in ("#", "queue", "queue offset") else "left")
        for i, r in enumerate(data["sent"], 1):
            table.add_row(str(i), r["send_status"], r["msg_id"], r["offset_msg_id"], r["broker_name"],
                          str(r["queue_id"]), str(r["queue_offset"]))
        console.print(table)
    elif command == "consume-message":
        if data["messages"]:
            table = Table(title=f"{len(data['messages'])} message(s) of {data['topic']}", header_style="bold")
            for column in ("queue", "offset", "msg id", "tags", "keys", "born (UTC)", "stored (UTC)", "body"):
                table.add_column(column, justify="right" if column == "offset" else "left")
            for m in data["messages"]:
                table.add_row(f"{m['broker_name']}:{m['queue_id']}", str(m["queue_offset"]), m["msg_id"],
                              Text(m["tags"] or ""), Text(" ".join(m["keys"])), utc(m["born_timestamp"]),
                              utc(m["store_timestamp"]),
                              Text(_preview(base64.b64decode(m["body_base64"]), ROW_PREVIEW_BYTES)))
            console.print(table)
        else:
            print(f"no message of {data['topic']} in the range read")
        # Where each queue was read from and to: --offset NEXT continues there.
        table = Table(title="queues read (no offset committed)", header_style="bold")
        for column in ("group", "queue", "from offset", "next offset", "max offset"):
            table.add_column(column, justify="left" if column == "group" else "right")
        for q in data["queues"]:
            table.add_row(q["broker_name"], str(q["queue_id"]), str(q["from_offset"]), str(q["next_offset"]),
                          "-" if q["max_offset"] is None else str(q["max_offset"]))
        console.print(table)
        if data["stopped_at_bytes"] is not None:
            print(f"stopped after {data['stopped_at_bytes'] // (1024 * 1024)} MiB of bodies; --offset NEXT (with "
                  f"--broker and --queue) reads on from where it stopped")
        written = sum(1 for m in data["messages"] if "body_file" in m)
        if written:
            print(f"{written} bod{'y' if written == 1 else 'ies'} written to "
                  f"{os.path.dirname(data['messages'][0]['body_file'])}, each named by its offset msg id")
    elif command == "query-msg-offset":
        print_message(console, data["messages"][0])
    elif command == "query-msg-trace":
        _print_trace(console, data)


def _print_trace(console: Console, data: dict[str, Any]) -> None:
    # mqadmin queryMsgTraceById's columns, the sends and the consumption in one table, oldest first.
    table = Table(title=f"trace of message {data['msg_id']} ({data['trace_topic']})", header_style="bold")
    for column in ("type", "group", "client host", "time (UTC)", "cost (ms)", "status", "reconsume times",
                   "details"):
        table.add_column(column, justify="right" if column in ("cost (ms)", "reconsume times") else "left")
    for t in data["traces"]:
        status = "-" if t["success"] is None else ("success" if t["success"] else "failed")
        kind = t["trace_type"]
        if kind == "Pub":
            details = (f"topic {t['topic']}, store host {t['store_host'] or '-'}, offset msg id "
                       f"{t['offset_msg_id'] or '-'}, {t['msg_type']}, {t['body_length']} bytes")
        elif kind == "EndTransaction":
            status = t["transaction_state"]
            details = f"transaction id {t['transaction_id']}" + (", from a check" if t["from_transaction_check"]
                                                                  else "")
        else:
            details = f"request {t['request_id']}"
        retry = str(t["retry_times"]) if kind == "SubBefore" else ""
        cost = "" if kind in ("SubBefore", "EndTransaction") else str(t["cost_ms"])
        table.add_row(kind, Text(t["group"]), t["client_host"] or "-", utc(t["timestamp_ms"]), cost, status, retry,
                      Text(details))
    console.print(table)
