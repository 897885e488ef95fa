"""``raftmq dev`` on directories whose names TOML and the shell treat specially: the nodes keep their data under the
``--data-dir`` given, and the client options it prints for a ``--tls-dir`` work pasted into a shell."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time

import pytest

from raftmq.commands.dev import GROUP, NODE_IDS
from tests.procs import REPO_ROOT, raftmq_argv

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def test_the_nodes_keep_their_data_in_the_data_dir_named_and_the_printed_tls_options_work(tmp_path, spawn):
    # A backslash-t was read as a tab in the generated configs (the nodes kept their data in another directory), a
    # quote made them unreadable (exit 1 after every process had started); the CA path of the printed client
    # options was not quoted for the shell.
    data_dir = tmp_path / 'da"ta\\tdir'
    tls_dir = tmp_path / "tls$HOME'x"
    dev = spawn(raftmq_argv("dev", "--data-dir", str(data_dir), "--base-port", "0", "--tls-dir", str(tls_dir)),
                ready_timeout_s=120)
    assert dev.fields["tls_ca_file"] == str(tls_dir / "ca.pem")
    for nid in NODE_IDS:
        for sub in ("store", "dledger"):
            assert any((data_dir / GROUP / nid / sub).iterdir()), (nid, sub)
    assert {p.name for p in tmp_path.iterdir()} == {data_dir.name, tls_dir.name, dev.log_path.name}  # none beside
    hint = dev.wait_output("  use it: ")
    flags = re.search(r"raftmq bench produce --namesrv (\S+) (.*) --seconds 10$", hint.rstrip("\n"))
    assert flags is not None, hint
    assert shlex.split(flags.group(2)) == ["--tls", "--tls-ca-file", str(tls_dir / "ca.pem")]
    command = f"{shlex.quote(sys.executable)} -m raftmq admin --namesrv {flags.group(1)} {flags.group(2)} cluster"
    for _ in range(50):  # the nodes register with the name server on their own schedule
        listed = subprocess.run(command, shell=True, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr[-2000:]
        if GROUP in listed.stdout:
            break
        time.sleep(0.2)
    assert GROUP in listed.stdout, listed.stdout
