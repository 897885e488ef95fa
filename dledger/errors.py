"""Errors of a DLedger group, in the project's one hierarchy (``remoting.errors.RaftMQError``).

``retriable``: the same append may succeed if tried again (on this member or on the new leader);
``refresh_route``: the caller should look the leader up again.
"""

from __future__ import annotations

from remoting.errors import FatalServerError, RaftMQError

__all__ = ["CommitLogMovedError", "DLedgerError", "NotLeaderError", "LeaderChangedError", "AppendTimeoutError",
           "AppendOutcomeUnknownError", "GroupBusyError", "RecordTooLargeError", "PreparedEntryTooLargeError",
           "BatchRejectedError", "LogMismatchError", "MembershipChangeError", "MemberDivergedError",
           "MemberFellBehindError", "MemberStoreError", "TransferLeadershipError"]


class DLedgerError(RaftMQError):
    retriable = False
    refresh_route = False


class NotLeaderError(DLedgerError):
    retriable = True
    refresh_route = True

    def __init__(self, group: str, leader_id: str | None, leader_service_address: str | None, *,
                 why: str | None = None) -> None:
        where = f"member {leader_id} ({leader_service_address})" if leader_id else "no member yet"
        because = f" ({why})" if why else ""
        super().__init__(f"This member is not the leader of group {group}{because}; the leader is {where}.")
        self.group = group
        self.leader_id = leader_id
        self.leader_addr = leader_service_address


class LeaderChangedError(DLedgerError):
    """The entry was not committed in the term it was proposed in; it will never be applied."""

    retriable = True
    refresh_route = True

    def __init__(self, group: str, reason: str) -> None:
        super().__init__(f"The append to group {group} was not committed ({reason}); it was not applied.")
        self.group = group
        self.reason = reason


class AppendTimeoutError(DLedgerError):
    """The outcome is unknown: the entry may still commit later."""

    retriable = True

    def __init__(self, group: str, timeout_s: float) -> None:
        super().__init__(f"The append to group {group} was not confirmed within {timeout_s:g} s; "
                         f"it may or may not be committed.")
        self.group = group
        self.timeout_s = timeout_s


class AppendOutcomeUnknownError(AppendTimeoutError):
    """A snapshot overtook the entry before its commit was seen here: it may or may not be applied, as after a
    timeout (dledger/patches.py, 16)."""

    def __init__(self, group: str) -> None:
        DLedgerError.__init__(self, f"The append to group {group} was overtaken by a snapshot before its commit "
                                    f"was seen on this member; it may or may not be committed.")
        self.group = group
        self.timeout_s = 0.0  # no timeout ran out: the snapshot arrived first


class GroupBusyError(DLedgerError):
    """The record was refused or dropped before it was proposed: it is not in the log and never will be, so
    sending it again cannot make a duplicate."""

    retriable = True

    def __init__(self, group: str, why: str) -> None:
        super().__init__(f"Group {group} is busy: {why}; the record was not stored.")
        self.group = group


class RecordTooLargeError(DLedgerError):
    def __init__(self, size: int, max_size: int) -> None:
        super().__init__(f"A record of {size} bytes does not fit in one DLedger entry (max {max_size} bytes).")
        self.size = size
        self.max_size = max_size


class PreparedEntryTooLargeError(RecordTooLargeError):
    """A record within ``max_record_bytes`` that the state machine's ``prepare_batch`` made into an entry past
    ``max_entry_bytes`` (the message store adds a queue unit and an index entry per key to each message): proposed
    alone, so it can never fit and must not be sent again as it is. Nothing was proposed."""

    def __init__(self, group: str, size: int, entry_size: int, max_entry_bytes: int) -> None:
        DLedgerError.__init__(self, f"A record of {size} bytes makes a DLedger entry of {entry_size} bytes once "
                                    f"prepared, more than group {group}'s max_entry_bytes {max_entry_bytes}; "
                                    f"it was not stored.")
        self.group = group
        self.size = size
        self.entry_size = entry_size
        self.max_size = max_entry_bytes


class BatchRejectedError(DLedgerError):
    """The state machine refused the batch (it was planned against an offset the log never reached)."""

    retriable = True

    def __init__(self, group: str, status: str, expected_start_offset: int, end_offset: int) -> None:
        super().__init__(f"Group {group} {status.lower()} a batch planned at offset {expected_start_offset} "
                         f"while the commit log ends at {end_offset}; nothing was written.")
        self.group = group
        self.status = status
        self.expected_start_offset = expected_start_offset
        self.end_offset = end_offset


