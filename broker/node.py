"""A broker node: one process serving one member of its broker group's Raft group.

``serve_broker(config, task_status=...)`` opens the store, makes it the Raft state machine
(``broker/commit_log_machine.py``), opens this member of the DLedger group, and serves remoting on the member's
service address until cancelled. Everything runs in one nursery (design §8.4): the store's services, the
remoting server, long polling, registration, the role watcher, the offset flusher, the topic-change registrar,
the client-expiry scan, the schedule service of delayed messages, the check service of transactional messages
and, with ``metrics_listen`` set, the ``/metrics`` endpoint (``broker/metrics.py``).

Rules this module keeps:

* **Writes only on the leader.** Sends, offset commits and topic changes are refused elsewhere with NOT_LEADER
  and ``leader_addr`` (the leader's service address); reads (pulls, offsets, lookups) are served by every node
  from its own store, whose commit log is byte-identical up to the committed offset.
* **Replicated metadata.** Topic configs and consumer offsets are DLedger metadata tables
  (``broker.topic_config``: topic → config, plus key ``""`` holding the data version; ``broker.consumer_offset``:
  ``group\\x01topic\\x01queue_id`` → offset). Every node mirrors them locally; a new leader therefore knows every
  topic and every offset flushed before it was elected. So are consumer groups' configs
  (``broker.subscription_group``, mirrored by ``broker/subscription_group.py``).
* **Queue locks for orderly consumers** (``broker/rebalance_lock.py``): served by the leader, held in its memory,
  with every change of holder replicated (``broker.rebalance_lock``: ``group\\x01topic\\x01queue_id`` → client
  id) so that a new leader knows who holds what; it restores them when its term starts.
* **Registration follows the role.** A role change triggers an immediate registration with every name server,
  so the route names the new leader as master within a round trip.

What the node reports about itself (the registration snapshot, the runtime info) is built in ``broker/status.py``;
the runtime config, read over the config file at start and changed by UPDATE_BROKER_CONFIG, in
``broker/runtime_config.py``. ``BrokerNode`` keeps the methods that call them.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cbor2
import trio

from broker.commit_log_machine import CommitLogMachine
from broker.config import BrokerConfig
from broker.consumer_manager import ClientManager
from broker.dispatcher import BrokerDispatcher
from broker.long_polling import PullRequestHoldService
from broker.metrics import broker_metrics_registry
from broker.offset_manager import ConsumerOffsetTable
from broker.pop import PopService, plan_reset
from broker.processor.base import RequestRejected
from broker.processor.pull_message import check_pullable
from broker.pull_stats import PullStats
from broker.rebalance_lock import QueueKey, RebalanceLockManager
from broker.registration import (REGISTRATION_HEADROOM_BYTES, RegistrationService, RegistrationSnapshot,
                                  registration_body_budget)
from broker.runtime_config import apply_config_update, load_runtime_config
from broker.schedule import ScheduleMessageService
from broker.status import registration_snapshot, runtime_info
from broker.transaction import TransactionalMessageService
from broker.store import MessageInput, MessageStore, encode_batch
from broker.store.dispatch import TOPIC_DELETE_LOG
from broker.subscription_group import SubscriptionGroupManager
from broker.topic_config import PERM_READ, TopicConfig, TopicConfigTable, auto_create_config
from dledger import DLedgerConfig, DLedgerError, DLedgerGroup, NotLeaderError, Role, open_dledger_group
from dledger.service import peer_with_history, remote_fetch_range
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.config import parse_host_port
from remoting.errors import RaftMQError
from remoting.message import PROPERTY_REAL_TOPIC, MessageView, decode_record, split_pop_retry_topic
from remoting.metrics_http import serve_metrics
from remoting.tls import ContextReloader
from remoting.transport import corked, open_remoting_client, serve_remoting

log = logging.getLogger(__name__)

__all__ = ["BrokerNode", "serve_broker", "TOPIC_TABLE", "OFFSET_TABLE", "LOCK_TABLE"]

TOPIC_TABLE = "broker.topic_config"
OFFSET_TABLE = "broker.consumer_offset"
LOCK_TABLE = "broker.rebalance_lock"
_VERSION_KEY = ""


def _offset_key(group: str, topic: str, queue_id: int) -> str:
    return f"{group}\x01{topic}\x01{queue_id}"


class BrokerNode:
    """The state the processors share. Built by ``serve_broker``; tests may build one around their own parts."""

    def __init__(self, config: BrokerConfig, store: MessageStore, group: DLedgerGroup, client: Any, *,
                 file_config: BrokerConfig | None = None) -> None:
        # ``config`` is replaced whole by UPDATE_BROKER_CONFIG (``update_config``): whatever reads a runtime key
        # reads it from here at each use. ``file_config`` is the config file's (with ``--set``), without the
        # node's runtime overrides: an override is kept only where the two differ.
        self.config = config
        self.file_config = file_config if file_config is not None else config
        self._config_lock = trio.Lock()
        # config.writable, kept with config: read by every send, where a property call is a cost of its own.
        self.writable = config.writable
        self.store = store
        self.group = group
        self.client = client
        self.broker_id = config.broker_id
        self.broker_addr = config.broker_addr
        host, port = parse_host_port(self.broker_addr, key="service_address")
        self.store_host = (host, port)
        self.topics = TopicConfigTable()
        self.offsets = ConsumerOffsetTable(read_committed=self._committed_offset, read_group=self._committed_offsets)
        self.clients = ClientManager(channel_expired_timeout_ms=config.channel_expired_timeout_ms,
                                     on_consumer_ids_changed=self._consumer_ids_changed)
        self.hold = PullRequestHoldService(self._max_queue_offset,
                                           check_interval_ms=config.long_polling_check_interval_ms)
        self.registration = RegistrationService(client, config.namesrv_addrs, self.registration_snapshot,
                                                interval_ms=config.register_interval_ms,
                                                timeout_ms=config.register_timeout_ms,
                                                tls_context=_client_tls(config),
                                                max_body_bytes=registration_body_budget(config.max_frame_size))
        self._topic_lock = trio.Lock()
        self._unregistrable_topics: set[tuple[str, str]] = set()  # (topic, problem) warned about once each
        # Held by the offset flusher around take-and-replicate and by a reset around its own replication, so a
        # batch of commits taken before a reset cannot be replicated after it and undo it.
        self._offset_lock = trio.Lock()
        self.queue_locks = RebalanceLockManager(config.rebalance_lock_max_live_time_ms)
        self.schedule = ScheduleMessageService(self, config.delay_levels_ms)
        self.transactions = TransactionalMessageService(self)
        self.pop = PopService(self)  # POP checkpoints and their revive (broker/pop.py)
        # The leader term whose holders queue_locks holds (restored from LOCK_TABLE when a term starts); lock
        # requests, with the replication of what they change, go one at a time.
        self._queue_locks_term: int | None = None
        self._queue_lock_mutex = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._started_ms = int(time.time() * 1000)
        self._sync_flush = config.store.flush_disk_type == "SYNC_FLUSH"
        self.max_message_size = config.max_message_size
        self.put_messages = 0
        self.put_requests = 0
        self.pulled_messages = 0
        self.pull_stats = PullStats()
        # topic -> [messages, body bytes] acknowledged to producers here (as leader): the per-topic figures of the
        # metrics, counted once per send request by the send processor, never per message.
        self.put_by_topic: dict[str, list[int]] = {}
        # Where GET /metrics is served ((host, port)), once serve_broker has started it; None: metrics_listen unset.
        self.metrics_address: tuple[str, int] | None = None
        # The topic table is mirrored as TopicConfigs (the send path reads them), refreshed as the group applies a
        # change to it: polled every 0.2 s before, a node served the old table that long after applying a change
        # (a follower refused pulls of queues a topic had just gained; a new leader, after the entries of the
        # earlier term, refused sends to them, INVALID_REQUEST, which producers do not retry).
        self._topic_generation = group.metadata_generation(TOPIC_TABLE)
        # The rows of the replicated topic table the mirror was built from (topic -> stored value): a refresh parses
        # only the rows that are not these very objects (a put stores new ones; so does a snapshot load).
        self._topic_rows: dict[str, Any] = {}
        # consumer_group -> its keys in the replicated offset table, as of the table's generation (None: not built):
        # one group's offsets are read without walking every group's.
        self._offset_keys_by_group: dict[str, list[str]] = {}
        self._offset_keys_generation: int | None = None
        # Set while a clean stop hands the leadership over: offset commits are refused meanwhile (commit_offset).
        self._handing_over = False
        # The pull figures follow the subscription-group table as _forget_deleted_topics makes them follow the
        # topic table: a group gone takes its own, and a group's pulls served before its config came count then.
        self.subscription_groups = SubscriptionGroupManager(self, on_groups_changed=self.pull_stats.groups_changed)
        group.on_metadata_applied(self._metadata_applied)
        self.refresh_metadata()

    # --- role ----------------------------------------------------------------------------------------------
    def is_leader(self) -> bool:
        return self.group.is_leader

    def queues_complete(self) -> bool:
        """Whether this node's consume queues hold every acknowledged message: it leads, its no-op is applied and
        dispatch has caught up with its commit log. Only then is an offset beyond a queue's end the consumer's
        mistake; a leader just elected (or dispatching a burst) may simply not have those units yet."""
        return self.group.is_ready_leader and self.store.dispatched_phy_offset >= self.store.commit_log.end

    async def wait_ready_leader(self) -> None:
        """Return once this node leads with its no-op applied, so its metadata holds every change its group
        committed; raise NOT_LEADER on a follower, or on a leader not ready within a second. A leader's table is
        complete only then: entries committed in an earlier term are applied after the new term's no-op, and after
        a restart of the whole group a member has applied only up to the commit index its journal had stored."""
        if self.group.is_ready_leader:
            return
        if not self.is_leader():
            raise self.not_leader()
        with trio.move_on_after(1.0):
            await self.group.wait_ready_leader()
        if not self.group.is_ready_leader:
            raise self.not_leader()

    def leader_addr(self) -> str | None:
        leader = self.group.leader_id
        if leader is None:
            return None
        member = self.group.member_address(leader)
        return member.service_address if member is not None and member.service_address else None

    def not_leader(self) -> RequestRejected:
        addr = self.leader_addr()
        if addr == self.broker_addr:
            addr = None  # elected, but its no-op is not applied yet: the client retries here shortly
        where = f"the leader is {addr}" if addr else "no leader is known yet"
        return RequestRejected(ResponseCode.NOT_LEADER,
                               f"broker node {self.broker_addr} ({self.config.broker_name}, node "
                               f"{self.broker_id}) is not the leader; {where}",
                               ext={"leader_addr": addr, "broker_name": self.config.broker_name})

    def role_name(self) -> str:
        return self.group.role.value

    # --- broker permission and runtime config -----------------------------------------------------------------
    def write_forbidden(self, topic: str | None = None) -> RequestRejected:
        """The refusal of a write made on a client's behalf (a send, a consumer's send-back) while the node's
        ``broker_permission`` lacks write (``writable``): NO_PERMISSION, which producers retry on another
        group after refreshing their route."""
        return RequestRejected(ResponseCode.NO_PERMISSION,
                              f"broker {self.config.broker_name} (node {self.broker_addr}) is not writable "
                              f"(broker_permission {self.config.broker_permission}): sending messages to it is "
                              f"forbidden", ext={"broker_name": self.config.broker_name, "topic": topic})

    async def update_config(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """UPDATE_BROKER_CONFIG on this node: ``values`` (runtime keys, typed) are judged as the config file is (a
        ConfigError naming the key and the value, and nothing changed), persisted in the node's overrides file
        (fsynced; SYSTEM_ERROR and nothing changed if that fails), and only then in effect. A change of
        ``broker_permission`` registers with every name server before this returns, so a route asked for after
        the answer shows it. Returns each key given with its value before. (``broker/runtime_config.py``.)"""
        return await apply_config_update(self, values)

    # --- metadata mirrors ----------------------------------------------------------------------------------
    def refresh_metadata(self) -> None:
        """Bring the topic mirror up to the applied table. Runs in the Raft tick (``_metadata_applied``) on every
        node, so it costs what changed, not the table: rebuilding all of it for each change took 257 ms at 50,000
        topics (``max_topic_count``), and at 40,000 a topic create held the trio thread past the election timeout.
        After a snapshot load every row is a new object, and the whole mirror is rebuilt once."""
        table = self.group.metadata_view(TOPIC_TABLE)
        version = int(table.get(_VERSION_KEY, 0))
        rows = len(table) - (_VERSION_KEY in table)
        if version == self.topics.data_version and len(self.topics) == rows:
            return
        mirrored = self._topic_rows
        changed = {k: v for k, v in table.items() if mirrored.get(k) is not v and k != _VERSION_KEY}
        added = sum(1 for k in changed if k not in mirrored)
        # Only a table that lost rows is walked for them.
        deleted = [k for k in mirrored if k not in table] if len(mirrored) + added != rows else []
        self.topics.apply_stored(version, changed, deleted)
        mirrored.update(changed)
        for key in deleted:
            del mirrored[key]
        if deleted:
            self._forget_deleted_topics()
        # Pulls held on a queue the change took away (topic deleted, read queues lowered) are answered now, as a
        # fresh pull would be, rather than "no new message" at their deadline.
        self.hold.release(self._pull_refused)

    def _forget_deleted_topics(self) -> None:
        """The send and pull figures of topics the table no longer holds go with them (the metrics exported them
        until the process restarted, and the counts grew with every topic ever deleted)."""
        topics = self.topics
        for topic in [t for t in self.put_by_topic if t not in topics]:
            del self.put_by_topic[topic]
        self.pull_stats.forget_topics(lambda topic: topic not in topics)

    def _metadata_applied(self) -> None:
        self.subscription_groups.metadata_applied()
        generation = self.group.metadata_generation(TOPIC_TABLE)
        if generation != self._topic_generation:
            self._topic_generation = generation
            self.refresh_metadata()

    def _pull_refused(self, topic: str, queue_id: int) -> bool:
        if split_pop_retry_topic(topic) is not None:
            # Held by a POP (a pull of it is refused before it is held): released only once its queue is gone.
            config = self.topic(topic)
            return (not self.config.broker_permission & PERM_READ or config is None or not config.readable
                    or queue_id >= config.read_queue_nums)
        try:
            check_pullable(self, topic, queue_id)
        except RequestRejected:
            return True
        return False

    def _committed_offset(self, group: str, topic: str, queue_id: int) -> int | None:
        # Read in place: every commit, offset query and queue a POP scans asks, and a copy of the table (every
        # group's offsets) cost 3.8 ms a commit at 200k keys.
        value = self.group.metadata_get(OFFSET_TABLE, _offset_key(group, topic, queue_id))
        return int(value) if value is not None else None

    def _committed_offsets(self, group: str) -> dict[tuple[str, int], int]:
        return {(topic, queue_id): offset for _group, topic, queue_id, offset in self.committed_offsets(group)}

    def committed_offsets(self, group: str | None = None) -> list[tuple[str, str, int, int]]:
        """``(consumer_group, topic, queue_id, offset)`` of the replicated offset table, of ``group`` or of all,
        as the table is now."""
        view = self.group.metadata_view(OFFSET_TABLE)
        out = []
        for key in view if group is None else self._offset_keys_of(group):
            value = view.get(key)
            if value is not None:
                consumer_group, topic, queue_id = key.split("\x01")
                out.append((consumer_group, topic, int(queue_id), int(value)))
        return out

    def _offset_keys_of(self, group: str) -> list[str]:
        """``group``'s keys in the replicated offset table (some may have gone since: read them with ``get``). The
        index is built again only after the table changed, and only when a group's offsets are asked for."""
        generation = self.group.metadata_generation(OFFSET_TABLE)
        if generation != self._offset_keys_generation:
            index: dict[str, list[str]] = {}
            for key in self.group.metadata_view(OFFSET_TABLE):
                index.setdefault(key.partition("\x01")[0], []).append(key)
            self._offset_keys_by_group, self._offset_keys_generation = index, generation
        return self._offset_keys_by_group.get(group, [])

    def topic(self, topic: str) -> TopicConfig | None:
        config = self.topics.get(topic)
        if config is None:
            # A topic created a moment ago on the leader may be applied here before the periodic refresh.
            self.refresh_metadata()
            config = self.topics.get(topic)
        return config

    def deleted_real_topic(self, view: MessageView) -> str | None:
        """The topic a record waiting in a broker topic (a delayed or timer message, a half message) is bound for
        (REAL_TOPIC), if it was deleted since the record was stored: gone, or cut after the record (deleted and
        created again). None otherwise. Such a message went with its topic: delivered or committed, it would land
        behind the deletion's cut and be served as a topic created again under the name's first message."""
        topic = view.properties.get(PROPERTY_REAL_TOPIC)
        if topic is None or (self.topic(topic) is not None
                             and not self.store.deleted_with_topic(topic, view.phy_offset)):
            return None
        return topic

    async def topic_for_send(self, topic: str, queue_nums: int | None = None) -> TopicConfig:
        """The config of ``topic`` a send writes to, auto-created if unknown (``auto_create_topic_enable``) with
        ``default_topic_queue_nums`` queues, or ``queue_nums`` if the sender asked for fewer (the SEND ext's
        ``default_topic_queue_nums``, RocketMQ's defaultTopicQueueNums: the producer's stand-in route has that many,
        so its sends and ordered keys keep to queues the topic has)."""
        config = self.topic(topic)
        if config is not None:
            return config
        # Unknown here, but a leader elected a moment ago applies the entries of earlier terms only after its
        # no-op: auto-created before that, a topic created just before the failover (or the restart of the whole
        # group) got the default config over the one it was created with, and an older data version.
        await self.wait_ready_leader()
        config = self.topic(topic)
        if config is not None:
            return config
        if not self.config.auto_create_topic_enable:
            raise RequestRejected(ResponseCode.TOPIC_NOT_EXIST,
                                  f"topic {topic!r} does not exist on broker {self.config.broker_name} and "
                                  f"auto_create_topic_enable is false", ext={"topic": topic})
        default = self.config.default_topic_queue_nums
        return await self.ensure_topic(auto_create_config(topic, default if queue_nums is None else
                                                          min(queue_nums, default)), "auto-created")

    async def ensure_topic(self, config: TopicConfig, how: str = "created") -> TopicConfig:
        """The config of ``config.topic_name``, created as ``config`` if it does not exist: an auto-created topic,
        or a group's retry and dead-letter topics (whatever ``auto_create_topic_enable`` says, as RocketMQ's
        createTopicInSendMessageBackMethod); decided by a ready leader, as every topic change. ``how`` names the
        creation in the log and in a refusal for want of room."""
        existing = self.topic(config.topic_name)
        if existing is not None:
            return existing
        async with self._topic_lock:
            await self.wait_ready_leader()
            existing = self.topic(config.topic_name)
            if existing is not None:
                return existing
            self._check_topic_room(config, how)
            log.info("topic %s topic=%s queues=%d perm=%d", how, config.topic_name, config.write_queue_nums,
                     config.perm)
            await self._put_topics({config.topic_name: config.to_wire()})
        await self._register_topic_change()
        return config

    async def update_topic(self, config: TopicConfig) -> None:
        async with self._topic_lock:
            # Decided from a complete table (see topic_for_send): its data version too, which the change raises.
            await self.wait_ready_leader()
            self._check_topic_room(config, "created" if self.topic(config.topic_name) is None else "updated")
            await self._put_topics({config.topic_name: config.to_wire()})
        await self._register_topic_change()

    def _check_topic_room(self, config: TopicConfig, what: str) -> None:
        """Refuse a new topic once the group holds ``max_topic_count``, and a topic change (``what``: "created",
        "auto-created", "updated") that would take the registration body past ``registration_body_budget``: the
        table rides in every registration, and one frame too large for a name server had every registration
        refused, the group out of every route. The bytes bound holds whatever the names (~80k topics of 127
        characters filled 16 MiB, under max_topic_count's 200,000) and whatever the frame limit. A change that does
        not grow the body passes even over the budget (a table stored under a larger max_frame_size)."""
        topic = config.topic_name
        code = ResponseCode.TOPIC_NOT_EXIST if what == "auto-created" else ResponseCode.INVALID_REQUEST
        limit = self.config.max_topic_count
        held = len(self.topics)
        if what != "updated" and held >= limit:
            raise RequestRejected(code, f"topic {topic!r} not {what}: broker {self.config.broker_name} holds {held} "
                                        f"topics, its max_topic_count is {limit} (delete unused topics, or raise it)",
                                  ext={"topic": topic})
        budget = registration_body_budget(self.config.max_frame_size)
        now = self.topics.registration_body_bytes
        after = self.topics.registration_body_bytes_with(config)
        if after > budget and after > now:
            raise RequestRejected(code, f"topic {topic!r} not {what}: the registration of broker "
                                        f"{self.config.broker_name} would carry {after} bytes of topic configs, over "
                                        f"its budget of {budget} (max_frame_size {self.config.max_frame_size} less "
                                        f"{REGISTRATION_HEADROOM_BYTES}); it carries {now} bytes for {held} topics "
                                        f"now (delete unused topics, or raise max_frame_size and the name servers' "
                                        f"max_frame_size_bytes)", ext={"topic": topic})

    async def delete_topic(self, topic: str) -> None:
        """RocketMQ's deleteTopic: the config, the consumer offsets, the POP state (pop offsets and checkpoints) and
        the messages go, and so do the topic's POP retry topics (``%RETRY%<group>+<topic>``, as with RocketMQ 5's
        clearRetryTopicWhenDeleteTopic), which a topic created again under the name would read as its own. The
        messages go by a deletion record in the commit log (``broker.store.dispatch``), appended first: should the
        config removal then fail, the topic still exists and the admin's retry completes the delete. Then a second one:
        a send admitted by the config before its removal was applied here can be queued behind the first record,
        and would sit past the cut, unreachable until the name is created again, then served as the new topic's
        (64 acknowledged sends of each round in a probe). Once the config is gone no send is admitted, and the
        group's queue is first in, first out, so the second record lands behind every admitted one. A producer's
        auto-create of the same name waits on the topic lock, so its messages land after both. Messages of the topic
        still waiting elsewhere go too: a delayed one is not delivered (``broker.schedule``), and a transaction's
        COMMIT is a rollback (``broker.transaction``)."""
        async with self._topic_lock:
            await self.wait_ready_leader()  # as update_topic
            await self.append_messages(self._deletion_record(topic))
            await self._put_topics({topic: None})
            await self.append_messages(self._deletion_record(topic))
            # Under the flusher's lock, as a reset: a batch of the topic's commits it took before the delete and was
            # still replicating would otherwise land after the removal below, and the group's offsets would outlive
            # the topic (and be its offsets again once the name is created again). Commits pending now are dropped
            # before any flush can take them; new ones are refused, the config being gone.
            async with self._offset_lock:
                self.offsets.apply_delete_topic(topic)
                stale = [k for k in self.group.metadata_view(OFFSET_TABLE) if k.split("\x01")[1:2] == [topic]]
                if stale:
                    await self._replicate(OFFSET_TABLE, {k: None for k in stale})
            # A pop offset wins over the committed one: kept, it would skip the new topic's first messages.
            await self.pop.forget(topic=topic)
        await self._register_topic_change()
        for config in self.topics.all():
            pop_retry = split_pop_retry_topic(config.topic_name)
            if pop_retry is not None and pop_retry[1] == topic:
                await self.delete_topic(config.topic_name)

    async def delete_group_offsets(self, group: str) -> int:
        """DELETE_SUBSCRIPTIONGROUP's clean_offset: every offset of ``group`` goes (all its topics, its retry topic's
        too) and its POP state (pop offsets, checkpoints: nothing of it is revived), replicated before this returns;
        the number of queues that had an offset. Under the flusher's lock, as delete_topic: a batch of the group's
        commits being replicated would otherwise land after the removal."""
        async with self._offset_lock:
            dropped = {_offset_key(*key) for key in self.offsets.apply_delete_group(group)}
            view = self.group.metadata_view(OFFSET_TABLE)
            stale = [k for k in self._offset_keys_of(group) if k in view]
            if stale:
                await self._replicate(OFFSET_TABLE, dict.fromkeys(stale))
            await self.pop.forget(group=group)
            return len(dropped.union(stale))

    def _deletion_record(self, topic: str) -> bytes:
        return encode_batch([MessageInput(topic=TOPIC_DELETE_LOG, queue_id=0, body=topic.encode("ascii"),
                                          properties={"KEYS": topic}, born_timestamp=int(time.time() * 1000),
                                          born_host=self.store_host)], self.store_host)

    async def _put_topics(self, items: dict[str, Any]) -> None:
        """Replicate a change of the topic table, raising its data version; under ``_topic_lock``, which keeps the
        versions in order. The caller registers it (``_register_topic_change``) once it has let the lock go."""
        self.refresh_metadata()
        items = dict(items)
        items[_VERSION_KEY] = self.topics.data_version + 1
        await self._replicate(TOPIC_TABLE, items)
        self.refresh_metadata()

    async def _register_topic_change(self) -> None:
        """Register a topic change before answering it, so a client's next route query already shows it (each
        name server under register_timeout_ms; one that is down or hangs holds the answer at most
        ``registration.INLINE_WAIT_S``, and the others not at all). Outside the topic
        lock: a registration at 40,000 topics took ~1 s, and every other topic change (a producer's auto-create
        too) waited that long behind it. Nothing is lost by it: the snapshot is taken as the round starts, after
        this change applied here, and a name server keeps the highest-numbered registration (its snapshot holds
        this change too, however the rounds overlap)."""
        await self.registration.register_all()

    async def _replicate(self, table: str, items: dict[str, Any]) -> None:
        if not self.is_leader():
            raise self.not_leader()
        await self.group.put_metadata(table, items, timeout_s=self.config.send_timeout_ms / 1000)

    # --- messages ------------------------------------------------------------------------------------------
    async def append_messages(self, batch: bytes) -> Sequence[Any]:
        """Replicate one encoded batch; returns the per-message results (msg_id, queue_id, queue_offset...)."""
        timeout_s = self.config.send_timeout_ms / 1000
        try:
            result = await self.group.append(batch, timeout_s=timeout_s)
        except NotLeaderError:
            if not self.group.is_leader:
                raise
            # Elected, but the no-op entry of the new term is not applied yet (the first few ms after a
            # failover): wait for it here rather than bouncing the producer into a route refresh.
            with trio.move_on_after(min(1.0, timeout_s)):
                await self.group.wait_ready_leader()
            result = await self.group.append(batch, timeout_s=timeout_s)
        messages = self.machine_messages(result.result)
        if self._sync_flush and messages:
            # SYNC_FLUSH: acknowledge only bytes on disk (group commit: one fdatasync covers every waiter).
            last = messages[-1]
            await self.store.wait_flushed(last.phy_offset + last.size)
        self.put_requests += 1
        self.put_messages += len(messages)
        return messages

    @staticmethod
    def machine_messages(result: Any) -> Sequence[Any]:
        if hasattr(result, "status"):
            if not result.ok:
                name = result.status.name
                if "ILLEGAL" in name or "PROPERTIES" in name:
                    code = ResponseCode.MESSAGE_ILLEGAL
                elif name == "DISK_FULL":
                    code = ResponseCode.SERVICE_NOT_AVAILABLE  # RocketMQ's answer while the store is not writable
                else:
                    code = ResponseCode.SYSTEM_ERROR
                raise RequestRejected(code, result.remark or f"the store refused the batch: {name}")
            return result.messages
        return result

    def _max_queue_offset(self, topic: str, queue_id: int) -> int:
        return self.store.get_max_offset_in_queue(topic, queue_id)

    def read_record(self, phy_offset: int) -> bytes | None:
        """The raw commit-log record at ``phy_offset`` (what PULL_MESSAGE sends), or None."""
        if not self.store.min_phy_offset <= phy_offset < self.store.max_phy_offset:
            return None
        raw = self.store.look_record_by_offset(phy_offset)
        return bytes(raw) if raw is not None else None

    def message_at(self, topic: str, queue_id: int, queue_offset: int) -> Any:
        result = self.store.get_messages(topic, queue_id, queue_offset, 1, 1 << 30)
        if not result.messages:
            return None
        return decode_record(result.messages[0], check_crc=False)

    def query_records(self, topic: str, key: str, max_num: int, begin: int, end: int) -> list[bytes]:
        result = self.store.query_message(topic, key, max_num, begin, end)
        out = []
        for view in result.messages:
            raw = self.read_record(view.phy_offset)
            if raw is not None:
                out.append(raw)
        return out

    async def reset_offsets(self, group: str, topic: str, offsets: dict[int, int]) -> list[str]:
        """Set ``group``'s offsets of ``topic`` (queue_id -> offset), replicated before returning, and tell the
        group's online members to drop what they cached of those queues and pull from there; returns their ids.
        A commit a member sends after that carries the new offsets (it re-commits them on the notification). A POP
        group reads its pop offsets first: those of the queues move too (``broker.pop.plan_reset``), under the queues'
        POP locks, so a POP running meanwhile neither reads the old one nor writes its successor back."""
        async with self.pop.queue_locks(group, topic, offsets):
            async with self._offset_lock:
                for queue_id, offset in offsets.items():
                    self.offsets.commit(group, topic, queue_id, offset)  # also overrides an older pending commit
                await self._replicate(OFFSET_TABLE, {_offset_key(group, topic, q): o for q, o in offsets.items()})
            await self.pop.write(plan_reset(self.pop.table(), group, topic, offsets))
        info = self.clients.consumer_groups.get(group)
        channels = list(info.channels.values()) if info is not None else []
        if channels and self._nursery is not None:
            frame = make_request(RequestCode.RESET_CONSUMER_CLIENT_OFFSET, oneway=True,
                                 ext={"consumer_group": group, "topic": topic,
                                      "broker_name": self.config.broker_name},
                                 body=cbor2.dumps({"offsets": sorted(offsets.items())}))
            for channel in channels:
                self._nursery.start_soon(self._notify_one, channel.conn, frame)
        return sorted(ch.client_id for ch in channels)

    # --- queue locks (orderly consumers) ------------------------------------------------------------------
    async def lock_queues(self, group: str, client_id: str, queues: Sequence[QueueKey]) -> list[QueueKey]:
        """LOCK_BATCH_MQ on the leader: renew ``client_id``'s locks among ``queues``, take the free ones (the change
        of holder replicated before this returns) and return every queue it now holds."""
        async with self._queue_lock_mutex:
            await self._queue_locks_of_this_term()
            plan = self.queue_locks.plan(group, client_id, queues)
            if plan.free:
                await self._replicate(LOCK_TABLE, {_offset_key(group, t, q): client_id for t, q in plan.free})
                self.queue_locks.grant(group, client_id, plan.free)
            return sorted(plan.held + plan.free)

    async def unlock_queues(self, group: str, client_id: str, queues: Sequence[QueueKey]) -> list[QueueKey]:
        """UNLOCK_BATCH_MQ on the leader: release ``client_id``'s locks among ``queues``; returns those released."""
        async with self._queue_lock_mutex:
            await self._queue_locks_of_this_term()
            if not self.queue_locks.held_by(group, client_id, queues):
                return []
            # The holder committed its last offsets before it unlocked, but they may still be pending here: a new
            # leader that knew of the unlock and not of them would let the next holder start before them, and it
            # would handle again, after their successors, messages the last one handled.
            await self._flush_offsets_once()
            # Judged again after the flush's wait: the node may have lost and won back its leadership meanwhile,
            # and the leader in between given these queues to another client, whose keys the delete would drop.
            await self._queue_locks_of_this_term()
            mine = self.queue_locks.held_by(group, client_id, queues)
            if not mine:
                return []
            await self._replicate(LOCK_TABLE, dict.fromkeys(_offset_key(group, t, q) for t, q in mine))
            return self.queue_locks.release(group, client_id, mine)

    async def _queue_locks_of_this_term(self) -> None:
        """Make ``queue_locks`` this leader term's: once per term, the replicated holders, each renewed now."""
        if not self.is_leader():
            raise self.not_leader()
        term = self.group.term
        if self._queue_locks_term == term:
            return
        # The table must hold every change committed before this term: wait for the term's no-op to apply.
        await self.wait_ready_leader()
        if self.group.term != term:
            raise self.not_leader()
        holders = []
        for key, client_id in self.group.metadata_view(LOCK_TABLE).items():
            group, topic, queue_id = key.split("\x01")
            holders.append((group, topic, int(queue_id), str(client_id)))
        self.queue_locks.restore(holders)
        self._queue_locks_term = term
        if holders:
            log.info("queue locks restored term=%d locks=%d (each held a whole life from now unless renewed)", term,
                     len(holders))

    async def prune_queue_locks(self) -> None:
        """Drop lapsed locks from the table and the replicated table (a killed member's stay there otherwise)."""
        async with self._queue_lock_mutex:
            # Under the mutex, not before it: while a prune waited for it, the node could lose and win back its
            # leadership, and the table is then a past term's: a lock lapsed there may have been given to another
            # client by the leader in between, and deleting its key would let a third take the queue from it.
            if not self.is_leader() or self._queue_locks_term != self.group.term:
                return
            lapsed = self.queue_locks.take_lapsed()
            if not lapsed:
                return
            try:
                await self._replicate(LOCK_TABLE, dict.fromkeys(_offset_key(g, t, q) for g, (t, q) in lapsed))
            except (RequestRejected, DLedgerError) as e:
                # Harmless: a holder replicated here and restored by a later leader lapses there again.
                log.info("lapsed queue locks not removed from the replicated table locks=%d error=%s", len(lapsed),
                         e)

    # --- clients -------------------------------------------------------------------------------------------
    def _consumer_ids_changed(self, group: str, conns: list[Any]) -> None:
        config = self.subscription_groups.get(group)
        if self._nursery is None or (config is not None and not config.notify_consumer_ids_changed_enable):
            return  # RocketMQ's notifyConsumerIdsChangedEnable false: members rebalance on their own timer
        frame = make_request(RequestCode.NOTIFY_CONSUMER_IDS_CHANGED, ext={"consumer_group": group}, oneway=True)
        for conn in conns:
            self._nursery.start_soon(self._notify_one, conn, frame)

    def notify_soon(self, conn: Any, frame: Any) -> None:
        """Send the oneway ``frame`` to a client's connection from a task of the node (a lost one is only logged)."""
        if self._nursery is not None:
            self._nursery.start_soon(self._notify_one, conn, frame)

    @staticmethod
    async def _notify_one(conn: Any, frame: Any) -> None:
        try:
            await conn.invoke_oneway(frame)
        except RaftMQError as e:
            log.debug("consumer notification not delivered code=%d error=%s", frame.code, e)

    # --- status (broker/status.py) -------------------------------------------------------------------------
    def registration_snapshot(self) -> RegistrationSnapshot:
        return registration_snapshot(self)

    def runtime_info(self) -> dict[str, Any]:
        return runtime_info(self)

    # --- background tasks ----------------------------------------------------------------------------------
    async def watch_role(self) -> None:
        async with self.group.role_changes() as changes:
            async for change in changes:
                if change.role is not Role.LEADER:
                    self.offsets.drop_pending()
                self.refresh_metadata()
                self.registration.trigger()

    async def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """A consumer's commit (UPDATE_CONSUMER_OFFSET), on the leader: pending, replicated with the others within
        ``consumer_offset_flush_interval_ms``, except while the queue has no replicated offset of the group (its
        first commits), replicated before this returns. A lost later commit costs re-consumption; a lost first one
        left the group without an offset, and a consumer from its last offset started at the queue's end,
        skipping everything stored since. Refused with NOT_LEADER while a clean stop hands the leadership over."""
        if self._handing_over:
            # Taken now it would stay pending: the flush waits for the transfer, fails once it is done, and the
            # commit, answered SUCCESS, went with the leadership. Refused, the consumer keeps it and commits it
            # again (its next persist) to the group's leader then.
            raise RequestRejected(ResponseCode.NOT_LEADER,
                                  f"broker node {self.broker_addr} ({self.config.broker_name}) is handing its "
                                  f"leadership over (stopping): the offset commit is taken by the next leader",
                                  ext={"leader_addr": None, "broker_name": self.config.broker_name})
        # "First" means not replicated yet, not "unknown here": a second commit arriving while the first one's
        # replication is in flight found it pending and was answered before anything was replicated.
        first = self._committed_offset(group, topic, queue_id) is None
        self.offsets.commit(group, topic, queue_id, offset)
        if not first:
            return
        await self._flush_offsets_once()
        if self._committed_offset(group, topic, queue_id) is None:
            # Taken by a flush in flight before this one could (the first commit's): its outcome is under the lock.
            async with self._offset_lock:
                pass
        if self._committed_offset(group, topic, queue_id) is None:
            if not self.is_leader():
                raise self.not_leader()
            raise RequestRejected(ResponseCode.SYSTEM_BUSY,
                                  f"the first offset of consumer group {group!r} for {topic}:{queue_id} is not "
                                  f"replicated yet; it is retried with the next offsets")

    async def flush_offsets(self) -> None:
        interval = self.config.consumer_offset_flush_interval_ms / 1000
        while True:
            await trio.sleep(interval)
            await self._flush_offsets_once()

    async def _flush_offsets_once(self) -> None:
        if not self.offsets.has_pending():
            return
        if not self.is_leader():
            self.offsets.drop_pending()
            return
        async with self._offset_lock:
            batch = self.offsets.take_pending()
            try:
                await self._replicate(OFFSET_TABLE, {_offset_key(g, t, q): o for g, t, q, o in batch})
            except RequestRejected:
                self.offsets.drop_pending()
            except Exception as e:
                log.warning("consumer offset flush failed entries=%d error=%s", len(batch), e)
                if self.is_leader():
                    self.offsets.requeue(batch)
            except BaseException:
                # Cancelled: the first commit of a consumer whose connection closed flushes inline, and every
                # group's pending commits, acknowledged already, went with it. Kept for the next flush instead.
                if self.is_leader():
                    self.offsets.requeue(batch)
                raise
            finally:
                self.offsets.flushed()

    async def hand_over_leadership(self) -> None:
        """On a clean stop (SIGTERM/SIGINT), while the node still serves: a leader replicates the consumer
        offsets it holds and hands its leadership to its most caught-up connected follower (Raft's leadership
        transfer, which etcd also does on shutdown). A planned restart then costs producers one NOT_LEADER
        redirect instead of an election timeout, and consumers no redelivery of what they had committed: from the
        start of the hand-over, commits (UPDATE_CONSUMER_OFFSET) are refused with NOT_LEADER, which consumers keep
        and commit again to the next leader; taken, they would have been left pending here once the leadership
        moved. (An offset a pull carries is taken as ever, and lost with the leadership: the consumer's next pull
        and periodic commit carry it again.) A follower, a leader with no follower connected, or
        ``leadership_handover_timeout_ms = 0``: nothing. It gives up at once when the last follower goes (the
        whole group is stopping), else after the timeout."""
        timeout_s = self.config.leadership_handover_timeout_ms / 1000
        group = self.group
        if timeout_s <= 0 or not group.is_leader or not group.statistics().connected_peers:
            return
        self._handing_over = True
        try:
            await self._hand_over(timeout_s)
        finally:
            self._handing_over = False

    async def _hand_over(self, timeout_s: float) -> None:
        group = self.group
        started = time.monotonic()
        outcome = ""
        waiting_for = "the consumer offsets to replicate"
        with trio.move_on_after(timeout_s) as handover:
            async with trio.open_nursery() as nursery:
                async def give_up_when_alone() -> None:
                    nonlocal outcome
                    while group.statistics().connected_peers:
                        await trio.sleep(0.02)
                    outcome = "no follower connected any more"
                    nursery.cancel_scope.cancel()

                nursery.start_soon(give_up_when_alone)
                try:
                    await self._flush_offsets_once()
                    waiting_for = ""
                    role = await group.transfer_leadership(timeout_s=timeout_s)
                    log.info("handed leadership over before stopping to=%s term=%d after_ms=%d", role.leader_id,
                             role.term, (time.monotonic() - started) * 1000)
                except DLedgerError as e:
                    outcome = str(e)
                nursery.cancel_scope.cancel()
        if handover.cancelled_caught:
            # Where it was stuck, so a slow hand-over can be told apart from a refused one.
            outcome = (f"not done within {self.config.leadership_handover_timeout_ms} ms (waiting for "
                       f"{waiting_for or group.transfer_phase or 'the transfer to start'})")
        if outcome:
            log.warning("stopping without handing leadership over: %s", outcome)

    async def register_topic_changes(self) -> None:
        while True:
            await trio.sleep(0.2)
            # A follower applies the topic changes its leader registered, but registered them itself only every
            # register_interval_ms. While the group has no master (its leader just died), a name server routes the
            # group's topics from the followers' registrations: a topic created since their last one dropped out
            # of the route, and clients that refreshed then stopped using the group until their next refresh.
            if self.topics.data_version != self.registration.registered_data_version:
                self.registration.trigger_behind(self.topics.data_version)

    async def create_trace_topic(self) -> None:
        """``trace_topic_enable`` (RocketMQ's traceTopicEnable): ``msg_trace_topic_name`` created with one queue, as
        RocketMQ's, if the group has no such topic. Only a ready leader may (replicated as any create), so every
        node waits until the topic exists or it leads; a restart finds it there and does nothing."""
        config = TopicConfig(topic_name=self.config.msg_trace_topic_name, read_queue_nums=1, write_queue_nums=1)
        while self.topic(config.topic_name) is None:
            if self.group.is_ready_leader:
                try:
                    await self.ensure_topic(config, "created for message traces (trace_topic_enable)")
                    continue
                except (RequestRejected, RaftMQError, DLedgerError) as e:
                    log.warning("trace topic not created yet, retried topic=%s error=%s", config.topic_name, e)
            await trio.sleep(0.5)

    async def scan_clients(self) -> None:
        while True:
            await trio.sleep(10)
            self.clients.scan_expired()
            self.pull_stats.prune()
            await self.prune_queue_locks()


