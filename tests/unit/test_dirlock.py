"""remoting.dirlock: one holder per directory and lock file, released by release() or by the holder's exit."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from remoting.config import ConfigError
from remoting.dirlock import DirectoryInUseError, DirectoryLock


def test_a_second_holder_is_refused_naming_the_first_and_the_lock_frees_on_release(tmp_path):
    first = DirectoryLock(tmp_path / "store", "store_dir")
    with pytest.raises(DirectoryInUseError, match=rf"store_dir '.*store' is in use by another process "
                                                  rf"\(pid {os.getpid()}\)") as e:
        DirectoryLock(tmp_path / "store", "store_dir")
    assert isinstance(e.value, ConfigError)  # the CLI's one line and exit 2
    other = DirectoryLock(tmp_path / "store", "the Raft data directory", "raft.lock")  # its own file
    first.release()
    first.release()  # idempotent
    DirectoryLock(tmp_path / "store", "store_dir").release()
    other.release()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    code = ("import sys, time; from pathlib import Path; from remoting.dirlock import DirectoryLock; "
            "DirectoryLock(Path(sys.argv[1]), 'store_dir'); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryInUseError, match=f"pid {holder.pid}"):
            DirectoryLock(tmp_path, "store_dir")
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdout.close()
    DirectoryLock(tmp_path, "store_dir").release()


@pytest.mark.parametrize("where", ["store", "store/deeper"])
def test_a_file_in_the_way_is_named_with_the_key(tmp_path, where):
    # mkdir's FileExistsError / NotADirectoryError came out as "could not start: [Errno 17] File exists: ...".
    (tmp_path / "store").write_text("not a directory")
    named = re.escape(f"store_dir '{tmp_path / where}' is not a directory: a file is in the way")
    with pytest.raises(ConfigError, match=f"^{named}$"):
        DirectoryLock(tmp_path / where, "store_dir")
