"""Real ``raftmq namesrv`` processes: two independent name servers, a fake broker registering with both,
one killed with SIGKILL while the other keeps answering; config errors and signals at the CLI."""

from __future__ import annotations

import os
import signal
import subprocess

import cbor2
import pytest
import trio

from namesrv import TopicConfig, encode_topic_configs
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import RemotingError
from remoting.transport import open_remoting_client
from tests.procs import raftmq_argv

pytestmark = pytest.mark.cluster


@pytest.fixture
def start_namesrv(spawn):
    """``spawn`` for name servers; also closes each process's output pipe, which ``ServerProcess.stop``
    leaves open (a ResourceWarning, an error under ``-W error``, when the object is collected)."""
    started = []

    def _start(*args: str):
        proc = spawn(raftmq_argv("namesrv", *args))
        started.append(proc)
        return proc

    yield _start
    for proc in started:
        proc.stop(timeout_s=5)
        if proc.proc.stdout is not None:
            proc.proc.stdout.close()

TOPICS = encode_topic_configs({"TopicA": TopicConfig(4, 4, 6)})


def register(broker_id: int, role: str, term: int):
    return make_request(RequestCode.REGISTER_BROKER, body=TOPICS, ext={
        "cluster_name": "DefaultCluster", "broker_name": "broker-a", "broker_id": broker_id,
        "broker_addr": f"127.0.0.1:{10910 + broker_id}", "role": role, "term": term, "data_version": 1})


async def broker_addrs(client, addr: str) -> dict[str, str] | None:
    resp = await client.invoke(addr, make_request(RequestCode.GET_ROUTEINFO_BY_TOPIC, ext={"topic": "TopicA"}))
    if resp.code == ResponseCode.TOPIC_NOT_EXIST:
        return None
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    return cbor2.loads(resp.body)["broker_datas"][0]["broker_addrs"]


async def test_two_independent_name_servers_survive_each_other(start_namesrv, tmp_path):
    fast = tmp_path / "fast.toml"
    fast.write_text("broker_expired_ms = 400\nscan_interval_ms = 50\n")
    ns_a = start_namesrv("--config", str(fast), "--listen", "127.0.0.1:0")
    ns_b = start_namesrv("--listen", "127.0.0.1:0")
    addr_a, addr_b = ns_a.fields["listen"], ns_b.fields["listen"]
    assert ns_a.fields["kind"] == "namesrv" and addr_a != addr_b

    async with open_remoting_client() as client:
        # A fake broker group: node 1 is a deposed leader still heart-beating term 5, node 2 leads at term 6.
        for addr in (addr_a, addr_b):
            for request in (register(2, "LEADER", 6), register(1, "LEADER", 5), register(3, "FOLLOWER", 6)):
                assert (await client.invoke(addr, request)).code == ResponseCode.SUCCESS
        expected = {"0": "127.0.0.1:10912", "1": "127.0.0.1:10911", "3": "127.0.0.1:10913"}
        assert await broker_addrs(client, addr_a) == expected
        assert await broker_addrs(client, addr_b) == expected

        # Node 3 falls silent (its connection stays open): A, with a 400 ms expiry, drops it; B does not.
        with trio.fail_after(5):
            while True:
                for addr in (addr_a, addr_b):
                    await client.invoke(addr, register(2, "LEADER", 6))
                    await client.invoke(addr, register(1, "FOLLOWER", 6))
                if "3" not in await broker_addrs(client, addr_a):
                    break
                await trio.sleep(0.05)
        assert await broker_addrs(client, addr_b) == expected

        ns_a.kill()
        with pytest.raises(RemotingError):
            for _ in range(3):  # the first call may still find the pooled connection open
                await client.invoke(addr_a, register(2, "LEADER", 6), timeout_s=2.0)
        assert await broker_addrs(client, addr_b) == {"0": "127.0.0.1:10912", "1": "127.0.0.1:10911",
                                                      "3": "127.0.0.1:10913"}
        resp = await client.invoke(addr_b, make_request(RequestCode.GET_BROKER_CLUSTER_INFO))
        assert cbor2.loads(resp.body)["cluster_addr_table"] == {"DefaultCluster": ["broker-a"]}
    assert ns_b.stop() == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_exits_cleanly(start_namesrv, signum):
    proc = start_namesrv("--listen", "127.0.0.1:0")
    os.kill(proc.pid, signum)
    assert proc.proc.wait(10) == 0


@pytest.mark.parametrize("text, needle", [
    ("broker_expire_ms = 5\n", "unknown config key 'broker_expire_ms'"),
    ("scan_interval_ms = 0\n", "scan_interval_ms must be >= 1, got 0"),
])
def test_config_error_exits_2_naming_the_key(tmp_path, text, needle):
    path = tmp_path / "namesrv.toml"
    path.write_text(text)
    done = subprocess.run(raftmq_argv("namesrv", "--config", str(path)), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert f"raftmq: error: {needle}" in done.stderr
    assert "ready" not in done.stdout


def test_bad_listen_flag_exits_2(tmp_path):
    done = subprocess.run(raftmq_argv("namesrv", "--listen", "nowhere"), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "listen must look like HOST:PORT" in done.stderr


def test_a_listen_address_it_cannot_bind_exits_2_naming_it(start_namesrv):
    """A port in use, or an address of no interface here: one line naming it and exit 2, as for any config
    error (was a trio exception-group traceback and exit 1)."""
    taken = start_namesrv("--listen", "127.0.0.1:0").fields["listen"]
    for listen, reason in ((taken, "Address already in use"), ("192.0.2.1:0", "Cannot assign requested address")):
        done = subprocess.run(raftmq_argv("namesrv", "--listen", listen), capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2, done.stderr
        assert f"raftmq: error: cannot listen on {listen}: {reason}" in done.stderr
        assert "Traceback" not in done.stderr and "ready" not in done.stdout
