"""Prefix caching: the pool's reference counts and index, the manager's sharing and registration, the
scheduler starting a request after its cached prefix, and the engine's outputs unchanged by it."""
from __future__ import annotations

import pytest

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.prefix_hash import ROOT, block_digest, chain_digests
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from tests.morph_helpers import one_thread  # noqa: F401 (a fixture)
from tests.test_engine import generate, mixed_prompts, tiny_engine

D = [bytes([i]) * 32 for i in range(8)]  # stand-in digests


def test_digests_chain_so_equal_blocks_after_different_prefixes_differ():
    a, b = chain_digests([1, 2, 3, 4, 9, 9, 9, 9], 4, 9), chain_digests([5, 6, 7, 8, 9, 9, 9, 9], 4, 9)
    assert len(a) == 2 and a[1] != b[1]  # same second block, different first
    assert a[0] == block_digest(ROOT, [1, 2, 3, 4]) and a[1] == block_digest(a[0], [9, 9, 9, 9])
    assert chain_digests([1, 2, 3, 4, 9, 9], 4, 9) == a[:1]  # a partial block has no digest


def test_a_freed_indexed_block_stays_cached_until_an_allocation_needs_it():
    pool = BlockPool(4, 4)
    ids = pool.allocate(2)
    assert pool.register(ids[0], D[0]) and pool.register(ids[1], D[1])
    assert not pool.register(ids[0], D[2]) and not pool.register(pool.allocate(1)[0], D[0])  # one each way
    pool.free(ids)
    assert (pool.num_free, pool.num_used, pool.num_cached) == (3, 1, 2)
    assert [pool.indexed(d) for d in (D[0], D[1], D[3])] == [0, 1, None]
    assert pool.allocate(1) == [3]  # uncached ids first
    assert pool.allocate(1) == [1]  # then the least recently freed cached block: the tail (freed in reverse)
    assert [pool.indexed(d) for d in (D[0], D[1])] == [0, None]
    pool.check_integrity()


def test_shared_blocks_count_references_and_come_back_into_use():
    pool = BlockPool(4, 4)
    (b,) = pool.allocate(1)
    pool.register(b, D[0])
    pool.acquire([b])  # a second request shares it
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.ref_count(b) == 1 and pool.num_cached == 0
    pool.free([b])
    assert pool.num_cached == 1 and pool.num_used == 0
    pool.acquire([b])  # a cached block comes back without a copy
    assert (pool.ref_count(b), pool.num_cached) == (1, 0)
    with pytest.raises(ValueError, match="no cached prefix"):
        pool.acquire([pool.allocate(1)[0]])
    pool.check_integrity()


def test_shrink_moves_an_indexed_block_with_its_digest_and_drops_cached_blocks_above_the_top():
    pool = BlockPool(6, 6)
    ids = pool.allocate(6)
    for i, d in zip(ids, D):
        pool.register(i, d)
    pool.free([0, 1, 2, 4])  # used: 3, 5; cached: 0, 1, 2, 4
    mapping = pool.plan_shrink(3)
    assert set(mapping) == {3, 5} and set(mapping.values()) <= {0, 1, 2}
    pool.apply_shrink(mapping, 3)
    assert (pool.indexed(D[5]), pool.indexed(D[3])) == (mapping[5], mapping[3])
    assert pool.indexed(D[4]) is None  # was above the new top
    assert pool.num_cached == 1 and pool.capacity == 3
    pool.check_integrity()


def _sched(capacity=16, block_size=4, budget=64):
    kv = KVCacheManager(BlockPool(capacity, capacity), block_size, enable_prefix_caching=True)
    return Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=8), kv


def _finish_prefill(sched: Scheduler, kv: KVCacheManager) -> None:
    out = sched.schedule()
    for c in out.chunks:
        s = next(s for s in sched.running if s.request_id == c.request_id)
        s.num_computed_tokens = c.end_pos
        kv.cache_computed(s.request_id, s.num_computed_tokens, s.token_slice, s.params.cache_salt)
        if c.needs_logits:
            s.output_token_ids.append(7)


