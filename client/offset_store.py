"""Consume offsets: where a consumer group resumes each queue.

Clustering consumers keep offsets on the broker group (replicated through Raft, so a new leader knows them):
``RemoteOffsetStore`` caches them in memory, marks them dirty on progress, and ``persist_all`` sends the dirty
ones with UPDATE_CONSUMER_OFFSET. Broadcasting consumers keep them locally in a JSON file
(``LocalFileOffsetStore``), written atomically (tmp + rename). Both only ever hold offsets of messages that
were fully processed, so a crash replays (duplicates), never skips.

A local file is one member's alone: each write replaces it whole with the writer's offsets, so a second writer
(another process with the same group, instance_name and directory) left a file whose offsets the first member, on
its next start, took as its own and skipped what it never handled. ``lock()`` holds the file for one store until
``close()`` through an ``flock`` on ``<file>.lock`` beside it (``remoting.dirlock``), not on the file itself: a
write renames a new file into its place, and a lock on the old one would not be seen by the next opener.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from client.message import I64_MAX, MessageQueue, check_int_arg, check_queue
from remoting.dirlock import DirectoryInUseError, DirectoryLock

__all__ = ["OffsetStore", "RemoteOffsetStore", "LocalFileOffsetStore"]

log = logging.getLogger(__name__)


class OffsetStore:
    """Offsets in memory with dirty tracking; subclasses load and persist them."""

    def __init__(self) -> None:
        self._offsets: dict[MessageQueue, int] = {}
        self._dirty: set[MessageQueue] = set()

    def update(self, mq: MessageQueue, offset: int, *, increase_only: bool = False) -> None:
        if offset < 0:
            raise ValueError(f"consume offset of {mq} must be >= 0, got {offset}")
        old = self._offsets.get(mq)
        if increase_only and old is not None and offset <= old:
            return
        if old != offset:
            self._offsets[mq] = offset
            self._dirty.add(mq)

    def read_cached(self, mq: MessageQueue) -> int | None:
        return self._offsets.get(mq)

    def remove(self, mq: MessageQueue) -> None:
        self._offsets.pop(mq, None)
        self._dirty.discard(mq)

    def dirty(self) -> dict[MessageQueue, int]:
        return {mq: self._offsets[mq] for mq in self._dirty if mq in self._offsets}

    def mark_clean(self, mq: MessageQueue, offset: int) -> None:
        if self._offsets.get(mq) == offset:
            self._dirty.discard(mq)

    def snapshot(self) -> dict[MessageQueue, int]:
        return dict(self._offsets)


class RemoteOffsetStore(OffsetStore):
    """``fetch(mq) -> int | None`` and ``commit(mq, offset)`` talk to the broker group; injected by the
    consumer so this class needs no sockets."""

    def __init__(self, fetch: Callable[[MessageQueue], Awaitable[int | None]],
                 commit: Callable[[MessageQueue, int], Awaitable[None]]) -> None:
        super().__init__()
        self._fetch = fetch
        self._commit = commit

    async def read_from_store(self, mq: MessageQueue) -> int | None:
        """The broker's committed offset (None if the group never committed this queue); caches it."""
        offset = await self._fetch(mq)
        if offset is not None and offset >= 0:
            self._offsets[mq] = offset
            self._dirty.discard(mq)
            return offset
        return None

    async def persist(self, mq: MessageQueue) -> bool:
        offset = self._offsets.get(mq)
        if offset is None:
            return True
        try:
            await self._commit(mq, offset)
        except Exception as e:  # noqa: BLE001 - a failed commit is retried on the next persist
            log.info("offset commit failed mq=%s offset=%d error=%s", mq, offset, e)
            return False
        self.mark_clean(mq, offset)
        return True

    async def persist_all(self, queues: Iterable[MessageQueue] | None = None) -> int:
        """Commit every dirty offset (of ``queues`` if given); returns how many failed."""
        wanted = None if queues is None else set(queues)
        failed = 0
        for mq in list(self.dirty()):
            if wanted is None or mq in wanted:
                failed += not await self.persist(mq)
        return failed


