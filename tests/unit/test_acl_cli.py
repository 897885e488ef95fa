"""The commands' ACL options: ``raftmq admin`` / ``raftmq bench`` credentials (flags or variables, in pairs) and
``raftmq dev --acl-file``, refused with exit 2 before anything is asked or started."""

from __future__ import annotations

import json
import os

import pytest

from raftmq.bench.common import check_credentials, exported_credentials
from raftmq.cli import main
from raftmq.commands.dev import acl_overrides, check_overrides
from remoting.config import ConfigError


@pytest.fixture(autouse=True)
def no_credentials_in_env(monkeypatch):
    monkeypatch.delenv("RAFTMQ_ACCESS_KEY", raising=False)
    monkeypatch.delenv("RAFTMQ_SECRET_KEY", raising=False)


@pytest.mark.parametrize("argv, env, named", [
    (["admin", "--namesrv", "127.0.0.1:1", "cluster", "--access-key", "producer1"], {},
     "--access-key is set but $RAFTMQ_SECRET_KEY is not"),
    (["admin", "--namesrv", "127.0.0.1:1", "--secret-key", "s3cret-value", "cluster"], {},
     "--secret-key is set but $RAFTMQ_ACCESS_KEY is not"),
    (["admin", "--namesrv", "127.0.0.1:1", "cluster", "--access-key", " "], {}, "--access-key must not be empty"),
    (["bench", "produce", "--namesrv", "127.0.0.1:1"], {"RAFTMQ_SECRET_KEY": "s3cret-value"},
     "$RAFTMQ_SECRET_KEY is set but $RAFTMQ_ACCESS_KEY is not"),
    (["dev", "--base-port", "0", "--acl-file", "/nonexistent/acl.toml"], {},
     "ACL file '/nonexistent/acl.toml' does not exist"),
])
def test_bad_acl_options_exit_2_naming_them(argv, env, named, capsys, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert named in err, err
    assert "s3cret-value" not in err


def test_flags_win_over_the_variables_and_are_exported_only_for_the_command(monkeypatch):
    class Args:
        access_key, secret_key = "flag-key", "flag-secret"

    monkeypatch.setenv("RAFTMQ_ACCESS_KEY", "env-key")
    monkeypatch.setenv("RAFTMQ_SECRET_KEY", "env-secret")
    args = Args()
    check_credentials(args)
    with exported_credentials(args):
        assert (os.environ["RAFTMQ_ACCESS_KEY"], os.environ["RAFTMQ_SECRET_KEY"]) == ("flag-key", "flag-secret")
    assert (os.environ["RAFTMQ_ACCESS_KEY"], os.environ["RAFTMQ_SECRET_KEY"]) == ("env-key", "env-secret")


def test_dev_acl_file_turns_acl_on_in_every_node(tmp_path):
    path = tmp_path / "acl.toml"
    path.write_text('[[accounts]]\naccess_key = "producer1"\nsecret_key = "producer-secret"\n')
    pairs = acl_overrides(str(path))
    assert pairs == ["acl_enable=true", f"acl_file={json.dumps(str(path.resolve()))}"]
    check_overrides(pairs)  # what each node's config will take
    assert acl_overrides(None) == []
    path.write_text('[[accounts]]\naccess_key = "producer1"\n')
    with pytest.raises(ConfigError, match=r"accounts\[0\] \(access_key 'producer1'\): secret_key is required"):
        acl_overrides(str(path))
