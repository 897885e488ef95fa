"""What store calls return: statuses with RocketMQ's names, and small result objects built without
per-message objects unless a caller asks for them."""

from __future__ import annotations

import dataclasses
import enum
from functools import cached_property
from typing import NamedTuple

from remoting.message import MessageView, create_msg_ids

__all__ = ["AppendStatus", "AppendResult", "AppendedMessage", "GetMessageStatus", "GetMessageResult",
           "QueryMessageResult", "StoreStatistics"]


class AppendStatus(enum.Enum):
    PUT_OK = "PUT_OK"
    DUPLICATE = "DUPLICATE"  # expected_phy_offset is behind the end: this batch was applied before; skipped
    OFFSET_MISMATCH = "OFFSET_MISMATCH"  # expected_phy_offset is ahead of the end: a batch is missing; rejected
    MESSAGE_ILLEGAL = "MESSAGE_ILLEGAL"  # bad topic, oversize body, malformed batch
    PROPERTIES_SIZE_EXCEEDED = "PROPERTIES_SIZE_EXCEEDED"
    DISK_FULL = "DISK_FULL"  # disk usage passed disk_reject_ratio
    CORRUPTED = "CORRUPTED"  # a raw copy failed its checks, or the log holds other bytes where a build goes


class AppendedMessage(NamedTuple):
    msg_id: str
    queue_id: int
    queue_offset: int
    phy_offset: int
    size: int


@dataclasses.dataclass(frozen=True, eq=False)
class AppendResult:
    """``status`` plus, for PUT_OK, per-message columns; ``messages`` builds one tuple per message on demand."""

    status: AppendStatus
    start_phy_offset: int
    end_phy_offset: int
    store_host: tuple[str, int] = ("0.0.0.0", 0)
    phy_offsets: list[int] = dataclasses.field(default_factory=list)
    queue_offsets: list[int] = dataclasses.field(default_factory=list)
    sizes: list[int] = dataclasses.field(default_factory=list)
    queue_ids: list[int] = dataclasses.field(default_factory=list)
    remark: str = ""
    field: str = ""

    @property
    def ok(self) -> bool:
        return self.status is AppendStatus.PUT_OK

    @cached_property
    def messages(self) -> list[AppendedMessage]:
        return list(map(AppendedMessage, create_msg_ids(self.store_host, self.phy_offsets), self.queue_ids,
                        self.queue_offsets, self.phy_offsets, self.sizes))


class GetMessageStatus(enum.Enum):
    FOUND = "FOUND"
    NO_MATCHED_MESSAGE = "NO_MATCHED_MESSAGE"  # units were read but the tag filter matched none of them
    MESSAGE_WAS_REMOVING = "MESSAGE_WAS_REMOVING"  # the units point into deleted commit-log segments
    OFFSET_FOUND_NULL = "OFFSET_FOUND_NULL"  # the ConsumeQueue file holding the offset is gone
    OFFSET_OVERFLOW_BADLY = "OFFSET_OVERFLOW_BADLY"  # offset > max offset
    OFFSET_OVERFLOW_ONE = "OFFSET_OVERFLOW_ONE"  # offset == max offset: nothing new yet
    OFFSET_TOO_SMALL = "OFFSET_TOO_SMALL"  # offset < min offset
    NO_MATCHED_LOGIC_QUEUE = "NO_MATCHED_LOGIC_QUEUE"  # no such topic/queue
    NO_MESSAGE_IN_QUEUE = "NO_MESSAGE_IN_QUEUE"  # the queue exists but is empty


@dataclasses.dataclass(eq=False)
class GetMessageResult:
    """``messages`` are zero-copy views of raw commit-log records (send them as they are); ``queue_offsets``
    the queue offset of each."""

    status: GetMessageStatus
    next_begin_offset: int
    min_offset: int
    max_offset: int
    messages: list[memoryview] = dataclasses.field(default_factory=list)
    queue_offsets: list[int] = dataclasses.field(default_factory=list)
    buffer_total_size: int = 0

    @property
    def message_count(self) -> int:
        return len(self.messages)


@dataclasses.dataclass(frozen=True)
class QueryMessageResult:
    messages: list[MessageView]
    index_last_update_timestamp: int
    index_last_update_phy_offset: int


@dataclasses.dataclass(frozen=True)
class StoreStatistics:
    min_phy_offset: int
    max_phy_offset: int
    flushed_phy_offset: int
    dispatched_phy_offset: int
    consume_queues: int
    index_files: int
    disk_usage_ratio: float
    disk_full: bool
