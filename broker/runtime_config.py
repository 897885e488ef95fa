"""A broker node's runtime config: the overrides read over the config file at start, and UPDATE_BROKER_CONFIG.

``serve_broker`` (``broker/node.py``) starts from ``load_runtime_config``; ``BrokerNode.update_config`` (whose
docstring is the contract processors rely on) hands its work to ``apply_config_update``. The two are here, apart
from the node, because they are one rule seen from both ends: what the overrides file says is what the node does,
at start and after every change (the keys, their checks and the file's format are ``broker/config.py``'s).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from broker.config import (BrokerConfig, read_runtime_overrides, runtime_overrides, with_runtime_values,
                           write_runtime_overrides)
from broker.processor.base import RequestRejected
from remoting.codes import ResponseCode

if TYPE_CHECKING:
    from broker.node import BrokerNode

__all__ = ["load_runtime_config", "apply_config_update"]

log = logging.getLogger(__name__)


def load_runtime_config(file_config: BrokerConfig) -> BrokerConfig:
    """``file_config`` (the config file's, with ``--set``) with the node's runtime overrides file applied over it;
    read once the store's directory lock is held, so that no other process writes the file meanwhile."""
    config, overrides = read_runtime_overrides(file_config)
    if overrides:
        log.info("runtime config overrides applied over the config file path=%s %s", config.runtime_overrides_path,
                 " ".join(f"{key}={value!r}" for key, value in sorted(overrides.items())))
    if not config.writable:
        log.warning("broker_permission=%d: this node refuses sends until it is set to 6 "
                    "(raftmq admin update-broker-config)", config.broker_permission)
    return config


async def apply_config_update(node: BrokerNode, values: Mapping[str, Any]) -> dict[str, Any]:
    """``BrokerNode.update_config``'s work: judged, persisted, then applied, under the node's config lock."""
    async with node._config_lock:
        old = node.config
        new = with_runtime_values(old, values)
        previous = {key: getattr(old, key) for key in values}
        overrides = runtime_overrides(node.file_config, new)
        # Written, then applied, with no checkpoint between: a client gone meanwhile must not leave the
        # file saying one thing and the node doing another until its next restart.
        with trio.CancelScope(shield=True):
            if overrides != runtime_overrides(node.file_config, old):
                path = new.runtime_overrides_path
                try:
                    await trio.to_thread.run_sync(write_runtime_overrides, path, overrides)
                except OSError as e:
                    raise RequestRejected(ResponseCode.SYSTEM_ERROR,
                                          f"the config change could not be persisted in {path} "
                                          f"({e.strerror or e}); nothing was changed") from None
            node.config = new
            node.writable = new.writable
        for key, before in previous.items():
            if getattr(new, key) != before:
                log.info("config changed at runtime key=%s value=%r previous=%r", key, getattr(new, key), before)
    if new.broker_permission != old.broker_permission:
        if not new.readable:
            # Held pulls are answered now with the refusal a fresh pull gets, not at their deadline.
            node.hold.release(node._pull_refused)
        await node.registration.register_all()
    return previous
