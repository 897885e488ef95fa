"""What a RocketMQ user expects of a client's identity and defaults: ids unique across hosts and restarts (two
containers, both pid 1, were both "127.0.0.1@1#DEFAULT#1", so brokers counted one member and both took the same
queues), the host's own address in ids and batch born hosts, and the name servers of NAMESRV_ADDR."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest

import client.instance
import client.producer
from client import Message, open_producer
from client.admin import AdminClient
from client.errors import ConfigError
from client.instance import ClientConfig, build_config
from client.producer import ProducerConfig
from tests.procs import REPO_ROOT
from tests.unit.client.fake_cluster import NAMESRV, FakeGroup, FakeRemoting, fake_remoting_ctx

# One client as a container's only process makes it: pid 1, nothing configured.
_PID_1_CLIENT = """
import os
os.getpid = lambda: 1
from client.instance import ClientConfig, ClientInstance
config = ClientConfig()
print(config.client_ip, ClientInstance(config, None, None).client_id)
"""


def test_two_processes_with_pid_1_on_hosts_alike_get_different_client_ids():
    ids = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _PID_1_CLIENT], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=60, check=True)
        ip, client_id = done.stdout.split()
        # Readable still: address, pid, the process's start part, instance name, instance counter.
        assert re.fullmatch(re.escape(ip) + r"@1#[0-9a-f]+-[0-9a-f]{8}#DEFAULT#1", client_id), client_id
        ids.append(client_id)
    assert ids[0] != ids[1]


class _NoSocket:
    def __init__(self, *args, **kwargs):
        raise AssertionError("detecting the address must send nothing (no socket)")


def _interfaces(monkeypatch, addrs: dict[str, tuple[str, bool]]) -> None:
    """Fake interfaces for psutil: name -> (IPv4 address, up)."""
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {
        name: [SimpleNamespace(family=socket.AF_INET, address=ip)] for name, (ip, _) in addrs.items()})
    monkeypatch.setattr(psutil, "net_if_stats", lambda: {
        name: SimpleNamespace(isup=up) for name, (_, up) in addrs.items()})


def test_the_address_is_the_host_names_then_an_interfaces_then_loopback(monkeypatch):
    monkeypatch.setattr(socket, "socket", _NoSocket)
    monkeypatch.setattr(socket, "gethostname", lambda: "host-1")
    resolved = ["127.0.1.1", "169.254.3.4", "10.1.2.3", "10.9.9.9"]  # Debian's loopback name, link-local first
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, 0)) for ip in resolved] if host == "host-1" else [])
    _interfaces(monkeypatch, {"lo": ("127.0.0.1", True), "eth0": ("172.16.0.5", True)})
    assert client.instance.detect_client_ip() == "10.1.2.3"

    def unresolved(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unresolved)
    _interfaces(monkeypatch, {"lo": ("127.0.0.1", True), "eth0": ("10.8.8.8", False), "eth1": ("172.16.0.5", True)})
    assert client.instance.detect_client_ip() == "172.16.0.5"  # eth0 is down
    _interfaces(monkeypatch, {"lo": ("127.0.0.1", True)})
    assert client.instance.detect_client_ip() == "127.0.0.1"


@pytest.fixture
def detected_ip(monkeypatch):
    """Every config built without client_ip gets 10.7.7.7, as on a host whose name resolves to it."""
    client.instance._default_client_ip.cache_clear()
    monkeypatch.setattr(client.instance, "detect_client_ip", lambda: "10.7.7.7")
    yield "10.7.7.7"
    client.instance._default_client_ip.cache_clear()


async def test_a_client_without_client_ip_puts_the_hosts_address_in_its_id_heartbeats_and_batches(monkeypatch,
                                                                                                detected_ip):
    fake = FakeRemoting([FakeGroup("broker-a", ["a:1", "a:2", "a:3"])])
    monkeypatch.setattr(client.producer, "open_remoting", lambda config, handler=None: fake_remoting_ctx(fake))
    born = []
    append = FakeGroup.append
    monkeypatch.setattr(FakeGroup, "append", lambda self, topic, queue_id, m: born.append(m.born_host) or append(
        self, topic, queue_id, m))
    assert ClientConfig().client_ip == ProducerConfig().client_ip == detected_ip
    assert ClientConfig(client_ip="10.0.0.9").client_ip == "10.0.0.9"  # a configured one wins
    async with open_producer(NAMESRV) as p:
        assert p.client_id.startswith(f"{detected_ip}@")
        await p.send_batch([Message("T", b"a"), Message("T", b"b")])
    # The born host of a batch is the client's (a single send's is the connection's, taken by the broker).
    assert [host for host, _port in born] == [detected_ip, detected_ip]


def test_the_name_servers_default_to_NAMESRV_ADDR(monkeypatch):
    monkeypatch.delenv("NAMESRV_ADDR", raising=False)
    assert ClientConfig().namesrv_addrs == ("127.0.0.1:9876",)
    monkeypatch.setenv("NAMESRV_ADDR", "10.0.0.1:9876; 10.0.0.2:9876")  # RocketMQ's separator, with a space
    assert ClientConfig().namesrv_addrs == ("10.0.0.1:9876", "10.0.0.2:9876")
    assert build_config(ProducerConfig, {}).namesrv_addrs == ("10.0.0.1:9876", "10.0.0.2:9876")  # open_producer()
    assert build_config(ProducerConfig, {"namesrv": "10.0.0.3:9876"}).namesrv_addrs == ("10.0.0.3:9876",)
    for value, error in [("", "NAMESRV_ADDR needs HOST:PORT[;HOST:PORT...], got ''"),
                         (" ; ", "NAMESRV_ADDR needs HOST:PORT[;HOST:PORT...], got ' ; '"),
                         ("nohost", "NAMESRV_ADDR must look like HOST:PORT, got 'nohost'"),
                         ("10.0.0.1:9876;h:0", "NAMESRV_ADDR needs a fixed port")]:
        monkeypatch.setenv("NAMESRV_ADDR", value)
        with pytest.raises(ConfigError, match=re.escape(error)):
            build_config(ProducerConfig, {})
        # Given explicitly, the name servers do not depend on the variable.
        assert build_config(ProducerConfig, {"namesrv": "10.0.0.3:9876"}).namesrv_addrs == ("10.0.0.3:9876",)


async def test_update_topic_perm_takes_what_mqadmin_takes():
    admin = AdminClient(None)  # refused before anything is asked
    for perm in (0, 1, 3, 5, 7, 8, True, "6"):
        with pytest.raises(ValueError, match=f"perm must be 2 .write., 4 .read. or 6 .read and write.*got {perm!r}"):
            await admin.update_topic_perm("T", perm)
