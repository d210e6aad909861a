"""release_free_heap: freed heap pages held by glibc go back to the OS (the replica's idle RSS)."""
import ctypes.util
import os
import sys

import pytest

from engine.heap import release_free_heap


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                    reason="glibc's malloc_trim and /proc are Linux-only")
def test_freed_heap_is_returned_at_idle():
    # 100 KB blocks: below glibc's mmap threshold, so they come from the heap. The last one stays
    # allocated and pins the top of the heap, so free() alone cannot give the rest back.
    blocks = [bytearray(100_000) for _ in range(1500)]
    for b in blocks:
        b[::4096] = b"x" * len(b[::4096])  # touch every page: resident
    keep = blocks.pop()
    before = _rss()
    del blocks
    held = _rss()
    assert held > before - 50_000_000  # free() kept most of the ~150 MB resident
    release_free_heap()
    assert _rss() < held - 100_000_000
    assert keep[0] == ord("x")
