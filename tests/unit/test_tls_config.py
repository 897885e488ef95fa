"""TLS configuration: contexts built from files, every mistake a ConfigError naming the key and the file, and the
first-byte rule of permissive mode."""

from __future__ import annotations

import ssl

import pytest

from client.instance import TLS_CA_FILE_ENV, TLS_ENABLE_ENV, ClientConfig
from namesrv.config import NamesrvConfig
from remoting.codec import encode, make_request
from remoting.config import ConfigError
from remoting.tls import client_context, is_tls_start, server_context_for_mode
from tests.tls_certs import make_tls_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def test_permissive_mode_tells_a_client_hello_from_a_plain_frame(files):
    hello = ssl.MemoryBIO()
    tls = client_context(ca_file=files.ca_file).wrap_bio(ssl.MemoryBIO(), hello, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    assert is_tls_start(hello.read())
    assert not is_tls_start(encode(make_request(105, ext={"topic": "t"}), opaque=1))
    with pytest.raises(ValueError):
        is_tls_start(b"")


def test_server_contexts_by_mode(files):
    assert server_context_for_mode("disabled", "", "") is None
    context = server_context_for_mode("enforcing", files.cert_file, files.key_file, files.ca_file, True)
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert server_context_for_mode("permissive", files.cert_file, files.key_file).verify_mode == ssl.CERT_NONE


@pytest.mark.parametrize("mode,cert,key,ca,auth,message", [
    ("strict", "c", "k", "", False, "tls_mode must be one of 'disabled', 'permissive', 'enforcing', got 'strict'"),
    ("enforcing", "", "", "", False, "tls_mode 'enforcing' needs tls_cert_file and tls_key_file"),
    ("permissive", "c", "", "", False, "tls_mode 'permissive' needs tls_key_file"),
    ("enforcing", "missing.pem", "k", "", False, "tls_cert_file 'missing.pem' does not exist"),
    ("enforcing", "c", "client.key", "", False, "tls_key_file 'client.key' is not the key of the certificate"),
    ("enforcing", "k", "k", "", False, "tls_cert_file 'k' holds no PEM certificate"),
    ("enforcing", "c", "c", "", False, "tls_key_file 'c' holds no PEM private key"),
    ("enforcing", "c", "k", "", True, "tls_need_client_auth needs tls_ca_file"),
    ("enforcing", "c", "k", "missing-ca.pem", True, "tls_ca_file 'missing-ca.pem' does not exist"),
])
def test_server_config_mistakes_name_the_key_and_file(files, monkeypatch, mode, cert, key, ca, auth, message):
    monkeypatch.chdir(files.ca_file.parent)
    names = {"c": files.cert_file.name, "k": files.key_file.name}
    with pytest.raises(ConfigError) as refused:
        server_context_for_mode(mode, names.get(cert, cert), names.get(key, key), ca, auth)
    assert message.replace("'c'", repr(names["c"])).replace("'k'", repr(names["k"])) in str(refused.value)


def test_namesrv_config_checks_its_tls_files_at_load(files, tmp_path):
    with pytest.raises(ConfigError, match="tls_cert_file '/nonexistent.pem' does not exist"):
        NamesrvConfig(tls_mode="enforcing", tls_cert_file="/nonexistent.pem", tls_key_file=str(files.key_file))
    with pytest.raises(ConfigError, match="tls_mode must be one of"):
        NamesrvConfig(tls_mode="on")
    config = NamesrvConfig(tls_mode="enforcing", tls_cert_file=str(files.cert_file), tls_key_file=str(files.key_file))
    assert isinstance(config.tls_server_context(), ssl.SSLContext)
    assert NamesrvConfig().tls_server_context() is None


def test_client_config_tls_fields(files, monkeypatch):
    monkeypatch.delenv(TLS_ENABLE_ENV, raising=False)
    monkeypatch.delenv(TLS_CA_FILE_ENV, raising=False)
    assert ClientConfig().tls_enable is False
    with pytest.raises(ConfigError, match="tls_ca_file is set but tls_enable is not"):
        ClientConfig(tls_ca_file=str(files.ca_file))
    with pytest.raises(ConfigError, match="tls_cert_file is set but tls_key_file is not"):
        ClientConfig(tls_enable=True, tls_cert_file=str(files.client_cert_file))
    with pytest.raises(ConfigError, match="tls_ca_file '/nonexistent-ca.pem' does not exist"):
        ClientConfig(tls_enable=True, tls_ca_file="/nonexistent-ca.pem")
    monkeypatch.setenv(TLS_ENABLE_ENV, "true")
    monkeypatch.setenv(TLS_CA_FILE_ENV, str(files.ca_file))
    config = ClientConfig()
    assert config.tls_enable and config.tls_ca_file == str(files.ca_file)
    monkeypatch.setenv(TLS_ENABLE_ENV, "ture")
    with pytest.raises(ConfigError, match=r"\$RAFTMQ_TLS_ENABLE must be true or false"):
        ClientConfig()


def _encrypted_key(files, path):
    from cryptography.hazmat.primitives import serialization
    key = serialization.load_pem_private_key(files.key_file.read_bytes(), password=None)
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.BestAvailableEncryption(b"secret")))
    return path


