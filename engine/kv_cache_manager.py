"""KVCacheManager: request -> block table. The only owner of block tables; block ids come from
the BlockPool, which it never bypasses."""
from __future__ import annotations

from engine.block_pool import BlockPool


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self._tables: dict[str, list[int]] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request_id: str, num_total_tokens: int) -> int:
        have = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_for(num_total_tokens) - have)

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Grow the request's table to cover `num_total_tokens` positions; False (nothing changed)
        when the pool has too few free blocks."""
        need = self.num_new_blocks(request_id, num_total_tokens)
        if need == 0:
            self._tables.setdefault(request_id, [])
            return True
        ids = self.pool.allocate(need)
        if ids is None:
            return False
        self._tables.setdefault(request_id, []).extend(ids)
        return True

    def free(self, request_id: str) -> None:
        """Return every block of the request (a no-op for a request that holds none)."""
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(table)

    def block_table(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._tables.get(request_id, ()))

    def remap(self, mapping: dict[int, int]) -> None:
        """Rewrite every table after a shrink moved blocks old_id -> new_id."""
        if not mapping:
            return
        for table in self._tables.values():
            for pos, block in enumerate(table):
                table[pos] = mapping.get(block, block)

    # -- figures -----------------------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.capacity if self.pool.capacity else 1.0

    def check_integrity(self) -> None:
        held = [b for t in self._tables.values() for b in t]
        if sorted(held) != self.pool.used_ids() or len(set(held)) != len(held):
            raise RuntimeError("block tables and the pool's used blocks disagree")
