"""BlockPool: the only owner of KV block ids, which of them are in use (by how many requests), the
free list, the prefix cache's index and the capacity.

Block ids index the block-major KV storage directly, so the pool decides where memory lives:

    id:   0        1 ...                       capacity-1 | capacity ...          max_blocks-1
          [ committed: backed by memory, allocatable   ]  [ reserved address space, not resident ]
          ^ live blocks packed low (lowest free id first)

- allocate() hands out the lowest free ids, so live blocks cluster at the bottom and a shrink
  (which only ever removes the top ids) rarely needs to migrate anything.
- grow(n) makes ids [capacity, capacity + n) free; shrink moves live ids at or above the new top
  into free ids below it (plan_shrink / apply_shrink) and then drops the top.

Prefix caching (engine/prefix_hash.py gives the keys): a full block whose K/V are computed may be
registered under its digest. Requests that start with the same tokens then share it (`acquire`), so
a block has a reference count. A registered block whose count drops to 0 stays *cached*: free (it is
counted in num_free and may be allocated) but still indexed, until an allocation needs it (uncached
free ids go first, then cached ones, least recently freed first) or a shrink drops it. Each id is in
exactly one of: free, cached (free and indexed), used (count >= 1, indexed or not).

`None` from allocate/plan_shrink means "cannot, now" (the caller waits or preempts); caller bugs
(double free, unknown id, a mapping that does not fit) raise ValueError.
"""
from __future__ import annotations

import collections
import heapq


