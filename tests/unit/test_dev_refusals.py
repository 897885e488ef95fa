"""``raftmq dev`` and ``raftmq chaos`` refuse, before anything is made or started (exit 2 naming the bad value), what
used to start every process and then fail, or run a cluster other than the one they report: a ``--set`` of a key
they set for the whole cluster, ACL turned on without an ACL file the nodes can load, a ``--tls-dir`` its ready
line cannot carry, and a chaos ``--data-dir`` that cannot be made."""

from __future__ import annotations

from pathlib import Path

import pytest

from raftmq.cli import main
from raftmq.commands.dev import GROUP, NODE_IDS, check_overrides
from remoting.config import ConfigError
from tests.unit.test_dev_cli import _refused

ACL_TEXT = '[[accounts]]\naccess_key = "producer1"\nsecret_key = "producer-secret"\n'
CLUSTER_SENTENCE = ("raftmq dev sets this for the whole cluster (its group broker-a, its name server, its secret); a "
                    "different layout needs configs of its own, run with raftmq broker")


@pytest.mark.parametrize("override, key", [
    # dev printed "group broker-a" and chaos waited 30 s for a leader of broker-a, of a group named g2.
    ('dledger.group="g2"', "dledger.group"),
    ('dledger.secret="one-secret-for-all"', "dledger.secret"),
    ('namesrv_addrs=["127.0.0.1:9999"]', "namesrv_addrs"),
])
@pytest.mark.parametrize("command", ["dev", "chaos"])
def test_a_key_dev_sets_for_the_whole_cluster_is_refused(command, override, key, tmp_path, capsys):
    data_dir = tmp_path / "cluster"
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--data-dir", str(data_dir), "--set", override])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == f"raftmq: error: --set {key}: {CLUSTER_SENTENCE}", err
    assert not data_dir.exists()


def test_acl_on_without_an_acl_file_is_refused_naming_the_key_before_anything_starts(tmp_path, capsys):
    # Four processes started, then every broker exited 1: "ACL file ... does not exist".
    data_dir = tmp_path / "dev"
    err = _refused(["--data-dir", str(data_dir), "--base-port", "0", "--set", "acl_enable=true"], capsys)
    missing = (data_dir / GROUP / NODE_IDS[0] / "store").resolve() / "plain_acl.toml"
    assert f"--set acl_enable: ACL file {str(missing)!r} does not exist" in err, err
    assert not data_dir.exists()


def test_acl_on_with_an_acl_file_that_does_not_load_is_refused_naming_the_key(tmp_path, capsys):
    data_dir, acl = tmp_path / "dev", tmp_path / "acl.toml"
    acl.write_text('[[accounts]]\naccess_key = "producer1"\n')
    err = _refused(["--data-dir", str(data_dir), "--base-port", "0", "--set", "acl_enable=true",
                    "--set", f'acl_file="{acl}"'], capsys)
    assert f"--set acl_file: ACL file {str(acl)!r}: accounts[0] (access_key 'producer1'): secret_key is " \
           f"required" in err, err
    assert not data_dir.exists()


def test_acl_on_is_let_through_when_every_node_has_its_acl_file(tmp_path):
    data_dir = tmp_path / "dev"
    with pytest.raises(ConfigError, match="--set acl_enable: ACL file .*/n1/store/plain_acl.toml' does not exist"):
        check_overrides(["acl_enable=true"], data_dir)
    for nid in NODE_IDS:
        store = data_dir / GROUP / nid / "store"
        store.mkdir(parents=True)
        (store / "plain_acl.toml").write_text(ACL_TEXT)
    check_overrides(["acl_enable=true"], data_dir)
    acl = tmp_path / "acl.toml"
    acl.write_text(ACL_TEXT)
    check_overrides(["acl_enable=true", f'acl_file="{acl}"'], None)


def test_chaos_with_acl_on_and_no_acl_file_is_refused_before_a_data_dir_is_made(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where chaos would make its temporary data directory
    with pytest.raises(SystemExit) as exit_info:
        main(["chaos", "--set", "acl_enable=true"])
    assert exit_info.value.code == 2
    assert "--set acl_enable: ACL is on without acl_file" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_tls_dir_with_whitespace_is_refused_before_its_certificates_are_made(tmp_path, monkeypatch, capsys):
    # Its ready line's tls_ca_file= was cut at the space by every reader of ready lines.
    tls_dir, data_dir = tmp_path / "my tls", tmp_path / "dev"
    err = _refused(["--data-dir", str(data_dir), "--base-port", "0", "--tls-dir", str(tls_dir)], capsys)
    assert f"--tls-dir {str(tls_dir)!r} holds whitespace" in err, err
    assert not tls_dir.exists() and not data_dir.exists()
    # A relative one is judged by the directory it names.
    (tmp_path / "a b").mkdir()
    monkeypatch.chdir(tmp_path / "a b")
    err = _refused(["--data-dir", str(data_dir), "--base-port", "0", "--tls-dir", "tls"], capsys)
    assert f"--tls-dir 'tls' ({str(tmp_path / 'a b' / 'tls')!r}) holds whitespace" in err, err
    assert list(Path.cwd().iterdir()) == []


def test_chaos_with_a_data_dir_that_cannot_be_made_exits_2_naming_it(capsys):
    # Was a NotADirectoryError traceback, exit 1.
    with pytest.raises(SystemExit) as exit_info:
        main(["chaos", "--data-dir", "/dev/null/x"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == "raftmq: error: --data-dir '/dev/null/x' cannot be made: Not a directory", err