async def _rejoin_if_rebuilt(config: DLedgerConfig, store: MessageStore, client: Any) -> DLedgerConfig:
    """A member with neither a commit log nor Raft data is either one of a new group or one rebuilt empty (its
    disk lost, or its log diverged); only a rebuilt one must keep out of elections until a leader is heard
    from (``--rejoin``, docs/operations.md). Its peers tell: if one holds a log, the group is not new."""
    if config.rejoin or not config.rejoin_probe_timeout_ms or store.max_phy_offset > 0 or config.has_raft_data():
        return config
    found = await peer_with_history(client, config)
    if found is None:
        log.info("starting with an empty log group=%s id=%s: no peer reports a log (a new group, or none "
                 "reachable: a member rebuilt empty while its peers are down needs --rejoin)", config.group,
                 config.self_id)
        return config
    address, status = found
    log.warning("starting with an empty log group=%s id=%s, but peer %s holds a log up to offset %s (term %s): "
                "a rebuilt member; rejoining as with --rejoin", config.group, config.self_id, address,
                status.get("end_offset"), status.get("term"))
    return config.replace(rejoin=True)


def _server_tls(node: BrokerNode) -> ContextReloader | None:
    """The TLS context source of the node's remoting server: its config's files as they are at each connection
    accepted (remoting/tls.py), from ``node.config`` as it is then. None with tls_mode "disabled"."""
    if node.config.tls_mode == "disabled":
        return None
    return ContextReloader(lambda: node.config.tls_server_context())


