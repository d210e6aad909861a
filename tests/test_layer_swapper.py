"""LayerSwapper through the engine: swaps between steps keep every request's KV (ids and contents),
restores are bit-exact, a restore needing blocks that live requests hold waits, the ledger is exact."""
from __future__ import annotations

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.morph.actions import RestoreLayer, SwapLayer
from engine.precision import Precision
from tests.morph_helpers import engine_for, one_thread  # noqa: F401 (one_thread is a fixture)
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")




def exact_budget_engine(model_dir, cache_dir, blocks: int, **overrides) -> LLMEngine:
    """An engine whose budget is weights + reserve + exactly `blocks` KV blocks (no slack)."""
    plan = engine_for(model_dir, cache_dir, **overrides).memory_plan
    engine = engine_for(model_dir, cache_dir, memory_budget=plan.weights + plan.reserve + blocks * plan.block_bytes,
                        **overrides)
    assert engine.pool.capacity == blocks and engine.ledger.free == 0
    return engine


def snapshot(engine: LLMEngine, request_ids) -> dict[str, tuple[tuple[int, ...], torch.Tensor]]:
    """Each request's block table and a copy of its blocks' KV (every layer, K and V)."""
    out = {}
    for rid in request_ids:
        table = engine.kv_manager.block_table(rid)
        out[rid] = (table, engine.storage.kv[list(table)].clone())
    return out


def original_tensors(engine: LLMEngine, layer: int) -> dict[str, torch.Tensor]:
    lin = engine.model.layers[layer].get_linears()
    out = {n: l.weight.clone() for n, l in lin.items()}
    out.update({n: w.clone() for n, w in engine.model.layers[layer].get_norm_weights().items()})
    return out


def current_tensors(engine: LLMEngine, layer: int) -> dict[str, torch.Tensor]:
    lin = engine.model.layers[layer].get_linears()
    out = {n: l.weight for n, l in lin.items()}
    out.update(engine.model.layers[layer].get_norm_weights())
    return out


def run_to_end(engine: LLMEngine, tokens: dict[str, list[int]], morph_results: list | None = None) -> dict[str, str]:
    reasons = {}
    while engine.has_unfinished():
        step = engine.step()
        if morph_results is not None:
            morph_results.extend(step.morph_results)
        for out in step.outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        engine.check_integrity()
    return reasons


def test_swap_down_mid_decode_keeps_requests_and_restore_is_bit_identical(tiny_model_dir, tmp_path):
    engine = engine_for(tiny_model_dir, tmp_path)
    originals = original_tensors(engine, 1)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9, 10, 11], params)
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    before = snapshot(engine, tokens)
    capacity = engine.pool.capacity

    result = engine.apply(SwapLayer(1, Precision.INT4))
    assert result.status == "done" and result.layers_changed == (1,)
    assert result.weight_bytes_delta < 0 and result.kv_blocks_delta > 0 and result.swap_seconds > 0
    assert engine.pool.capacity == capacity + result.kv_blocks_delta
    after = snapshot(engine, tokens)
    for rid, (table, kv) in before.items():
        assert after[rid][0] == table and torch.equal(after[rid][1], kv)
    assert engine.model.layers[1].q_proj.precision == Precision.INT4

    reasons = run_to_end(engine, tokens)
    assert reasons == {f"r{i}": "length" for i in range(3)}
    assert all(len(t) == 10 for t in tokens.values())

    restored = engine.apply(RestoreLayer(1))
    assert restored.status == "done" and restored.weight_bytes_delta == -result.weight_bytes_delta
    for name, t in current_tensors(engine, 1).items():
        assert t.dtype == originals[name].dtype and torch.equal(t, originals[name]), name
    assert engine.pool.capacity == capacity
    engine.check_integrity()


def test_restore_waits_for_live_blocks_then_completes(tiny_model_dir, tmp_path):
    engine = exact_budget_engine(tiny_model_dir, tmp_path, blocks=20)
    down = engine.apply(SwapLayer(0, Precision.INT4))
    assert down.status == "done" and engine.pool.capacity > 40
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", list(range(3 + i, 19 + i)), params)  # 16 tokens = 4 blocks each, then 5
    engine.step()
    engine.step()
    assert engine.pool.num_used > 20  # more than a full-precision layer 0 would leave room for
    state = (engine.morph_state(), engine.ledger.figures(), snapshot(engine, [f"r{i}" for i in range(6)]))

    waiting = engine.apply(RestoreLayer(0))
    assert waiting.status == "waiting" and "live blocks" in waiting.message
    assert engine.morph_state().layer_precisions == state[0].layer_precisions
    assert engine.morph_state().pending == (RestoreLayer(0),)
    assert engine.ledger.figures() == state[1] and engine.pool.capacity == state[0].kv_capacity_blocks
    after = snapshot(engine, state[2])
    assert all(after[rid][0] == t and torch.equal(after[rid][1], kv) for rid, (t, kv) in state[2].items())
    assert engine.scheduler.num_preemptions == 0

    tokens: dict[str, list[int]] = {}
    reported: list = []
    reasons = run_to_end(engine, tokens, reported)  # run_pending retries the restore at every step boundary
    assert set(reasons) == {f"r{i}" for i in range(6)} and set(reasons.values()) == {"length"}
    reported += engine.step().morph_results  # one more boundary, in case the last requests finished in the final step
    # step() reports the restore once, when it went through, not at every step it kept waiting
    assert [(r.action, r.status) for r in reported] == [(RestoreLayer(0), "done")]
    assert engine.model.layers[0].q_proj.precision == Precision.FP32
    assert engine.morph_state().pending == () and engine.pool.capacity == 20 and engine.ledger.free == 0


