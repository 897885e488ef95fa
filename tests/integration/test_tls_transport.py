"""TLS on the trio transport, server and client in-process on port 0: a round trip, each server mode, a wrong CA,
client certificates, and a peer that never handshakes."""

from __future__ import annotations

import functools
import logging
import ssl

import cbor2
import pytest
import trio
import trio.testing

from remoting.codec import make_request, make_response
from remoting.codes import RequestCode, ResponseCode
from remoting.errors import ConnectError, ConnectionClosedError
from remoting.tls import client_context, server_context
from remoting.transport import REFUSED_WITHIN_S, ClientConnection, open_remoting_client, serve_remoting
from tests.tls_certs import make_tls_files


class Echo:
    def __init__(self) -> None:
        self.streams: list[type] = []

    async def handle(self, request, conn):
        self.streams.append(type(conn._stream))
        return make_response(request, ResponseCode.SUCCESS, body=request.body)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return make_tls_files(tmp_path_factory.mktemp("tls"))


async def _serve(nursery, tls_files, mode, *, need_client_auth=False, **kw):
    handler = Echo()
    context = server_context(tls_files.cert_file, tls_files.key_file, ca_file=tls_files.ca_file,
                             need_client_auth=need_client_auth)
    host, port = await nursery.start(functools.partial(serve_remoting, handler, "127.0.0.1", 0, tls_mode=mode,
                                                       tls_context=context, **kw))
    return handler, f"{host}:{port}"


async def _echo(addr, body=b"ping", **client_kw):
    async with open_remoting_client(**client_kw) as client:
        response = await client.invoke(addr, make_request(RequestCode.ECHO, body=body), timeout_s=10)
    assert response.code == ResponseCode.SUCCESS
    return response.body


async def test_round_trip_over_tls_carries_small_and_large_frames(nursery, tls_files):
    handler, addr = await _serve(nursery, tls_files, "enforcing")
    context = client_context(ca_file=tls_files.ca_file)
    async with open_remoting_client(tls_context=context) as client:
        big = bytes(range(256)) * 8192  # 2 MiB: many TLS records, sent by the writer task
        answers = []

        async def one(body):
            answers.append((await client.invoke(addr, make_request(RequestCode.ECHO, body=body), timeout_s=10)).body)

        async with trio.open_nursery() as inner:
            for body in (b"a", big, b"b" * 1000, big[:70000]):
                inner.start_soon(one, body)
        assert sorted(map(len, answers)) == [1, 1000, 70000, len(big)]
        assert big in answers
        assert isinstance(client.connections()[addr]._stream, trio.SSLStream)
    assert handler.streams and all(t is trio.SSLStream for t in handler.streams)


async def test_enforcing_closes_a_plain_client_with_a_clear_error(nursery, tls_files, caplog):
    _, addr = await _serve(nursery, tls_files, "enforcing")
    with caplog.at_level(logging.WARNING, logger="remoting"):
        with pytest.raises(ConnectionClosedError) as closed:
            await _echo(addr)
    assert 'a server with tls_mode = "enforcing" closes plain connections' in str(closed.value)
    assert any("plain connection refused" in r.getMessage() for r in caplog.records)
    # ...and keeps serving TLS clients.
    assert await _echo(addr, tls_context=client_context(ca_file=tls_files.ca_file)) == b"ping"


async def test_permissive_serves_plain_and_tls_on_one_port(nursery, tls_files):
    handler, addr = await _serve(nursery, tls_files, "permissive")
    assert await _echo(addr, b"plain") == b"plain"
    assert await _echo(addr, b"secure", tls_context=client_context(ca_file=tls_files.ca_file)) == b"secure"
    assert handler.streams == [trio.SocketStream, trio.SSLStream]


async def test_a_server_signed_by_another_ca_fails_verification(nursery, tls_files, caplog):
    _, addr = await _serve(nursery, tls_files, "enforcing")
    with pytest.raises(ConnectError) as refused:
        await _echo(addr, tls_context=client_context(ca_file=tls_files.other_ca_file))
    assert "TLS handshake failed" in str(refused.value) and "certificate verify failed" in str(refused.value)
    # Verification off (asked for explicitly, and logged loudly) connects to the same server.
    with caplog.at_level(logging.WARNING, logger="remoting.tls"):
        unverified = client_context(ca_file=tls_files.other_ca_file, verify=False)
    assert any("NOT verified" in r.getMessage() for r in caplog.records)
    assert await _echo(addr, tls_context=unverified) == b"ping"


