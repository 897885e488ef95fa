"""Errors of the message store. Statuses (``AppendStatus``, ``GetMessageStatus``) report expected outcomes; these
exceptions report a store that cannot be used as it is."""

from __future__ import annotations

from remoting.errors import RaftMQError

__all__ = ["StoreError", "StoreCorruptedError", "StoreClosedError"]


class StoreError(RaftMQError):
    """The message store cannot do what was asked."""


class StoreCorruptedError(StoreError):
    """Store files are inconsistent in a way recovery must not guess about (missing segments, changed sizes)."""


class StoreClosedError(StoreError):
    """The store was closed."""
