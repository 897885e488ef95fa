"""``raftmq admin``: the everyday part of RocketMQ's mqadmin, over ``client.admin``.

    raftmq admin [--namesrv HOST:PORT[,...]] cluster                 (clusterList)
    raftmq admin topics                                              (topicList)
    raftmq admin route TOPIC                                         (topicRoute)
    raftmq admin create-topic TOPIC [--read-queues N] [--write-queues N] [--perm 6] [--order]
                                    [--cluster NAME | --broker NAME ...]   (updateTopic)
    raftmq admin update-topic-perm TOPIC --perm 2|4|6 [--cluster NAME | --broker NAME ...]   (updateTopicPerm)
    raftmq admin delete-topic TOPIC [--cluster NAME | --broker NAME ...]   (deleteTopic)
    raftmq admin status [--broker NAME | --addr HOST:PORT]           (brokerStatus)
    raftmq admin broker-config [--broker NAME | --addr HOST:PORT]    (getBrokerConfig)
    raftmq admin update-broker-config (--broker NAME | --addr HOST:PORT) -k KEY -v VALUE   (updateBrokerConfig)
    raftmq admin topic-status TOPIC                                  (topicStatus)
    raftmq admin consumer-connection GROUP [--cluster NAME]          (consumerConnection)
    raftmq admin consumer-progress GROUP [--topic TOPIC] [--cluster NAME]  (consumerProgress)
    raftmq admin delete-group GROUP [--cluster NAME | --broker NAME ...]   (deleteSubGroup -r)
    raftmq admin update-sub-group -g GROUP [-s true|false] [-r N] [...] [--cluster NAME | --broker NAME ...]
                                                                     (updateSubGroup)
    raftmq admin sub-group-list [-g GROUP] [--cluster NAME | --broker NAME ...]   (getConsumerConfig)
    raftmq admin producer-connection GROUP [--cluster NAME]          (producerConnection)
    raftmq admin reset-offset GROUP TOPIC --to earliest|latest|now|MS|ISO-8601   (resetOffsetByTime)
    raftmq admin consumer-status -g GROUP [-i CLIENT_ID] [-s]       (consumerStatus)
    raftmq admin clone-group-offset -s SRC_GROUP -d DEST_GROUP -t TOPIC   (cloneGroupOffset)
    raftmq admin query-msg-id MSG_ID [--topic TOPIC] [--body-file PATH]   (queryMsgById, queryMsgByUniqueKey)
    raftmq admin query-msg-key TOPIC KEY [--max N] [--begin-ms MS] [--end-ms MS]   (queryMsgByKey)
    raftmq admin send-message TOPIC --body TEXT|--body-file PATH [--keys K1,K2] [--tags TAG]
                              [--broker NAME --queue N] [--count N] [--delay-level N]   (sendMessage)
    raftmq admin consume-message TOPIC [--broker NAME [--queue N]] [--offset N | --begin-ms MS] [--end-ms MS]
                                 [--count N] [--tags EXPR] [--group GROUP] [--body-file-dir DIR]   (consumeMessage)
    raftmq admin query-msg-offset TOPIC --broker NAME --queue N --offset N [--body-file PATH]   (queryMsgByOffset)
    raftmq admin query-msg-trace --msg-id MSG_ID [--trace-topic TOPIC]   (queryMsgTraceById)

The message commands (the last four, and the message rows and tables) are in ``admin_messages.py``; the consumer-
and producer-group commands (consumer-connection to clone-group-offset) in ``admin_groups.py``.

Without ``--namesrv``, the name servers ``NAMESRV_ADDR`` names (as mqadmin), else 127.0.0.1:9876 (``raftmq dev``'s).
A cluster with ACL on takes ``--access-key`` / ``--secret-key`` (or $RAFTMQ_ACCESS_KEY / $RAFTMQ_SECRET_KEY); one
serving TLS takes ``--tls`` and ``--tls-ca-file PEM`` (or $RAFTMQ_TLS_ENABLE / $RAFTMQ_TLS_CA_FILE).
Every command takes ``--json`` (one JSON line on stdout). Exit status: 0 done, 1 the cluster refused or could not
be reached (the message says which and why), 2 a bad argument (named), 141 whoever read stdout went away
(``| head -1``; ``raftmq.cli.EXIT_BROKEN_PIPE``).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from rich.console import Console
from rich.table import Table
from rich.text import Text

from broker.delay_level import format_delay
from broker.topic_config import (SYSTEM_TOPIC_PREFIX, TopicConfigError, check_sendable_topic, is_reserved_topic,
                                 is_system_topic, validate_group_name, validate_topic_name)
from client import open_admin
from client.admin import UPDATABLE_PERMS, AdminClient
from client.admin_messages import MAX_QUERY_NUM
from client.instance import DEFAULT_NAMESRV_ADDR, NAMESRV_ADDR_ENV
from client.route import PERM_INHERIT, PERM_READ, PERM_WRITE, TopicRouteData
from remoting.config import ConfigError, check_field, name_problem, parse_host_port
from raftmq.bench.common import (add_credential_args, check_credentials, check_namesrv_arg, exported_credentials,
                                 namesrv_from_env, print_json_error)
from raftmq.commands import admin_groups, admin_messages
# Shared with the group commands, under the names this module has always used.
from raftmq.commands.admin_groups import (LATEST_MS, Refused as _Refused, add_targets as _add_targets,
                                          change as _change, parse_when)
# Shared with the message commands, under the names this module has always used.
from raftmq.commands.admin_messages import (check_body_file as _check_body_file, message_data as _message_data,
                                            print_message as _print_message, utc as _utc)
from raftmq.console import PipeConsole
from raftmq.runner import leaf_exceptions, run_interruptible
from remoting.errors import RaftMQError
from remoting.message import KEY_SEPARATOR, MessageFormatError, parse_msg_id

_ALL_PERMS = PERM_READ | PERM_WRITE | PERM_INHERIT


def register(subparsers) -> None:
    parser = subparsers.add_parser("admin", help="administer a cluster: groups, topics, routes, broker status",
                                   description="Administer a cluster through its name servers (RocketMQ's "
                                               "mqadmin: clusterList, topicList, topicRoute, updateTopic, "
                                               "updateTopicPerm, deleteTopic, topicStatus, brokerStatus, "
                                               "getBrokerConfig, updateBrokerConfig, consumerConnection, "
                                               "consumerProgress, deleteSubGroup, updateSubGroup, "
                                               "getConsumerConfig, consumerStatus, cloneGroupOffset, "
                                               "producerConnection, resetOffsetByTime, "
                                               "queryMsgById, queryMsgByKey, queryMsgByOffset, queryMsgTraceById, "
                                               "sendMessage, consumeMessage).")
    _add_common(parser, defaults=True)
    # The same options after the command too (`raftmq admin topic-status T --json`), where "unrecognized
    # arguments: --json" contradicted "every command takes --json"; there they only override when given.
    common = argparse.ArgumentParser(add_help=False)
    _add_common(common, defaults=False)
    commands = parser.add_subparsers(dest="admin_command", metavar="COMMAND", required=True)
    add_command = functools.partial(commands.add_parser, parents=[common])

    add_command("cluster", help="broker groups and their nodes: address, role, term")
    add_command("topics", help="every topic the name servers route")
    route = add_command("route", help="a topic's queues and the nodes of its groups")
    route.add_argument("topic")
    create = add_command("create-topic", help="create or update a topic on every group of a cluster")
    create.add_argument("topic")
    create.add_argument("--read-queues", type=int, default=8, help="read queues per group (default 8)")
    create.add_argument("--write-queues", type=int, default=8, help="write queues per group (default 8)")
    create.add_argument("--perm", type=int, default=PERM_READ | PERM_WRITE,
                        help="permission bits: 4 read, 2 write, 1 inherit (default 6)")
    create.add_argument("--order", action="store_true", help="an ordered topic")
    _add_targets(create)
    perm = add_command("update-topic-perm", help="change only a topic's permission on every group that has it "
                                                 "(its queues, order and flags stay)")
    perm.add_argument("topic")
    perm.add_argument("--perm", type=int, required=True,
                      help="2 write only, 4 read only, 6 read and write (6 makes a %%DLQ%% topic readable)")
    _add_targets(perm)
    delete = add_command("delete-topic", help="delete a topic from every group of a cluster")
    delete.add_argument("topic")
    _add_targets(delete)
    status = add_command("status", help="a broker node's runtime status (GET_BROKER_RUNTIME_INFO)")
    _add_node(status)
    broker_config = add_command("broker-config", help="a broker node's effective config, defaults included "
                                                      "(GET_BROKER_CONFIG; the cluster secret is not shown)")
    _add_node(broker_config)
    update_config = add_command("update-broker-config",
                                help="change a config key at runtime on every member of a group, or on one node "
                                     "(UPDATE_BROKER_CONFIG; kept across restarts), e.g. -k broker_permission -v 4 "
                                     "to stop a group taking writes, -v 6 to give them back")
    which = update_config.add_mutually_exclusive_group(required=True)
    which.add_argument("--broker", help="every member of this group (each registers and may lead)")
    which.add_argument("--addr", help="this node only, HOST:PORT")
    update_config.add_argument("-k", "--key", required=True,
                               help="the config key: broker_permission, auto_create_topic_enable, "
                                    "default_topic_queue_nums, max_topic_count, long_polling_timeout_ms, "
                                    "max_transfer_count, max_transfer_bytes, max_batch_messages, "
                                    "enable_property_filter or timer_max_delay_sec")
    update_config.add_argument("-v", "--value", required=True,
                               help="its value, as in the config file (4, 15000, true)")
    delays = add_command("delay-offsets", help="delayed messages per delay level: delivered and stored up to "
                                               "where, how many wait (GET_ALL_DELAY_OFFSET)")
    _add_node(delays)
    topic_status = add_command("topic-status", help="a topic's queues: min and max offsets, last update")
    topic_status.add_argument("topic")
    admin_groups.register(add_command)
    by_id = add_command("query-msg-id", help="one message by its id: the broker's offset message id, or "
                                              "the producer's unique id with --topic")
    by_id.add_argument("msg_id", metavar="MSG_ID")
    by_id.add_argument("--topic", help="the message's topic (needed for a producer's unique id, SendResult.msg_id)")
    by_id.add_argument("--body-file", metavar="PATH", help="also write the message body to this file")
    by_key = add_command("query-msg-key", help="messages of a topic by key (KEYS), newest first")
    by_key.add_argument("topic")
    by_key.add_argument("key")
    by_key.add_argument("--max", type=int, default=32, help=f"most messages (1..{MAX_QUERY_NUM}, default 32)")
    by_key.add_argument("--begin-ms", type=int, default=0, help="stored at or after (ms since the epoch)")
    by_key.add_argument("--end-ms", type=int, default=None, help="stored at or before (ms since the epoch)")
    admin_messages.register(add_command)
    parser.set_defaults(func=run)


def _add_common(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    # None: resolved when the command runs (_check), so a bad NAMESRV_ADDR fails only the commands that use it.
    parser.add_argument("--namesrv", default=default(None),
                        help=f"name servers, HOST:PORT[,HOST:PORT...] (default: ${NAMESRV_ADDR_ENV}, else "
                             f"{DEFAULT_NAMESRV_ADDR}, raftmq dev's)")
    parser.add_argument("--timeout", type=float, default=default(10.0),
                        help="seconds for the whole command (default 10)")
    parser.add_argument("--json", action="store_true", default=default(False),
                        help="print the result as one JSON line")
    add_credential_args(parser, defaults=defaults)


def _add_node(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--broker", help="the leader of this group (default: of every group)")
    which.add_argument("--addr", help="this node, HOST:PORT (any member, follower or leader)")


# The group and topic names a command takes, checked before anything is sent, by how its usage names them.
_GROUP_ARG = {"consumer-connection": "GROUP", "consumer-progress": "GROUP", "reset-offset": "GROUP",
              "delete-group": "GROUP", "producer-connection": "GROUP", "consume-message": "--group",
              "update-sub-group": "--group", "sub-group-list": "--group"}
_TOPIC_ARG = {"route": "TOPIC", "create-topic": "TOPIC", "update-topic-perm": "TOPIC", "delete-topic": "TOPIC",
              "topic-status": "TOPIC",
              "consumer-progress": "--topic", "reset-offset": "TOPIC", "query-msg-id": "--topic",
              "query-msg-key": "TOPIC", "send-message": "TOPIC", "consume-message": "TOPIC",
              "query-msg-offset": "TOPIC"}


def _check_names(args: argparse.Namespace) -> None:
    group_arg, topic_arg = _GROUP_ARG.get(args.admin_command), _TOPIC_ARG.get(args.admin_command)
    try:
        if group_arg is not None and args.group is not None:  # sub-group-list's is optional
            validate_group_name(args.group, group_arg)
        if topic_arg is not None and args.topic is not None:
            validate_topic_name(args.topic)
            # The brokers create or update no topic producers may not send to (TBW102, rmq_sys_*).
            changes = args.admin_command in ("create-topic", "update-topic-perm")
            if changes and is_system_topic(args.topic):
                raise TopicConfigError(f"topic {args.topic!r} is reserved for the broker (prefix "
                                       f"{SYSTEM_TOPIC_PREFIX!r})", field="topic")
            if changes and is_reserved_topic(args.topic):  # the trace topic too: the brokers create it
                raise TopicConfigError(f"topic {args.topic!r} is reserved for the broker", field="topic")
            if args.admin_command == "send-message":  # the brokers refuse sends to them
                check_sendable_topic(args.topic)
    except TopicConfigError as e:
        # The topic check's sentence says "topic ...": name the argument as the usage does.
        raise ConfigError(str(e).replace("topic ", f"{topic_arg} ", 1) if e.field == "topic" else str(e)) from None
    # Cluster and broker group names, by the rule every broker and name server holds them to: an illegal one
    # was looked up and reported as unknown to the name servers (exit 1).
    broker = getattr(args, "broker", None)  # repeatable (a list) for create/delete-topic, one name for status
    names = [("--cluster", getattr(args, "cluster", None))]
    names += [("--broker", b) for b in (broker if isinstance(broker, list) else [broker])]
    for flag, value in names:
        problem = None if value is None else name_problem(value)
        if problem:
            raise ConfigError(f"{flag} {value!r} {problem}")


def _check(args: argparse.Namespace) -> None:
    args.namesrv_from_env = False
    if args.namesrv is None:
        env = namesrv_from_env()  # a ConfigError naming NAMESRV_ADDR when it is set but wrong
        args.namesrv, args.namesrv_from_env = env or DEFAULT_NAMESRV_ADDR, env is not None
    check_namesrv_arg(args.namesrv)
    check_credentials(args)
    if not 0 < args.timeout <= 3600:
        raise ConfigError(f"--timeout must be within (0, 3600] seconds, got {args.timeout}")
    if args.admin_command == "create-topic":
        for flag, value in (("--read-queues", args.read_queues), ("--write-queues", args.write_queues)):
            if not 1 <= value <= 1024:
                raise ConfigError(f"{flag} must be within 1..1024, got {value}")
        if args.write_queues > args.read_queues:  # the brokers and the admin client refuse it too
            raise ConfigError(f"--write-queues {args.write_queues} must not exceed --read-queues {args.read_queues}: "
                              f"messages sent to the queues beyond would never be consumed")
        if args.perm & ~_ALL_PERMS or not args.perm & (PERM_READ | PERM_WRITE):
            raise ConfigError(f"--perm must combine 4 (read), 2 (write) and 1 (inherit) with read or write set, "
                              f"got {args.perm}")
    if args.admin_command == "update-topic-perm" and args.perm not in UPDATABLE_PERMS:
        raise ConfigError(f"--perm must be 2 (write only), 4 (read only) or 6 (read and write), as mqadmin "
                          f"updateTopicPerm takes, got {args.perm}")
    if args.admin_command in admin_groups.COMMANDS:
        admin_groups.check(args)
    if args.admin_command == "update-broker-config":
        # Here, not at the top: broker.config brings in the Raft stack, which every other command does without.
        from broker.config import BrokerConfig, check_runtime_key, parse_runtime_value

        check_runtime_key(args.key)  # a ConfigError naming it and the keys that can change: exit 2, nothing sent
        # The value read and judged as every node reads and judges it (its type, bounds and choices): a bad one was
        # sent, refused by each node, and reported as "not changed on 3 of 3 node(s)... run the command again once
        # it is back". Checks across keys depend on each node's own config: they stay on the nodes.
        try:
            check_field(BrokerConfig, args.key, parse_runtime_value(args.key, args.value))
        except ConfigError as e:
            raise ConfigError(f"--value {args.value!r} refused: {e}") from None
    if args.admin_command in ("status", "delay-offsets", "broker-config", "update-broker-config") \
            and args.addr is not None:
        # An empty --addr was taken as none given: the group leaders answered instead of the node meant.
        parse_host_port(args.addr, key="--addr", dial=True)
    _check_names(args)
    if args.admin_command in admin_messages.COMMANDS:
        admin_messages.check(args)
    if args.admin_command == "reset-offset":
        args.timestamp_ms = parse_when(args.to)
    if args.admin_command == "query-msg-id":
        if args.body_file is not None:
            _check_body_file(args.body_file)
        if not args.msg_id:  # with --topic, the lookup by unique id raised ValueError: a traceback
            raise ConfigError("MSG_ID must not be empty")
        try:
            parse_msg_id(args.msg_id)
        except MessageFormatError as e:
            if args.topic is None:
                # What is wrong with it: "32 hex digits" alone was said of one that has them but names no port
                # or offset a broker writes.
                raise ConfigError(f"MSG_ID {args.msg_id!r} is not an offset message id ({e}); "
                                  f"a producer's unique id needs --topic") from None
    if args.admin_command == "query-msg-key":
        if not args.key:
            raise ConfigError("KEY must not be empty")
        if KEY_SEPARATOR in args.key:  # the answer was "no message with key ...", true but no help
            raise ConfigError(f"KEY {args.key[:80]!r} holds a space: a message's keys are stored split on spaces, "
                              f"so no key has one; ask for one key at a time")
        if not 1 <= args.max <= MAX_QUERY_NUM:
            raise ConfigError(f"--max must be within 1..{MAX_QUERY_NUM}, got {args.max}")
        end_ms = LATEST_MS if args.end_ms is None else args.end_ms
        if not 0 <= args.begin_ms <= end_ms <= LATEST_MS:
            raise ConfigError(f"--begin-ms and --end-ms must satisfy 0 <= begin <= end <= {LATEST_MS}, got "
                              f"{args.begin_ms} and {args.end_ms}")


def _route_data(route: TopicRouteData) -> dict[str, Any]:
    return {"topic": route.topic,
            "queue_datas": [{"broker_name": q.broker_name, "read_queue_nums": q.read_queue_nums,
                             "write_queue_nums": q.write_queue_nums, "perm": q.perm} for q in route.queue_datas],
            "broker_datas": [{"cluster": b.cluster, "broker_name": b.broker_name,
                              "broker_addrs": {str(k): v for k, v in sorted(b.broker_addrs.items())}}
                             for b in route.broker_datas]}


async def _cluster(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    info = await admin.cluster_info()
    cluster_of = {name: cluster for cluster, names in info.clusters.items() for name in names}
    groups = []
    for name, nodes in sorted(info.nodes.items()):  # the name server lists every group's nodes
        groups.append({"cluster": cluster_of.get(name, ""), "broker_name": name,
                       "leader_addr": info.master_addr(name), "nodes": [dict(n) for n in nodes]})
    return {"groups": groups}


async def _topics(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    return {"topics": await admin.list_topics()}


async def _route(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    return _route_data(await admin.get_route(args.topic))


async def _create(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    await _warn_of_hidden_queues(admin, args.topic, args.read_queues)
    route = await admin.create_topic(args.topic, read_queue_nums=args.read_queues, write_queue_nums=args.write_queues,
                                     perm=args.perm, order=args.order, cluster=args.cluster,
                                     broker_names=args.broker)
    return {"topic": args.topic, "created": True, "route": _route_data(route) if route is not None else None}


async def _warn_of_hidden_queues(admin: AdminClient, topic: str, read_queue_nums: int) -> None:
    """Fewer read queues than a group has now leave the messages in the others to no consumer until they are
    raised again. Allowed, as in RocketMQ (it is how a topic is shrunk once those queues are drained), but said."""
    try:
        queues = await admin.topic_status(topic)
    except RaftMQError:  # a new topic, or one no node can tell about: nothing to hide
        return
    hidden = [q for q in queues if q.queue.queue_id >= read_queue_nums and q.max_offset > q.min_offset]
    for q in hidden:
        print(f"raftmq admin create-topic: warning: {q.queue.broker_name} queue {q.queue.queue_id} of {topic} holds "
              f"{q.max_offset - q.min_offset} message(s) that --read-queues {read_queue_nums} leaves to no consumer "
              f"until the read queues are raised again", file=sys.stderr, flush=True)


async def _update_perm(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    updates = await admin.update_topic_perm(args.topic, args.perm, cluster=args.cluster, broker_names=args.broker)
    try:
        route: dict[str, Any] | None = _route_data(await admin.get_route(args.topic))
    except RaftMQError:  # the change is made (each group re-registered before it answered): only not shown
        route = None
    return {"topic": args.topic, "perm": args.perm,
            "groups": [{"broker_name": u.broker_name, "previous_perm": u.previous_perm, "perm": u.perm,
                        "changed": u.changed, "read_queue_nums": u.read_queue_nums,
                        "write_queue_nums": u.write_queue_nums, "order": u.order} for u in updates],
            "route": route}


async def _delete(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    groups = await admin.delete_topic(args.topic, cluster=args.cluster, broker_names=args.broker)
    return {"topic": args.topic, "deleted": True, "broker_names": groups}


async def _nodes(admin: AdminClient, args: argparse.Namespace) -> list[str]:
    """The nodes a per-node command asks: ``--addr``, else the leader of ``--broker``, else of every group."""
    if args.addr is not None:
        return [args.addr]
    info = await admin.cluster_info()
    names = [args.broker] if args.broker else sorted(info.broker_addrs)
    if not names:  # printed nothing and exited 0, as if every leader had answered
        raise _Refused("no broker group is registered with the name servers")
    addrs = []
    for name in names:
        addr = info.master_addr(name)
        if addr is None:
            raise _Refused(f"broker group {name!r} has no leader registered with the name servers "
                           f"(known groups: {', '.join(sorted(info.broker_addrs)) or 'none'})")
        addrs.append(addr)
    return addrs


async def _status(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    return {"nodes": {addr: await admin.broker_status(addr) for addr in await _nodes(admin, args)}}


async def _broker_config(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    return {"nodes": {addr: await admin.broker_config(addr) for addr in await _nodes(admin, args)}}


async def _update_broker_config(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    """Every member of ``--broker`` (as its nodes' config lists them, a member that is down too), or ``--addr``,
    all at once. Each node applies the change or refuses it on its own: one failing fails the command (exit 1),
    after the others were changed, with every node's outcome in the message."""
    addrs = [args.addr] if args.addr is not None else await admin.broker_member_addrs(args.broker)
    done: dict[str, Any] = {}
    failed: dict[str, RaftMQError] = {}

    async def one(addr: str) -> None:
        try:
            done[addr] = await admin.update_broker_config(addr, {args.key: args.value})
        except RaftMQError as e:
            failed[addr] = e

    async with trio.open_nursery() as nursery:
        for addr in addrs:
            nursery.start_soon(one, addr)
    if failed:
        lines = [f"node {addr}: {_change(args.key, done[addr].previous[args.key], done[addr].values[args.key])}"
                 if addr in done
                 else f"node {addr}: failed: {failed[addr]}" for addr in addrs]
        error = _Refused(f"{args.key} was not changed on {len(failed)} of {len(addrs)} node(s)"
                         + (f" of {args.broker}" if args.broker else "") + "; a node that refused it or could not "
                         "be reached keeps its value (run the command again once it is back)")
        for line in lines:
            error.add_note(line)
        raise error
    return {"key": args.key, "nodes": [{"addr": addr, "previous": done[addr].previous[args.key],
                                        "value": done[addr].values[args.key]} for addr in addrs]}


def _flat(config: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """``(key, value)`` rows of a config, its sections' keys dotted as in a config file's tables."""
    rows = []
    for key, value in sorted(config.items()):
        if isinstance(value, dict):
            rows += _flat(value, f"{prefix}{key}.")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            rows.append((prefix + key, "; ".join(", ".join(f"{k}={v}" for k, v in item.items()) for item in value)))
        else:
            rows.append((prefix + key, json.dumps(value) if isinstance(value, (list, bool)) or value is None
                         else str(value)))
    return rows


async def _delay_offsets(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    return {"nodes": {addr: [{"level": p.level, "delay_ms": p.delay_ms, "delivered_offset": p.delivered_offset,
                              "max_offset": p.max_offset, "waiting": p.waiting}
                             for p in await admin.delay_offsets(addr)]
                      for addr in await _nodes(admin, args)}}


async def _topic_status(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    queues = await admin.topic_status(args.topic)
    return {"topic": args.topic,
            "queues": [{"broker_name": q.queue.broker_name, "queue_id": q.queue.queue_id,
                        "min_offset": q.min_offset, "max_offset": q.max_offset,
                        "last_update_timestamp": q.last_update_timestamp} for q in queues]}


async def _query_msg_id(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    message = await admin.view_message(args.msg_id, topic=args.topic)
    if args.body_file is not None:
        try:
            with open(args.body_file, "wb") as f:
                f.write(message.body)
        except OSError as e:
            raise _Refused(f"could not write the body to --body-file {args.body_file!r}: {e.strerror or e}") from None
    return {"messages": [_message_data(message)]}


async def _query_msg_key(admin: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    found = await admin.query_message(args.topic, args.key, max_num=args.max, begin_ms=args.begin_ms,
                                      end_ms=args.end_ms)
    if not found:
        raise _Refused(f"no message with key {args.key!r} in topic {args.topic!r} stored between {args.begin_ms} "
                       f"and {'now' if args.end_ms is None else args.end_ms}")
    return {"messages": [_message_data(m) for m in found]}


_COMMANDS: dict[str, Callable[[AdminClient, argparse.Namespace], Awaitable[dict[str, Any]]]] = {
    "cluster": _cluster, "topics": _topics, "route": _route, "create-topic": _create,
    "update-topic-perm": _update_perm, "delete-topic": _delete,
    "status": _status, "broker-config": _broker_config, "update-broker-config": _update_broker_config,
    "delay-offsets": _delay_offsets, "topic-status": _topic_status,
    **admin_groups.COMMANDS,
    "query-msg-id": _query_msg_id,
    "query-msg-key": _query_msg_key,
    **admin_messages.COMMANDS,
}


def _print(command: str, data: dict[str, Any]) -> None:
    # Piped output (scripts, grep) gets whole rows, not the 80 columns rich assumes without a terminal.
    console = PipeConsole() if sys.stdout.isatty() else PipeConsole(width=200)
    if command == "cluster":
        table = Table(title="broker groups", header_style="bold")
        for column in ("cluster", "group", "id", "address", "role", "term", "last heartbeat"):
            table.add_column(column)
        for g in data["groups"]:
            for n in g["nodes"]:
                age = n.get("last_update_age_ms")
                table.add_row(g["cluster"], g["broker_name"], str(n.get("broker_id", "")), n.get("broker_addr", ""),
                              str(n.get("role", "")), str(n.get("term", "")),
                              "" if age is None else f"{age / 1000:.1f} s ago")
        console.print(table)
    elif command == "topics":
        for topic in data["topics"]:
            print(topic)
    elif command == "route":
        _print_route(console, data)
    elif command == "create-topic":
        if data["route"] is None:
            print(f"topic {data['topic']} created; the name servers do not route it yet (registration pending)")
        else:
            _print_route(console, data["route"])
    elif command == "update-topic-perm":
        for g in data["groups"]:
            kept = (f"read queues {g['read_queue_nums']}, write queues {g['write_queue_nums']}"
                    + (", order" if g["order"] else "") + " kept")
            print(f"{g['broker_name']}: perm of {data['topic']} {g['previous_perm']} -> {g['perm']} ({kept})"
                  if g["changed"] else f"{g['broker_name']}: perm of {data['topic']} already {g['perm']}, unchanged")
        if data["route"] is not None:
            _print_route(console, data["route"])
    elif command == "delete-topic":
        print(f"topic {data['topic']} deleted from {', '.join(data['broker_names'])}")
    elif command == "topic-status":
        table = Table(title=f"status of {data['topic']}", header_style="bold")
        for column in ("group", "queue", "min offset", "max offset", "last update (UTC)"):
            table.add_column(column, justify="right" if column in ("queue", "min offset", "max offset") else "left")
        for q in data["queues"]:
            table.add_row(q["broker_name"], str(q["queue_id"]), str(q["min_offset"]), str(q["max_offset"]),
                          _utc(q["last_update_timestamp"]))
        console.print(table)
    elif command in admin_groups.COMMANDS:
        admin_groups.print_result(console, command, data)
    elif command == "broker-config":
        for addr, config in data["nodes"].items():
            table = Table(title=f"config of broker node {addr}", header_style="bold")
            table.add_column("key")
            table.add_column("value")
            for key, value in _flat(config):
                table.add_row(key, Text(value))
            console.print(table)
    elif command == "update-broker-config":
        for node in data["nodes"]:
            print(f"{node['addr']}: {_change(data['key'], node['previous'], node['value'])}")
    elif command == "delay-offsets":
        for addr, levels in data["nodes"].items():
            table = Table(title=f"delayed messages on broker node {addr}", header_style="bold")
            for column in ("level", "delay", "delivered offset", "max offset", "waiting"):
                table.add_column(column, justify="right")
            for row in levels:
                table.add_row(str(row["level"]), format_delay(row["delay_ms"]), str(row["delivered_offset"]),
                              str(row["max_offset"]), str(row["waiting"]))
            console.print(table)
    elif command == "query-msg-id":
        _print_message(console, data["messages"][0])
    elif command in admin_messages.COMMANDS:
        admin_messages.print_result(console, command, data)
    elif command == "query-msg-key":
        table = Table(title=f"{len(data['messages'])} message(s), newest first", header_style="bold")
        for column in ("msg id", "offset msg id", "group", "queue", "queue offset", "tags", "keys", "stored (UTC)",
                       "body bytes"):
            table.add_column(column)
        for m in data["messages"]:
            table.add_row(m["msg_id"], m["offset_msg_id"], m["broker_name"], str(m["queue_id"]),
                          str(m["queue_offset"]), Text(m["tags"] or ""), Text(" ".join(m["keys"])),
                          _utc(m["store_timestamp"]),
                          str(m["body_size"]))
        console.print(table)
    else:
        for addr, status in data["nodes"].items():
            table = Table(title=f"broker node {addr}", header_style="bold")
            table.add_column("key")
            table.add_column("value", justify="right")
            for key, value in sorted(status.items()):
                table.add_row(key, str(value))
            console.print(table)


def _print_route(console: Console, route: dict[str, Any]) -> None:
    table = Table(title=f"route of {route['topic']}", header_style="bold")
    for column in ("group", "read queues", "write queues", "perm", "leader", "followers"):
        table.add_column(column)
    addrs = {b["broker_name"]: b["broker_addrs"] for b in route["broker_datas"]}
    for q in route["queue_datas"]:
        nodes = addrs.get(q["broker_name"], {})
        table.add_row(q["broker_name"], str(q["read_queue_nums"]), str(q["write_queue_nums"]), str(q["perm"]),
                      nodes.get("0", "-"), ", ".join(a for i, a in sorted(nodes.items()) if i != "0") or "-")
    console.print(table)


def run(args: argparse.Namespace) -> int:
    _check(args)  # a ConfigError: cli.py prints it (and its JSON line with --json), exit 2

    async def main() -> dict[str, Any]:
        with trio.fail_after(args.timeout):
            async with open_admin(args.namesrv) as admin:
                return await _COMMANDS[args.admin_command](admin, args)

    try:
        # Exported, so that the producer and consumer of the message commands sign with them too.
        with exported_credentials(args):
            data = run_interruptible(main)
    except (RaftMQError, _Refused, OSError, trio.TooSlowError, BaseExceptionGroup) as e:
        # create/delete ask every group's leader at once: the first group's refusal, the others' in its notes.
        errors = leaf_exceptions(e)
        if not all(isinstance(x, (RaftMQError, _Refused, OSError, trio.TooSlowError)) for x in errors):
            raise
        messages = []
        for error in errors:
            asked = (f"node {args.addr}" if getattr(args, "addr", None) is not None
                     # --addr's node is asked without the name servers; the variable is named, as it may
                     # have been set long ago in another shell file
                     else f"name servers {args.namesrv}" + (f" (from {NAMESRV_ADDR_ENV})" if args.namesrv_from_env
                                                            else ""))
            text = (f"no answer within --timeout {args.timeout:g} s ({asked})"
                    if isinstance(error, trio.TooSlowError) else str(error))
            messages += [text, *getattr(error, "__notes__", ())]
        for message in messages:
            print(f"raftmq admin {args.admin_command}: {message}", file=sys.stderr, flush=True)
        if args.json:
            print_json_error(messages, 1)
        return 1
    if args.json:
        print(json.dumps(data, default=str), flush=True)
    else:
        _print(args.admin_command, data)
    return 0
