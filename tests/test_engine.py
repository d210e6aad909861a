"""LLMEngine end to end: greedy outputs are batch-invariant (alone == batched == chunked prefill ==
under preemption), stop rules, abort, seeded sampling; on a tiny random model and the real one."""
from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import StopChecker

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def generate(engine: LLMEngine, prompts: dict[str, list[int] | str], params=GREEDY) -> dict[str, list[int]]:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    reasons = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens[out.request_id].extend(out.token_ids)
            assert len(tokens[out.request_id]) == out.num_output_tokens
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert set(reasons) == set(prompts)
    engine.check_integrity()
    assert engine.pool.num_used == 0
    return tokens


def mixed_prompts(n: int = 16, vocab: int = 256, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(3, vocab) for _ in range(rng.randint(3, 20))] for i in range(n)}


def tiny_engine(model_dir, **overrides) -> LLMEngine:
    cfg = dict(model=str(model_dir), dtype="fp32", memory_budget="32MiB", max_model_len=64,
               block_size=4, reserve="1MiB", seed=0,
               enable_morphing=False)  # engine-core tests: no host store, no executor
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir):
    """Each prompt generated alone (one request in the engine at a time)."""
    engine = tiny_engine(tiny_model_dir)
    prompts = mixed_prompts()
    return prompts, {rid: generate(engine, {rid: p})[rid] for rid, p in prompts.items()}


def test_tiny_batch_of_16_equals_alone(tiny_model_dir, tiny_reference):
    prompts, alone = tiny_reference
    assert generate(tiny_engine(tiny_model_dir), prompts) == alone
    assert len({tuple(t) for t in alone.values()}) > 8  # outputs really differ per prompt


def test_tiny_chunked_prefill_equals_alone(tiny_model_dir, tiny_reference):
    prompts, alone = tiny_reference
    engine = tiny_engine(tiny_model_dir, max_num_batched_tokens=16)
    assert generate(engine, prompts) == alone


def test_tiny_preemption_equals_alone(tiny_model_dir, tiny_reference):
    prompts, alone = tiny_reference
    probe = tiny_engine(tiny_model_dir)
    plan = probe.memory_plan
    budget = plan.weights + plan.reserve + 20 * plan.block_bytes  # 20 blocks of 4 tokens for 16 requests
    engine = tiny_engine(tiny_model_dir, memory_budget=budget)
    assert engine.pool.capacity == 20
    assert generate(engine, prompts) == alone
    assert engine.scheduler.num_preemptions > 0


