"""``StoreConfig``: every knob of the message store, with RocketMQ's defaults where one exists."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from remoting.config import ConfigError, bounded, check_fields
from remoting.message import DEFAULT_MAX_MESSAGE_SIZE, MAX_PROPERTIES_SIZE, MAX_TOPIC_LENGTH, record_size

__all__ = ["StoreConfig", "END_FILE_MIN_BLANK_LENGTH"]

# A record is placed in a segment only if at least this many bytes stay free behind it, so the segment can
# always be closed with a blank header (total_size + magic), as RocketMQ's END_FILE_MIN_BLANK_LENGTH.
END_FILE_MIN_BLANK_LENGTH = 8


def _hours(value: tuple[int, ...]) -> str | None:
    if any(not 0 <= h <= 23 for h in value):
        return "must list hours within 0..23"
    if not value:
        # No hour ever matched: segments past file_reserved_hours stayed until the disk was 75 % full.
        return "must list at least one hour (every hour: 0 to 23)"
    return None


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    store_dir: Path = bounded(Path("store"), doc="directory holding commitlog/, consumequeue/, index/, checkpoint")
    segment_size_bytes: int = bounded(1024 ** 3, min=64 * 1024, max=2 ** 40, doc="commit-log segment size")
    consume_queue_units_per_file: int = bounded(300_000, min=16, max=50_000_000,
                                                doc="20-byte units per ConsumeQueue file")
    flush_disk_type: Literal["ASYNC_FLUSH", "SYNC_FLUSH"] = bounded("ASYNC_FLUSH")
    flush_interval_ms: int = bounded(500, min=1, max=3_600_000, doc="ASYNC_FLUSH period; SYNC_FLUSH idle period")
    flush_consume_queue_interval_ms: int = bounded(1000, min=1, max=3_600_000,
                                                   doc="period of ConsumeQueue/IndexFile flush + checkpoint")
    max_message_size: int = bounded(DEFAULT_MAX_MESSAGE_SIZE, min=1, max=256 * 1024 * 1024)
    index_hash_slots: int = bounded(1_000_000, min=1, max=50_000_000, doc="hash slots per IndexFile")
    index_max_entries: int = bounded(4_000_000, min=1, max=100_000_000, doc="entries per IndexFile")
    # Ten years: retention by age is off for longer (inf was taken), and the disk ratios still delete.
    file_reserved_hours: float = bounded(72.0, min=0.0, max=87_600.0,
                                         doc="age after which a commit-log segment may go")
    delete_when_hours: tuple[int, ...] = bounded((4,), check=_hours,
                                                 doc="local hours at which expired segments are deleted")
    # The store maps every segment it holds (vm.max_map_count is 65530 by default), so it never holds more; a
    # count past that (2**64 was taken) only said, by accident, that nothing is ever deleted, not even forcibly.
    min_retained_segments: int = bounded(1, min=1, max=65_536,
                                         doc="the newest segments never deleted, expired or not")
    # A pass runs on the event loop (Raft ticks wait for it), and each deletion unmaps and unlinks a whole segment;
    # RocketMQ's deleteFileBatchMax is 10.
    delete_segments_per_pass: int = bounded(10, min=1, max=100, doc="segments one clean pass may delete")
    # The pass also refreshes the disk usage that refuses appends at disk_reject_ratio (RocketMQ's
    # cleanResourceInterval is 10 s): an hour at most, as the flush intervals; 2**64 turned cleaning off.
    clean_interval_ms: int = bounded(10_000, min=1, max=3_600_000,
                                     doc="how often the clean service looks at ages and disk")
    disk_clean_early_ratio: float = bounded(0.75, min=0.0, max=1.0,
                                            doc="disk usage from which expired segments go at any hour")
    # Floors as RocketMQ's (diskSpaceCleanForciblyRatio 0.30, diskSpaceWarningLevelRatio 0.35): at 0, a value
    # taken for "off", every pass deleted unexpired segments down to min_retained_segments, or every send was
    # refused as if the disk were full.
    disk_clean_forcibly_ratio: float = bounded(0.85, min=0.30, max=1.0,
                                               doc="disk usage from which the oldest segments go, expired or not")
    disk_reject_ratio: float = bounded(0.90, min=0.35, max=1.0, doc="disk usage from which appends are refused")
    # Both windows at most 1 TiB (the largest segment_size_bytes): one past any machine's memory only turned the
    # release off (2**64 was taken), and RSS or the page cache grew with the data stored.
    hot_window_bytes: int = bounded(64 * 1024 * 1024, min=0, max=2 ** 40,
                                    doc="mapped bytes behind the write position kept resident; older pages are "
                                        "released after each flush so RSS does not grow with the data stored")
    page_cache_window_bytes: int = bounded(256 * 1024 * 1024, min=0, max=2 ** 40,
                                           doc="flushed commit-log bytes behind the write position left in the "
                                               "page cache; older ones are dropped after each flush so the "
                                               "store recycles its page cache instead of taking fresh memory "
                                               "(0 leaves it all to the kernel)")
    # A chunk is dispatched on the event loop with no checkpoint inside: at ~100 MB/s (docs/benchmarks.md) 64 MiB
    # holds it ~0.6 s, past dledger's election timeouts; 16 MiB stays near 0.15 s.
    dispatch_chunk_bytes: int = bounded(1024 * 1024, min=4096, max=16 * 1024 * 1024,
                                        doc="commit-log bytes dispatched before the reput task yields")

    def __post_init__(self) -> None:
        check_fields(self)
        if not isinstance(self.store_dir, Path):
            object.__setattr__(self, "store_dir", Path(self.store_dir))
        largest = record_size(self.max_message_size, MAX_TOPIC_LENGTH, MAX_PROPERTIES_SIZE)
        if largest + END_FILE_MIN_BLANK_LENGTH > self.segment_size_bytes:
            raise ConfigError(f"store.segment_size_bytes must hold one record of max_message_size "
                              f"{self.max_message_size} ({largest + END_FILE_MIN_BLANK_LENGTH} bytes), "
                              f"got {self.segment_size_bytes}")
        if self.index_hash_slots > self.index_max_entries:
            # Every IndexFile holds all its slots (4 bytes each) whatever its entries: index_max_entries lowered
            # alone (1000 against 1,000,000 slots) made a 4 MB file, and one more mapping, per 1000 keys.
            raise ConfigError(f"store.index_hash_slots must be <= index_max_entries ({self.index_max_entries}): "
                              f"an IndexFile never uses more slots than entries, got {self.index_hash_slots}")
        if not self.disk_clean_early_ratio <= self.disk_clean_forcibly_ratio <= self.disk_reject_ratio:
            raise ConfigError("store disk ratios must satisfy disk_clean_early_ratio <= disk_clean_forcibly_ratio "
                              f"<= disk_reject_ratio, got {self.disk_clean_early_ratio}, "
                              f"{self.disk_clean_forcibly_ratio}, {self.disk_reject_ratio}")
