"""One process builds a cache entry (a converted model, a host store) while the others wait for it.

Ray Serve starts replicas at the same time; each would otherwise convert the same GGUF or build the
same host store into the same folder. The builder holds a file lock; the waiters find the finished
entry when they get the lock. Failures become ModelLoadError with what to do about them.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

from engine.errors import ModelLoadError

BUILD_LOCK_TIMEOUT_S = 1800.0  # a big model on a slow disk; beyond this something is stuck


@contextlib.contextmanager
def exclusive_build(folder: Path, lock_name: str, what: str) -> Iterator[None]:
    """Hold `folder/lock_name` while building `what` under `folder` (created if missing)."""
    lock_path = folder / lock_name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock_path), timeout=BUILD_LOCK_TIMEOUT_S):
            yield
    except Timeout:
        raise ModelLoadError(f"waited {BUILD_LOCK_TIMEOUT_S:.0f}s for another process building {what}; "
                             f"if none is running, delete {lock_path}") from None
    except PermissionError as e:
        raise ModelLoadError(f"cannot write {what} under {folder} ({e}); set cache_dir "
                             f"(or $MORPHSERVE_CACHE) to a writable folder") from e
