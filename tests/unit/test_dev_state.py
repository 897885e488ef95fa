"""``raftmq dev``'s state files (cluster.json, secret, the nodes' configs) belong to one run at a time: a second run
on a directory in use is refused before it writes anything (raftmq.commands.dev.lock_data_dir). With a running
``raftmq dev``: tests/cluster/test_dev_lock.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raftmq.cli import main
from raftmq.commands.dev import GROUP, NODE_IDS, plan_ports, write_broker_configs
from remoting.dirlock import DirectoryLock


def _state_files(data_dir: Path) -> dict[str, bytes]:
    names = ["cluster.json", "secret", *(f"{GROUP}-{nid}.toml" for nid in NODE_IDS)]
    return {name: (data_dir / name).read_bytes() for name in names}


def test_a_dir_whose_node_runs_without_dev_is_refused_before_it_writes(tmp_path, capsys):
    # A node started by hand from the directory's configs (or by `raftmq chaos` on it) holds its store and Raft
    # locks but not dev's: the nodes' own locks are probed too. Held here as the store and the member hold them.
    data_dir = tmp_path / "dev"
    data_dir.mkdir()
    write_broker_configs(data_dir, plan_ports(data_dir, 0))
    before = _state_files(data_dir)
    for sub, what, file in (("store", "store_dir", "lock"), ("dledger", "the Raft data directory", "raft.lock")):
        held = DirectoryLock(data_dir / GROUP / "n2" / sub, what, file)
        try:
            with pytest.raises(SystemExit) as exit_info:
                main(["dev", "--data-dir", str(data_dir), "--base-port", "0"])
        finally:
            held.release()
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip() == (
            f"raftmq: error: --data-dir {str(data_dir)!r} holds a running node: {what} "
            f"{str(data_dir / GROUP / 'n2' / sub)!r} is in use by another process (pid {os.getpid()}): two "
            f"processes writing one directory would corrupt it")
        assert _state_files(data_dir) == before
    DirectoryLock(data_dir, "--data-dir", "dev.lock").release()  # a refused start let go of its own lock


def test_a_refused_start_lets_go_of_the_data_dir(tmp_path, capsys):
    # Refused after the lock was taken (a damaged cluster.json): the lock goes with the refusal, not the process.
    data_dir = tmp_path / "dev"
    data_dir.mkdir()
    (data_dir / "cluster.json").write_text("{nope")
    with pytest.raises(SystemExit) as exit_info:
        main(["dev", "--data-dir", str(data_dir)])
    assert exit_info.value.code == 2
    assert "cannot be read as JSON" in capsys.readouterr().err
    DirectoryLock(data_dir, "--data-dir", "dev.lock").release()


def test_base_port_may_not_move_the_raft_ports_of_a_group_with_raft_data(tmp_path, capsys):
    # Each member's Raft snapshot names the group by its Raft addresses: re-run with --base-port on that data, the
    # members dialled the old ports, never connected, and no leader was ever elected (every send failed).
    from remoting.config import ConfigError

    data_dir = tmp_path / "dev"
    data_dir.mkdir()
    write_broker_configs(data_dir, plan_ports(data_dir, 20000))
    assert plan_ports(data_dir, 0)["ports"]["raft"] != plan_ports(data_dir, 20000)["ports"]["raft"]  # no Raft data
    (data_dir / GROUP / "n2" / "dledger").mkdir(parents=True)
    (data_dir / GROUP / "n2" / "dledger" / "raft.snapshot").write_bytes(b"a snapshot")
    assert plan_ports(data_dir, 20000)["ports"]["raft"] == [31035, 31045, 31055]  # the same ports: fine
    before = _state_files(data_dir)
    with pytest.raises(ConfigError, match="would move the Raft ports of the group whose Raft data"):
        plan_ports(data_dir, 20100)
    with pytest.raises(SystemExit) as exit_info:
        main(["dev", "--data-dir", str(data_dir), "--base-port", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "(members n2; from [31035, 31045, 31055] to [" in err and "Run without --base-port" in err, err
    assert _state_files(data_dir) == before  # cluster.json kept: a run without --base-port still works


def test_base_port_on_raft_data_reads_only_the_ports_of_cluster_json(tmp_path):
    # A missing secret file (no matter of ports) made the refusal say the ports would move "from None".
    from remoting.config import ConfigError

    data_dir = tmp_path / "dev"
    data_dir.mkdir()
    write_broker_configs(data_dir, plan_ports(data_dir, 20000))
    (data_dir / GROUP / "n1" / "dledger").mkdir(parents=True)
    (data_dir / GROUP / "n1" / "dledger" / "raft.journal").write_bytes(b"a journal")
    (data_dir / "secret").unlink()  # the same ports: allowed (a new secret is made, as before)
    assert plan_ports(data_dir, 20000)["ports"]["raft"] == [31035, 31045, 31055]
    (data_dir / "cluster.json").write_text("{nope")
    with pytest.raises(ConfigError, match="cannot be read .*whether --base-port would move the Raft ports"):
        plan_ports(data_dir, 20000)
