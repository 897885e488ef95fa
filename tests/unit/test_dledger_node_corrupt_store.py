"""A real ``raftmq dledger-node`` whose message store does not fit its config says so in one line, exit 2, as
``raftmq broker`` does: it was a StoreCorruptedError traceback, exit 1."""

from __future__ import annotations

import subprocess

from tests.procs import free_port, raftmq_argv


def test_a_store_that_does_not_fit_its_config_is_one_line_naming_it(tmp_path):
    store = tmp_path / "store"
    (store / "commitlog").mkdir(parents=True)
    # A segment's name is its first phy_offset: 7 is no multiple of any segment size (a size changed, a file
    # copied in by hand).
    (store / "commitlog" / "00000000000000000007").write_bytes(b"\0" * 7)
    raft, service = free_port(), free_port()
    config = tmp_path / "node.toml"
    config.write_text('state_machine = "message_store"\n'
                      "[dledger]\n"
                      'group = "g"\nself_id = "n0"\nsecret = "0123456789abcdef0123"\n'
                      f'data_dir = "{tmp_path / "dledger"}"\n'
                      f'members = [{{id = "n0", raft_address = "127.0.0.1:{raft}", '
                      f'service_address = "127.0.0.1:{service}"}}]\n'
                      "[store]\n"
                      f'store_dir = "{store}"\n')
    done = subprocess.run(raftmq_argv("--log-level", "WARNING", "dledger-node", "--config", str(config)),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == (
        f"raftmq: error: dledger-node n0 (listen 127.0.0.1:{service}, raft 127.0.0.1:{raft}) could not start: "
        "commit log segment 00000000000000000007 does not start at a multiple of segment_size_bytes 1073741824; "
        "was the size changed?")
    assert done.stdout == ""  # no ready line
