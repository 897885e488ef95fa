"""Request-reply's parts that need no producer (RocketMQ 4.6's request): the table of requests waiting for their
replies, the reading of a pushed reply, and the preparation of a request (its cluster, its queue, the heartbeats).

``Producer.request`` and ``Producer._on_reply`` (``client/producer.py``) use them; they are apart because none of
them touches a send: the waiting table and the reply reader are synchronous pieces the connection's reader calls,
and the preparation asks only the client instance (routes, name servers, heartbeats). The rules of request-reply as
a whole are in ``client/producer.py``'s docstring.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import trio

from client.errors import NoRouteError, TooManyRequestsError
from client.instance import ClientInstance, answer_data, now_ms
from client.message import MAX_INFLATED_BODY, MessageExt, MessageQueue, decompressed_body
from remoting.codes import RequestCode
from remoting.errors import RaftMQError
from remoting.message import (COMPRESSED_FLAG, PROPERTY_CORRELATION_ID, PROPERTY_REPLY_MESSAGE_ARRIVE_TIME,
                              MessageFormatError, decode_record, reply_topic)

__all__ = ["PendingRequests", "read_reply", "prepare_request"]

log = logging.getLogger(__name__)


class _PendingReply:
    __slots__ = ("_event", "reply")

    def __init__(self) -> None:
        self._event = trio.Event()
        self.reply: MessageExt | None = None

    def set(self, reply: MessageExt) -> None:
        self.reply = reply
        self._event.set()

    async def wait(self) -> MessageExt:
        await self._event.wait()
        assert self.reply is not None
        return self.reply


class PendingRequests:
    """The requests of one producer waiting for their replies, by correlation id (RocketMQ's RequestFutureHolder).
    An entry lives exactly as long as its ``expect`` block: a reply, a timeout, a failed send and a cancellation
    all leave through it, so nothing stays behind (RocketMQ scans its table for expired futures every second
    instead). At most ``max_pending`` at once; ``complete`` is synchronous, for the connection's reader."""

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self._waiting: dict[str, _PendingReply] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, correlation_id: object) -> bool:
        return correlation_id in self._waiting

    @contextlib.contextmanager
    def expect(self, correlation_id: str) -> Iterator[_PendingReply]:
        """Wait for the reply of ``correlation_id`` within the block (``await pending.wait()``)."""
        if len(self._waiting) >= self.max_pending:
            raise TooManyRequestsError(f"{len(self._waiting)} requests of this producer already wait for their "
                                       f"replies (max_pending_requests {self.max_pending}); wait for some to be "
                                       f"answered or to time out", max_pending=self.max_pending)
        if correlation_id in self._waiting:
            raise ValueError(f"a request with correlation id {correlation_id!r} is already waiting for its reply")
        pending = self._waiting[correlation_id] = _PendingReply()
        try:
            yield pending
        finally:
            if self._waiting.get(correlation_id) is pending:
                del self._waiting[correlation_id]

    def complete(self, correlation_id: str, reply: MessageExt) -> bool:
        """Hand ``reply`` to the request waiting for it; False if none waits (timed out, or answered already)."""
        pending = self._waiting.pop(correlation_id, None)
        if pending is None:
            return False
        pending.set(reply)
        return True