async def test_a_tls_client_at_a_plain_server_fails_its_handshake(nursery, tls_files):
    host, port = await nursery.start(serve_remoting, Echo(), "127.0.0.1", 0)
    with pytest.raises(ConnectError, match="TLS handshake failed"):
        await _echo(f"{host}:{port}", tls_context=client_context(ca_file=tls_files.ca_file))


async def test_client_auth_refuses_a_client_without_a_certificate(nursery, tls_files, caplog):
    _, addr = await _serve(nursery, tls_files, "enforcing", need_client_auth=True)
    with caplog.at_level(logging.WARNING, logger="remoting"):
        # TLS 1.3 completes the client's side of the handshake before the server has judged its certificate:
        # the refusal arrives as an alert on the first read, and fails the request.
        with pytest.raises((ConnectError, ConnectionClosedError)) as refused:
            await _echo(addr, tls_context=client_context(ca_file=tls_files.ca_file))
    assert "a server with tls_need_client_auth closes TLS connections without a client certificate" \
        in str(refused.value)
    assert any("TLS handshake failed" in r.getMessage() for r in caplog.records)
    with_cert = client_context(ca_file=tls_files.ca_file, cert_file=tls_files.client_cert_file,
                               key_file=tls_files.client_key_file)
    assert await _echo(addr, tls_context=with_cert) == b"ping"


@pytest.mark.parametrize("mode", ["enforcing", "permissive"])
async def test_a_client_that_never_handshakes_is_dropped_after_the_bound(nursery, tls_files, caplog, mode):
    _, addr = await _serve(nursery, tls_files, mode, tls_handshake_timeout_s=0.2)
    host, _, port = addr.rpartition(":")
    with caplog.at_level(logging.WARNING, logger="remoting"):
        silent = await trio.open_tcp_stream(host, int(port))
        try:
            with trio.fail_after(30):  # a safety net only: the server closes it after 0.2 s
                assert await silent.receive_some(1) == b""
        finally:
            await silent.aclose()
    assert any("TLS handshake timed out" in r.getMessage() for r in caplog.records)
    assert await _echo(addr, tls_context=client_context(ca_file=tls_files.ca_file)) == b"ping"


async def test_serve_remoting_refuses_a_bad_mode_or_a_missing_context(nursery):
    with pytest.raises(ValueError, match="tls_mode must be one of"):
        await nursery.start(functools.partial(serve_remoting, Echo(), "127.0.0.1", 0, tls_mode="strict"))
    with pytest.raises(ValueError, match="needs a server tls_context"):
        await nursery.start(functools.partial(serve_remoting, Echo(), "127.0.0.1", 0, tls_mode="enforcing"))
    assert isinstance(client_context(), ssl.SSLContext)


async def test_a_ca_file_is_trusted_alone_not_beside_the_system_store(nursery, tls_files, tmp_path, monkeypatch):
    # The default ("system") store is the server's own CA here: a client given another CA file must still refuse
    # the server, as the file is all it trusts.
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_files.ca_file))
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "empty"))
    _, addr = await _serve(nursery, tls_files, "enforcing")
    assert await _echo(addr, tls_context=client_context()) == b"ping"  # the store does trust it
    with pytest.raises(ConnectError, match="certificate verify failed"):
        await _echo(addr, tls_context=client_context(ca_file=tls_files.other_ca_file))


async def _close_reason_after(delay_s):
    """The reason a client connection's request fails with when the server closes it ``delay_s`` after the
    connection opened, having answered nothing."""
    client_end, server_end = trio.testing.memory_stream_pair()
    conn = ClientConnection(client_end, "127.0.0.1:1", None)

    async def server():
        await server_end.receive_some()
        await trio.sleep(delay_s)
        await server_end.aclose()

    async with trio.open_nursery() as inner:
        await inner.start(conn._run)
        inner.start_soon(server)
        with pytest.raises(ConnectionClosedError) as closed:
            await conn.invoke(make_request(RequestCode.ECHO, body=b"x"), timeout_s=60)
    return str(closed.value)


