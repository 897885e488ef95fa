from __future__ import annotations

import subprocess
import sys

import broker


def test_public_api_is_pinned():
    assert broker.__all__ == [
        "BrokerConfig", "BrokerNode", "ClientManager", "ConsumerOffsetTable", "PullRequestHoldService",
        "RegistrationService", "TopicConfig", "TopicConfigTable", "load_broker_config", "serve_broker",
    ]
    for name in broker.__all__:
        assert getattr(broker, name).__name__ == name


def test_importing_the_store_does_not_load_the_raft_stack():
    code = "import sys, broker.store; print('pysyncobj' in sys.modules, 'dledger' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