class MembershipChangeError(DLedgerError):
    def __init__(self, group: str, action: str, member_id: str, reason: str) -> None:
        super().__init__(f"Could not {action} member {member_id} of group {group}: {reason}.")
        self.group = group
        self.member_id = member_id
        self.reason = reason


class TransferLeadershipError(DLedgerError):
    retriable = True

    def __init__(self, group: str, target: str | None, reason: str, *, retriable: bool = True) -> None:
        super().__init__(f"Leadership of group {group} was not transferred to {target or 'any member'}: {reason}.")
        self.group = group
        self.target = target
        self.reason = reason
        self.retriable = retriable  # False when the target is the leader or no member: asking again cannot help


def _rebuild_remedy(what_follows: str) -> str:
    """The remedy both fatal member errors give, with what the empty member then does."""
    return (f"To rejoin, stop it, move both its Raft data directory and its commit-log store aside and start it "
            f"empty: {what_follows} (docs/operations.md, 'Rebuilding a member').")


class MemberDivergedError(DLedgerError, FatalServerError):
    """This member's commit log differs from the group's: the bytes a peer sent to catch it up do not continue
    its own. Serving reads or voting on would spread a log nobody acknowledged, so the member stops."""

    def __init__(self, group: str, member_id: str, offset: int, reason: str) -> None:
        super().__init__(
            f"member {member_id} of group {group} has diverged from the group at commit-log offset {offset} "
            f"({reason}). It stops rather than serve a commit log the group never committed. "
            + _rebuild_remedy("it copies the group's log from a peer"))
        self.group = group
        self.member_id = member_id
        self.offset = offset
        self.reason = reason


class LogMismatchError(DLedgerError):
    """Raised by a state machine's ``apply_batch``: what its log holds of a committed entry's range (replayed
    after a restart) differs from the entry's bytes. The member turns it into ``MemberDivergedError``."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"log mismatch at offset {offset}: {reason}")
        self.offset = offset
        self.reason = reason


class MemberFellBehindError(DLedgerError, FatalServerError):
    """This member needs commit-log bytes its peers no longer have: retention deleted them while it was away."""

    def __init__(self, group: str, member_id: str, offset: int, peer_min_offset: int) -> None:
        super().__init__(
            f"member {member_id} of group {group} needs the commit log from offset {offset}, but its peers keep "
            f"it only from offset {peer_min_offset} (retention deleted the older segments while it was away). "
            + _rebuild_remedy("it starts its commit log at a peer's min offset"))
        self.group = group
        self.member_id = member_id
        self.offset = offset
        self.peer_min_offset = peer_min_offset


class CommitLogMovedError(DLedgerError):
    """A peer no longer keeps the commit log from the offset a catching-up member asked for: it begins at
    ``min_offset`` (retention). What the member does depends on whether it is empty (``dledger.catch_up``).
    ``state`` is the peer's state machine's ``start_state(min_offset)``, what an empty member starting its log
    there passes to ``start_at``; None from a peer that sends none (an older version)."""

    def __init__(self, peer_id: str, offset: int, min_offset: int, end_offset: int, *,
                 state: bytes | None = None) -> None:
        super().__init__(f"member {peer_id} keeps the commit log only from offset {min_offset}, not from {offset}")
        self.peer_id = peer_id
        self.offset = offset
        self.min_offset = min_offset
        self.end_offset = end_offset
        self.state = state


class MemberStoreError(DLedgerError, FatalServerError):
    """This member could not write what the group gave it: its state machine failed to apply a committed entry,
    copied bytes could not be written, or its Raft journal could not grow (a full disk, an I/O error). Retrying
    on every tick, or skipping the entry, would leave it out of step with the group's log, so it stops."""

    def __init__(self, group: str, member_id: str, action: str, error: BaseException) -> None:
        super().__init__(
            f"member {member_id} of group {group} could not {action}: {error}. It stops rather than fall out of "
            f"step with the group's log. Once the cause is gone (a full disk: free space on it), start it again: "
            f"it recovers its store and Raft log and the group brings it up to date.")
        self.group = group
        self.member_id = member_id
        self.action = action
        self.error = error
