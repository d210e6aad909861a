"""Give freed heap memory back to the OS (glibc's malloc_trim), called when an engine goes idle.

Why: a decode batch allocates activation tensors of many sizes. glibc raises its mmap threshold
after freeing a large mmapped block (up to 32 MiB on 64-bit), so later tensors of those sizes come
from the heap arenas, and freed arena memory stays resident: the replica's RSS climbs with every
new batch shape and does not come back at idle. malloc_trim(0) returns the free pages of every
arena. Elsewhere (musl, macOS) there is nothing to call and this is a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Return free heap pages to the OS; True when something was released."""
    trim = _malloc_trim()
    if trim is None:
        return False
    try:
        return bool(trim(0))
    except Exception:  # noqa: BLE001 - a best-effort hint, never a reason to fail
        logger.debug("malloc_trim failed", exc_info=True)
        return False