def test_an_encrypted_key_is_refused_by_name_not_prompted_for(files, tmp_path):
    # Without a password callback OpenSSL asks on the terminal (blocking a broker's start) or, with none, fails
    # with "PEM lib".
    key = _encrypted_key(files, tmp_path / "encrypted.key")
    with pytest.raises(ConfigError, match=f"tls_key_file '{key}' is encrypted .*give an unencrypted key"):
        server_context_for_mode("enforcing", files.cert_file, key)
    with pytest.raises(ConfigError, match=f"tls_key_file '{key}' is encrypted"):
        client_context(ca_file=files.ca_file, cert_file=files.cert_file, key_file=key)


def test_a_client_with_a_ca_file_trusts_that_file_only(files, tmp_path, monkeypatch):
    # The "system" store is the other CA here: with a CA file given, it must not be trusted as well.
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("SSL_CERT_FILE", str(files.other_ca_file))
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "empty"))
    system = client_context().get_ca_certs()
    assert len(system) == 1  # the test controls the default store
    only_ca = client_context(ca_file=files.ca_file)
    assert [c["subject"] for c in only_ca.get_ca_certs()] != [c["subject"] for c in system]
    assert len(only_ca.get_ca_certs()) == 1
    assert only_ca.check_hostname and only_ca.verify_mode == ssl.CERT_REQUIRED


def _broker_config(**tls):
    from broker.config import BrokerConfig
    from remoting.config import config_from_mapping
    members = [{"id": f"n{i}", "raft_address": f"127.0.0.1:{20000 + i}", "service_address": f"127.0.0.1:{10000 + i}"}
               for i in (1, 2, 3)]
    return config_from_mapping(BrokerConfig, {
        "namesrv_addrs": ["127.0.0.1:9876"], "store": {"store_dir": "/tmp/x/store"},
        "dledger": {"group": "broker-a", "self_id": "n1", "secret": "0123456789abcdef-secret",
                    "data_dir": "/tmp/x/dledger", "members": members}, **tls})


def test_an_enforcing_broker_must_dial_its_peers_over_tls(files):
    keys = {"tls_cert_file": str(files.cert_file), "tls_key_file": str(files.key_file),
            "tls_ca_file": str(files.ca_file)}
    # Its catch-up fetches go to its peers' enforcing ports: plain, they failed only once a member lagged.
    with pytest.raises(ConfigError, match='tls_mode = "enforcing" needs tls_client_enable = true: the members of a '
                                          'group fetch from each other'):
        _broker_config(tls_mode="enforcing", **keys)
    assert _broker_config(tls_mode="enforcing", tls_client_enable=True, **keys).tls_client_context() is not None
    assert _broker_config(tls_mode="permissive", **keys).tls_client_context() is None


def _chaos_args(*argv):
    import argparse

    from raftmq.commands import chaos
    parser = argparse.ArgumentParser()
    chaos.register(parser.add_subparsers())
    return chaos, parser.parse_args(["chaos", *argv])


def test_chaos_serves_tls_with_tls_and_refuses_enforcing_brokers_without(files, tmp_path):
    chaos, args = _chaos_args("--set", "tls_client_enable=true")
    with pytest.raises(ConfigError, match='chaos\'s name server and clients speak plain TCP; serve TLS everywhere '
                                          'with --tls'):
        chaos.check_args(args)
    # --tls: the whole cluster and its clients (it refused before); the tls_* keys are its to set.
    chaos.check_args(_chaos_args("--tls")[1])
    with pytest.raises(ConfigError, match="--set tls_mode and --tls: --tls sets the tls_\\* keys of every node"):
        chaos.check_args(_chaos_args("--tls", "--set", 'tls_mode="permissive"')[1])
    with pytest.raises(ConfigError, match="--tls-ca-file needs --tls-dir"):
        chaos.check_args(_chaos_args("--tls-ca-file", str(files.ca_file))[1])
    chaos, args = _chaos_args("--tls-dir", str(tmp_path / "made"))
    chaos.check_args(args)
    assert args.tls and args.tls_dir.generated and args.tls_dir.ca_file == tmp_path / "made" / "ca.pem"


def test_verify_takes_the_tls_flags(files, tmp_path, monkeypatch, capsys):
    from raftmq.cli import main
    from raftmq.commands import verify
    monkeypatch.delenv(TLS_ENABLE_ENV, raising=False)
    monkeypatch.delenv(TLS_CA_FILE_ENV, raising=False)
    argv = ["verify", "--group", "broker-a", "--members", "127.0.0.1:1,127.0.0.1:2"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--tls-ca-file", str(tmp_path / "missing.pem")])
    assert exit_info.value.code == 2
    assert f"--tls-ca-file '{tmp_path / 'missing.pem'}' does not exist" in capsys.readouterr().err
    contexts = []

    async def fake_verify(group, addresses, *, timeout_s, tls_context, max_lag_bytes, signer):
        contexts.append(tls_context)
        return {"up_to": 0, "furthest": 0, "members": {}, "segments": 0, "divergent": [], "lagging": {},
                "identical": True}

    monkeypatch.setattr(verify, "verify_group", fake_verify)
    assert main([*argv, "--tls-ca-file", str(files.ca_file)]) == 0
    assert main(argv) == 0
    monkeypatch.setenv(TLS_ENABLE_ENV, "true")  # as every client: the variable when the flag is left out
    assert main(argv) == 0
    assert [isinstance(c, ssl.SSLContext) for c in contexts] == [True, False, True]
    assert len(contexts[0].get_ca_certs()) == 1
