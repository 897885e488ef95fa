"""Errors of the message store. Statuses (``AppendStatus``, ``GetMessageStatus``) report expected outcomes; these
exceptions report a store that cannot be used as it is."""

from __future__ import annotations

from remoting.errors import FatalServerError, RaftMQError

__all__ = ["StoreError", "StoreCorruptedError", "StoreClosedError", "StoreIOError"]


class StoreError(RaftMQError):
    """The message store cannot do what was asked."""


class StoreCorruptedError(StoreError):
    """Store files are inconsistent in a way recovery must not guess about (missing segments, changed sizes)."""


class StoreClosedError(StoreError):
    """The store was closed."""


class StoreIOError(StoreError, FatalServerError):
    """A store file could not be written or synced: a full disk, an I/O error. The node stops rather than go on
    with indexes or a flush position its disk does not hold."""

    def __init__(self, store_dir: object, action: str, error: OSError) -> None:
        super().__init__(
            f"the message store in {store_dir} could not {action}: {error}. The node stops rather than serve "
            f"what its disk does not hold. Free space on that disk (or replace it) and start the node again: it "
            f"recovers its store from the commit log and catches up with its group.")
        self.store_dir = store_dir
        self.action = action
        self.error = error
