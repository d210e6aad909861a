"""KVCacheManager: request -> block table. The only owner of block tables and of which of a request's
blocks are registered in the prefix cache; block ids come from the BlockPool, which it never bypasses.

Prefix caching (when enabled): a request that holds no blocks may start with the cached blocks that
match its first tokens (`take_cached_prefix`; they are shared, never written: a request writes K/V
only at positions after its computed tokens, which lie past its full shared blocks). As its K/V are
computed, each newly full block is registered under its digest (`cache_computed`), so later requests,
and this one after a preemption, can share it. Digests carry `precision_tag`: EXACT when the step that
computed the block had every layer at full precision, MORPHED otherwise (set by the engine after every
morph). At full precision a request finds only EXACT blocks; morphed, for each block the EXACT one if
cached, else a MORPHED one (engine/prefix_hash.py says why).
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from engine.block_pool import BlockPool
from engine.prefix_hash import EXACT, MORPHED, block_digest, chain_digests, root


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = False):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.precision_tag = EXACT  # the tag of the blocks the steps from now on compute (prefix_hash.precision_tag)
        self._tables: dict[str, list[int]] = {}
        self._digests: dict[str, list[bytes]] = {}  # per request: digests of its first full, computed blocks
        # Per waiting request: (its token count, the EXACT digests of its full blocks before its last token),
        # kept until it is freed: the demand is measured after every step, and its tokens change only by a
        # preemption.
        self._exact: dict[str, tuple[int, list[bytes]]] = {}
        self.prefix_queried_tokens = 0  # prompt tokens of admitted requests that looked in the cache
        self.prefix_hit_tokens = 0  # of those, tokens found there (their prefill was skipped)

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
        """Drop the request's hold on every block (a no-op for a request that holds none)."""
        table = self._tables.pop(request_id, None)
        self._digests.pop(request_id, None)
        self._exact.pop(request_id, None)
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

    # -- prefix caching ----------------------------------------------------------------------
    def take_cached_prefix(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Share into a request that holds no blocks the longest run of cached blocks its tokens start
        with; returns the tokens they hold (its K/V need no computing). The last token is always left
        to compute (its logits give the next token), so a block holding it is never taken. `cache_salt`:
        the request's (only blocks computed for requests of the same salt are found)."""
        if not self.enable_prefix_caching or self._tables.get(request_id):
            return 0
        digests, ids = self._find_cached(request_id, token_ids, cache_salt)
        if ids:
            self.pool.acquire(ids)
            self._tables[request_id] = list(ids)
            self._digests[request_id] = digests
        return len(ids) * self.block_size

    def cached_prefix_blocks(self, request_id: str, token_ids: Sequence[int],
                             cache_salt: str | None = None) -> tuple[int, int]:
        """For a request that holds no blocks: (the cached blocks it would share if admitted now, how many
        of those other requests hold). Only the held ones spare free blocks: taking a cached free block
        takes it from the free blocks as a fresh one would; every one spares its prefill."""
        if not self.enable_prefix_caching or self._tables.get(request_id):
            return 0, 0
        _, ids = self._find_cached(request_id, token_ids, cache_salt)
        return len(ids), sum(1 for i in ids if self.pool.ref_count(i) > 0)

    def _find_cached(self, request_id: str, token_ids: Sequence[int],
                     cache_salt: str | None) -> tuple[list[bytes], list[int]]:
        """(digests, ids) of the longest run of cached blocks the tokens start with, before the last token:
        each block the EXACT one, or, while the engine is morphed, a MORPHED one where no EXACT one is cached."""
        exact = self._exact_digests(request_id, token_ids, cache_salt)
        digests, ids, bs = [], [], self.block_size
        for i, digest in enumerate(exact):
            parent, tokens = digests[-1] if digests else root(cache_salt), token_ids[i * bs:(i + 1) * bs]
            if digests and parent != exact[i - 1]:  # the run left the EXACT chain: its own keys from here
                digest = block_digest(parent, tokens, EXACT)
            block = self.pool.indexed(digest)
            if block is None and self.precision_tag == MORPHED:
                digest = block_digest(parent, tokens, MORPHED)
                block = self.pool.indexed(digest)
            if block is None:
                break
            digests.append(digest)
            ids.append(block)
        return digests, ids

    def _exact_digests(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None) -> list[bytes]:
        """The EXACT digests of the request's full blocks before its last token (the one always computed)."""
        kept = self._exact.get(request_id)
        if kept is None or kept[0] != len(token_ids):
            n = (len(token_ids) - 1) // self.block_size
            kept = (len(token_ids), chain_digests(token_ids, self.block_size, n, root(cache_salt), EXACT))
            self._exact[request_id] = kept
        return kept[1]

    def count_lookup(self, num_tokens: int, num_cached: int) -> None:
        """Counts an admitted request's lookup (its prompt tokens, those found): the hit rate's figures."""
        self.prefix_queried_tokens += num_tokens
        self.prefix_hit_tokens += num_cached

    def cache_computed(self, request_id: str, num_computed: int, token_slice: Callable[[int, int], Sequence[int]],
                       cache_salt: str | None = None) -> None:
        """Register the request's blocks that `num_computed` tokens have filled since the last call.
        `token_slice(start, end)`: the request's tokens (prompt, then outputs) in that range."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id)
        if not table:
            return
        digests = self._digests.setdefault(request_id, [])
        full = min(num_computed // self.block_size, len(table))
        while len(digests) < full:
            i, bs = len(digests), self.block_size
            parent = digests[-1] if digests else root(cache_salt)
            digests.append(block_digest(parent, token_slice(i * bs, (i + 1) * bs), self.precision_tag))
            self.pool.register(table[i], digests[-1])

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
        held = collections.Counter(b for t in self._tables.values() for b in t)
        if sorted(held) != self.pool.used_ids() or any(self.pool.ref_count(b) != n for b, n in held.items()):
            raise RuntimeError("block tables and the pool's used blocks (with their reference counts) disagree")
        if any(len(set(t)) != len(t) for t in self._tables.values()):
            raise RuntimeError("a block table holds a block twice")
