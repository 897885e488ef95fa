"""Name-server request handling: one ``handle`` for the remoting server, a method per request code.

Bad input never reaches the route table: a missing or ill-typed field is answered INVALID_REQUEST with a remark
naming it (and ``ext.field``), an unknown code REQUEST_CODE_NOT_SUPPORTED. Everything else unexpected is left
to the transport, which logs it with its traceback and answers SYSTEM_ERROR.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import cbor2
import trio

from namesrv.requests import (InvalidRequestError, TopicConfigCache, parse_register_broker, parse_topic,
                              parse_unregister_broker)
from namesrv.route_info import EvictedNode, RouteConflictError, RouteInfoManager
from remoting.codec import Frame, make_response
from remoting.codes import RequestCode, ResponseCode

log = logging.getLogger(__name__)

__all__ = ["NamesrvProcessor"]


def _now_ms() -> int:
    return int(trio.current_time() * 1000)


# At most one WARNING a minute per field for refused registrations (``_say_refusal``).
REFUSAL_WARNING_INTERVAL_MS = 60_000


class NamesrvProcessor:
    """The remoting handler of a name server; ``route_info`` is its whole state."""

    def __init__(self, route_info: RouteInfoManager, *, clock_ms: Callable[[], int] = _now_ms) -> None:
        self.route_info = route_info
        self._clock_ms = clock_ms
        self._topic_config_cache = TopicConfigCache()
        # Encoded route bodies, valid while the table's generation stands: route queries outnumber changes by
        # far, and encoding a route with a few groups costs more than the whole rest of the request.
        self._route_bodies: dict[str, bytes] = {}
        self._route_bodies_generation = -1
        # GET_ROUTEINFO_BY_TOPIC answered, and of those TOPIC_NOT_EXIST: the metrics' routes served.
        self.route_queries = 0
        self.route_misses = 0
        # Refused registrations by field: (when the last one was said at WARNING, ms; refusals since). A refused
        # node registers again every second until its config is mended, and each refusal was a WARNING.
        self._refusals_said: dict[str, tuple[int, int]] = {}
        self._handlers: dict[int, Callable[[Frame, Any], Frame]] = {
            RequestCode.REGISTER_BROKER: self._register_broker,
            RequestCode.UNREGISTER_BROKER: self._unregister_broker,
            RequestCode.GET_ROUTEINFO_BY_TOPIC: self._get_route_info_by_topic,
            RequestCode.GET_BROKER_CLUSTER_INFO: self._get_broker_cluster_info,
            RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER: self._get_all_topic_list,
        }

    async def handle(self, request: Frame, conn: Any) -> Frame | None:
        handler = self._handlers.get(request.code)
        if handler is None:
            response = make_response(request, ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                                     remark=f"request code {request.code} is not supported by the name server")
        else:
            try:
                response = handler(request, conn)
            except InvalidRequestError as e:
                response = make_response(request, ResponseCode.INVALID_REQUEST, remark=str(e),
                                         ext={"field": e.field})
            except RouteConflictError as e:
                self._say_refusal(e)
                response = make_response(request, ResponseCode.INVALID_REQUEST, remark=str(e),
                                         ext={"field": e.field})
        return None if request.is_oneway else response

    def _say_refusal(self, error: RouteConflictError) -> None:
        """A refused registration at WARNING the first time and then once a minute per field, with how many were
        refused since (the others at DEBUG): the node retries every second."""
        now = self._clock_ms()
        said_at, since = self._refusals_said.get(error.field, (None, 0))
        if said_at is not None and now - said_at < REFUSAL_WARNING_INTERVAL_MS:
            self._refusals_said[error.field] = (said_at, since + 1)
            log.debug("registration rejected: %s", error)
            return
        self._refusals_said[error.field] = (now, 0)
        log.warning("registration rejected (%d more on %s since the last warning): %s", since, error.field, error)

    def connection_closed(self, conn: Any) -> None:
        # The table logs each eviction with its reason.
        self._forget(self.route_info.connection_closed(conn))

    def scan_not_active(self, now_ms: int) -> list[EvictedNode]:
        """The table's expiry scan (``serve_namesrv`` runs it every ``scan_interval_ms``), forgetting what the
        processor cached for the nodes it evicts."""
        return self._forget(self.route_info.scan_not_active(now_ms))

    def _forget(self, evicted: list[EvictedNode]) -> list[EvictedNode]:
        # The cache holds only nodes in the table: one entry per node that left was how a client that registered
        # and dropped big topic sets grew a name server with an empty table past 2 GB.
        for node in evicted:
            self._topic_config_cache.forget((node.broker_name, node.broker_id))
        return evicted

    # ---- one method per request code ---------------------------------------------------------------------

    def _register_broker(self, request: Frame, conn: Any) -> Frame:
        registration = parse_register_broker(request.ext, request.body, self._topic_config_cache)
        result = self.route_info.register_broker(registration, now_ms=self._clock_ms(), conn_key=conn)
        # Cached only now that the table took it: a refused registration's body stays out (and cannot replace the
        # entry of the node that holds the id), and so does an older one that arrived late: the table kept the
        # newer topic set, and the cache holding the stale body decoded the node's next heartbeat again.
        if not result.ignored:
            self._topic_config_cache.store((registration.broker_name, registration.broker_id), request.body,
                                           registration.topic_configs)
        ext = {k: v for k, v in result.to_wire().items() if v is not None}
        return make_response(request, ResponseCode.SUCCESS, ext=ext)

    def _unregister_broker(self, request: Frame, conn: Any) -> Frame:
        cluster_name, broker_name, broker_id, broker_addr = parse_unregister_broker(request.ext)
        removed = self.route_info.unregister_broker(cluster_name, broker_name, broker_id, broker_addr)
        if removed is not None:  # an old incarnation's late unregister leaves its successor's entry alone
            self._forget([removed])
        return make_response(request, ResponseCode.SUCCESS, ext={"removed": removed is not None})

    def _get_route_info_by_topic(self, request: Frame, conn: Any) -> Frame:
        topic = parse_topic(request.ext)
        self.route_queries += 1
        if self._route_bodies_generation != self.route_info.generation:
            self._route_bodies.clear()
            self._route_bodies_generation = self.route_info.generation
        body = self._route_bodies.get(topic)
        if body is None:
            route = self.route_info.pickup_topic_route(topic)
            if route is None:
                self.route_misses += 1
                return make_response(request, ResponseCode.TOPIC_NOT_EXIST, ext={"topic": topic},
                                     remark=f"no route info in this name server for topic {topic!r}")
            body = self._route_bodies[topic] = cbor2.dumps(route.to_wire())
        return make_response(request, ResponseCode.SUCCESS, body=body)

    def _get_broker_cluster_info(self, request: Frame, conn: Any) -> Frame:
        info = self.route_info.cluster_info(self._clock_ms())
        return make_response(request, ResponseCode.SUCCESS, body=cbor2.dumps(info.to_wire()))

    def _get_all_topic_list(self, request: Frame, conn: Any) -> Frame:
        return make_response(request, ResponseCode.SUCCESS,
                             body=cbor2.dumps({"topic_list": self.route_info.topic_list()}))