class BlockPool:
    def __init__(self, capacity: int, max_blocks: int):
        if not 0 <= capacity <= max_blocks:
            raise ValueError(f"need 0 <= capacity ({capacity}) <= max_blocks ({max_blocks})")
        self.capacity = capacity
        self.max_blocks = max_blocks
        self._free_heap: list[int] = list(range(capacity))  # free and uncached; sorted -> already a heap
        self._free_set: set[int] = set(self._free_heap)
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # free, indexed; LRU first
        self._refs: dict[int, int] = {}  # id in use -> how many requests hold it
        self._digest_of: dict[int, bytes] = {}  # indexed id -> its prefix digest
        self._block_of: dict[bytes, int] = {}  # prefix digest -> the one id indexed under it

    # -- figures -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: uncached free ones and cached ones (it evicts those)."""
        return len(self._free_set) + len(self._cached)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a cached prefix block."""
        return len(self._cached)

    def used_ids(self) -> list[int]:
        return sorted(self._refs)

    def ref_count(self, block_id: int) -> int:
        return self._refs.get(block_id, 0)

    # -- allocation --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (lowest uncached ids first, then the least recently freed cached ones, which
        leave the index); None when fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            return None
        ids = [heapq.heappop(self._free_heap) for _ in range(min(n, len(self._free_heap)))]
        self._free_set.difference_update(ids)
        while len(ids) < n:
            evicted, _ = self._cached.popitem(last=False)
            self._unindex(evicted)
            ids.append(evicted)
        for i in ids:
            self._refs[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block; a block nobody holds becomes free, or cached if indexed.
        Freed in reverse so that a request's last blocks are evicted before its first: a cached prefix
        is only of use from its head."""
        if len(set(ids)) != len(ids):
            raise ValueError(f"free() got duplicate block ids {ids}")
        for i in ids:
            if i not in self._refs:
                kind = "free already (double free)" if i in self._free_set or i in self._cached else "unknown"
                raise ValueError(f"block {i} is {kind}")
        for i in reversed(ids):
            self._refs[i] -= 1
            if self._refs[i]:
                continue
            del self._refs[i]
            if i in self._digest_of:
                self._cached[i] = None
            else:
                self._free_set.add(i)
                heapq.heappush(self._free_heap, i)

    # -- the prefix cache's index --------------------------------------------------------------
    def indexed(self, digest: bytes) -> int | None:
        """The id indexed under `digest`, if any."""
        return self._block_of.get(digest)

    def acquire(self, ids: list[int]) -> None:
        """One more reference to each indexed block (a cached one comes back into use)."""
        for i in ids:
            if i not in self._digest_of:
                raise ValueError(f"block {i} holds no cached prefix block")
        for i in ids:
            if i in self._refs:
                self._refs[i] += 1
            else:
                del self._cached[i]
                self._refs[i] = 1

    def register(self, block_id: int, digest: bytes) -> bool:
        """Index a used, fully computed block under its digest; False (nothing changes) when the digest
        is indexed already (the duplicate stays private to its request) or the block is."""
        if block_id not in self._refs:
            raise ValueError(f"block {block_id} is not in use")
        if digest in self._block_of or block_id in self._digest_of:
            return False
        self._block_of[digest] = block_id
        self._digest_of[block_id] = digest
        return True

    def _unindex(self, block_id: int) -> None:
        del self._block_of[self._digest_of.pop(block_id)]

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
        """Where each live block at or above `new_capacity` would move: {old_id: new_id}, into the lowest
        uncached free ids below it first, then cached ones (least recently freed first: they are evicted).
        None when there are not enough free blocks below the new top."""
        if not 0 <= new_capacity <= self.capacity:
            raise ValueError(f"cannot shrink capacity {self.capacity} to {new_capacity}")
        movers = sorted(i for i in self._refs if i >= new_capacity)
        if self.num_used > new_capacity:
            return None
        targets = heapq.nsmallest(len(movers), (i for i in self._free_set if i < new_capacity))
        targets += [i for i in self._cached if i < new_capacity][:len(movers) - len(targets)]
        if len(targets) < len(movers):
            return None
        return dict(zip(movers, targets))

    def apply_shrink(self, mapping: dict[int, int], new_capacity: int) -> None:
        """Commit a plan from plan_shrink (after the caller copied the data and rewrote tables). A moved
        block keeps its references and its index entry; cached blocks used as targets or at or above the
        new top leave the index."""
        expected = {i for i in self._refs if i >= new_capacity}
        if set(mapping) != expected:
            raise ValueError(f"shrink mapping must move exactly the live blocks >= {new_capacity}: {sorted(expected)}")
        targets = list(mapping.values())
        if len(set(targets)) != len(targets) or any(
                t >= new_capacity or (t not in self._free_set and t not in self._cached) for t in targets):
            raise ValueError(f"shrink targets {targets} must be distinct free ids below {new_capacity}")
        target_set = set(targets)
        for i in [i for i in self._cached if i >= new_capacity or i in target_set]:
            del self._cached[i]
            self._unindex(i)
        refs = {mapping.get(i, i): n for i, n in self._refs.items()}
        for old, new in mapping.items():
            if old in self._digest_of:
                digest = self._digest_of.pop(old)
                self._digest_of[new], self._block_of[digest] = digest, new
        self._refs = refs
        self._free_set = {i for i in self._free_set if i < new_capacity} - target_set
        self._free_heap = sorted(self._free_set)
        self.capacity = new_capacity

    # -- invariants --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        problems = []
        used, cached, free = set(self._refs), set(self._cached), self._free_set
        if len(free) + len(cached) + len(used) != self.capacity:
            problems.append(f"free {len(free)} + cached {len(cached)} + used {len(used)} != capacity {self.capacity}")
        for name, a, b in (("free and used", free, used), ("free and cached", free, cached),
                           ("cached and used", cached, used)):
            if a & b:
                problems.append(f"ids both {name}: {sorted(a & b)}")
        if any(n < 1 for n in self._refs.values()):
            problems.append(f"reference counts below 1: {sorted(i for i, n in self._refs.items() if n < 1)}")
        if len(self._free_heap) != len(free) or set(self._free_heap) != free:
            problems.append("free heap and free set disagree")
        if not cached <= set(self._digest_of) <= used | cached:
            problems.append("the index must hold every cached block and only used or cached ones")
        if {d: i for i, d in self._digest_of.items()} != self._block_of:
            problems.append("the index's two maps disagree")
        out_of_range = [i for i in (*free, *cached, *used) if not 0 <= i < self.capacity]
        if out_of_range:
            problems.append(f"ids outside [0, {self.capacity}): {sorted(out_of_range)}")
        if self.capacity > self.max_blocks:
            problems.append(f"capacity {self.capacity} > max_blocks {self.max_blocks}")
        if problems:
            raise RuntimeError("BlockPool integrity violated: " + "; ".join(problems))
