"""Subscription groups: RocketMQ's SubscriptionGroupConfig and SubscriptionGroupManager, as replicated state.

A consumer group's config lives in the group's Raft metadata table ``broker.subscription_group`` (group name ->
config map, plus key ``""`` holding the data version), changed only on the leader and mirrored by every node, as
the topic table is (``broker/topic_config.py``): so a new leader, and a follower serving pulls, knows that a group
was stopped. The rules this module keeps:

* **What the broker acts on.** ``consume_enable`` false refuses the group's pulls (NO_PERMISSION, RocketMQ's
  "subscription group no permission, G"), held ones too; ``consume_broadcast_enable`` false refuses the pulls of
  a group whose members heartbeat as BROADCASTING; ``retry_max_times`` is the send-back's limit when the request
  carries no ``max_reconsume_times`` (raftmq's consumers always send one, RocketMQ's older clients did not);
  ``retry_queue_nums`` is the queue count of the group's retry topic when a send-back first creates it, and a
  failed message goes to one of its queues at random; ``notify_consumer_ids_changed_enable`` false keeps the
  members from being told of each other's arrivals and departures (they rebalance on their own timer instead).
  ``consume_from_min_enable``, ``broker_id`` and ``which_broker_when_consume_slowly`` are stored and shown only:
  RocketMQ's broker does not act on the first either, and raftmq picks the node a pull goes to by Raft role.
* **Created on first use, cheaply.** With ``auto_create_subscription_group`` (default true, as RocketMQ) a
  member's heartbeat to the leader, or a pull or send-back of an unknown group, starts the group's creation with the
  defaults in a task of the leader's own (a pull is served with the defaults at once meanwhile); a known group costs
  a dict lookup. The heartbeat is RocketMQ's moment: a group whose members are online shows in
  ``raftmq admin sub-group-list`` before its first pull (a member still looking for its start offsets, one whose
  queues are all another member's). A heartbeat is never refused for it: with auto-create off, or no room left, it
  only creates nothing, and the group's pulls say why. Off, an unknown group's pulls are refused
  SUBSCRIPTION_GROUP_NOT_EXIST until an admin creates it; RocketMQ's own groups (``TOOLS_CONSUMER``, the
  ``CID_RMQ_SYS_`` prefix) are created all the same, as there.
* **Bounded.** At most ``max_subscription_group_count`` groups (the table rides in every Raft snapshot): one more
  is refused, SUBSCRIPTION_GROUP_NOT_EXIST when auto-created, INVALID_REQUEST when an admin creates it. At most
  ``MAX_AUTO_CREATIONS_AT_ONCE`` auto-creations run at once, whatever starts them (heartbeats of many new groups
  at once, pulls under ever-new group names): one not started now is started by the group's next heartbeat or
  pull.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import trio

from broker.processor.base import RequestRejected
from broker.topic_config import MAX_QUEUE_NUMS, TopicConfigError, validate_group_name
from dledger import DLedgerError
from remoting.codes import ResponseCode
from remoting.message import I32, I64

if TYPE_CHECKING:
    from broker.node import BrokerNode

log = logging.getLogger(__name__)

SUBSCRIPTION_GROUP_TABLE = "broker.subscription_group"
_VERSION_KEY = ""
DEFAULT_RETRY_MAX_TIMES = 16  # RocketMQ's retryMaxTimes
DEFAULT_RETRY_QUEUE_NUMS = 1  # RocketMQ's retryQueueNums
# RocketMQ's MixAll.TOOLS_CONSUMER_GROUP and isSysConsumerGroup: created whatever auto_create_subscription_group says.
TOOLS_CONSUMER_GROUP = "TOOLS_CONSUMER"
SYS_CONSUMER_GROUP_PREFIX = "CID_RMQ_SYS_"

_BOOLS = ("consume_enable", "consume_from_min_enable", "consume_broadcast_enable", "notify_consumer_ids_changed_enable")
# name -> (lo, hi). retry_queue_nums 0 is RocketMQ's "drop what is sent back": refused, a message would be lost.
_INTS = {"retry_queue_nums": (1, MAX_QUEUE_NUMS), "retry_max_times": (0, I32[1]), "broker_id": (0, I64[1]),
         "which_broker_when_consume_slowly": (0, I64[1])}


class SubscriptionGroupError(ValueError):
    """A subscription group field is invalid; the message names the field and the value."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class SubscriptionGroupConfig:
    group_name: str
    consume_enable: bool = True
    consume_from_min_enable: bool = True  # stored and shown only
    consume_broadcast_enable: bool = True
    retry_queue_nums: int = DEFAULT_RETRY_QUEUE_NUMS
    retry_max_times: int = DEFAULT_RETRY_MAX_TIMES
    broker_id: int = 0  # stored and shown only
    which_broker_when_consume_slowly: int = 1  # stored and shown only
    notify_consumer_ids_changed_enable: bool = True

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_changes(self, changes: Mapping[str, Any]) -> SubscriptionGroupConfig:
        """This config with ``changes`` (field -> value; None: keep the value) validated and applied; unknown
        fields and bad values raise ``SubscriptionGroupError`` naming the field."""
        kwargs: dict[str, Any] = {}
        for name, value in changes.items():
            if value is None:
                continue
            if name in _BOOLS:
                if not isinstance(value, bool):
                    raise SubscriptionGroupError(f"{name} must be true or false, got {value!r}", field=name)
            elif name in _INTS:
                lo, hi = _INTS[name]
                if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                    raise SubscriptionGroupError(f"{name} must be an integer within {lo}..{hi}, got {value!r}",
                                                 field=name)
            elif name != "group_name":
                raise SubscriptionGroupError(f"{name} is not a subscription group field (fields: "
                                             f"{', '.join(FIELDS)})", field=str(name))
            elif value != self.group_name:
                raise SubscriptionGroupError(f"group_name {value!r} differs from {self.group_name!r}",
                                             field="group_name")
            kwargs[name] = value
        return dataclasses.replace(self, **kwargs)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], *, stored: bool = False) -> SubscriptionGroupConfig:
        """A config from a request or a replicated entry (snake_case keys): ``group_name`` required, every other
        field optional (RocketMQ's default). ``stored``: a replicated entry, whose keys this version does not know
        (a later version's fields) are left out rather than refused."""
        if not isinstance(data, Mapping):
            raise SubscriptionGroupError(f"subscription group config must be a map, got {type(data).__name__}",
                                         field="body")
        group = data.get("group_name")
        if not isinstance(group, str):
            raise SubscriptionGroupError(f"group_name must be a non-empty string, got {group!r}", field="group_name")
        try:
            validate_group_name(group, "group_name")
        except TopicConfigError as e:
            raise SubscriptionGroupError(str(e), field="group_name") from None
        if stored:
            data = {k: v for k, v in data.items() if k in FIELDS}
        return cls(group).with_changes(data)


