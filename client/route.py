"""Topic routes: what the name servers say, cached, refreshed, and the queue choice made from them.

Rules of this module:
- A route names, per broker group, the address of each node (``broker_addrs[0]`` is the Raft leader, the
  master) and, per group, how many write/read queues the topic has there.
- A name server that does not know a topic is asked no more than one that cannot be reached: the next is asked
  (one restarted less than a registration interval ago knows only the brokers that re-registered since). Only
  when no name server routes the topic is it unknown (``NoRouteError`` with ``topic_unknown=True``).
- Name servers are asked one at a time (``RouteCache.ask_namesrvs``, which ``ClientInstance.invoke_namesrv`` uses
  too, sharing its memory): first the one that last answered with something (a route, a cluster info naming a
  broker; RocketMQ's ``namesrvAddrChoosed``), then the others in turn, those that failed within
  ``NAMESRV_ISOLATION_MS`` (refused, timed out, an error answer) last. Once one has answered that it knows
  nothing, each of the rest is a second opinion, waited for ``SECOND_OPINION_TIMEOUT_S`` at most: a hung name
  server (a stopped process still accepts connections) held every lookup of an unknown topic its whole request
  timeout, which is a send's whole deadline, so no send to a new topic got as far as creating it.
- Routes are cached per topic and refreshed every ``poll_name_server_interval_ms`` and *at once* when a broker
  says NOT_LEADER, a connection fails, or a group's leader falls silent with requests waiting (the leader
  watch in ``client/instance.py``) (``RouteCache.refresh``). Concurrent refreshes of one topic share one
  name-server query. A refresh that fails keeps the cached route, but not for ever when the topic is unknown
  (deleted): once every refresh for ``UNKNOWN_TOPIC_GRACE_S`` found it so, its route is dropped, and the topic is
  as one never routed to every user (a send looks it up again or auto-creates it, a rebalance skips it, a simple
  consumer asks for it in the background and receives its other topics). A cached route to a deleted topic sent
  every POP, pull and send there for the client's life, to be refused TOPIC_NOT_EXIST each time. Not at the first
  "unknown": a name server restarted a moment ago (the only one, or the only one answering) knows no topic until
  the brokers register again, at most ``register_interval_ms`` (up to 60 s) later.
- A NOT_LEADER answer carries the leader's address; it is remembered as a *leader hint* for that group and
  wins over the cached route, because the name server learns of a new leader only when that leader registers.
  A hint is dropped when a request to it fails or the route agrees with it.
- Every topic's route names the groups it spans with all their nodes, so one group appears in many routes, each
  as fresh as its topic's last refresh. A group's nodes and master are taken from the route queried *last* that
  names it (a query number taken as each name-server query goes out), whatever topic that was and whenever its
  answer came: refreshing topic A after a failover must move every topic on the group, and topic B's stale copy
  must not bring the dead leader back (it did: sends to A went to the dead node first, then were redirected,
  until B's own refresh up to 30 s later). Routes carry no version, so query order stands in for one: one name
  server answers one connection's requests in the order they were sent, so a later query never reads an older
  table there (two name servers may disagree, as they may for one topic). A route answered late for a query
  sent early (a slow name server, the next one asked after a failure) changes nothing its newer peers said.
  A stand-in route (``install_default``) only fills in groups no route names yet.
- Queue selection is round-robin over writable queues, skipping groups the fault tracker marks unavailable
  (RocketMQ's ``MQFaultStrategy``) and, on a retry, the group that just failed, falling back to any queue
  rather than failing when every group looks unavailable.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cbor2
import trio

from client.errors import NoRouteError
from client.message import MessageQueue
from remoting.config import parse_host_port
from remoting.errors import RequestTimeoutError

__all__ = [
    "PERM_READ", "PERM_WRITE", "PERM_INHERIT", "MASTER_ID", "QueueData", "BrokerData", "TopicRouteData",
    "FaultTracker", "TopicPublishInfo", "RouteCache", "parse_route",
]

log = logging.getLogger(__name__)

PERM_INHERIT = 0x1
PERM_WRITE = 0x2
PERM_READ = 0x4
MASTER_ID = 0


@dataclasses.dataclass(frozen=True, slots=True)
class QueueData:
    broker_name: str
    read_queue_nums: int
    write_queue_nums: int
    perm: int = PERM_READ | PERM_WRITE
    topic_sys_flag: int = 0

    @property
    def writable(self) -> bool:
        return bool(self.perm & PERM_WRITE)

    @property
    def readable(self) -> bool:
        return bool(self.perm & PERM_READ)


@dataclasses.dataclass(frozen=True, slots=True)
class BrokerData:
    cluster: str
    broker_name: str
    broker_addrs: Mapping[int, str]

    @property
    def master_addr(self) -> str | None:
        return self.broker_addrs.get(MASTER_ID)


@dataclasses.dataclass(frozen=True, slots=True)
class TopicRouteData:
    topic: str
    queue_datas: tuple[QueueData, ...]
    broker_datas: tuple[BrokerData, ...]

    def broker(self, broker_name: str) -> BrokerData | None:
        for b in self.broker_datas:
            if b.broker_name == broker_name:
                return b
        return None

    def write_queues(self) -> list[MessageQueue]:
        out = []
        for qd in sorted(self.queue_datas, key=lambda q: q.broker_name):
            b = self.broker(qd.broker_name)
            # A group whose leader is not registered right now (an election, or the name server has not heard
            # of the new leader yet) keeps its queues: any node of it redirects us to the leader.
            if qd.writable and b is not None and b.broker_addrs:
                out.extend(MessageQueue(self.topic, qd.broker_name, i) for i in range(qd.write_queue_nums))
        return out

    def read_queues(self) -> list[MessageQueue]:
        out = []
        for qd in sorted(self.queue_datas, key=lambda q: q.broker_name):
            if qd.readable:
                out.extend(MessageQueue(self.topic, qd.broker_name, i) for i in range(qd.read_queue_nums))
        return out


def _field(d: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    # Accept RocketMQ's camelCase spelling as well as ours, so a route dumped by either side parses.
    for name in names:
        if name in d:
            return d[name]
    return default


def peer_addr(value: Any) -> str:
    """An address a peer gave (a route's broker, a leader hint), checked where it comes in: a bad one reached the
    connection pool, whose ValueError (meant for a caller's own bad argument) ended the client's background tasks
    (heartbeats, route refreshes), which expect RaftMQError. Raises ``ConfigError``, a ``ValueError``."""
    parse_host_port(value, key="broker address", dial=True)
    return value


def parse_broker_addr_table(data: Any) -> dict[str, dict[int, str]]:
    """``{group: {broker id: address}}`` from a GET_BROKER_CLUSTER_INFO map. Raises TypeError, ValueError,
    AttributeError or OverflowError where the map is malformed; callers say whose answer it was."""
    table = data.get("broker_addr_table", {})
    return {_text(name, "broker name"): {int(k): peer_addr(v) for k, v in group.get("broker_addrs", {}).items()}
            for name, group in table.items()}


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{what} {value!r} is not a non-empty text")
    return value


def parse_route(topic: str, data: Mapping[str, Any]) -> TopicRouteData:
    """Build a ``TopicRouteData`` from the name server's map; raises ``NoRouteError`` if it is malformed."""
    try:
        queue_datas = tuple(
            QueueData(broker_name=str(_field(q, "broker_name", "brokerName")),
                      read_queue_nums=int(_field(q, "read_queue_nums", "readQueueNums")),
                      write_queue_nums=int(_field(q, "write_queue_nums", "writeQueueNums")),
                      perm=int(_field(q, "perm", default=PERM_READ | PERM_WRITE)),
                      topic_sys_flag=int(_field(q, "topic_sys_flag", "topicSysFlag", default=0)))
            for q in _field(data, "queue_datas", "queueDatas", default=()))
        broker_datas = tuple(
            BrokerData(cluster=str(_field(b, "cluster", default="")),
                       broker_name=str(_field(b, "broker_name", "brokerName")),
                       broker_addrs={int(k): peer_addr(v)
                                     for k, v in _field(b, "broker_addrs", "brokerAddrs", default={}).items()})
            for b in _field(data, "broker_datas", "brokerDatas", default=()))
    except (TypeError, ValueError, AttributeError, OverflowError) as e:
        raise NoRouteError(f"the name server's route for topic {topic!r} is malformed: {e}", topic=topic) from e
    return TopicRouteData(topic, queue_datas, broker_datas)


class FaultTracker:
    """Per-group availability from observed send latency and failures (RocketMQ's LatencyFaultTolerance).

    Slow groups are avoided for a while in proportion to their latency; a failed group is avoided for
    ``isolation_ms``. Short by default: a failed leader is usually replaced within a second or two, and the
    route refresh on failure already steers us to the new one.
    """

    LATENCY_MAX_MS = (50, 100, 550, 1000, 2000, 3000, 15000)
    NOT_AVAILABLE_MS = (0, 0, 3000, 6000, 12000, 18000, 60000)

    def __init__(self, *, isolation_ms: int = 1000, clock: Callable[[], float] = time.monotonic) -> None:
        self.isolation_ms = isolation_ms
        self._clock = clock
        self._until: dict[str, float] = {}

    def update(self, broker_name: str, latency_ms: float, *, isolation: bool) -> None:
        if not isolation and latency_ms < self.LATENCY_MAX_MS[2]:
            # The common case, once per acknowledged send: fast enough to never be avoided.
            if self._until:
                self._until.pop(broker_name, None)
            return
        if isolation:
            duration = self.isolation_ms
        else:
            duration = 0
            for limit, avoid in zip(reversed(self.LATENCY_MAX_MS), reversed(self.NOT_AVAILABLE_MS)):
                if latency_ms >= limit:
                    duration = avoid
                    break
        if duration:
            self._until[broker_name] = self._clock() + duration / 1000
        else:
            self._until.pop(broker_name, None)

    @property
    def avoiding(self) -> bool:
        """Whether some group may be avoided now (False: every group is available, nothing to ask per group)."""
        return bool(self._until)

    def is_available(self, broker_name: str) -> bool:
        until = self._until.get(broker_name)
        if until is None:
            return True
        if self._clock() >= until:
            del self._until[broker_name]
            return True
        return False


class TopicPublishInfo:
    """The writable queues of one topic and the round-robin position over them."""

    def __init__(self, route: TopicRouteData) -> None:
        self.route = route
        self.queues: list[MessageQueue] = route.write_queues()
        # A stand-in route (RouteCache.install_default): its sends ask the broker to create the topic with the
        # producer's default_topic_queue_nums, and the first answer has the real route fetched at once.
        self.stand_in = False
        self._counter = itertools.count(random.randrange(1 << 16))

    def select(self, faults: FaultTracker | None, last_broker: str | None = None) -> MessageQueue:
        if not self.queues:
            raise NoRouteError(f"topic {self.route.topic!r} has no writable queue on any broker group",
                               topic=self.route.topic)
        n = len(self.queues)
        start = next(self._counter)
        if last_broker is None and (faults is None or not faults.avoiding):
            return self.queues[start % n]  # what the loops below pick when no group is to be skipped
        if faults is not None:
            for i in range(n):
                mq = self.queues[(start + i) % n]
                if faults.is_available(mq.broker_name) and mq.broker_name != last_broker:
                    return mq
        if last_broker is not None:
            for i in range(n):
                mq = self.queues[(start + i) % n]
                if mq.broker_name != last_broker:
                    return mq
        return self.queues[start % n]


_UNKNOWN: Any = object()

# How long a name server that failed is asked after the others: a registration interval, by which a restarted one
# knows every broker again. Asked last, not skipped: it is still asked when the others fail or know nothing.
NAMESRV_ISOLATION_MS = 30_000
# How long a name server is waited for once another has answered that it knows nothing. A working one answers in
# milliseconds; a hung one would hold the lookup for its request timeout (3 s, a send's whole deadline). One that
# does not answer in time is taken as failed (asked last from then on), and what the others said stands.
SECOND_OPINION_TIMEOUT_S = 0.5
# How long the name servers must have said a cached topic is unknown before its route is dropped: two of the longest
# registration interval (the brokers' register_interval_ms, at most 60 s), by which a restarted name server knows
# every broker, and so every topic, again, with a refresh's timing to spare (the name servers' own broker_expired_ms).
UNKNOWN_TOPIC_GRACE_S = 120.0


def _namesrv_failure(error: Exception) -> bool:
    """Whether ``error`` from asking one name server means: ask the next (else it is raised as it is)."""
    return bool(getattr(error, "retriable", False) or getattr(error, "refresh_route", False)
                or isinstance(error, OSError))


@dataclasses.dataclass
class NamesrvAnswers:
    """What the name servers said to one question (``RouteCache.ask_namesrvs``), in the order they were asked."""

    answer: Any = None  # the first answer with something in it, None if none had
    answered_by: str | None = None
    empty: list[tuple[str, Any]] = dataclasses.field(default_factory=list)  # (address, answer) knowing nothing
    errors: dict[str, Exception] = dataclasses.field(default_factory=dict)  # address -> why it gave no answer
    # Of errors, those a second opinion's bound cut short (alive, maybe, and only slow): not "down".
    cut_short: list[str] = dataclasses.field(default_factory=list)


class _RouteFetch:
    """One query of the name servers for a topic, awaited by every caller that needs it meanwhile."""

    __slots__ = ("done", "finished", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.finished = False  # False once done: the caller that started it was cancelled
        self.error: Exception | None = None


class RouteCache:
    """Routes per topic from the name servers, with leader hints per broker group.

    ``query(addr, topic) -> Mapping | None`` asks one name server (None: topic unknown there); it is injected
    so this class stays testable without sockets. It also keeps which name server to ask first and which failed
    lately (``ask_namesrvs``), for every question the client asks the name servers.
    """

    def __init__(self, namesrv_addrs: Sequence[str], query: Callable[[str, str], Any]) -> None:
        if not namesrv_addrs:
            raise ValueError("namesrv_addrs must name at least one name server")
        self.namesrv_addrs = list(namesrv_addrs)
        self._query = query
        self._routes: dict[str, TopicRouteData] = {}
        self._publish: dict[str, TopicPublishInfo] = {}
        self._inflight: dict[str, _RouteFetch] = {}
        self._leader_hints: dict[str, str] = {}
        # broker_name -> (query number, BrokerData) of the newest route naming the group (see the module rules).
        self._groups: dict[str, tuple[int, BrokerData]] = {}
        self._query_numbers = itertools.count()
        # broker_name -> master_addr(broker_name), asked at least once per send: kept until a route or a leader
        # hint changes, instead of searching the routes each time.
        self._masters: dict[str, str | None] = {}
        # topic -> when (trio's clock) a refresh first found its cached route's topic unknown, since the last route.
        self._unknown_since: dict[str, float] = {}
        # The name server that last answered with something, asked first (a random one to begin with, as
        # RocketMQ's clients pick, so that a fleet's clients spread over them).
        self._ns_index = random.randrange(len(self.namesrv_addrs))
        self._namesrv_faults = FaultTracker(isolation_ms=NAMESRV_ISOLATION_MS)
        self.refresh_count = 0

    @property
    def topics(self) -> list[str]:
        return list(self._routes)

    def cached(self, topic: str) -> TopicRouteData | None:
        return self._routes.get(topic)

    async def get(self, topic: str) -> TopicRouteData:
        route = self._routes.get(topic)
        if route is None:
            route = await self.refresh(topic)
        return route

    def cached_publish_info(self, topic: str) -> TopicPublishInfo | None:
        return self._publish.get(topic)

    async def publish_info(self, topic: str) -> TopicPublishInfo:
        info = self._publish.get(topic)
        if info is None:
            await self.get(topic)
            info = self._publish[topic]
        return info

    async def refresh(self, topic: str) -> TopicRouteData:
        """Ask the name servers now; concurrent callers for one topic share one query. A query given up by the
        caller that started it (cancelled by its own deadline, or a closing consumer) answers nothing: those
        that waited on it ask again, the first of them for the rest. They were handed its ``trio.Cancelled``,
        which then unwound tasks that nobody had cancelled."""
        while True:
            fetch = self._inflight.get(topic)
            if fetch is None:
                break
            await fetch.done.wait()
            if fetch.finished:
                route = self._routes.get(topic)
                if route is None:
                    raise fetch.error or NoRouteError(f"no route for topic {topic!r}", topic=topic)
                return route
        fetch = self._inflight[topic] = _RouteFetch()
        try:
            route, number = await self._fetch(topic)
            self._install(route, number)
            fetch.finished = True
            return route
        except Exception as e:
            if getattr(e, "topic_unknown", False) and getattr(e, "unknown_for_sure", True):
                self._unknown(topic)
            else:
                # The grace counts an unbroken run of "unknown": a refresh no name server answered, or one cut short,
                # ends it (else name servers down for 2 minutes, then restarted, dropped the route at their first
                # "unknown", before the brokers registered again).
                self._unknown_since.pop(topic, None)
            fetch.error = e
            fetch.finished = True
            raise
        finally:
            del self._inflight[topic]
            fetch.done.set()

    def namesrv_order(self) -> list[str]:
        """The name servers in the order to ask them: the one that answered last, the others in turn after it,
        those that failed within ``NAMESRV_ISOLATION_MS`` last."""
        n = len(self.namesrv_addrs)
        ring = [self.namesrv_addrs[(self._ns_index + i) % n] for i in range(n)]
        available = [addr for addr in ring if self._namesrv_faults.is_available(addr)]
        return available + [addr for addr in ring if addr not in available]

    async def ask_namesrvs(self, ask: Callable[[str], Any], knows_nothing: Callable[[Any], bool],
                           what: str) -> NamesrvAnswers:
        """Ask the name servers (``namesrv_order``) for ``what`` (named in the log) one at a time with
        ``ask(addr)`` until one answers with something (not ``knows_nothing(answer)``); that one is asked first
        next time. A failure (an error that is retriable, asks for a route refresh, or is an ``OSError``) or an
        answer knowing nothing sends on to the next: name servers never talk to each other and learn brokers only
        from registrations, so one restarted a moment ago knows nothing the others know. Once one knew nothing,
        each of the rest is waited for ``SECOND_OPINION_TIMEOUT_S`` at most, one after the other (a fixed asking
        order, as before). Any other error is raised as it is."""
        answers = NamesrvAnswers()
        for addr in self.namesrv_order():
            started = time.monotonic()
            wait_s = SECOND_OPINION_TIMEOUT_S if answers.empty else math.inf
            try:
                with trio.move_on_after(wait_s) as waited:
                    answer = await ask(addr)
            except trio.Cancelled:
                # The caller gave up (its deadline, a closing client): after a long wait, that is this name
                # server's slowness, and it is asked after the others for a while (FaultTracker's latency steps).
                waited_ms = (time.monotonic() - started) * 1000
                if waited_ms >= FaultTracker.LATENCY_MAX_MS[2]:
                    self._namesrv_faults.update(addr, waited_ms, isolation=False)
                raise
            except Exception as e:  # noqa: BLE001 - any name server failure means: try the next one
                if not _namesrv_failure(e):
                    raise
                log.debug("name server query failed namesrv=%s what=%s error=%s", addr, what, e)
                self._namesrv_faults.update(addr, 0, isolation=True)
                answers.errors[addr] = e
                continue
            if waited.cancelled_caught:
                log.debug("name server gave no second opinion in time namesrv=%s what=%s wait_s=%s", addr, what,
                          wait_s)
                self._namesrv_faults.update(addr, 0, isolation=True)
                answers.errors[addr] = RequestTimeoutError(addr, wait_s)
                answers.cut_short.append(addr)
                continue
            self._namesrv_faults.update(addr, (time.monotonic() - started) * 1000, isolation=False)
            if knows_nothing(answer):
                log.debug("a name server knows nothing of it, asking the next namesrv=%s what=%s", addr, what)
                answers.empty.append((addr, answer))
                continue
            self._ns_index = self.namesrv_addrs.index(addr)
            answers.answer, answers.answered_by = answer, addr
            return answers
        return answers

    async def _fetch(self, topic: str) -> tuple[TopicRouteData, int]:
        """The route and the number of the query that got it (taken as that query went out)."""
        # "Unknown" from one name server is no more final than a failed connection (see ask_namesrvs): the topic
        # is unknown only if no name server routes it.
        numbers: dict[str, int] = {}

        async def ask(addr: str) -> TopicRouteData | None:
            numbers[addr] = next(self._query_numbers)
            data = await self._query(addr, topic)
            self.refresh_count += 1
            return None if data is None else parse_route(topic, data)  # a malformed one: ask the next

        answers = await self.ask_namesrvs(ask, lambda route: route is None, f"the route of topic {topic!r}")
        if answers.answered_by is not None:
            return answers.answer, numbers[answers.answered_by]
        errors = answers.errors
        unknown_at = [addr for addr, _ in answers.empty]
        last_error = next(reversed(errors.values()), None)
        if not errors:
            raise NoRouteError(f"no name server knows topic {topic!r} (asked {', '.join(unknown_at)})", topic=topic,
                               topic_unknown=True, unknown_for_sure=True)
        if unknown_at:
            # Those that answered all said unknown; the silent ones may know better, but nothing routes the topic
            # now. Still "unknown": a consumer subscribed before the topic exists must take it from its first
            # message once it appears, name server down or not (at worst it consumes an existing topic's history).
            # One the second opinion's bound cut short may be only slow (a first connection, a far link) and know
            # the topic: unknown still, for a producer's auto-create, which needs an answer within its send's
            # deadline; but ``unknown_for_sure`` is false, and a consumer does not take the topic for one created
            # after its subscription (it would consume an existing topic's whole history).
            failed = "; ".join(f"{a} did not answer: {e}" for a, e in errors.items())
            raise NoRouteError(f"no name server that answered knows topic {topic!r} ({', '.join(unknown_at)}; "
                               f"{failed})", topic=topic, topic_unknown=True,
                               unknown_for_sure=not answers.cut_short) from last_error
        raise NoRouteError(f"no name server answered for topic {topic!r} (tried {', '.join(self.namesrv_addrs)}): "
                           f"{last_error}", topic=topic) from last_error

    def _unknown(self, topic: str) -> None:
        """A refresh found ``topic`` unknown to every name server that answered: its cached route, if any, is dropped
        once that has lasted ``UNKNOWN_TOPIC_GRACE_S`` (see the module rules)."""
        if topic not in self._routes:
            return
        now = trio.current_time()
        since = self._unknown_since.setdefault(topic, now)
        if now - since < UNKNOWN_TOPIC_GRACE_S:
            return
        log.warning("topic unknown to the name servers for %.0f s (deleted?), its cached route dropped topic=%s",
                    now - since, topic)
        del self._unknown_since[topic]
        old = self._routes.pop(topic)
        self._publish.pop(topic, None)
        self._masters.clear()
        self._forget_groups(old)

    def _forget_groups(self, old: TopicRouteData) -> None:
        """Forget the groups ``old`` (a route replaced or dropped) named that no cached route names any more."""
        groups = self._groups
        for b in old.broker_datas:
            if b.broker_name in groups and not any(r.broker(b.broker_name) is not None for r in self._routes.values()):
                del groups[b.broker_name]

    def _install(self, route: TopicRouteData, number: int | None) -> None:
        """Cache ``route``, got by query ``number`` (None: a stand-in, which only fills in unknown groups)."""
        self._masters.clear()
        self._unknown_since.pop(route.topic, None)
        old = self._routes.get(route.topic)
        self._routes[route.topic] = route
        if old is None or old.write_queues() != route.write_queues() or old.broker_datas != route.broker_datas:
            self._publish[route.topic] = TopicPublishInfo(route)
        # Set on the kept one too: a real route equal to the stand-in it replaces is no stand-in any more.
        self._publish[route.topic].stand_in = number is None
        groups = self._groups
        for b in route.broker_datas:
            held = groups.get(b.broker_name)
            if held is None or number is not None and number > held[0]:
                groups[b.broker_name] = (-1 if number is None else number, b)
            newest = groups[b.broker_name][1]
            # Compared with the group's newest route, not this one: that is what master_addr falls back to once
            # the hint is gone, and an older route agreeing with the hint says nothing about it.
            if newest.master_addr and self._leader_hints.get(b.broker_name) == newest.master_addr:
                del self._leader_hints[b.broker_name]
        if old is not None:
            self._forget_groups(old)  # a group the topic left: forgotten once no route names it

    def install_default(self, topic: str, brokers: Mapping[str, Mapping[int, str]], queue_nums: int,
                        cluster: str = "") -> TopicRouteData:
        """A stand-in route for a topic no name server knows yet, spread over ``brokers`` (from cluster info):
        the first send creates the topic on the broker (``auto_create_topic_enable``), which then registers
        it, and the next refresh replaces this route with the real one (RocketMQ does the same through the
        template topic TBW102)."""
        route = TopicRouteData(
            topic,
            tuple(QueueData(name, queue_nums, queue_nums) for name in sorted(brokers)),
            tuple(BrokerData(cluster, name, dict(addrs)) for name, addrs in sorted(brokers.items())))
        if not route.write_queues():
            raise NoRouteError(f"topic {topic!r} is unknown and no broker group is registered to create it on",
                               topic=topic)
        self._install(route, None)
        return route

    def set_leader_hint(self, broker_name: str, addr: str | None) -> None:
        self._masters.pop(broker_name, None)
        if addr:
            try:
                addr = peer_addr(addr)
            except ValueError as e:  # a broker's NOT_LEADER or status named one: worth nothing, the route decides
                log.warning("leader hint ignored broker_name=%s error=%s", broker_name, e)
                self._leader_hints.pop(broker_name, None)
                return
            self._leader_hints[broker_name] = addr
        else:
            self._leader_hints.pop(broker_name, None)

    def drop_leader_hint(self, broker_name: str, addr: str) -> None:
        if self._leader_hints.get(broker_name) == addr:
            del self._leader_hints[broker_name]
            self._masters.pop(broker_name, None)

    def _broker(self, broker_name: str) -> BrokerData | None:
        held = self._groups.get(broker_name)
        return None if held is None else held[1]

    def master_addr(self, broker_name: str) -> str | None:
        addr = self._masters.get(broker_name, _UNKNOWN)
        if addr is _UNKNOWN:
            addr = self._masters[broker_name] = self._find_master_addr(broker_name)
        return addr

    def _find_master_addr(self, broker_name: str) -> str | None:
        hint = self._leader_hints.get(broker_name)
        if hint:
            return hint
        b = self._broker(broker_name)
        if b is None:
            return None
        if b.master_addr:
            return b.master_addr
        # No leader registered: ask a follower, which answers NOT_LEADER naming the leader once it knows it.
        return b.broker_addrs[min(b.broker_addrs)] if b.broker_addrs else None

    def routed_master_addr(self, broker_name: str) -> str | None:
        """The group's master as the name servers last routed it, leader hints aside."""
        b = self._broker(broker_name)
        return b.master_addr if b is not None and b.master_addr else None

    def topic_on(self, broker_name: str) -> str | None:
        """A cached topic whose route includes the group: refreshing it refreshes the group's master."""
        for topic, route in self._routes.items():
            if route.broker(broker_name) is not None:
                return topic
        return None

    def broker_names(self) -> list[str]:
        return sorted({b.broker_name for route in self._routes.values() for b in route.broker_datas})

    def replica_addrs(self, broker_name: str) -> list[str]:
        """Every known node of the group, master (or hinted leader) first."""
        b = self._broker(broker_name)
        addrs = [] if b is None else [b.broker_addrs[k] for k in sorted(b.broker_addrs)]
        master = self.master_addr(broker_name)
        if master:
            addrs = [master] + [a for a in addrs if a != master]
        return addrs

    def all_broker_addrs(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for route in self._routes.values():
            for b in route.broker_datas:
                out.setdefault(b.broker_name, set()).update(b.broker_addrs.values())
        for name, addr in self._leader_hints.items():
            out.setdefault(name, set()).add(addr)
        return out


def decode_route_response(ext: Mapping[str, Any], body: bytes, topic: str) -> Mapping[str, Any]:
    """The route map from a GET_ROUTEINFO_BY_TOPIC response: a CBOR body, else the ext itself. A body that is not
    one raises ``NoRouteError``, as a malformed map does in ``parse_route``: that name server's answer is not
    usable and the next is asked. (A bare ``ValueError`` escaped the background route refreshes, which expect
    ``RaftMQError``, and took the whole client down with them.)"""
    if body:
        try:
            data = cbor2.loads(body)
        except Exception as e:  # noqa: BLE001 - cbor2 reports bad input as several exception types
            raise NoRouteError(f"the name server's route for topic {topic!r} is not valid CBOR: {e}",
                               topic=topic) from e
        if not isinstance(data, Mapping):
            raise NoRouteError(f"the name server's route for topic {topic!r} is a {type(data).__name__}, not a map",
                               topic=topic)
        return data
    return ext
