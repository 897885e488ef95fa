"""DLedger on pysyncobj: one Raft group per broker name, replicating a byte log (the commit log).

Only this package imports pysyncobj (``dledger.patches`` contains its defects). The message store is plugged in
as a ``StateMachine``; this package knows bytes, offsets and Raft indexes, not messages.
"""

from dledger.byte_log import ByteLog
from dledger.config import DLedgerConfig, MemberAddress, build_syncobj_conf
from dledger.entry import Entry, EntryError, EntryTooLargeError, decode_entry, encode_entry
from dledger.errors import (AppendOutcomeUnknownError, AppendTimeoutError, BatchRejectedError, DLedgerError,
                            GroupBusyError, LeaderChangedError, LogMismatchError, MemberDivergedError,
                            MemberFellBehindError, MembershipChangeError, MemberStoreError, NotLeaderError,
                            RecordTooLargeError, TransferLeadershipError)
from dledger.group import (AppendResult, DLedgerGroup, DLedgerStatistics, FetchRange, Role, RoleChange,
                           open_dledger_group)
from dledger.state_machine import ApplyStatus, BatchResult, PreparedBatch, StateMachine

__all__ = [
    "AppendOutcomeUnknownError", "AppendResult", "AppendTimeoutError", "ApplyStatus", "BatchRejectedError",
    "BatchResult", "ByteLog", "DLedgerConfig", "DLedgerError", "DLedgerGroup", "DLedgerStatistics", "Entry",
    "EntryError", "EntryTooLargeError", "FetchRange", "GroupBusyError", "LeaderChangedError", "LogMismatchError",
    "MemberAddress", "MemberDivergedError", "MemberFellBehindError", "MemberStoreError", "MembershipChangeError",
    "NotLeaderError", "PreparedBatch", "RecordTooLargeError", "Role", "RoleChange", "StateMachine",
    "TransferLeadershipError",
    "build_syncobj_conf", "decode_entry", "encode_entry", "open_dledger_group",
]