def test_a_request_starts_after_the_cached_blocks_its_prompt_begins_with():
    sched, kv = _sched()
    shared = list(range(100, 112))  # three full blocks
    a = Sequence("a", shared + [1, 2], SamplingParams(max_tokens=4), 0.0)
    sched.add(a)
    _finish_prefill(sched, kv)
    b = Sequence("b", shared + [7], SamplingParams(max_tokens=4), 0.0)
    c = Sequence("c", shared, SamplingParams(max_tokens=4), 0.0)  # all cached: its last block is recomputed
    sched.add(b), sched.add(c)
    chunks = {ch.request_id: ch for ch in sched.schedule().chunks}
    assert (chunks["b"].start_pos, chunks["b"].token_ids) == (12, (7,))
    assert chunks["b"].block_table[:3] == kv.block_table("a")[:3]
    assert chunks["c"].start_pos == 8 and chunks["c"].block_table[:2] == kv.block_table("a")[:2]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (12, 8)
    assert (kv.prefix_queried_tokens, kv.prefix_hit_tokens) == (14 + 13 + 12, 0 + 12 + 8)
    kv.check_integrity()


def test_a_blocked_head_gives_its_shared_blocks_back_and_prompt_logprobs_skip_the_cache():
    sched, kv = _sched(capacity=6)
    shared = list(range(100, 108))
    sched.add(Sequence("a", shared + [1], SamplingParams(max_tokens=4), 0.0))
    _finish_prefill(sched, kv)  # a holds 3 blocks, 2 of them indexed
    big = Sequence("big", shared + list(range(20)), SamplingParams(max_tokens=4), 0.0)  # needs 5 more than its 2
    sched.add(big)
    assert sched.schedule().chunks[0].request_id == "a" and sched.waiting[0] is big
    assert big.num_computed_tokens == 0 and kv.block_table("big") == () and kv.pool.ref_count(0) == 1
    sched.remove(sched.waiting[0])
    wants = Sequence("lp", shared + [5], SamplingParams(max_tokens=4, prompt_logprobs=1), 0.0)
    sched.add(wants)
    chunk = next(c for c in sched.schedule().chunks if c.request_id == "lp")
    assert chunk.start_pos == 0 and wants.num_cached_tokens == 0
    kv.check_integrity()


