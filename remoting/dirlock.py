"""One process per data directory: an exclusive ``flock`` on a lock file inside it, held while the process has
the directory open (RocketMQ's store keeps a ``lock`` file for the same reason). Each user names its own file, so
a store and a Raft data directory configured as one directory do not lock each other out.

A second broker started with a running node's config used to open that node's store and Raft journal, recover
them (cutting what it took for a torn tail, rewriting the checkpoint) while the live process kept writing, and
only then fail on the taken Raft port. The lock is taken before anything in the directory is read. ``flock`` locks
belong to the open file, so the kernel drops them when the holder exits, however it exits (SIGKILL included):
there is no stale lock to clean up after a crash."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from remoting.config import ConfigError

__all__ = ["DirectoryInUseError", "DirectoryLock"]


class DirectoryInUseError(ConfigError):
    """Another process (or another open of the same store in this one) holds the directory."""


class DirectoryLock:
    """``DirectoryLock(path, what, file)`` creates ``path`` if needed and locks ``path / file``, or raises
    DirectoryInUseError naming ``what`` and the holder's pid; ``release()`` (idempotent) unlocks."""

    def __init__(self, path: Path, what: str, file: str = "lock") -> None:
        path = Path(path)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # "could not start: [Errno 17] File exists" named no key
            raise ConfigError(f"{what} {str(path)!r} is not a directory: a file is in the way") from None
        self.path = path / file
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise DirectoryInUseError(f"{what} {str(path)!r} is in use by another process (pid {holder}): two "
                                      f"processes writing one directory would corrupt it") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor of the open file releases the flock
