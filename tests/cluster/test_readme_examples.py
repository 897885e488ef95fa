"""The README's examples run as written against `raftmq dev` (the name server's address swapped for this run's):
the first thing a newcomer copies must work, and nothing else kept it true when the API changed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.procs import raftmq_argv

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_NAMESRV = "127.0.0.1:9876"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)


def _run(code: str, namesrv: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "example.py"
    script.write_text(code.replace(DEFAULT_NAMESRV, namesrv), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env,
                          cwd=tmp_path)


def test_the_readme_examples_run_against_raftmq_dev(spawn, tmp_path):
    blocks = _python_blocks()
    assert len(blocks) >= 2 and all(DEFAULT_NAMESRV in block for block in blocks[:2]), blocks
    dev = spawn(raftmq_argv("--log-level", "WARNING", "dev", "--data-dir", str(tmp_path / "dev"), "--base-port", "0"),
                ready_timeout_s=90)
    namesrv = dev.fields["namesrv"]

    # The quick example: a send, then a push consumer from the first offset that takes it back.
    done = _run(blocks[0], namesrv, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    sent, consumed = done.stdout.strip().splitlines()
    assert re.fullmatch(r"SendStatus.SEND_OK TopicTest@broker-a:[0-9]+ [0-9]+", sent), sent
    assert consumed == "TagA b'hello'", consumed

    # The simple consumer's lines, inside a main of their own (the README shows them as a fragment): the message
    # the quick example sent, received and acked.
    fragment = blocks[1]
    program = ("import trio\nfrom client import open_simple_consumer\n\nasync def main():\n"
               + textwrap.indent(fragment, "    ") + "\ntrio.run(main)\n")
    done = _run(program, namesrv, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines() == ["b'hello'"], done.stdout