def test_engine_outputs_are_the_same_with_and_without_the_cache(tiny_model_dir):
    prefix = list(range(40, 60))  # 5 blocks of 4, shared by every prompt
    prompts = {rid: prefix + p for rid, p in mixed_prompts(n=8, seed=3).items()}
    off = generate(tiny_engine(tiny_model_dir, enable_prefix_caching=False), prompts)
    engine = tiny_engine(tiny_model_dir)
    first = generate(engine, {"r0": prompts["r0"]})
    assert first["r0"] == off["r0"]
    cached = {}
    for rid, p in prompts.items():  # one at a time: each finds the prefix (and r0 its whole prompt) cached
        engine.add_request(rid, p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            for out in engine.step().outputs:
                cached.setdefault(out.request_id, []).extend(out.token_ids)
                if out.finished:
                    assert out.num_cached_tokens >= len(prefix)
    assert cached == off
    snap = engine.pressure()
    assert snap.prefix_cache_hits_total >= 8 * len(prefix) and snap.kv_cached_blocks > 0
    engine.check_integrity()


def test_engine_preemption_with_the_cache_equals_without(tiny_model_dir):
    prefix = list(range(40, 52))
    prompts = {rid: prefix + p for rid, p in mixed_prompts(n=12, seed=4).items()}
    off = generate(tiny_engine(tiny_model_dir, enable_prefix_caching=False), prompts)
    probe = tiny_engine(tiny_model_dir)
    plan = probe.memory_plan
    engine = tiny_engine(tiny_model_dir, memory_budget=plan.weights + plan.reserve + 24 * plan.block_bytes)
    assert generate(engine, prompts) == off
    assert engine.scheduler.num_preemptions > 0 and engine.kv_manager.prefix_hit_tokens > 0


def test_demand_counts_a_waiting_prefix_others_hold_as_shared_and_no_cached_prefix_as_backlog():
    from engine.demand import measure_demand

    sched, kv = _sched(capacity=16)
    shared = list(range(100, 116))  # 4 blocks
    sched.add(Sequence("a", shared + [1], SamplingParams(max_tokens=4), 0.0))
    _finish_prefill(sched, kv)  # a holds 5 blocks, the first 4 indexed
    waiting = Sequence("w", shared + [2, 3], SamplingParams(max_tokens=4), 0.0)  # 18 tokens + 4 reserved: 6 blocks
    stranger = Sequence("s", list(range(300, 318)), SamplingParams(max_tokens=4), 0.0)
    sched.waiting.extend([waiting, stranger])
    demand = measure_demand(sched.waiting, sched.running, kv, 4, 64, 8)
    assert demand.waiting_blocks == (6 - 4, 6)  # a holds w's 4 prefix blocks: only 2 are new
    assert demand.prefill_backlog_tokens == (18 - 16) + 18
    sched.remove(sched.running[0])  # a finishes: its blocks stay cached, but free
    demand = measure_demand(sched.waiting, [], kv, 4, 64, 8)
    assert demand.waiting_blocks == (6, 6)  # taking a cached free block takes a free block
    assert demand.prefill_backlog_tokens == (18 - 16) + 18  # ... and still spares its prefill


def test_at_full_precision_only_exact_blocks_are_found_and_morphed_an_exact_one_first():
    from engine.prefix_hash import EXACT, MORPHED

    sched, kv = _sched()
    shared = list(range(100, 112))
    kv.precision_tag = MORPHED  # a morphed engine computes the first request's blocks
    sched.add(Sequence("a", shared + [1], SamplingParams(max_tokens=4), 0.0))
    _finish_prefill(sched, kv)
    tokens = tuple(shared + [2])
    kv.precision_tag = EXACT  # restored: K/V computed with quantized layers are not exact
    assert kv.cached_prefix_blocks("b", tokens) == (0, 0)
    kv.precision_tag = MORPHED  # morphed again (by whatever morph): they are read
    assert kv.cached_prefix_blocks("b", tokens) == (3, 3)
    kv.precision_tag = EXACT  # an exact copy of the first block, computed at full precision ...
    sched.add(Sequence("c", shared[:4] + [9, 9, 9, 9, 9], SamplingParams(max_tokens=4), 0.0))
    _finish_prefill(sched, kv)
    kv.precision_tag = MORPHED  # ... is what a morphed engine takes first, then the morphed ones after it
    assert kv.take_cached_prefix("d", tokens) == 4  # a's next blocks chain from a's own first one, not c's
    assert kv.block_table("d") == kv.block_table("c")[:1]
    kv.free("d")
    assert kv.cached_prefix_blocks("e", tuple(shared[:4] + [9, 9, 9, 9, 9, 1])) == (2, 2)
    kv.check_integrity()


@pytest.mark.usefixtures("one_thread")
def test_an_engine_that_restored_reads_no_block_computed_while_morphed(tiny_model_dir, tmp_path):
    from engine.morph.actions import RestoreLayer, SwapLayer
    from engine.precision import Precision
    from tests.morph_helpers import engine_for

    engine = engine_for(tiny_model_dir, tmp_path)
    prompt = list(range(40, 61))  # 5 full blocks of 4 before the last token
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def cached(rid: str) -> int:
        engine.add_request(rid, prompt, params)
        found = None
        while engine.has_unfinished():
            found = next((o.num_cached_tokens for o in engine.step().outputs if o.request_id == rid), found)
        return found

    assert engine.apply(SwapLayer(0, Precision.INT4)).status == "done"
    assert (cached("morphed-1"), cached("morphed-2")) == (0, 20)
    assert engine.apply(RestoreLayer(0)).status == "done"
    assert (cached("full-1"), cached("full-2")) == (0, 20)  # computed again at full precision, then shared
    engine.check_integrity()


def test_only_requests_with_the_same_cache_salt_share_blocks():
    sched, kv = _sched()
    shared = list(range(100, 112))
    sched.add(Sequence("a", shared + [1], SamplingParams(max_tokens=4, cache_salt="tenant-a"), 0.0))
    _finish_prefill(sched, kv)
    tokens = tuple(shared + [2])
    assert kv.cached_prefix_blocks("x", tokens) == (0, 0)  # unsalted
    assert kv.cached_prefix_blocks("y", tokens, "tenant-b") == (0, 0)
    assert kv.cached_prefix_blocks("z", tokens, "tenant-a") == (3, 3)
    with pytest.raises(Exception, match="cache_salt"):
        SamplingParams(cache_salt="")
