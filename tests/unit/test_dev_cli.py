"""``raftmq dev``'s refusals: bad input exits 2 naming the bad value, like every other raftmq command, and
before anything is written (the cluster itself is tested in tests/cluster/test_broker_cluster.py)."""

from __future__ import annotations

import pytest

from raftmq.cli import main


@pytest.mark.parametrize("argv, env, named", [
    (["--base-port", "65000"], None, "--base-port 65000 puts a port outside 1..65535 (66035)"),
    (["--base-port", "-3"], None, "--base-port -3 puts a port outside 1..65535 (-3)"),
    (["--base-port", "0"], "70000-70010", "RAFTMQ_PORT_RANGE='70000-70010'"),
    (["--base-port", "0", "--stop-timeout", "-1"], None, "--stop-timeout must be within 0.1..3600, got -1.0"),
    (["--base-port", "0", "--stop-timeout", "nan"], None, "--stop-timeout must be within 0.1..3600, got nan"),
    # --set is checked as every node would check it, before a node is started (they exited one by one, rc 1).
    (["--base-port", "0", "--set", 'store.flush_disk_type="BAD"'], None,
     "store.flush_disk_type must be one of 'ASYNC_FLUSH', 'SYNC_FLUSH', got 'BAD'"),
    (["--base-port", "0", "--set", "nonsense"], None, "--set needs KEY=VALUE, got 'nonsense'"),
    (["--base-port", "0", "--set", "no_such=1"], None, "unknown config key 'no_such'"),
    (["--base-port", "0", "--set", "cluster_name.x=1"], None,
     "config key 'cluster_name.x': 'cluster_name' is a value, not a table"),
    # A key dev writes per node passed the check, and every node claimed one identity, port or directory: it ended
    # as a bind error from the second node, exit 1.
    (["--base-port", "0", "--set", 'dledger.self_id="n2"'], None,
     "--set dledger.self_id: raftmq dev sets this per node"),
    (["--base-port", "0", "--set", ' dledger.self_id = "n2"'], None,
     "--set dledger.self_id: raftmq dev sets this per node"),
    (["--base-port", "0", "--set", 'store.store_dir="/tmp/one-store"'], None,
     "--set store.store_dir: raftmq dev sets this per node"),
    (["--base-port", "0", "--set", 'dledger.data_dir="/tmp/one-raft"'], None,
     "--set dledger.data_dir: raftmq dev sets this per node"),
    (["--base-port", "0", "--set", 'listen="127.0.0.1:12345"'], None, "--set listen: raftmq dev sets this per node"),
    (["--base-port", "0", "--set", 'metrics_listen="127.0.0.1:9100"'], None,
     "--set metrics_listen: raftmq dev sets this per node"),
    (["--base-port", "0", "--set",
      'dledger.members=[{id="n1", raft_address="127.0.0.1:2", service_address="127.0.0.1:3"}]'], None,
     "--set dledger.members: raftmq dev sets this per node"),
    (["--base-port", "0", "--set", "dledger.members.x=1"], None,
     "--set dledger.members.x: raftmq dev sets this per node"),
    # A whole table put store_dir back to its default, "store" in the current directory, for all three nodes.
    (["--base-port", "0", "--set", 'store={flush_disk_type="SYNC_FLUSH"}'], None,
     "--set store: raftmq dev sets store.store_dir in it per node, and this replaces the whole table; set its "
     "other keys one by one (store.KEY=VALUE)"),
    (["--base-port", "0", "--set", 'dledger={group="broker-a"}'], None,
     "--set dledger: raftmq dev sets dledger.self_id in it per node"),
    # Path("") is ".": the whole cluster was written into the current directory.
    (["--base-port", "0", "--data-dir", ""], None,
     "--data-dir must name a directory (an empty one means the current directory), got ''"),
    (["--base-port", "0", "--data-dir", "  "], None,
     "--data-dir must name a directory (an empty one means the current directory), got '  '"),
])
def test_a_bad_option_exits_2_naming_it_and_writes_nothing(argv, env, named, tmp_path, monkeypatch, capsys):
    if env is not None:
        monkeypatch.setenv("RAFTMQ_PORT_RANGE", env)
    (tmp_path / "cwd").mkdir()  # where an empty --data-dir put the cluster
    monkeypatch.chdir(tmp_path / "cwd")
    data_dir = tmp_path / "dev"
    with pytest.raises(SystemExit) as exit_info:
        main(["dev", "--data-dir", str(data_dir), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1, err
    assert not data_dir.exists()
    assert not any((tmp_path / "cwd").iterdir())


def test_good_overrides_pass_the_check():
    from raftmq.commands.dev import check_overrides

    check_overrides(["long_polling_timeout_ms=500", 'store.flush_disk_type="SYNC_FLUSH"',
                     "dledger.heartbeat_interval_ms=50"])


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["dev", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_a_data_dir_that_is_a_file_or_cannot_be_made_exits_2_naming_it(tmp_path, capsys):
    # Were FileExistsError / NotADirectoryError tracebacks, exit 1.
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert f"--data-dir {str(afile)!r} is a file, not a directory" in _refused(
        ["--data-dir", str(afile), "--base-port", "0"], capsys)
    assert f"--data-dir {str(afile / 'sub')!r} cannot be made: Not a directory" in _refused(
        ["--data-dir", str(afile / "sub"), "--base-port", "0"], capsys)


@pytest.mark.parametrize("text, named", [
    ("{nope", "cannot be read as JSON"),
    ("[1]", "needs 'ports' and 'secret_file'"),
    ('{"ports": 5, "secret_file": "s"}', "needs 'ports' and 'secret_file'"),
    ('{"ports": {"namesrv": 1, "service": [2, 3, 4, 5], "raft": [6, 7]}, "secret_file": "SECRET"}',
     "'ports' must hold a name server port and 3 service and 3 Raft ports within 1..65535"),
    ('{"ports": {"namesrv": 0, "service": [2, 3, 4], "raft": [5, 6, 7]}, "secret_file": "SECRET"}',
     "'ports' must hold a name server port"),
    ('{"ports": {"namesrv": 1, "service": [2, 3, 4], "raft": [5, 6, 7]}, "secret_file": "/nonexistent/secret"}',
     "names a secret file that does not exist, '/nonexistent/secret'"),
])
def test_a_damaged_cluster_json_exits_2_naming_it(text, named, tmp_path, capsys):
    # Was a JSONDecodeError, KeyError or FileNotFoundError traceback from deep in the start, exit 1.
    data_dir = tmp_path / "dev"
    data_dir.mkdir()
    (data_dir / "secret").write_text("s" * 32)
    (data_dir / "cluster.json").write_text(text.replace("SECRET", str(data_dir / "secret")))
    err = _refused(["--data-dir", str(data_dir)], capsys)
    assert f"{str(data_dir / 'cluster.json')!r} (the ports and secret of an earlier run) {named}" in err
    assert "remove it, or the whole --data-dir, to start over" in err