FIELDS = tuple(f.name for f in dataclasses.fields(SubscriptionGroupConfig))


def is_builtin_group(group: str) -> bool:
    """A group RocketMQ's broker creates whatever autoCreateSubscriptionGroup says (its tools' and its own)."""
    return group == TOOLS_CONSUMER_GROUP or group.startswith(SYS_CONSUMER_GROUP_PREFIX)


class SubscriptionGroupTable:
    """The subscription groups of one broker group, as this node applied them; ``data_version`` counts changes."""

    def __init__(self, configs: Iterable[SubscriptionGroupConfig] = ()) -> None:
        self._configs: dict[str, SubscriptionGroupConfig] = {c.group_name: c for c in configs}
        # The replicated entry each name was last read from: the Raft side replaces only the entries a change sets,
        # so one still the same object is not read again (reading every entry at each change took 0.4 s of the
        # event loop per auto-created group once 50,000 were held).
        self._read_from: dict[str, Any] = {}
        self.data_version = 0

    def get(self, group: str) -> SubscriptionGroupConfig | None:
        return self._configs.get(group)

    def __contains__(self, group: str) -> bool:
        return group in self._configs

    def __len__(self) -> int:
        return len(self._configs)

    @property
    def unreadable(self) -> set[str]:
        """Groups the replicated table holds that this version cannot read (skipped, logged)."""
        return self._read_from.keys() - self._configs.keys()

    def all(self) -> list[SubscriptionGroupConfig]:
        return list(self._configs.values())

    def to_wire(self) -> dict[str, dict[str, Any]]:
        return {name: c.to_wire() for name, c in sorted(self._configs.items())}

    def restore(self, table: Mapping[str, Any]) -> set[str]:
        """Replace the contents with a replicated table (``""`` -> data version, name -> config map); returns
        the groups that can consume less than before (stopped, refused broadcasting, or removed), whose held pulls
        must be answered again. An entry that does not read as a config is skipped, logged: one bad entry must not
        keep a node from serving every other group."""
        configs = {}
        read_from = {}
        narrowed: set[str] = set()
        for name, data in table.items():
            if name == _VERSION_KEY:
                continue
            read_from[name] = data
            if self._read_from.get(name) is data:
                if name in self._configs:  # unchanged (and an unreadable one was logged when it came)
                    configs[name] = self._configs[name]
                continue
            try:
                config = SubscriptionGroupConfig.from_wire(data, stored=True)
            except SubscriptionGroupError as e:
                log.warning("replicated subscription group skipped group=%r error=%s", name, e)
                continue
            configs[name] = config
            old = self._configs.get(name)
            if old is not None and _narrowed(old, config):
                narrowed.add(name)
        narrowed.update(name for name in self._configs if name not in configs)
        self._configs = configs
        self._read_from = read_from
        self.data_version = int(table.get(_VERSION_KEY, 0))
        return narrowed


