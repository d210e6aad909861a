"""Scheduler: token budget, chunked prefill, FCFS admission, decodes first, preemption by recompute."""
from __future__ import annotations

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def make(capacity=16, block_size=4, budget=32, max_seqs=8):
    pool = BlockPool(capacity, capacity)
    kv = KVCacheManager(pool, block_size)
    return Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=max_seqs), pool


def seq(rid: str, n_prompt: int) -> Sequence:
    return Sequence(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=50), arrival_time=0.0)


def run(sched: Scheduler, out) -> None:
    """Pretend the model ran: advance computed tokens and append a token where logits were needed."""
    by_id = {s.request_id: s for s in sched.running}
    for c in out.chunks:
        s = by_id[c.request_id]
        s.num_computed_tokens += len(c.token_ids)
        if c.needs_logits:
            s.output_token_ids.append(7)


def test_chunked_prefill_under_token_budget():
    sched, pool = make(budget=16)
    a = seq("a", 20)
    sched.add(a)
    out = sched.schedule()
    (c,) = out.chunks
    assert (c.start_pos, len(c.token_ids), c.needs_logits, c.block_table) == (0, 16, False, (0, 1, 2, 3))
    run(sched, out)
    (c,) = sched.schedule().chunks
    assert (c.start_pos, c.token_ids, c.needs_logits, c.block_table) == (16, tuple(range(26, 30)), True, (0, 1, 2, 3, 4))


def test_decodes_first_then_fcfs_admission_limited_by_budget_and_max_seqs():
    sched, pool = make(budget=10, max_seqs=2)
    a, b, c = seq("a", 3), seq("b", 6), seq("c", 2)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [(x.request_id, len(x.token_ids)) for x in out.chunks] == [("a", 3), ("b", 6)]
    run(sched, out)
    out = sched.schedule()  # both decode; c waits for a running slot
    assert [(x.request_id, x.start_pos, len(x.token_ids)) for x in out.chunks] == [("a", 3, 1), ("b", 6, 1)]
    assert [s.request_id for s in sched.waiting] == ["c"]


def test_fcfs_head_of_line_blocks_when_its_blocks_are_missing():
    sched, pool = make(capacity=4, block_size=4, budget=64)
    big, small = seq("big", 20), seq("small", 2)
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert out.is_empty and sched.num_waiting == 2  # big needs 5 blocks of 4; small must not overtake


def test_preemption_evicts_the_newest_running_request_and_requeues_it_first():
    sched, pool = make(capacity=4, block_size=4, budget=64)
    a, b = seq("a", 8), seq("b", 8)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())  # a: blocks 0,1; b: blocks 2,3 (full; both need a block to decode)
    a.output_token_ids.append(7)  # a has 10 tokens now -> needs a third block
    a.num_computed_tokens = 9
    out = sched.schedule()
    assert out.preempted == ("b",)
    assert [(c.request_id, c.start_pos, c.block_table) for c in out.chunks] == [("a", 9, (0, 1, 2))]
    assert sched.num_preemptions == 1 and b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0 and list(sched.waiting) == [b]
    assert pool.num_used == 3


def test_a_request_preempts_itself_when_every_other_one_is_scheduled():
    sched, pool = make(capacity=5, block_size=4, budget=64)
    a, b = seq("a", 8), seq("b", 8)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())  # a: blocks 0,1; b: 2,3; both sampled a token (9 tokens each)
    out = sched.schedule()  # a takes block 4; b finds none and only itself to evict
    assert out.preempted == ("b",)
    assert [(c.request_id, c.block_table) for c in out.chunks] == [("a", (0, 1, 4))]
    run(sched, out)
    sched.remove(a)
    out = sched.schedule()  # b re-prefills prompt + its output (9 tokens) from position 0
    (c,) = out.chunks
    assert (c.request_id, c.start_pos, len(c.token_ids), c.needs_logits) == ("b", 0, 9, True)
    assert c.token_ids == tuple(range(10, 18)) + (7,)


def test_remove_frees_blocks():
    sched, pool = make()
    a = seq("a", 9)
    sched.add(a)
    sched.schedule()
    assert pool.num_used == 3
    sched.remove(a)
    assert pool.num_used == 0 and not sched.has_unfinished()