def _client_tls(config: BrokerConfig) -> ContextReloader | None:
    """The TLS context source of the node's own client (catch-up fetches to its peers, registration with the name
    servers): its files as they are at each connection it makes, so a certificate or CA rotated on disk is used
    without a restart, as the server's is. None without ``tls_client_enable``."""
    if not config.tls_client_enable:
        return None
    return ContextReloader(config.tls_client_context)  # type: ignore[arg-type]


async def serve_broker(config: BrokerConfig, *, on_serving: Callable[[BrokerNode], None] | None = None,
                       task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
    """Run one broker node until cancelled; ``task_status.started((host, port))`` once it listens, after
    ``on_serving(node)`` (the command keeps the node for ``hand_over_leadership`` on a signal)."""
    store = MessageStore.open(config.store)
    machine = CommitLogMachine(store)
    try:
        # Read once the store's directory lock is held: no other process writes the file meanwhile.
        file_config = config
        config = load_runtime_config(file_config)
        async with trio.open_nursery() as outer:
            await outer.start(store.serve)
            client_tls = _client_tls(config)
            async with open_remoting_client(max_frame_size=config.max_frame_size, tls_context=client_tls) as client:
                dledger_config = await _rejoin_if_rebuilt(config.dledger, store, client)
                async with open_dledger_group(dledger_config, machine,
                                              fetch_range=remote_fetch_range(client, config.broker_name,
                                                                             dledger_config.secret),
                                              completion_context=corked) as group:
                    node = BrokerNode(config, store, group, client, file_config=file_config)
                    dispatcher = BrokerDispatcher(node)
                    store.add_dispatch_listener(node.hold.notify_message_arriving)
                    host, port = parse_host_port(config.listen_address, key="listen")
                    try:
                        async with trio.open_nursery() as nursery:
                            node._nursery = nursery
                            if config.metrics_listen:
                                # First: a metrics address the host refuses stops the node before it serves or
                                # registers (a ConfigError naming metrics_listen).
                                node.metrics_address = await nursery.start(
                                    serve_metrics, broker_metrics_registry(node), config.metrics_listen)
                            await nursery.start(node.hold.serve)
                            bound = await nursery.start(functools.partial(
                                serve_remoting, dispatcher, host, port, max_frame_size=config.max_frame_size,
                                tls_mode=config.tls_mode, tls_context=_server_tls(node)))
                            nursery.start_soon(node.watch_role)
                            nursery.start_soon(node.flush_offsets)
                            nursery.start_soon(node.register_topic_changes)
                            nursery.start_soon(node.scan_clients)
                            if config.trace_topic_enable:
                                nursery.start_soon(node.create_trace_topic)
                            nursery.start_soon(node.schedule.serve)
                            nursery.start_soon(node.transactions.serve)
                            nursery.start_soon(node.pop.serve)
                            nursery.start_soon(dispatcher.replies.serve)
                            await nursery.start(node.registration.serve)
                            log.info("broker node serving broker_name=%s broker_id=%d listen=%s:%d metrics=%s",
                                     config.broker_name, node.broker_id, bound[0], bound[1],
                                     "%s:%d" % node.metrics_address if node.metrics_address else "off")
                            if on_serving is not None:
                                on_serving(node)
                            task_status.started(bound)
                    finally:
                        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                            await node.registration.unregister_all()
            outer.cancel_scope.cancel()
    finally:
        store.close()