class LocalFileOffsetStore(OffsetStore):
    """Offsets in one JSON file, for broadcasting consumers (each member tracks every queue itself); between
    ``lock()`` and ``close()`` no other store may hold it (the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        """Loads the file if it exists and creates its directory: a file or directory that cannot be used fails
        here, when the consumer opens, rather than in the first background persist."""
        super().__init__()
        self.path = Path(path)
        self._lock: DirectoryLock | None = None
        self._load()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"directory {str(self.path.parent)!r} for the offset file cannot be created: {e}") \
                from None
        if not os.access(self.path.parent, os.W_OK | os.X_OK):
            raise ValueError(f"directory {str(self.path.parent)!r} for the offset file is not writable")

    def _load(self) -> None:
        """Every entry checked as the consumer would use it: an offset of -5 was taken, and the first pull of its
        queue then raised inside the consumer's task and took the consumer down with an error naming no file."""
        self._offsets.clear()
        self._dirty.clear()
        if not self.path.exists():
            return
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or not isinstance(data.get("offsets"), list):
                raise ValueError("it must be an object whose \"offsets\" is a list")
            for entry in data["offsets"]:
                if not isinstance(entry, dict):
                    raise ValueError(f"entry {entry!r} must be an object")
                mq = check_queue("entry", MessageQueue(entry["topic"], entry["broker_name"], entry["queue_id"]))
                try:
                    check_int_arg("offset", entry["offset"], 0, I64_MAX)
                except ValueError as e:
                    raise ValueError(f"entry {mq!r}: {e}") from None
                self._offsets[mq] = entry["offset"]
        except KeyError as e:
            raise ValueError(f"offset file {str(self.path)!r} is malformed: an entry has no {e}") from None
        except ValueError as e:  # json.JSONDecodeError is one
            raise ValueError(f"offset file {str(self.path)!r} is malformed: {e}") from None
        except OSError as e:
            raise ValueError(f"offset file {str(self.path)!r} cannot be read: {e}") from None

    def lock(self) -> None:
        """Holds the file for this store alone until ``close()``, and loads it again under the lock (a holder that
        closed meanwhile wrote its last offsets after this store first read them; so it is called before any
        ``update``). ``DirectoryInUseError`` naming the file if another store holds it, in this process or another;
        a holder killed has released it."""
        if self._lock is not None:
            return
        lock_name = self.path.name + ".lock"
        try:
            self._lock = DirectoryLock(self.path.parent, "offset_store_dir", lock_name)
        except DirectoryInUseError:
            holder = ""
            with contextlib.suppress(OSError):  # the holder's pid, which DirectoryLock writes in it
                holder = (self.path.parent / lock_name).read_text(encoding="ascii", errors="replace").strip()
            raise DirectoryInUseError(f"offset file {str(self.path)!r} is held by another consumer (process "
                                      f"{holder or 'unknown'}, lock file {lock_name!r})") from None
        except OSError as e:
            raise ValueError(f"lock file {lock_name!r} of offset file {str(self.path)!r} cannot be opened: {e}") \
                from None
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Lets the file go (idempotent); the consumer has persisted its offsets before."""
        if self._lock is not None:
            lock, self._lock = self._lock, None
            lock.release()

    async def read_from_store(self, mq: MessageQueue) -> int | None:
        return self._offsets.get(mq)

    async def persist(self, mq: MessageQueue) -> bool:
        """Write ``mq``'s offset now (the file holds every queue, so this writes the file if anything is dirty);
        False if it could not be written."""
        return not await self.persist_all([mq])

    async def persist_all(self, queues: Iterable[MessageQueue] | None = None) -> int:
        if not self._dirty:
            return 0
        entries = [{"topic": mq.topic, "broker_name": mq.broker_name, "queue_id": mq.queue_id, "offset": off}
                   for mq, off in sorted(self._offsets.items())]
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"offsets": entries}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            # Like a failed remote commit: kept dirty and written on the next persist (a full disk, a directory
            # removed under us); raising here took the whole consumer down from its persist task.
            log.warning("offset file not written path=%s error=%s", self.path, e)
            return len(self._dirty)
        self._dirty.clear()
        return 0