def _narrowed(old: SubscriptionGroupConfig, new: SubscriptionGroupConfig | None) -> bool:
    if new is None:
        return True
    return (old.consume_enable and not new.consume_enable) or (old.consume_broadcast_enable
                                                               and not new.consume_broadcast_enable)


# Auto-creations of subscription groups under way at once on a leader (``SubscriptionGroupManager._unknown_pulled``).
MAX_AUTO_CREATIONS_AT_ONCE = 16


class SubscriptionGroupManager:
    """The node's side: the mirror of the replicated table, the pull and send-back lookups, and the changes, which
    are made on a ready leader one at a time (``_lock``), each from a complete table."""

    def __init__(self, node: BrokerNode, *,
                 on_groups_changed: Callable[[Callable[[str], bool], set[str]], None] | None = None) -> None:
        self.node = node
        # Told after each change of the table is applied here: (whether the table holds a group, the groups it lost).
        self._on_groups_changed = on_groups_changed
        self.table = SubscriptionGroupTable()
        self._generation = -1
        self._lock = trio.Lock()
        self._creating: set[str] = set()  # auto-creations under way in a task of the node
        self.metadata_applied()

    # --- mirror --------------------------------------------------------------------------------------------
    def metadata_applied(self) -> None:
        """Refresh the mirror if the replicated table changed; the pulls held for a group that may consume less now
        are answered again (the resume refuses them, or holds them again for their time left), and only those:
        waking every held pull of the node re-ran each pull of every other group, to hold it again. Then
        ``on_groups_changed`` is told, on every node (the node's pull figures follow the table with it,
        ``broker/pull_stats.py``)."""
        generation = self.node.group.metadata_generation(SUBSCRIPTION_GROUP_TABLE)
        if generation == self._generation:
            return
        self._generation = generation
        table = self.table
        narrowed = table.restore(self.node.group.metadata(SUBSCRIPTION_GROUP_TABLE))
        if narrowed:
            self.node.hold.release_groups(narrowed)
        if self._on_groups_changed is not None:
            self._on_groups_changed(table.__contains__, {group for group in narrowed if group not in table})

    def get(self, group: str) -> SubscriptionGroupConfig | None:
        return self.table.get(group)

    # --- checks --------------------------------------------------------------------------------------------
    def check_pull(self, group: str) -> None:
        """Raise the refusal a pull of ``group`` gets from its subscription group: unknown with auto-create off
        (or no room for it), ``consume_enable`` false, or broadcasting with ``consume_broadcast_enable`` false.
        RocketMQ checks the last only for a pull without its own subscription, as its push consumer pulls; raftmq's
        consumers always send theirs, so it is checked whenever the members' heartbeats said BROADCASTING."""
        config = self.table.get(group)
        if config is None:
            config = self._unknown_pulled(group)
        name = self.node.config.broker_name
        if not config.consume_enable:
            raise RequestRejected(ResponseCode.NO_PERMISSION,
                                  f"subscription group no permission, {group}: consume_enable is false on broker "
                                  f"{name} (raftmq admin update-sub-group --group {group} --consume-enable true)",
                                  ext={"consumer_group": group})
        if not config.consume_broadcast_enable:
            info = self.node.clients.consumer_groups.get(group)
            if info is not None and info.message_model == "BROADCASTING":
                raise RequestRejected(ResponseCode.NO_PERMISSION,
                                      f"the consumer group[{group}] can not consume by broadcast way: "
                                      f"consume_broadcast_enable is false on broker {name}",
                                      ext={"consumer_group": group})

    def check_offset_commit(self, group: str) -> None:
        """Raise the refusal an offset commit of ``group`` gets: a group not in the table that may not be created
        (auto-create off, or no room for it), as RocketMQ 5's SUBSCRIPTION_GROUP_NOT_EXIST; an unknown one that may
        is created, as by a pull. Unchecked, commits under made-up names each stored an offset for good (in every
        snapshot), past the bound ``max_subscription_group_count`` sets on groups."""
        if group not in self.table:
            self._unknown_pulled(group)

    def _unknown_pulled(self, group: str) -> SubscriptionGroupConfig:
        """The config a pull of a group not in the table is served with (the defaults), its creation started on the
        leader; or the refusal."""
        self._check_may_create(group, "auto-created")
        self._start_auto_create(group)
        return SubscriptionGroupConfig(group)

    def heartbeat_seen(self, group: str) -> None:
        """A member of ``group`` heartbeated: start creating its config if it has none (RocketMQ's heartbeat does),
        as a pull would. Never raises: with auto-create off or no room left the heartbeat is served all the same,
        and only the group's pulls are refused, saying why."""
        if group in self.table or group in self._creating:  # every heartbeat of a known group: two lookups
            return
        try:
            self._check_may_create(group, "auto-created")
        except RequestRejected:
            return
        self._start_auto_create(group)

    def _start_auto_create(self, group: str) -> None:
        node = self.node
        if group in self.table.unreadable:
            # Replicated by a later version with what this one cannot read: served with the defaults here, never
            # overwritten with them.
            return
        # At most a few at a time, each one Raft write: pulls under ever-new group names (a name with a pid in it)
        # queued a task and a write each. One not started now is started by the group's next heartbeat or pull.
        if (group not in self._creating and len(self._creating) < MAX_AUTO_CREATIONS_AT_ONCE and node.is_leader()
                and node._nursery is not None):
            self._creating.add(group)
            node._nursery.start_soon(self._auto_create, group)

    async def _auto_create(self, group: str) -> None:
        try:
            await self.ensure(group)
        except (RequestRejected, DLedgerError) as e:
            # The next pull of the group tries again (a leader elected a moment ago, a full table...).
            log.info("subscription group not auto-created consumer_group=%s error=%s", group, e)
        except Exception:
            log.exception("subscription group auto-creation failed consumer_group=%s", group)
        finally:
            self._creating.discard(group)

    def _check_may_create(self, group: str, how: str) -> None:
        node = self.node
        if how == "auto-created" and not (node.config.auto_create_subscription_group or is_builtin_group(group)):
            raise RequestRejected(ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST,
                                  f"subscription group [{group}] does not exist on broker {node.config.broker_name} "
                                  f"and auto_create_subscription_group is false (create it: raftmq admin "
                                  f"update-sub-group --group {group})", ext={"consumer_group": group})
        limit = node.config.max_subscription_group_count
        held = len(self.table)
        if held >= limit:
            auto = how == "auto-created"
            raise RequestRejected(ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST if auto else ResponseCode.INVALID_REQUEST,
                                  f"subscription group [{group}] not {how}: broker {node.config.broker_name} holds "
                                  f"{held} subscription groups, its max_subscription_group_count is {limit} (delete "
                                  f"unused groups with raftmq admin delete-group, or raise it)",
                                  ext={"consumer_group": group} if auto else {"consumer_group": group,
                                                                              "field": "group_name"})

    # --- changes (leader) ----------------------------------------------------------------------------------
    async def ensure(self, group: str) -> SubscriptionGroupConfig:
        """``group``'s config, auto-created with the defaults if it has none (a send-back's, a pull's task)."""
        config = self.table.get(group)
        if config is not None:
            return config
        async with self._lock:
            await self.node.wait_ready_leader()
            config = self.table.get(group)
            if config is not None:
                return config
            self._check_may_create(group, "auto-created")
            config = SubscriptionGroupConfig(group)
            if group in self.table.unreadable:
                return config  # as _unknown_pulled: a later version's entry is not overwritten with the defaults
            await self._put({group: config.to_wire()})
            log.info("subscription group auto-created consumer_group=%s", group)
        return config

    async def update(self, group: str, changes: Mapping[str, Any]
                     ) -> tuple[SubscriptionGroupConfig, SubscriptionGroupConfig | None]:
        """UPDATE_AND_CREATE_SUBSCRIPTIONGROUP: the fields in ``changes`` set, the others kept (RocketMQ's defaults
        for a new group); returns the config now and the one before (None: created). ``SubscriptionGroupError``
        for a bad field, nothing changed."""
        async with self._lock:
            await self.node.wait_ready_leader()
            previous = self.table.get(group)
            config = (previous or SubscriptionGroupConfig(group)).with_changes(changes)
            if previous is None:
                self._check_may_create(group, "created")
            if config != previous:
                await self._put({group: config.to_wire()})
                log.info("subscription group %s consumer_group=%s %s", "created" if previous is None else "updated",
                         group, " ".join(f"{k}={v}" for k, v in config.to_wire().items() if k != "group_name"))
        return config, previous

    async def delete(self, group: str) -> bool:
        """DELETE_SUBSCRIPTIONGROUP's config part: whether the group had a config here (now removed)."""
        async with self._lock:
            await self.node.wait_ready_leader()
            if group not in self.table:
                return False
            await self._put({group: None})
            log.info("subscription group deleted consumer_group=%s", group)
        return True

    async def _put(self, items: dict[str, Any]) -> None:
        items[_VERSION_KEY] = self.table.data_version + 1
        await self.node._replicate(SUBSCRIPTION_GROUP_TABLE, items)
        self.metadata_applied()  # applied already (the group calls back first); a no-op unless it was not