def read_reply(ext: Mapping[str, Any], body: bytes, max_inflated: int = MAX_INFLATED_BODY,
               max_inflated_key: str | None = None) -> MessageExt:
    """The reply a PUSH_REPLY_MESSAGE_TO_CLIENT carries (its body the stored record, ext ``broker_name`` the group
    that stored it), a compressed body inflated up to ``max_inflated`` bytes, with ARRIVE_TIME (ms) added as
    RocketMQ's client adds it. Raises ValueError saying what is malformed."""
    broker_name = ext.get("broker_name")
    if type(broker_name) is not str or not broker_name:
        raise ValueError(f"broker_name {broker_name!r} names no broker group")
    try:
        view = decode_record(body)
    except (MessageFormatError, ValueError) as e:
        raise ValueError(f"the body is not a reply record: {e}") from None
    correlation_id = view.properties.get(PROPERTY_CORRELATION_ID)
    if not correlation_id:
        raise ValueError(f"the reply record (topic {view.topic!r}) has no {PROPERTY_CORRELATION_ID} property")
    body, sys_flag = view.body, view.sys_flag
    if sys_flag & COMPRESSED_FLAG:
        body, sys_flag = decompressed_body(body, sys_flag, view.topic, broker_name, view.queue_id, view.queue_offset,
                                           max_inflated, max_inflated_key)
    properties = view.properties
    properties[PROPERTY_REPLY_MESSAGE_ARRIVE_TIME] = str(now_ms())
    return MessageExt(view.topic, body, view.queue_id, view.queue_offset, broker_name, properties, view.phy_offset,
                      view.born_timestamp, view.store_timestamp, view.store_host, view.reconsume_times, sys_flag,
                      view.flag)


async def prepare_request(instance: ClientInstance, topic: str, default_topic_queue_nums: int,
                          fault_aware: bool) -> tuple[str, MessageQueue | None]:
    """``(cluster, queue)`` of a request to ``topic``: the cluster its group is in (property CLUSTER, which
    names the reply topic), and the queue to pin it to when the topic's groups are in several clusters (else
    None: any group, with retries, as a send). Then, like RocketMQ's prepareSendRequest, a heartbeat to every
    leader of the request's and the reply topic's routes whose connection has carried none yet: the leader a
    reply reaches must know this client's connection to push it here."""
    inst = instance
    routes = inst.routes
    try:
        info = routes.cached_publish_info(topic) or await routes.publish_info(topic)
    except NoRouteError:
        if routes.cached(topic) is not None:
            raise
        # As a send: a topic no name server knows yet goes to every group, which auto-create it.
        await inst.install_default_route(topic, default_topic_queue_nums)
        info = await routes.publish_info(topic)
    names = {mq.broker_name for mq in info.queues}
    clusters = {name: b.cluster for name in names if (b := info.route.broker(name)) is not None and b.cluster}
    if len(clusters) < len(names):
        # A stand-in route (install_default_route) names no clusters: the name servers' cluster table does.
        frame = await inst.invoke_namesrv(RequestCode.GET_BROKER_CLUSTER_INFO)
        try:
            table = answer_data(frame).get("cluster_addr_table", {})
            for cluster, brokers in table.items():
                for name in brokers:
                    if name in names and name not in clusters and isinstance(cluster, str) and cluster:
                        clusters[name] = cluster
        except (AttributeError, TypeError, ValueError) as e:
            raise NoRouteError(f"the name server's cluster info, to learn the cluster of topic {topic!r}'s "
                               f"groups, is malformed: {type(e).__name__}: {e}", topic=topic) from None
    if not clusters:
        raise NoRouteError(f"no broker group of topic {topic!r} names its cluster: a request needs it for the "
                           f"reply topic", topic=topic)
    queue: MessageQueue | None = None
    if len(set(clusters.values())) == 1 and len(clusters) == len(names):
        cluster = next(iter(clusters.values()))
    else:
        candidates = [mq for mq in info.queues if mq.broker_name in clusters]
        queue = info.select(inst.faults if fault_aware else None)
        if queue.broker_name not in clusters:
            queue = candidates[0]
        cluster = clusters[queue.broker_name]
    reply_route = routes.cached(reply_topic(cluster))
    if reply_route is None:
        try:
            reply_route = await routes.get(reply_topic(cluster))
        except RaftMQError as e:  # not registered yet: the replier's send then auto-routes it to every group
            log.debug("reply topic not routed yet topic=%s error=%s", reply_topic(cluster), e)
    groups = set(names) | ({b.broker_name for b in reply_route.broker_datas} if reply_route is not None else set())
    leaders = [addr for name in sorted(groups) if (addr := routes.master_addr(name))]
    need = inst.heartbeat_needed(leaders)
    if need:
        await inst.send_heartbeat(need)
    return cluster, queue
