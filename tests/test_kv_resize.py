"""KVResizer: growing and shrinking the KV cache mid-decode (migrating live blocks) keeps every
request's tokens identical to a run without resizes; the ledger and pool stay consistent."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = {f"r{i}": [(7 * i + j) % 200 + 3 for j in range(10 + 2 * i)] for i in range(4)}


def make_engine(model_dir, capacity_blocks: int | None = None) -> LLMEngine:
    cfg = dict(model=str(model_dir), dtype="fp32", max_model_len=64, block_size=4, reserve="1MiB",
               memory_budget="32MiB", enable_morphing=False)  # the resizer alone, no executor
    if capacity_blocks is not None:
        plan = make_engine(model_dir).memory_plan
        cfg["memory_budget"] = plan.weights + plan.reserve + capacity_blocks * plan.block_bytes
    return LLMEngine(EngineConfig(**cfg))


def run_to_end(engine: LLMEngine, tokens: dict[str, list[int]]) -> None:
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, list[int]]:
    engine = make_engine(tiny_model_dir, capacity_blocks=40)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    tokens: dict[str, list[int]] = {}
    run_to_end(engine, tokens)
    return tokens


def test_grow_and_migrating_shrink_mid_decode_are_token_identical(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir, capacity_blocks=56)
    resizer, pool, ledger = engine.kv_resizer, engine.pool, engine.ledger
    assert pool.max_blocks == 56  # without morphing the address space is what the budget backs
    # Start at 40 committed blocks, leaving the ledger room to grow back to 56 mid-decode (in the
    # real engine that room comes from swapping a layer down).
    assert resizer.shrink(16).status == "done" and pool.capacity == 40
    assert ledger.free >= 16 * engine.storage.block_bytes
    engine.add_request("filler", list(range(3, 43)), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    for out in engine.step().outputs:  # the filler's prefill takes the low ids 0..9
        tokens.setdefault(out.request_id, []).extend(out.token_ids)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    for _ in range(3):
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)

    grown = resizer.grow(16)
    assert (grown.status, grown.blocks_delta, pool.capacity) == ("done", 16, 56)
    assert ledger.kv == 56 * engine.storage.block_bytes
    engine.check_integrity()

    engine.abort("filler")  # frees the low ids; the requests' blocks now sit above them
    top_before = max(pool.used_ids())
    new_capacity = pool.num_used + 1
    assert top_before >= new_capacity  # so the shrink has to migrate
    shrunk = resizer.shrink(pool.capacity - new_capacity)
    assert shrunk.status == "done" and shrunk.blocks_migrated > 0 and pool.capacity == new_capacity
    assert max(pool.used_ids()) < new_capacity and ledger.kv == new_capacity * engine.storage.block_bytes
    engine.check_integrity()

    run_to_end(engine, tokens)
    assert {rid: tokens[rid] for rid in PROMPTS} == reference
    engine.check_integrity()


def test_shrink_waits_when_live_blocks_do_not_fit_and_changes_nothing(tiny_model_dir):
    engine = make_engine(tiny_model_dir, capacity_blocks=40)
    engine.add_request("a", list(range(3, 43)), GREEDY)  # 40 prompt tokens = 10 blocks each
    engine.add_request("b", list(range(5, 45)), GREEDY)
    engine.step()
    used, cap, kv = engine.pool.used_ids(), engine.pool.capacity, engine.ledger.kv
    assert len(used) == 20
    result = engine.kv_resizer.shrink(cap - 16)  # 20 live blocks cannot fit below id 16
    assert result.status == "waiting" and result.blocks_delta == 0
    assert (engine.pool.used_ids(), engine.pool.capacity, engine.ledger.kv) == (used, cap, kv)
    assert engine.scheduler.num_preemptions == 0


def test_grow_takes_only_what_the_ledger_allows(tiny_model_dir):
    engine = make_engine(tiny_model_dir, capacity_blocks=40)
    assert engine.kv_resizer.grow(1).status == "noop"  # the budget is exactly full
    assert engine.kv_resizer.shrink(20).blocks_delta == -20
    result = engine.kv_resizer.grow(10**6)
    assert (result.status, result.blocks_delta, engine.pool.capacity) == ("done", 20, 40)
    assert engine.ledger.free == 0 and engine.pool.num_free == 40
    engine.check_integrity()


def test_shrink_never_goes_below_one_full_length_request(tiny_model_dir):
    engine = make_engine(tiny_model_dir, capacity_blocks=40)
    result = engine.kv_resizer.shrink(40)
    assert result.status == "done" and engine.pool.capacity == 64 // 4
    assert engine.kv_resizer.shrink(1).status == "noop"
