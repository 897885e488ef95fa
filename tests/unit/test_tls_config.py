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
