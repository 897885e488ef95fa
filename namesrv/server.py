"""``serve_namesrv``: a remoting server around one RouteInfoManager plus the expiry scan and, with
``metrics_listen`` set, the ``/metrics`` endpoint (``namesrv/metrics.py``), in one nursery."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import trio

from namesrv.config import NamesrvConfig
from namesrv.metrics import namesrv_metrics_registry
from namesrv.processor import NamesrvProcessor
from namesrv.route_info import RouteInfoManager
from remoting.metrics_http import serve_metrics
from remoting.tls import ContextReloader
from remoting.transport import serve_remoting

log = logging.getLogger(__name__)

__all__ = ["serve_namesrv"]


async def serve_namesrv(config: NamesrvConfig, *, route_info: RouteInfoManager | None = None,
                        on_metrics_serving: Callable[[tuple[str, int]], None] | None = None,
                        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; reports the bound ``(host, port)`` through ``task_status``. ``route_info`` may
    be passed in by an embedding that wants to look at the table (it must be fresh: nothing is persisted).
    With ``metrics_listen`` set, ``on_metrics_serving((host, port))`` learns where ``/metrics`` is served, before
    ``task_status`` reports."""
    if route_info is None:
        route_info = RouteInfoManager(broker_expired_ms=config.broker_expired_ms)
    processor = NamesrvProcessor(route_info)
    host, port = config.listen_address
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(functools.partial(
            serve_remoting, processor, host, port, max_frame_size=config.max_frame_size_bytes,
            tls_mode=config.tls_mode,
            # The files as they are at each TLS connection accepted: a certificate replaced on disk serves the next.
            tls_context=None if config.tls_mode == "disabled" else ContextReloader(config.tls_server_context)))
        nursery.start_soon(_scan_not_active, processor, config.scan_interval_ms)
        metrics = "off"
        if config.metrics_listen:
            registry = namesrv_metrics_registry(processor, node_id=f"{bound[0]}:{bound[1]}")
            metrics_bound = await nursery.start(serve_metrics, registry, config.metrics_listen)
            metrics = "%s:%d" % metrics_bound
            if on_metrics_serving is not None:
                on_metrics_serving(metrics_bound)
        log.info("name server serving listen=%s:%d broker_expired_ms=%d scan_interval_ms=%d metrics=%s tls_mode=%s",
                 bound[0], bound[1], config.broker_expired_ms, config.scan_interval_ms, metrics, config.tls_mode)
        task_status.started(bound)


async def _scan_not_active(processor: NamesrvProcessor, scan_interval_ms: int) -> None:
    while True:
        await trio.sleep(scan_interval_ms / 1000)
        # The table logs each eviction with its reason; the processor forgets what it cached of those nodes.
        processor.scan_not_active(int(trio.current_time() * 1000))