def test_stop_token_eos_and_length(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    prompt = [5, 6, 7, 8]
    free_run = generate(engine, {"a": prompt})["a"]
    stop_at = free_run[3]
    engine.add_request("b", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                   stop_token_ids=(stop_at,)))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step().outputs)
    got = [t for o in outs for t in o.token_ids]
    assert got == free_run[:free_run.index(stop_at) + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].finish_time is not None
    assert all(o.finish_reason is None for o in outs[:-1])
    engine.add_request("c", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    last = [o for _ in range(5) for o in engine.step().outputs][-1]
    assert (last.finish_reason, last.num_output_tokens) == ("length", 3)


def test_abort_frees_blocks_and_reports(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    engine.add_request("a", [5, 6, 7, 8, 9], GREEDY)
    engine.add_request("b", [5, 6], GREEDY)
    engine.step()
    assert engine.pool.num_used == 3
    out = engine.abort("a")
    assert out.finish_reason == "abort" and engine.pool.num_used == 1
    assert engine.abort("a") is None
    engine.abort("b")
    assert engine.pool.num_used == 0 and not engine.has_unfinished()
    engine.check_integrity()


def test_seeded_sampling_is_batch_invariant(tiny_model_dir):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    prompts = mixed_prompts(n=4, seed=3)
    alone = generate(tiny_engine(tiny_model_dir), {"r0": prompts["r0"]}, params)["r0"]
    batched = generate(tiny_engine(tiny_model_dir), prompts, params)
    assert batched["r0"] == alone
    assert alone != generate(tiny_engine(tiny_model_dir), {"r0": prompts["r0"]}, GREEDY)["r0"][:8]


def test_pressure_and_morph_state_without_executor(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    engine.add_request("a", [5, 6, 7], GREEDY)
    snap = engine.pressure()
    assert (snap.num_waiting, snap.num_running, snap.kv_used_blocks) == (1, 0, 0)
    engine.step()
    snap = engine.pressure()
    assert (snap.num_waiting, snap.num_running, snap.kv_used_blocks, snap.step) == (0, 1, 1, 1)
    assert snap.kv_capacity_blocks == engine.pool.capacity and snap.ttft_recent_s is not None
    assert snap.ledger.free >= 0 and snap.ledger.kv == engine.pool.capacity * engine.storage.block_bytes
    state = engine.morph_state()
    assert state.num_quantized == 0 and not state.morphing_enabled
    from engine.morph.actions import RestoreLayer
    assert engine.apply(RestoreLayer(0)).status == "rejected"


class _CharTokenizer:
    """Token id i <-> chr(i): enough to test streaming and stop strings without a real vocabulary."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_stop_strings_cut_the_text_and_hold_back_partial_matches():
    checker = StopChecker(_CharTokenizer(), SamplingParams(stop=("END",)))
    streamed = ""
    for ch in "abcEN":
        assert checker.push(ord(ch)) is None
        streamed += checker.flush(finished=False)
    assert streamed == "abc"  # "EN" is held back: it may be the start of "END"
    assert checker.push(ord("D")) == "stop"
    assert streamed + checker.flush(finished=True) == "abc"


DEFAULT_BASE = dict(dtype="fp32", max_model_len=64, block_size=16, reserve="64MiB", memory_budget="1GiB",
                    max_num_seqs=16, enable_morphing=False)


@pytest.fixture(scope="module")
def default_batched(default_model_dir):
    """The real model (fp32): two requests alone == inside a batch of 16 mixed-length prompts."""
    prompts = mixed_prompts(n=16, vocab=49152, seed=1)
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), **DEFAULT_BASE))
    short, long_ = min(prompts, key=lambda r: len(prompts[r])), max(prompts, key=lambda r: len(prompts[r]))
    alone = {rid: generate(engine, {rid: prompts[rid]})[rid] for rid in (short, long_)}
    batched = generate(engine, prompts)
    return prompts, alone, batched, engine.memory_plan


@pytest.mark.slow
def test_default_model_batch_of_16_equals_alone(default_batched):
    prompts, alone, batched, _ = default_batched
    assert {rid: batched[rid] for rid in alone} == alone


@pytest.mark.slow
def test_default_model_chunked_prefill_equals_batch(default_model_dir, default_batched):
    prompts, _, batched, _ = default_batched
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), **DEFAULT_BASE, max_num_batched_tokens=16))
    assert generate(engine, prompts) == batched


@pytest.mark.slow
def test_default_model_preemption_equals_batch(default_model_dir, default_batched):
    prompts, _, batched, plan = default_batched
    small = plan.weights + plan.reserve + 24 * plan.block_bytes  # 16 requests want up to 32 blocks
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), **{**DEFAULT_BASE, "memory_budget": small}))
    assert generate(engine, prompts) == batched
    assert engine.scheduler.num_preemptions > 0


def test_monitor_windows_signals_on_the_engine_clock():
    from engine.block_pool import BlockPool
    from engine.kv_cache_manager import KVCacheManager
    from engine.ledger import MemoryLedger
    from engine.monitor import PressureMonitor
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence

    now = [100.0]
    pool = BlockPool(10, 20)
    sched = Scheduler(KVCacheManager(pool, 4), max_num_batched_tokens=16, max_num_seqs=4)
    monitor = PressureMonitor(sched, pool, MemoryLedger(10_000, 100), window_s=5.0, clock=lambda: now[0])
    sched.add(Sequence("w", [1, 2], SamplingParams(), arrival_time=99.0))
    monitor.record_first_token(100.5, 0.2)
    monitor.record_first_token(101.0, 0.4)
    monitor.record_decode_gap(101.0, 0.05)
    monitor.record_tokens(101.0, 30)
    now[0] = 102.0
    snap = monitor.on_step()
    assert (snap.step, snap.num_waiting, snap.queue_delay_s) == (1, 1, 3.0)
    assert snap.ttft_recent_s == pytest.approx(0.3) and snap.tpot_recent_s == pytest.approx(0.05)
    assert snap.throughput_tok_s == pytest.approx(30 / 2.0)  # window not yet full: 2 s since start
    assert (snap.kv_capacity_blocks, snap.kv_max_blocks, snap.kv_usage) == (10, 20, 0.0)
    now[0] = 105.8  # the 100.5 sample left the window; the 101.0 ones are still in
    snap = monitor.snapshot()
    assert snap.ttft_recent_s == pytest.approx(0.4) and snap.throughput_tok_s == pytest.approx(30 / 5.0)
    now[0] = 106.5
    snap = monitor.snapshot()
    assert snap.ttft_recent_s is None and snap.throughput_tok_s == 0.0


def test_every_step_returns_its_prefill_and_decode_tokens(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 43)), params)  # 40 tokens: two prefill chunks
    engine.add_request("b", list(range(5, 15)), params)
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step().stats)
    assert sum(s.num_prefill_tokens for s in steps) == 50
    assert sum(s.num_decode_tokens for s in steps) == 2 * 3  # the first token of each comes from its prefill
    assert steps[0].phase == "prefill" and steps[-1].phase == "decode"
    assert all(s.num_tokens <= 32 and s.seconds > 0 for s in steps)