def test_swapping_layers_frees_exact_bytes_and_grows_kv(tiny_model_dir, tmp_path):
    engine = exact_budget_engine(tiny_model_dir, tmp_path, blocks=20)
    store, block_bytes = engine.morph_executor.swapper.store, engine.storage.block_bytes
    weights0, capacity0 = engine.ledger.weights, engine.pool.capacity
    freed = 0
    for layer in (0, 2, 3):
        full, int4 = store.layer_bytes(layer, Precision.FP32), store.layer_bytes(layer, Precision.INT4)
        result = engine.apply(SwapLayer(layer, Precision.INT4))
        assert result.status == "done" and result.weight_bytes_delta == int4 - full
        assert engine.ledger.layer_weights(layer) == engine.model.layer_weight_bytes(layer) == int4
        freed += full - int4
        engine.check_integrity()
        assert engine.ledger.weights + engine.ledger.kv + engine.ledger.reserve <= engine.ledger.budget
    assert engine.ledger.weights == weights0 - freed
    assert engine.pool.capacity == capacity0 + freed // block_bytes
    assert engine.storage.capacity == engine.pool.capacity
    assert engine.ledger.kv == engine.pool.capacity * block_bytes

    step_down = engine.apply(SwapLayer(0, Precision.INT8))  # int4 -> int8 is a step up in bytes
    assert step_down.status == "done" and step_down.weight_bytes_delta > 0 and step_down.kv_blocks_delta < 0
    for layer in (0, 2, 3):
        assert engine.apply(RestoreLayer(layer)).status == "done"
        engine.check_integrity()
    assert engine.ledger.weights == weights0 and engine.pool.capacity == capacity0


def test_down_then_up_through_the_ladder(tiny_model_dir, tmp_path):
    engine = engine_for(tiny_model_dir, tmp_path)
    originals = original_tensors(engine, 2)
    seen = []
    for p in (Precision.INT8, Precision.INT4, Precision.INT8, Precision.FP32):
        assert engine.apply(SwapLayer(2, p)).status == "done"
        seen.append(engine.model.layers[2].q_proj.precision)
        engine.check_integrity()
    assert seen == [Precision.INT8, Precision.INT4, Precision.INT8, Precision.FP32]
    assert all(torch.equal(t, originals[n]) for n, t in current_tensors(engine, 2).items())
    assert engine.apply(SwapLayer(2, Precision.FP32)).status == "noop"


def test_prefetched_variant_is_used_and_counted_while_staged(tiny_model_dir, tmp_path):
    engine = engine_for(tiny_model_dir, tmp_path)
    swapper, ledger = engine.morph_executor.swapper, engine.ledger
    need = swapper.store.layer_bytes(3, Precision.INT4)
    swapper.prefetch(3, Precision.INT4)  # the KV cache holds every free byte: no room to load ahead
    assert not swapper._prefetched and ledger.staged == 0
    engine.kv_resizer.shrink(-(-need // engine.storage.block_bytes))
    weights_before = ledger.weights
    swapper.prefetch(3, Precision.INT4)
    future = swapper._prefetched[(3, Precision.INT4)]
    prefetched_linears, _ = future.result()
    assert ledger.staged == need and ledger.weights == weights_before + need  # resident, so counted
    ledger.check_integrity()
    assert engine.apply(SwapLayer(3, Precision.INT4)).status == "done"
    assert engine.model.layers[3].q_proj is prefetched_linears["q_proj"] and not swapper._prefetched
    assert ledger.staged == 0 and ledger.layer_weights(3) == engine.model.layer_weight_bytes(3)
    swapper.prefetch(3, Precision.FP32)  # an up move is never prefetched (its bytes are not paid for)
    assert not swapper._prefetched


def test_a_dropped_prefetch_gives_its_bytes_back(tiny_model_dir, tmp_path):
    engine = engine_for(tiny_model_dir, tmp_path)
    swapper, ledger = engine.morph_executor.swapper, engine.ledger
    both = sum(swapper.store.layer_bytes(3, p) for p in (Precision.INT4, Precision.INT8))
    engine.kv_resizer.shrink(-(-both // engine.storage.block_bytes))
    swapper.prefetch(3, Precision.INT4)
    swapper.prefetch(3, Precision.INT8)
    assert ledger.staged == both
    assert engine.apply(SwapLayer(3, Precision.INT8)).status == "done"  # the INT4 copy is stale now
    assert ledger.staged == 0 and not swapper._prefetched
    ledger.check_integrity()
