"""KVResizer: grow or shrink the committed KV cache between steps, keeping every request's state.

Shrink removes only the highest block ids. Live blocks at or above the new top are first copied
(every layer, K and V) into free blocks below it and the block tables rewritten; nothing is
preempted. If too few blocks are free below the new top, the shrink waits (changes nothing).
Must run at a step boundary: no model step may be reading the storage meanwhile.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Literal

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.kv_storage import KVStorage
from engine.ledger import MemoryLedger


@dataclasses.dataclass(frozen=True)
class ResizeResult:
    status: Literal["done", "waiting", "noop"]
    blocks_delta: int  # > 0 grown, < 0 shrunk
    blocks_migrated: int = 0
    seconds: float = 0.0
    message: str = ""


class KVResizer:
    def __init__(self, pool: BlockPool, storage: KVStorage, kv_manager: KVCacheManager,
                 ledger: MemoryLedger, min_blocks: int = 0):
        self.pool, self.storage, self.kv_manager, self.ledger = pool, storage, kv_manager, ledger
        self.min_blocks = min_blocks  # never shrink below one max_model_len request's worth

    def growable_blocks(self) -> int:
        """How many blocks the ledger's free bytes and the reserved address space allow now."""
        by_budget = max(0, self.ledger.free) // self.storage.block_bytes
        return min(by_budget, self.pool.max_blocks - self.pool.capacity)

    def grow(self, n: int) -> ResizeResult:
        """Commit up to n more blocks (fewer if the ledger or max_blocks say so)."""
        if n < 0:
            raise ValueError(f"grow() needs n >= 0, got {n}")
        n = min(n, self.growable_blocks())
        if n == 0:
            return ResizeResult("noop", 0, message="no room to grow (budget or max_blocks)")
        t0 = time.perf_counter()
        new_capacity = self.pool.capacity + n
        self.ledger.set_kv(new_capacity * self.storage.block_bytes)  # raises, unchanged, if over budget
        self.storage.set_capacity(new_capacity)
        self.pool.grow(n)
        self._check()
        return ResizeResult("done", n, seconds=time.perf_counter() - t0)

    def shrink(self, n: int) -> ResizeResult:
        """Give back the top n blocks, migrating live ones below the new top; 'waiting' when the
        free blocks below it are too few (nothing changed, nobody preempted)."""
        if n < 0:
            raise ValueError(f"shrink() needs n >= 0, got {n}")
        n = min(n, self.pool.capacity - self.min_blocks)
        if n <= 0:
            return ResizeResult("noop", 0, message=f"capacity is at its minimum ({self.min_blocks} blocks)")
        new_capacity = self.pool.capacity - n
        mapping = self.pool.plan_shrink(new_capacity)
        if mapping is None:
            return ResizeResult("waiting", 0, message=(
                f"{self.pool.num_used} live blocks do not fit below block {new_capacity}; retry when requests finish"))
        t0 = time.perf_counter()
        self.storage.move_blocks(mapping)
        self.kv_manager.remap(mapping)
        self.pool.apply_shrink(mapping, new_capacity)
        self.storage.set_capacity(new_capacity)
        self.ledger.set_kv(new_capacity * self.storage.block_bytes)
        self._check()
        return ResizeResult("done", -n, blocks_migrated=len(mapping), seconds=time.perf_counter() - t0)

    def _check(self) -> None:
        self.pool.check_integrity()
        self.kv_manager.check_integrity()
        self.ledger.check_integrity()
        if self.storage.capacity != self.pool.capacity:
            raise RuntimeError(f"storage capacity {self.storage.capacity} != pool capacity {self.pool.capacity}")
