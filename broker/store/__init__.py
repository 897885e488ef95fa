"""The message store (design §3): CommitLog, ConsumeQueue, IndexFile, recovery, flush, retention.

``MessageStore.open(StoreConfig(...))`` recovers and returns a store; ``append_batch`` appends a batch made by
``encode_batch`` deterministically; ``serve`` runs the background services. Layouts: ``docs/store-format.md``.
"""

from remoting.message import (MessageFormatError, MessageInput, MessageView, create_msg_id, decode_batch,
                              decode_record, encode_batch, iter_records, parse_msg_id, tags_code, validate_batch)

from .config import StoreConfig
from .errors import StoreClosedError, StoreCorruptedError, StoreError
from .message_store import MessageStore
from .results import (AppendedMessage, AppendResult, AppendStatus, GetMessageResult, GetMessageStatus,
                      QueryMessageResult, StoreStatistics)

__all__ = [
    "AppendResult", "AppendStatus", "AppendedMessage", "GetMessageResult", "GetMessageStatus", "MessageFormatError",
    "MessageInput", "MessageStore", "MessageView", "QueryMessageResult", "StoreClosedError", "StoreConfig",
    "StoreCorruptedError", "StoreError", "StoreStatistics", "create_msg_id", "decode_batch", "decode_record",
    "encode_batch", "iter_records", "parse_msg_id", "tags_code", "validate_batch",
]
