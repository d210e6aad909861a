"""BlockPool: the only owner of KV block ids, which of them are in use, the free list and the capacity.

Block ids index the block-major KV storage directly, so the pool decides where memory lives:

    id:   0        1 ...                       capacity-1 | capacity ...          max_blocks-1
          [ committed: backed by memory, allocatable   ]  [ reserved address space, not resident ]
          ^ live blocks packed low (lowest free id first)

- allocate() hands out the lowest free ids, so live blocks cluster at the bottom and a shrink
  (which only ever removes the top ids) rarely needs to migrate anything.
- grow(n) makes ids [capacity, capacity + n) free; shrink moves live ids at or above the new top
  into free ids below it (plan_shrink / apply_shrink) and then drops the top.

`None` from allocate/plan_shrink means "cannot, now" (the caller waits or preempts); caller bugs
(double free, unknown id, a mapping that does not fit) raise ValueError.
"""
from __future__ import annotations

import heapq


class BlockPool:
    def __init__(self, capacity: int, max_blocks: int):
        if not 0 <= capacity <= max_blocks:
            raise ValueError(f"need 0 <= capacity ({capacity}) <= max_blocks ({max_blocks})")
        self.capacity = capacity
        self.max_blocks = max_blocks
        self._free_heap: list[int] = list(range(capacity))  # sorted -> already a heap
        self._free_set: set[int] = set(self._free_heap)
        # Ids in use. Each has one owner (no prefix sharing yet, so no reference counts).
        self._used: set[int] = set()

    # -- figures -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free_set)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def used_ids(self) -> list[int]:
        return sorted(self._used)

    # -- allocation --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, lowest ids first; None when fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free_set):
            return None
        ids = [heapq.heappop(self._free_heap) for _ in range(n)]
        for i in ids:
            self._free_set.remove(i)
            self._used.add(i)
        return ids

    def free(self, ids: list[int]) -> None:
        """Return blocks to the free list."""
        if len(set(ids)) != len(ids):
            raise ValueError(f"free() got duplicate block ids {ids}")
        for i in ids:
            if i not in self._used:
                kind = "free already (double free)" if i in self._free_set else "unknown"
                raise ValueError(f"block {i} is {kind}")
        for i in ids:
            self._used.remove(i)
            self._free_set.add(i)
            heapq.heappush(self._free_heap, i)

    # -- capacity ----------------------------------------------------------------------------
    def grow(self, n: int) -> None:
        """Ids [capacity, capacity + n) become free."""
        if n < 0 or self.capacity + n > self.max_blocks:
            raise ValueError(f"cannot grow by {n}: capacity {self.capacity}, max_blocks {self.max_blocks}")
        new_ids = range(self.capacity, self.capacity + n)
        self._free_set.update(new_ids)
        for i in new_ids:
            heapq.heappush(self._free_heap, i)
        self.capacity += n

    def plan_shrink(self, new_capacity: int) -> dict[int, int] | None:
        """Where each live block at or above `new_capacity` would move: {old_id: new_id}, the lowest
        free ids first. None when there are not enough free blocks below the new top."""
        if not 0 <= new_capacity <= self.capacity:
            raise ValueError(f"cannot shrink capacity {self.capacity} to {new_capacity}")
        movers = sorted(i for i in self._used if i >= new_capacity)
        if self.num_used > new_capacity:
            return None
        targets = heapq.nsmallest(len(movers), (i for i in self._free_set if i < new_capacity))
        if len(targets) < len(movers):
            return None
        return dict(zip(movers, targets))

    def apply_shrink(self, mapping: dict[int, int], new_capacity: int) -> None:
        """Commit a plan from plan_shrink (after the caller copied the data and rewrote tables)."""
        expected = {i for i in self._used if i >= new_capacity}
        if set(mapping) != expected:
            raise ValueError(f"shrink mapping must move exactly the live blocks >= {new_capacity}: {sorted(expected)}")
        targets = list(mapping.values())
        if len(set(targets)) != len(targets) or any(t >= new_capacity or t not in self._free_set for t in targets):
            raise ValueError(f"shrink targets {targets} must be distinct free ids below {new_capacity}")
        for old, new in mapping.items():
            self._used.remove(old)
            self._used.add(new)
        self._free_set = {i for i in self._free_set if i < new_capacity} - set(targets)
        self._free_heap = sorted(self._free_set)
        self.capacity = new_capacity

    # -- invariants --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        problems = []
        if self.num_free + self.num_used != self.capacity:
            problems.append(f"free {self.num_free} + used {self.num_used} != capacity {self.capacity}")
        if self._free_set & self._used:
            problems.append(f"ids both free and used: {sorted(self._free_set & self._used)}")
        if len(self._free_heap) != len(self._free_set) or set(self._free_heap) != self._free_set:
            problems.append("free heap and free set disagree")
        out_of_range = [i for i in (*self._free_set, *self._used) if not 0 <= i < self.capacity]
        if out_of_range:
            problems.append(f"ids outside [0, {self.capacity}): {sorted(out_of_range)}")
        if self.capacity > self.max_blocks:
            problems.append(f"capacity {self.capacity} > max_blocks {self.max_blocks}")
        if problems:
            raise RuntimeError("BlockPool integrity violated: " + "; ".join(problems))
