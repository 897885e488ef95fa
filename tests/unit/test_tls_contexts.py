"""TLS contexts built once per settings and file versions, reloaded when a file is replaced (keeping the last good
one while the files disagree); the client's TLS variables read by one function; the TLS directory of ``raftmq dev
--tls-dir`` (found, made, or refused)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil

import pytest

from client.instance import TLS_CA_FILE_ENV, TLS_ENABLE_ENV, tls_settings
from namesrv.config import NamesrvConfig
from raftmq.bench.common import tls_context_from_args
from raftmq.commands.dev_tls import open_tls_dir
from remoting import tls
from remoting.config import ConfigError
from remoting.tls import ContextReloader, client_context, server_context
from tests.tls_certs import make_tls_files


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Two sets of files, each signed by its own CA."""
    base = tmp_path_factory.mktemp("tls")
    return make_tls_files(base / "one"), make_tls_files(base / "two")


@pytest.fixture
def live(pairs, tmp_path):
    """A server's cert and key, copies of the first set, at paths the test may replace."""
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    shutil.copy(pairs[0].cert_file, cert)
    shutil.copy(pairs[0].key_file, key)
    return cert, key


def _replace(path, source):
    # As certbot or a secret mount does: a new file renamed over the old one.
    shutil.copy(source, path.with_suffix(".new"))
    os.replace(path.with_suffix(".new"), path)


@pytest.fixture
def loads(monkeypatch):
    """How many times certificate chains are loaded from disk."""
    count = [0]
    load_chain = tls._load_chain

    def counted(*args):
        count[0] += 1
        return load_chain(*args)

    monkeypatch.setattr(tls, "_load_chain", counted)
    return count


def test_a_config_checked_at_load_serves_the_context_it_built(live, loads):
    cert, key = live
    config = NamesrvConfig(tls_mode="enforcing", tls_cert_file=str(cert), tls_key_file=str(key))
    assert loads[0] == 1
    # The start asks again: the files are not read a second time.
    assert config.tls_server_context() is config.tls_server_context()
    assert NamesrvConfig(tls_mode="enforcing", tls_cert_file=str(cert), tls_key_file=str(key)).tls_server_context() \
        is config.tls_server_context()
    assert loads[0] == 1
    # Other settings, another context.
    assert server_context(cert, key, ca_file=None, need_client_auth=False) is config.tls_server_context()
    assert loads[0] == 1


def test_a_broker_config_and_its_runtime_updates_build_each_context_once(pairs, live, loads):
    from broker.config import with_runtime_values
    from tests.unit.test_tls_config import _broker_config
    cert, key = live
    config = _broker_config(tls_mode="enforcing", tls_client_enable=True, tls_cert_file=str(cert),
                            tls_key_file=str(key), tls_ca_file=str(pairs[0].ca_file))
    assert loads[0] == 2  # the server's and its own client's
    updated = with_runtime_values(config, {"max_transfer_count": 64})  # checks the whole config again, twice
    assert updated.tls_server_context() is config.tls_server_context()
    assert updated.tls_client_context() is config.tls_client_context()
    assert loads[0] == 2


def test_a_replaced_file_builds_a_new_context(pairs, live, loads):
    cert, key = live
    first = server_context(cert, key)
    _replace(cert, pairs[1].cert_file)
    _replace(key, pairs[1].key_file)
    second = server_context(cert, key)
    assert second is not first and loads[0] == 2
    assert server_context(cert, key) is second


def test_files_that_do_not_load_are_refused_again_without_reading_them(live, loads):
    cert, key = live
    for _ in range(2):
        with pytest.raises(ConfigError, match="tls_key_file '.*missing.key' does not exist"):
            server_context(cert, cert.parent / "missing.key")
    assert loads[0] == 1  # tried once
    shutil.copy(key, cert.parent / "missing.key")  # it appears: tried again
    assert server_context(cert, cert.parent / "missing.key") is not None and loads[0] == 2


