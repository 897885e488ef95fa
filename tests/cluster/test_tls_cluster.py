"""TLS with real processes: a name server and the 3-node group broker-a, all with tls_mode = "enforcing" and the
brokers dialing the name server and each other over TLS; a producer and a push consumer with tls_enable and the
CA send and consume, and ``raftmq admin --tls`` works where a plain one is refused."""

from __future__ import annotations

import json

import pytest
import trio

from client import Message, open_producer, open_push_consumer
from raftmq.commands.dev import NODE_IDS, plan_ports, write_broker_configs
from tests.cluster.test_admin_cli import _admin
from tests.procs import raftmq_argv
from tests.tls_certs import make_tls_files

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(180)]

TOPIC = "TlsTopic"


async def test_an_enforcing_cluster_serves_tls_clients_and_admin(spawn, tmp_path):
    files = make_tls_files(tmp_path / "tls")
    (tmp_path / "cluster").mkdir()
    state = plan_ports(tmp_path / "cluster", 0)
    namesrv = f"127.0.0.1:{state['ports']['namesrv']}"
    tls_keys = {"tls_mode": "enforcing", "tls_cert_file": str(files.cert_file), "tls_key_file": str(files.key_file),
                "tls_ca_file": str(files.ca_file)}
    namesrv_toml = tmp_path / "namesrv.toml"
    namesrv_toml.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in tls_keys.items()))
    spawn(raftmq_argv("namesrv", "--config", str(namesrv_toml), "--listen", namesrv))
    overrides = [arg for key, value in {**tls_keys, "tls_client_enable": True}.items()
                 for arg in ("--set", f"{key}={json.dumps(value)}")]
    for path in write_broker_configs(tmp_path / "cluster", state):
        spawn(raftmq_argv("broker", "--config", str(path), *overrides), ready_timeout_s=60)
    tls_args = ("--tls-ca-file", str(files.ca_file))

    async def admin(*args, expect_rc):  # in this process, as the CLI runs it; a thread of its own runs its trio
        return await trio.to_thread.run_sync(lambda: _admin(namesrv, *args, expect_rc=expect_rc))

    with trio.fail_after(60):  # the brokers register over TLS once a leader is elected
        while True:
            created = await admin("create-topic", TOPIC, "--read-queues", "2", "--write-queues", "2", *tls_args,
                                  expect_rc=None)
            if created.returncode == 0:
                break
            await trio.sleep(0.3)
    # A topic created means its leader registered; each follower registers on its own, over TLS too (a fresh clone's
    # run once listed 2 of the 3 right after the topic was created).
    with trio.fail_after(30):
        while True:
            cluster = json.loads((await admin("--json", "cluster", "--tls", *tls_args, expect_rc=0)).stdout)
            if len(cluster["groups"][0]["nodes"]) == len(NODE_IDS):
                break
            await trio.sleep(0.3)
    plain = await admin("cluster", "--timeout", "3", expect_rc=1)
    assert 'a server with tls_mode = "enforcing" closes plain connections' in plain.stderr, plain.stderr

    options = {"tls_enable": True, "tls_ca_file": str(files.ca_file)}
    bodies = {b"tls-%d" % i for i in range(20)}
    received: set[bytes] = set()
    done = trio.Event()

    async def handler(msg):
        received.add(msg.body)
        if received >= bodies:
            done.set()

    async with open_producer(namesrv, **options) as producer, \
            open_push_consumer(namesrv, topic=TOPIC, handler=handler, consumer_group="tls_readers", **options):
        for body in sorted(bodies):
            await producer.send(Message(TOPIC, body))
        with trio.fail_after(60):
            await done.wait()
    assert received == bodies


async def test_dev_with_an_empty_tls_dir_serves_tls_with_certificates_it_made(spawn, tmp_path):
    # The brokers register with the name server and fetch from each other over TLS; clients take the CA printed.
    tls_dir = tmp_path / "tls"
    dev = spawn(raftmq_argv("--log-level", "WARNING", "dev", "--data-dir", str(tmp_path / "dev"), "--base-port", "0",
                            "--tls-dir", str(tls_dir)), ready_timeout_s=120)
    namesrv, ca_file = dev.fields["namesrv"], dev.fields["tls_ca_file"]
    assert ca_file == str(tls_dir.resolve() / "ca.pem")
    assert f"clients take --tls --tls-ca-file {ca_file}" in dev.wait_output("TLS only (certificates made now")

    async def admin(*args, expect_rc):
        return await trio.to_thread.run_sync(lambda: _admin(namesrv, *args, expect_rc=expect_rc))

    with trio.fail_after(60):  # a route needs a registration, over TLS, of an elected leader
        while (await admin("create-topic", TOPIC, "--tls-ca-file", ca_file, expect_rc=None)).returncode != 0:
            await trio.sleep(0.3)
    plain = await admin("cluster", "--timeout", "3", expect_rc=1)
    assert 'a server with tls_mode = "enforcing" closes plain connections' in plain.stderr, plain.stderr
    async with open_producer(namesrv, tls_enable=True, tls_ca_file=ca_file) as producer:
        await producer.send(Message(TOPIC, b"over tls"))


@pytest.mark.load
def test_chaos_with_tls_runs_its_cluster_and_clients_over_tls(tmp_path, figure):
    from tests.cluster.test_chaos_cli import _chaos
    data_dir = tmp_path / "chaos"
    report = _chaos(figure, data_dir, "--tls", "--rounds", "1", "--fault", "stop", "--target", "follower",
                    "--down-seconds", "1", "--settle-seconds", "1", "--senders", "2")
    assert report["tls"] and report["missing"] == 0 and report["logs_identical"] and report["acked"] > 0
    namesrv_toml = (data_dir / "namesrv.toml").read_text()
    assert 'tls_mode = "enforcing"' in namesrv_toml and str(data_dir / "tls" / "server.pem") in namesrv_toml
