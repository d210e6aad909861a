"""BlockPool: exact ids on allocate/free/grow/shrink, caller bugs raise, and a property test."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager


def test_allocate_lowest_ids_first_and_reuse_after_free():
    pool = BlockPool(capacity=8, max_blocks=16)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.free([1, 3])
    assert pool.allocate(3) == [1, 3, 5]
    assert (pool.num_used, pool.num_free) == (6, 2)
    assert pool.allocate(3) is None  # cannot: nothing changed
    assert (pool.num_used, pool.num_free) == (6, 2)
    pool.check_integrity()


def test_caller_bugs_raise():
    pool = BlockPool(4, 8)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(ValueError, match="double free"):
        pool.free(ids)
    with pytest.raises(ValueError, match="unknown"):
        pool.free([7])
    with pytest.raises(ValueError):
        pool.grow(5)
    with pytest.raises(ValueError):
        BlockPool(9, 8)


def test_grow_adds_top_ids():
    pool = BlockPool(2, 6)
    assert pool.allocate(2) == [0, 1]
    pool.grow(3)
    assert pool.capacity == 5
    assert pool.allocate(4) is None
    assert pool.allocate(3) == [2, 3, 4]
    pool.check_integrity()


def test_shrink_migrates_top_live_blocks_into_lowest_free_ids():
    pool = BlockPool(8, 8)
    pool.allocate(8)
    pool.free([1, 2, 4, 5, 7])  # live: 0, 3, 6
    assert pool.plan_shrink(2) is None  # 3 live blocks cannot fit below 2
    mapping = pool.plan_shrink(4)
    assert mapping == {6: 1}
    pool.apply_shrink(mapping, 4)
    assert pool.capacity == 4 and pool.used_ids() == [0, 1, 3]
    assert pool.allocate(1) == [2]
    pool.check_integrity()


def test_apply_shrink_rejects_a_wrong_mapping():
    pool = BlockPool(4, 4)
    pool.allocate(4)
    pool.free([0, 1])
    with pytest.raises(ValueError):
        pool.apply_shrink({3: 0}, 2)  # block 2 is live above the top too
    with pytest.raises(ValueError):
        pool.apply_shrink({2: 0, 3: 0}, 2)


def test_manager_tables_and_remap():
    pool = BlockPool(6, 6)
    kv = KVCacheManager(pool, block_size=4)
    assert kv.allocate_slots("a", 5) and kv.block_table("a") == (0, 1)
    assert kv.allocate_slots("b", 4) and kv.block_table("b") == (2,)
    assert kv.allocate_slots("a", 8) and kv.block_table("a") == (0, 1)
    assert kv.allocate_slots("a", 9) and kv.block_table("a") == (0, 1, 3)
    assert not kv.allocate_slots("b", 4 * 4)  # needs 3 more, 2 free: nothing changes
    assert kv.block_table("b") == (2,) and pool.num_free == 2
    kv.free("a")
    mapping = pool.plan_shrink(2)
    assert mapping == {2: 0}
    kv.remap(mapping)
    pool.apply_shrink(mapping, 2)
    assert kv.block_table("b") == (0,)
    kv.check_integrity()


ops = st.lists(st.tuples(st.sampled_from(["alloc", "share", "free", "grow", "shrink"]), st.integers(0, 12)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_with_sharing_keep_integrity(operations):
    """Each owner holds a list of blocks; the pool's reference counts always equal the owners' holdings."""
    pool = BlockPool(capacity=8, max_blocks=16)
    owned: dict[int, list[int]] = {}
    digests = iter(bytes([i % 256, i // 256]) * 16 for i in range(10_000))
    registered: list[bytes] = []
    next_owner = 0
    for op, n in operations:
        if op == "alloc" and (ids := pool.allocate(n)) is not None:
            for i in ids[: n // 2]:  # index some of them, as computed full blocks are
                registered.append(next(digests))
                pool.register(i, registered[-1])
            owned[next_owner], next_owner = ids, next_owner + 1
        elif op == "share":  # another request takes up to n of the blocks still indexed
            indexed = [i for d in registered if (i := pool.indexed(d)) is not None][:n]
            pool.acquire(indexed)
            owned[next_owner], next_owner = indexed, next_owner + 1
        elif op == "free" and owned:
            pool.free(owned.pop(sorted(owned)[n % len(owned)]))
        elif op == "grow":
            pool.grow(min(n, pool.max_blocks - pool.capacity))
        elif op == "shrink":
            new_cap = max(0, pool.capacity - n)
            if (mapping := pool.plan_shrink(new_cap)) is not None:
                pool.apply_shrink(mapping, new_cap)
                owned = {o: [mapping.get(i, i) for i in ids] for o, ids in owned.items()}
        pool.check_integrity()
        held = [i for ids in owned.values() for i in ids]
        assert sorted(set(held)) == pool.used_ids()
        assert all(pool.ref_count(i) == held.count(i) for i in set(held))
