"""The broker node: processors, long polling, registration and the store (see docs/architecture.md, "Broker").

The names below are imported lazily: ``import broker.store`` (used by the store's own tests and tools) must not
pull in the Raft stack (``dledger``, pysyncobj) that ``broker.node`` needs.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "BrokerConfig", "BrokerNode", "ClientManager", "ConsumerOffsetTable", "PullRequestHoldService",
    "RegistrationService", "TopicConfig", "TopicConfigTable", "load_broker_config", "serve_broker",
]

_WHERE = {
    "BrokerConfig": "broker.config", "load_broker_config": "broker.config",
    "BrokerNode": "broker.node", "serve_broker": "broker.node",
    "ClientManager": "broker.consumer_manager", "ConsumerOffsetTable": "broker.offset_manager",
    "PullRequestHoldService": "broker.long_polling", "RegistrationService": "broker.registration",
    "TopicConfig": "broker.topic_config", "TopicConfigTable": "broker.topic_config",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'broker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