def test_the_reloader_serves_the_files_as_they_are_and_keeps_the_last_good_context(pairs, live, caplog):
    cert, key = live
    reloader = ContextReloader(lambda: server_context(cert, key))
    first = reloader()
    assert reloader() is first
    with caplog.at_level(logging.INFO, logger="remoting.tls"):
        _replace(cert, pairs[1].cert_file)  # its key not yet: they disagree
        assert reloader() is first and reloader() is first
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "TLS files changed but do not load" in warnings[0], warnings
        assert "is not the key of the certificate" in warnings[0]
        _replace(key, pairs[1].key_file)
        second = reloader()
    assert second is not first and reloader() is second
    assert any("TLS files changed: connections made or accepted from now on" in r.getMessage() for r in caplog.records)


def test_the_reloader_refuses_files_that_do_not_load_at_start(live):
    cert, _ = live
    with pytest.raises(ConfigError, match="holds no PEM private key"):
        ContextReloader(lambda: server_context(cert, cert))


def test_a_client_without_a_ca_file_follows_the_system_store_it_is_given(pairs, tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("SSL_CERT_FILE", str(pairs[0].ca_file))
    one = client_context()
    monkeypatch.setenv("SSL_CERT_FILE", str(pairs[1].ca_file))
    two = client_context()
    assert one is not two and one.get_ca_certs() != two.get_ca_certs()


def test_tls_settings_take_each_value_given_else_its_variable(monkeypatch):
    monkeypatch.delenv(TLS_ENABLE_ENV, raising=False)
    monkeypatch.delenv(TLS_CA_FILE_ENV, raising=False)
    assert tls_settings() == (False, "")
    monkeypatch.setenv(TLS_ENABLE_ENV, "yes")
    monkeypatch.setenv(TLS_CA_FILE_ENV, "/etc/ca.pem")
    assert tls_settings() == (True, "/etc/ca.pem")
    assert tls_settings(enable=False, ca_file="mine.pem") == (False, "mine.pem")
    monkeypatch.setenv(TLS_ENABLE_ENV, "maybe")
    with pytest.raises(ConfigError, match=rf"\${TLS_ENABLE_ENV} must be true or false"):
        tls_settings()
    assert tls_settings(enable=True) == (True, "/etc/ca.pem")  # the flag given: the variable is not read


def test_tls_context_from_args_reads_the_flags_then_the_variables(pairs, monkeypatch):
    monkeypatch.delenv(TLS_ENABLE_ENV, raising=False)
    monkeypatch.setenv(TLS_CA_FILE_ENV, str(pairs[0].ca_file))
    plain = argparse.Namespace(tls=False, tls_ca_file=None)
    with pytest.raises(ConfigError, match=rf"\${TLS_CA_FILE_ENV} is set but TLS is not on: pass --tls"):
        tls_context_from_args(plain)
    assert tls_context_from_args(argparse.Namespace(tls=True, tls_ca_file=None)) \
        is client_context(ca_file=str(pairs[0].ca_file))
    flagged = argparse.Namespace(tls=True, tls_ca_file=str(pairs[1].ca_file))
    assert tls_context_from_args(flagged) is client_context(ca_file=str(pairs[1].ca_file))
    monkeypatch.delenv(TLS_CA_FILE_ENV)
    assert tls_context_from_args(plain) is None


def test_an_empty_tls_dir_gets_a_ca_and_a_server_certificate_then_keeps_them(tmp_path):
    made = open_tls_dir(tmp_path / "tls")
    assert made.generated
    names = sorted(p.name for p in (tmp_path / "tls").iterdir())
    assert names == ["ca.key", "ca.pem", "server.key", "server.pem"]
    for key in ("ca.key", "server.key"):
        assert (tmp_path / "tls" / key).stat().st_mode & 0o777 == 0o600
    before = {name: (tmp_path / "tls" / name).read_bytes() for name in names}
    again = open_tls_dir(tmp_path / "tls")
    assert not again.generated and again.ca_file == made.ca_file
    assert {name: (tmp_path / "tls" / name).read_bytes() for name in names} == before


def test_a_tls_dir_with_its_three_files_is_used_as_it_is(pairs):
    given = open_tls_dir(pairs[0].ca_file.parent)  # tests/tls_certs.py writes the names dev reads
    assert not given.generated and given.cert_file == pairs[0].cert_file


def test_a_tls_dir_that_is_incomplete_or_mismatched_is_refused_naming_it(pairs, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(pairs[0].ca_file, partial / "ca.pem")
    with pytest.raises(ConfigError, match="holds ca.pem but not server.pem, server.key: give all of"):
        open_tls_dir(partial)
    assert sorted(p.name for p in partial.iterdir()) == ["ca.pem"]  # nothing made over it
    mismatched = tmp_path / "mismatched"
    mismatched.mkdir()
    shutil.copy(pairs[1].ca_file, mismatched / "ca.pem")  # signed neither
    shutil.copy(pairs[0].cert_file, mismatched / "server.pem")
    shutil.copy(pairs[0].key_file, mismatched / "server.key")
    with pytest.raises(ConfigError, match="--tls-dir: a client trusting .*ca.pem' refuses .*server.pem' for "
                                          "127.0.0.1"):
        open_tls_dir(mismatched)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        open_tls_dir(tmp_path / "file")


def test_a_tls_dir_left_with_only_ca_key_by_an_interrupted_run_is_refused_saying_so(tmp_path):
    # Making them writes ca.key first: an interrupted run left only it, which counted as "none there", and making
    # them again failed on it with "cannot write ca.key: File exists".
    made = tmp_path / "made"
    open_tls_dir(made)
    for name in ("ca.pem", "server.pem", "server.key"):
        (made / name).unlink()
    key = (made / "ca.key").read_bytes()
    with pytest.raises(ConfigError, match=r"holds ca.key but not ca.pem, server.pem, server.key: give all of .* \(a "
                                          r"run making them writes ca.key first: if one was interrupted, remove "
                                          r"ca.key and the next run makes them all\)"):
        open_tls_dir(made)
    assert sorted(p.name for p in made.iterdir()) == ["ca.key"] and (made / "ca.key").read_bytes() == key
    (made / "ca.key").unlink()  # as the refusal says
    assert open_tls_dir(made).generated


def test_dev_refuses_a_tls_key_set_beside_tls_dir(tmp_path, capsys):
    from raftmq.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["dev", "--data-dir", str(tmp_path / "dev"), "--tls-dir", str(tmp_path / "tls"),
              "--set", 'tls_mode="permissive"'])
    assert exit_info.value.code == 2
    assert "--set tls_mode and --tls-dir: --tls-dir sets the tls_* keys of every node" in capsys.readouterr().err
    assert not (tmp_path / "dev").exists() and not (tmp_path / "tls").exists()


def test_a_broker_node_serves_the_files_of_its_config_as_they_are_at_each_connection(pairs, live):
    import types

    from broker.node import _server_tls
    from tests.unit.test_tls_config import _broker_config
    cert, key = live
    node = types.SimpleNamespace(config=_broker_config(tls_mode="permissive", tls_cert_file=str(cert),
                                                       tls_key_file=str(key)))
    contexts = _server_tls(node)
    first = contexts()
    _replace(cert, pairs[1].cert_file)
    _replace(key, pairs[1].key_file)
    assert contexts() is not first
    node.config = _broker_config(tls_mode="permissive", tls_cert_file=str(pairs[0].cert_file),
                                 tls_key_file=str(pairs[0].key_file))  # the config the node holds now counts
    assert contexts() is server_context(pairs[0].cert_file, pairs[0].key_file)
    assert _server_tls(types.SimpleNamespace(config=_broker_config())) is None