async def test_the_refusal_hint_is_a_guess_and_only_for_a_close_at_once(autojump_clock):
    # A refusal comes on the first bytes; a server lost later (killed, in a plain cluster) is no TLS matter.
    quick = await _close_reason_after(0)
    assert "before any answer (if the server enforces TLS: " in quick, quick
    late = await _close_reason_after(2 * REFUSED_WITHIN_S)
    assert "closed by peer" in late and "TLS" not in late, late


class RaftStatus:
    """GET_RAFT_STATUS as a member answers it, for ``raftmq verify``."""

    def __init__(self, self_id):
        self.self_id = self_id

    async def handle(self, request, conn):
        body = cbor2.dumps([[0, 100, 0xAB]]) if "checksum_up_to" in request.ext else b""
        return make_response(request, ResponseCode.SUCCESS, body=body, ext={
            "role": "leader", "term": 1, "committed_index": 3, "end_offset": 100, "self_id": self.self_id})


async def test_verify_reaches_enforcing_members_over_tls(nursery, tls_files):
    from raftmq.commands.verify import verify_group
    context = server_context(tls_files.cert_file, tls_files.key_file)
    addrs = []
    for self_id in ("n1", "n2"):
        host, port = await nursery.start(functools.partial(serve_remoting, RaftStatus(self_id), "127.0.0.1", 0,
                                                           tls_mode="enforcing", tls_context=context))
        addrs.append(f"{host}:{port}")
    report = await verify_group("broker-a", addrs, timeout_s=10,
                                tls_context=client_context(ca_file=tls_files.ca_file))
    assert report["identical"] and report["up_to"] == 100
    with pytest.raises(ConnectionClosedError, match="if the server enforces TLS"):
        await verify_group("broker-a", addrs, timeout_s=10)


async def test_a_client_follows_its_ca_file_replaced_on_disk_without_a_restart(nursery, tmp_path):
    # A client's context was built once, at open: after a CA rotation (servers given certificates of the new CA,
    # the client's CA file replaced), a long-lived producer or consumer failed every new connection ("certificate
    # verify failed") until restarted, while servers already followed their own files.
    from client.instance import ClientConfig, open_remoting

    one, two = make_tls_files(tmp_path / "one"), make_tls_files(tmp_path / "two")
    ca = tmp_path / "ca.pem"
    ca.write_bytes(one.ca_file.read_bytes())
    _, old = await _serve(nursery, one, "enforcing")
    config = ClientConfig(namesrv_addrs=("127.0.0.1:1",), tls_enable=True, tls_ca_file=str(ca))
    async with open_remoting(config) as client:
        ping = make_request(RequestCode.ECHO, body=b"ping")
        assert (await client.invoke(old, ping, timeout_s=10)).body == b"ping"
        _, new = await _serve(nursery, two, "enforcing")  # a server of the new CA
        staged = tmp_path / "ca.pem.new"
        staged.write_bytes(two.ca_file.read_bytes())
        staged.replace(ca)  # as a secret's rotation does: renamed over the old file
        assert (await client.invoke(new, ping, timeout_s=10)).body == b"ping"
        # The connection open keeps the context it was made with.
        assert (await client.invoke(old, ping, timeout_s=10)).body == b"ping"


def test_a_brokers_own_client_context_follows_its_files(tmp_path):
    # The broker's client (catch-up fetches to its peers, registration with the name servers) is given a reloader,
    # as its server is: each connection it makes gets the files as they are then.
    from broker.node import _client_tls
    from tests.integration.broker.helpers import broker_configs

    one, two = make_tls_files(tmp_path / "one"), make_tls_files(tmp_path / "two")
    ca = tmp_path / "ca.pem"
    ca.write_bytes(one.ca_file.read_bytes())
    (plain,) = broker_configs(tmp_path / "plain", "127.0.0.1:1")
    assert _client_tls(plain) is None  # tls_client_enable off
    (config,) = broker_configs(tmp_path / "node", "127.0.0.1:1", tls_client_enable=True, tls_ca_file=str(ca))
    reloader = _client_tls(config)
    before = reloader()
    assert reloader() is before
    staged = tmp_path / "ca.pem.new"
    staged.write_bytes(two.ca_file.read_bytes())
    staged.replace(ca)
    after = reloader()
    assert after is not before and after.get_ca_certs() != before.get_ca_certs()
