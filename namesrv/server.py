"""``serve_namesrv``: a remoting server around one RouteInfoManager plus the expiry scan, in one nursery."""

from __future__ import annotations

import functools
import logging

import trio

from namesrv.config import NamesrvConfig
from namesrv.processor import NamesrvProcessor
from namesrv.route_info import RouteInfoManager
from remoting.transport import serve_remoting

log = logging.getLogger(__name__)

__all__ = ["serve_namesrv"]


async def serve_namesrv(config: NamesrvConfig, *, route_info: RouteInfoManager | None = None,
                        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; reports the bound ``(host, port)`` through ``task_status``. ``route_info`` may
    be passed in by an embedding that wants to look at the table (it must be fresh: nothing is persisted)."""
    if route_info is None:
        route_info = RouteInfoManager(broker_expired_ms=config.broker_expired_ms)
    processor = NamesrvProcessor(route_info)
    host, port = config.listen_address
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(functools.partial(
            serve_remoting, processor, host, port, max_frame_size=config.max_frame_size_bytes))
        nursery.start_soon(_scan_not_active, route_info, config.scan_interval_ms)
        log.info("name server serving listen=%s:%d broker_expired_ms=%d scan_interval_ms=%d",
                 bound[0], bound[1], config.broker_expired_ms, config.scan_interval_ms)
        task_status.started(bound)


async def _scan_not_active(route_info: RouteInfoManager, scan_interval_ms: int) -> None:
    while True:
        await trio.sleep(scan_interval_ms / 1000)
        # The table logs each eviction with its reason.
        route_info.scan_not_active(int(trio.current_time() * 1000))
