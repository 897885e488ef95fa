"""``page_cache_window_bytes``: after a flush, commit-log pages older than the window leave the page cache (so
new writes recycle them), the window stays cached, and everything stays readable (from disk)."""

from __future__ import annotations

import ctypes
import mmap
import os

from broker.store import MessageStore, decode_record

from .helpers import fill, small_config

_libc = ctypes.CDLL(None, use_errno=True)


def cached_pages(path) -> list[bool]:
    """Page-cache residency of each page of a file: ``mincore`` on a fresh shared mapping, which faults nothing
    in and reports the page cache's state for a file mapping."""
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as mm:
        anchor = ctypes.c_char.from_buffer(mm)
        try:
            if _libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            del anchor
    return [bool(v & 1) for v in vec]


def test_flushed_pages_behind_the_window_leave_the_page_cache_and_stay_readable(tmp_path):
    window = 64 * 1024
    with MessageStore.open(small_config(tmp_path / "s", page_cache_window_bytes=window,
                                        segment_size_bytes=1024 * 1024)) as store:
        fill(store, 120)  # ~370 KiB in the first segment
        store.dispatch_pending()
        end = store.max_phy_offset
        first = tmp_path / "s" / "commitlog" / f"{0:020d}"
        assert all(cached_pages(first)[: end // mmap.PAGESIZE])  # written, not yet flushed: all cached
        store.flush_all()
        cached = cached_pages(first)
        cold = (end - window) // mmap.PAGESIZE  # pages wholly behind the window
        assert not any(cached[:cold]), "flushed pages behind the window are still cached"
        assert all(cached[(end - window) // mmap.PAGESIZE + 1: end // mmap.PAGESIZE]), "the window was dropped"
        # Still readable: the first message comes back from disk, byte-identical to what a pull returns.
        oldest = store.get_messages("TopicTest", 0, 0, 1, 1 << 20).messages[0]
        assert decode_record(oldest).queue_offset == 0
        assert store.read_commit_log(0, len(oldest))[: len(oldest)] == bytes(oldest)


def test_zero_window_leaves_the_page_cache_alone(tmp_path):
    with MessageStore.open(small_config(tmp_path / "s", page_cache_window_bytes=0,
                                        segment_size_bytes=1024 * 1024)) as store:
        fill(store, 120)
        store.flush_all()
        end = store.max_phy_offset
        assert all(cached_pages(tmp_path / "s" / "commitlog" / f"{0:020d}")[: end // mmap.PAGESIZE])
