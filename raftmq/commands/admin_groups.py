"""``raftmq admin``'s consumer- and producer-group commands: a group's members, what they are doing and their
progress, its subscription group config, moving or copying its offsets, deleting it (RocketMQ's mqadmin
consumerConnection, consumerStatus, consumerProgress, updateSubGroup, getConsumerConfig, resetOffsetByTime,
cloneGroupOffset, deleteSubGroup -r, producerConnection).

    raftmq admin consumer-connection GROUP [--cluster NAME]          (consumerConnection)
    raftmq admin consumer-status -g GROUP [-i CLIENT_ID] [-s]        (consumerStatus)
    raftmq admin consumer-progress GROUP [--topic TOPIC] [--cluster NAME]  (consumerProgress)
    raftmq admin delete-group GROUP [--cluster NAME | --broker NAME ...]   (deleteSubGroup -r)
    raftmq admin update-sub-group -g GROUP [-s true|false] [-r N] [...] [--cluster NAME | --broker NAME ...]
                                                                     (updateSubGroup)
    raftmq admin sub-group-list [-g GROUP] [--cluster NAME | --broker NAME ...]   (getConsumerConfig)
    raftmq admin producer-connection GROUP [--cluster NAME]          (producerConnection)
    raftmq admin reset-offset GROUP TOPIC --to earliest|latest|now|MS|ISO-8601   (resetOffsetByTime)
    raftmq admin clone-group-offset -s SRC_GROUP -d DEST_GROUP -t TOPIC   (cloneGroupOffset)

Apart from ``admin.py`` (registration, the checks every command shares, ``run``) so that each stays under the size
we split at; the commands, their options, argument checks and printers are here, as the message commands are in
``admin_messages.py``. The group and topic names these commands take are checked by ``admin.py``'s name checks,
with every other command's; those of consumer-status and clone-group-offset by ``check`` here.

This module imports nothing of ``admin.py``; ``admin.py`` imports it (one way, as the packages import), and takes
from it what both use: ``Refused``, ``add_targets``, ``change``, ``parse_when`` and ``LATEST_MS``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from broker.topic_config import TopicConfigError, validate_group_name, validate_topic_name
from client.admin import SUBSCRIPTION_GROUP_FIELDS, AdminClient, ConsumerRunningInfo
from raftmq.commands.admin_messages import utc as _utc
from remoting.config import ConfigError
from remoting.errors import RaftMQError

__all__ = ["COMMANDS", "LATEST_MS", "Refused", "register", "check", "print_result", "add_targets", "change",
           "parse_when"]

LATEST_MS = (1 << 63) - 1  # a time after every message: each queue's end


class Refused(Exception):
    """What an admin command found it cannot do, from the cluster's answers (no member online, no such config):
    ``admin.run`` prints its sentence and notes, exit 1."""


# update-sub-group's options, with mqadmin updateSubGroup's letters: flag, short flag, field, help. Whether a field
# is a boolean, and an integer's bounds: client.admin.SUBSCRIPTION_GROUP_FIELDS.
_SUB_GROUP_OPTIONS = (
    ("--consume-enable", "-s", "consume_enable", "false: the group's pulls are refused (NO_PERMISSION), held ones at "
                                                 "once; true: served again"),
    ("--consume-from-min-enable", "-m", "consume_from_min_enable", "stored and shown only"),
    ("--consume-broadcast-enable", "-d", "consume_broadcast_enable", "false: pulls of members that consume as "
                                                                     "BROADCASTING are refused"),
    ("--retry-queue-nums", "-q", "retry_queue_nums", "queues of its retry topic when a send-back creates it "
                                                     "(1..1024, default 1)"),
    ("--retry-max-times", "-r", "retry_max_times", "retries before the dead-letter topic, for a send-back that "
                                                   "names no limit (default 16)"),
    ("--broker-id", "-i", "broker_id", "stored and shown only"),
    ("--which-broker-when-consume-slowly", "-w", "which_broker_when_consume_slowly", "stored and shown only"),
    ("--notify-consumer-ids-changed-enable", "-a", "notify_consumer_ids_changed_enable",
     "false: members are not told when the group's members change (they rebalance on their own timer)"),
)


def _true_false(text: str) -> bool:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")


def add_targets(parser: argparse.ArgumentParser) -> None:
    """``--cluster`` or ``--broker NAME ...``: the broker groups a change goes to (the topic commands take them too)."""
    targets = parser.add_mutually_exclusive_group()
    targets.add_argument("--cluster", help="every group of this cluster (default: every group)")
    targets.add_argument("--broker", action="append", metavar="NAME", help="this group (repeatable)")


def register(add_command: Callable[..., argparse.ArgumentParser]) -> None:
    connection = add_command("consumer-connection", help="a consumer group's online members and what "
                                                          "they subscribe to")
    connection.add_argument("group", help="the consumer group")
    connection.add_argument("--cluster", help="only the broker groups of this cluster (default: every group)")
    progress = add_command("consumer-progress",
                           help="a consumer group's offsets and lag on every queue it consumes")
    progress.add_argument("group", help="the consumer group")
    scope = progress.add_mutually_exclusive_group()
    scope.add_argument("--topic", help="only this topic, on every group that routes it (default: every topic "
                                       "the consumer group has committed offsets for)")
    scope.add_argument("--cluster", help="only the broker groups of this cluster (default: every group)")
    delete_group = add_command("delete-group", help="remove a consumer group that runs no more: its offsets on every "
                                                    "group, and its retry topic (its dead letters are kept)")
    delete_group.add_argument("group", help="the consumer group (no member may be online)")
    add_targets(delete_group)
    sub_group = add_command("update-sub-group",
                            help="create a consumer group's subscription group config, or change the fields given, "
                                 "on every group (e.g. -s false stops its consumers, -s true lets them go on); the "
                                 "fields not given keep their value")
    sub_group.add_argument("-g", "--group", required=True, help="the consumer group")
    for flag, short, field, text in _SUB_GROUP_OPTIONS:
        boolean = SUBSCRIPTION_GROUP_FIELDS[field] is bool
        sub_group.add_argument(flag, short, dest=field, default=None, metavar="true|false" if boolean else "N",
                               type=_true_false if boolean else int, help=text)
    add_targets(sub_group)
    sub_groups = add_command("sub-group-list", help="consumer groups' subscription group configs on every group")
    sub_groups.add_argument("-g", "--group", help="only this consumer group")
    add_targets(sub_groups)
    producers = add_command("producer-connection", help="a producer group's online producers")
    producers.add_argument("group", help="the producer group")
    producers.add_argument("--cluster", help="only the broker groups of this cluster (default: every group)")
    reset = add_command("reset-offset", help="move a consumer group to a point in time on every queue "
                                              "of a topic (online members follow at once)")
    reset.add_argument("group", help="the consumer group")
    reset.add_argument("topic")
    reset.add_argument("--to", required=True, metavar="WHEN",
                       help="earliest (the oldest message kept), latest (the end), now, milliseconds since the "
                            "epoch, or an ISO-8601 time (UTC unless it names its zone)")
    status = add_command("consumer-status", help="what a consumer group's online members are doing: their config, "
                                                 "queues, caches and rates, as each says itself")
    status.add_argument("-g", "--group", required=True, help="the consumer group")
    status.add_argument("-i", "--client-id", help="only this member (default: every member online)")
    status.add_argument("-s", "--jstack", action="store_true", help="each member's task dump too")
    clone = add_command("clone-group-offset", help="give a consumer group another group's committed offsets of a "
                                                   "topic, on every group that routes it (online members follow)")
    clone.add_argument("-s", "--src-group", required=True, help="the group whose offsets are copied")
    clone.add_argument("-d", "--dest-group", required=True, help="the group that gets them")
    clone.add_argument("-t", "--topic", required=True)


def check(args: argparse.Namespace) -> None:
    """update-sub-group's field bounds (reset-offset's --to is read by ``parse_when``, which ``admin.py``'s
    check calls once the names are checked); consumer-status's and clone-group-offset's names."""
    try:
        if args.admin_command == "consumer-status":
            validate_group_name(args.group, "--group")
            if args.client_id is not None and not args.client_id.strip():
                raise ConfigError("--client-id must not be empty (leave it out for every member)")
        elif args.admin_command == "clone-group-offset":
            validate_group_name(args.src_group, "--src-group")
            validate_group_name(args.dest_group, "--dest-group")
            validate_topic_name(args.topic)
            if args.src_group == args.dest_group:
                raise ConfigError(f"--src-group and --dest-group are both {args.src_group!r}: nothing to clone")
    except TopicConfigError as e:
        raise ConfigError(str(e).replace("topic ", "--topic ", 1) if e.field == "topic" else str(e)) from None
    if args.admin_command == "update-sub-group":
        for flag, _short, field, _help in _SUB_GROUP_OPTIONS:
            bounds, value = SUBSCRIPTION_GROUP_FIELDS[field], getattr(args, field)
            if bounds is not bool and value is not None and not bounds[0] <= value <= bounds[1]:
                raise ConfigError(f"{flag} must be within {bounds[0]}..{bounds[1]}, got {value}")


def parse_when(value: str) -> int:
    """``--to``: a time in milliseconds since the epoch."""
    text = value.strip()
    if text == "earliest":
        return 0
    if text == "latest":
        return LATEST_MS
    if text == "now":
        return int(time.time() * 1000)
    if text.isascii() and text.isdigit():  # str.isdigit alone takes "٣" and "²"
        ms = int(text)
        if ms > LATEST_MS:  # the brokers take a signed 64-bit time
            raise ConfigError(f"--to in milliseconds must be at most {LATEST_MS} (or latest), got {value!r}")
        return ms
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"--to must be earliest, latest, now, milliseconds since the epoch or an ISO-8601 time, "
                          f"got {value!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    ms = int(when.timestamp() * 1000)
    if ms < 0:
        raise ConfigError(f"--to must not be before 1970, got {value!r}")
    return ms


async def _consumer_connection(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    found = await admin.consumer_connections(args.group, cluster=args.cluster)
    if not found.connections:
        raise Refused(f"consumer group {args.group!r} has no member online")
    return {"consumer_group": found.consumer_group, "consume_type": found.consume_type,
            "message_model": found.message_model,
            "consume_from_where": found.consume_from_where, "subscriptions": dict(found.subscriptions),
            "connections": [{"client_id": cid, "client_addr": addr,
                             "subscriptions": dict(found.member_subscriptions.get(cid, {}))}
                            for cid, addr in found.connections.items()],
            "differing_subscriptions": found.differing_topics()}


async def _delete_group(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    done = await admin.delete_group(args.group, cluster=args.cluster, broker_names=args.broker)
    return {"consumer_group": done.consumer_group, "removed_offsets": done.removed_offsets,
            "retry_topic_deleted_from": list(done.retry_topic_deleted_from),
            "config_removed_from": list(done.config_removed_from)}


async def _consumer_status(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    if args.client_id is not None:
        ids = [args.client_id]
    else:
        ids = list((await admin.consumer_connections(args.group)).connections)
        if not ids:
            raise Refused(f"consumer group {args.group!r} has no member online")
    members = []
    for client_id in ids:
        try:
            members.append(_running_info_data(await admin.consumer_running_info(args.group, client_id,
                                                                                jstack=args.jstack)))
        except RaftMQError as e:
            if len(ids) == 1:
                raise
            # One member that left since it was listed, or that does not answer, leaves the others to show.
            members.append({"client_id": client_id, "error": str(e)})
    return {"consumer_group": args.group, "members": members}


def _running_info_data(info: ConsumerRunningInfo) -> dict[str, Any]:
    return {"client_id": info.client_id, "broker_name": info.broker_name, "properties": dict(info.properties),
            "subscriptions": dict(info.subscriptions),
            "queues": [{"topic": q.queue.topic, "broker_name": q.queue.broker_name, "queue_id": q.queue.queue_id,
                        "committed_offset": q.committed_offset, "cached_msg_count": q.cached_msg_count,
                        "cached_msg_bytes": q.cached_msg_bytes, "cached_msg_min_offset": q.cached_msg_min_offset,
                        "cached_msg_max_offset": q.cached_msg_max_offset, "locked": q.locked, "paused": q.paused,
                        "last_pull_timestamp": q.last_pull_timestamp,
                        "last_consume_timestamp": q.last_consume_timestamp} for q in info.queues],
            "status": {topic: {"pull_tps": s.pull_tps, "pull_rt_ms": s.pull_rt_ms, "consume_ok_tps": s.consume_ok_tps,
                               "consume_failed_tps": s.consume_failed_tps, "consume_rt_ms": s.consume_rt_ms,
                               "consume_failed_msgs": s.consume_failed_msgs} for topic, s in info.status.items()},
            "jstack": info.jstack}


async def _clone_group_offset(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    done = await admin.clone_group_offset(args.src_group, args.dest_group, args.topic)
    return {"src_group": done.src_group, "dest_group": done.dest_group, "topic": done.topic,
            "queues": [{"broker_name": mq.broker_name, "queue_id": mq.queue_id, "previous": done.previous[mq],
                        "offset": offset} for mq, offset in sorted(done.offsets.items())],
            "consumer_ids": {name: list(ids) for name, ids in done.consumer_ids.items()}}


async def _update_sub_group(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    fields = {field: getattr(args, field) for _flag, _short, field, _help in _SUB_GROUP_OPTIONS
              if getattr(args, field) is not None}
    updates = await admin.update_subscription_group(args.group, cluster=args.cluster, broker_names=args.broker,
                                                    **fields)
    return {"consumer_group": args.group,
            "groups": [{"broker_name": u.broker_name, "created": u.previous is None,
                        "changed": {k: list(v) for k, v in u.changed.items()}, "config": u.config.fields()}
                       for u in updates]}


async def _sub_group_list(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    groups = await admin.subscription_groups(args.group, cluster=args.cluster, broker_names=args.broker)
    if args.group is not None and not groups:
        raise Refused(f"consumer group {args.group!r} has no subscription group config on any group asked (a "
                      f"member's heartbeat or first pull creates one, as does raftmq admin update-sub-group)")
    return {"subscription_groups": [{"group_name": g.group_name, "broker_name": g.broker_name, **g.fields()}
                                    for g in groups]}


async def _producer_connection(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    found = await admin.producer_connections(args.group, cluster=args.cluster)
    if not found.connections:
        raise Refused(f"producer group {args.group!r} has no producer online")
    return {"producer_group": found.producer_group,
            "connections": [{"client_id": cid, "client_addr": addr, "broker_names": list(found.broker_names[cid])}
                            for cid, addr in found.connections.items()]}


async def _consumer_progress(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    stats = await admin.consume_stats(args.group, topic=args.topic, cluster=args.cluster)
    if not stats.queues:
        where = f"topic {args.topic!r}" if args.topic else "any topic"
        raise Refused(f"consumer group {args.group!r} has no progress on {where}: it has committed no offset "
                      f"there and no online member subscribes to it")
    return {"consumer_group": stats.consumer_group, "total_lag": stats.total_lag, "consume_tps": stats.consume_tps,
            "consumer_ids": {name: list(ids) for name, ids in stats.consumer_ids.items()},
            "queues": [{"topic": q.queue.topic, "broker_name": q.queue.broker_name, "queue_id": q.queue.queue_id,
                        "broker_offset": q.broker_offset, "consumer_offset": q.consumer_offset, "lag": q.lag,
                        "last_timestamp": q.last_timestamp} for q in stats.queues]}


async def _reset_offset(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    done = await admin.reset_offset(args.group, args.topic, args.timestamp_ms)
    return {"consumer_group": done.consumer_group, "topic": args.topic, "timestamp_ms": args.timestamp_ms,
            "queues": [{"broker_name": mq.broker_name, "queue_id": mq.queue_id, "previous": done.previous[mq],
                        "offset": offset} for mq, offset in sorted(done.offsets.items(),
                                                                   key=lambda kv: (kv[0].broker_name,
                                                                                   kv[0].queue_id))],
            "consumer_ids": {name: list(ids) for name, ids in done.consumer_ids.items()}}


def change(key: str, before: Any, after: Any) -> str:
    return (f"{key} {json.dumps(before)} -> {json.dumps(after)}" if before != after
            else f"{key} already {json.dumps(after)}, unchanged")


COMMANDS = {"consumer-connection": _consumer_connection, "consumer-progress": _consumer_progress,
            "delete-group": _delete_group, "update-sub-group": _update_sub_group, "sub-group-list": _sub_group_list,
            "producer-connection": _producer_connection, "reset-offset": _reset_offset,
            "consumer-status": _consumer_status, "clone-group-offset": _clone_group_offset}


def print_result(console: Console, command: str, data: dict[str, Any]) -> None:
    if command == "consumer-connection":
        table = Table(title=f"members of consumer group {data['consumer_group']}", header_style="bold")
        table.add_column("client id")
        table.add_column("address")
        table.add_column("subscriptions")
        for c in data["connections"]:
            table.add_row(Text(c["client_id"]), c["client_addr"],
                          Text(", ".join(f"{t} ({e})" for t, e in c["subscriptions"].items())))
        console.print(table)
        print(f"consume type: {data['consume_type']} ({_CONSUME_TYPES.get(data['consume_type'], 'unknown')}); "
              f"message model: {data['message_model']}; consume from: {data['consume_from_where']}; "
              "subscriptions: " + ", ".join(f"{t} ({e})" for t, e in data["subscriptions"].items()))
        for topic, members in data["differing_subscriptions"].items():
            print(f"warning: the members subscribe to {topic} differently ("
                  + ", ".join(f"{cid}: {e}" for cid, e in members.items()) + "): each pulls the queues it is given "
                  "with its own expression, so messages only another member wants are skipped")
    elif command == "consumer-progress":
        _print_progress(console, data)
    elif command == "delete-group":
        removed = ", ".join(f"{name}: {n}" for name, n in data["removed_offsets"].items())
        print(f"consumer group {data['consumer_group']} deleted; queue offsets removed per group: {removed}")
        if data["retry_topic_deleted_from"]:
            print(f"its retry topic deleted from {', '.join(data['retry_topic_deleted_from'])}")
        configs = data["config_removed_from"]
        print(f"its subscription group config removed from {', '.join(configs)}" if configs
              else "it had no subscription group config on any group asked")
        print(f"its dead-letter topic, if any, is kept (raftmq admin delete-topic '%DLQ%{data['consumer_group']}')")
    elif command == "update-sub-group":
        for g in data["groups"]:
            what = ("created: " + ", ".join(f"{k} {json.dumps(v)}" for k, v in g["config"].items()) if g["created"]
                    else "; ".join(change(k, before, after) for k, (before, after) in g["changed"].items())
                    or "unchanged")
            print(f"{g['broker_name']}: subscription group {data['consumer_group']} {what}")
    elif command == "sub-group-list":
        table = Table(title="subscription groups", header_style="bold")
        columns = ("consume_enable", "consume_broadcast_enable", "retry_max_times", "retry_queue_nums",
                   "consume_from_min_enable", "notify_consumer_ids_changed_enable", "broker_id",
                   "which_broker_when_consume_slowly")
        for column in ("consumer group", "group", "consume", "broadcast", "retry max", "retry queues", "from min",
                       "notify ids", "broker id", "when slow"):
            table.add_column(column)
        for g in data["subscription_groups"]:
            table.add_row(Text(g["group_name"]), g["broker_name"], *(json.dumps(g[c]) for c in columns))
        console.print(table)
    elif command == "producer-connection":
        table = Table(title=f"producers of group {data['producer_group']}", header_style="bold")
        for column in ("client id", "address", "broker groups"):
            table.add_column(column)
        for c in data["connections"]:
            table.add_row(Text(c["client_id"]), c["client_addr"], ", ".join(c["broker_names"]))
        console.print(table)
    elif command == "reset-offset":
        _print_moved_offsets(console, data, f"offsets of consumer group {data['consumer_group']} on {data['topic']} "
                                          f"reset", "members online")
    elif command == "clone-group-offset":
        _print_moved_offsets(console, data, f"offsets of {data['src_group']} on {data['topic']} cloned to "
                                          f"{data['dest_group']}", f"members of {data['dest_group']} online")
    elif command == "consumer-status":
        for member in data["members"]:
            _print_running_info(console, data["consumer_group"], member)


# consume_type as RocketMQ's mqadmin spells it out.
_CONSUME_TYPES = {"CONSUME_PASSIVELY": "push", "CONSUME_ACTIVELY": "pull"}


def _print_moved_offsets(console: Console, data: dict[str, Any], title: str, who: str) -> None:
    """reset-offset's and clone-group-offset's answer: each queue's offset before and after, and the members
    told at once."""
    table = Table(title=title, header_style="bold")
    for column in ("group", "queue", "previous offset", "new offset"):
        table.add_column(column, justify="left" if column == "group" else "right")
    for q in data["queues"]:
        table.add_row(q["broker_name"], str(q["queue_id"]), "-" if q["previous"] is None else str(q["previous"]),
                      str(q["offset"]))
    console.print(table)
    members = sorted({m for ids in data["consumer_ids"].values() for m in ids})
    print(f"{who} told to pull from the new offsets: {len(members)}" + (f" ({', '.join(members)})" if members else ""))


def _print_running_info(console: Console, group: str, m: dict[str, Any]) -> None:
    if "error" in m:
        print(f"consumer {m['client_id']} of group {group}: not asked: {m['error']}")
        return
    props = m["properties"]
    kind = _CONSUME_TYPES.get(props.get("consume_type"), "unknown")
    how = "orderly" if props.get("consume_orderly") else "concurrently"
    form = f", {props['consume_form']}" if props.get("consume_form") else ""
    print(f"consumer {m['client_id']} of group {group} (asked through {m['broker_name']}): "
          f"{props.get('consume_type')} ({kind}), {props.get('message_model')}, {how}{form}; started "
          f"{_utc(props.get('consumer_start_timestamp'))} UTC; {props.get('client_version', '')}")
    print("subscriptions: " + (", ".join(f"{t} ({e})" for t, e in m["subscriptions"].items()) or "none"))
    properties = Table(title="properties", header_style="bold")
    properties.add_column("name")
    properties.add_column("value")
    for name, value in sorted(props.items()):
        properties.add_row(name, Text(json.dumps(value) if not isinstance(value, str) else value))
    console.print(properties)
    queues = Table(title=f"queues held by {m['client_id']}", header_style="bold")
    for column in ("topic", "group", "queue", "committed", "cached", "cached bytes", "min offset", "max offset",
                   "locked", "paused", "last pull (UTC)", "last consume (UTC)"):
        queues.add_column(column, justify="left" if column in ("topic", "group") or "UTC" in column else "right")

    def opt(value: Any) -> str:
        return "-" if value is None else str(value)

    for q in m["queues"]:
        queues.add_row(Text(q["topic"]), q["broker_name"], str(q["queue_id"]), opt(q["committed_offset"]),
                       str(q["cached_msg_count"]), str(q["cached_msg_bytes"]), opt(q["cached_msg_min_offset"]),
                       opt(q["cached_msg_max_offset"]), "yes" if q["locked"] else "no", "yes" if q["paused"] else "no",
                       _utc(q["last_pull_timestamp"]), _utc(q["last_consume_timestamp"]))
    console.print(queues)
    rates = Table(title="rates over the last minute", header_style="bold")
    for column in ("topic", "pull TPS", "pull RT (ms)", "consume OK TPS", "consume failed TPS", "consume RT (ms)",
                   "failed (last hour)"):
        rates.add_column(column, justify="left" if column == "topic" else "right")
    for topic, r in m["status"].items():
        rates.add_row(Text(topic), f"{r['pull_tps']:g}", f"{r['pull_rt_ms']:g}", f"{r['consume_ok_tps']:g}",
                      f"{r['consume_failed_tps']:g}", f"{r['consume_rt_ms']:g}", str(r["consume_failed_msgs"]))
    console.print(rates)
    if m["jstack"] is not None:
        print(f"task dump of {m['client_id']}:")
        print(m["jstack"])


def _print_progress(console: Console, data: dict[str, Any]) -> None:
    table = Table(title=f"progress of consumer group {data['consumer_group']}", header_style="bold")
    for column in ("topic", "group", "queue", "broker offset", "consumer offset", "lag", "last consumed (UTC)"):
        table.add_column(column, justify="right" if column in ("queue", "broker offset", "consumer offset", "lag")
                         else "left")
    for q in data["queues"]:
        when = _utc(q["last_timestamp"])
        table.add_row(q["topic"], q["broker_name"], str(q["queue_id"]), str(q["broker_offset"]),
                      "-" if q["consumer_offset"] is None else str(q["consumer_offset"]), str(q["lag"]), when)
    console.print(table)
    members = sorted({m for ids in data["consumer_ids"].values() for m in ids})
    print(f"total lag: {data['total_lag']}; consume TPS: {data['consume_tps']:g}; members online: {len(members)}"
          + (f" ({', '.join(members)})" if members else ""))
