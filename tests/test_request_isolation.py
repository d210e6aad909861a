"""One request's fault harms no other: a request that makes the engine step raise fails alone, and
the requests batched with it finish token-identical to a run without it (issue 12, item 1).

The poison bypasses SamplingParams on purpose (validation refuses every bad value it knows): it
stands for a fault that validation cannot foresee, in the sampler or after it.
"""
from __future__ import annotations

import asyncio

import pytest

import engine.llm_engine as llm_engine
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.errors import StepFailed
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

TINY = dict(dtype="fp32", memory_budget="32MiB", max_model_len=64, block_size=4, reserve="1MiB",
            enable_morphing=False)


def good_params(i: int) -> SamplingParams:
    """Greedy and seeded sampling mixed, so generator state matters."""
    if i % 2:
        return SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)


def poisoned_params() -> SamplingParams:
    params = SamplingParams(max_tokens=8, temperature=0.8, ignore_eos=True)
    object.__setattr__(params, "top_p", "not a number")  # the sampler raises on it
    return params


PROMPTS = {f"r{i}": [3 + i, 9, 4 + 2 * i, 17][: 2 + i % 3] for i in range(7)}


def run_sync(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list] = {rid: [] for rid in requests}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step().outputs:
            outputs[out.request_id].append(out)
    assert not engine.has_unfinished()
    return outputs


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def clean_run(engine: LLMEngine, prefix: str) -> dict[str, list[int]]:
    outs = run_sync(engine, {prefix + rid: (p, good_params(i)) for i, (rid, p) in enumerate(PROMPTS.items())})
    return {rid.removeprefix(prefix): tokens(o) for rid, o in outs.items()}


@pytest.fixture
def tiny_engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), **TINY))


def test_a_fault_after_generators_advanced_rewinds_them(tiny_engine, monkeypatch):
    """The sampler fault happens after the good rows drew their noise: the retry must not draw again."""
    clean = clean_run(tiny_engine, "clean-")
    bad = SamplingParams(max_tokens=8, temperature=0.7, ignore_eos=True)
    real_sample = llm_engine.sample

    def sample_then_fail(logits, params, generators, *contexts):
        drawn = real_sample(logits, params, generators, *contexts)
        if any(p is bad for p in params):
            raise RuntimeError("injected fault after sampling")
        return drawn

    monkeypatch.setattr(llm_engine, "sample", sample_then_fail)
    requests = {rid: (p, good_params(i)) for i, (rid, p) in enumerate(PROMPTS.items())}
    requests["bad"] = ([5, 6, 7], bad)
    outs = run_sync(tiny_engine, requests)
    assert len(outs["bad"]) == 1 and isinstance(outs["bad"][0].error, RuntimeError)
    assert outs["bad"][0].finish_reason == "abort"
    assert {rid: tokens(outs[rid]) for rid in PROMPTS} == clean
    assert all(outs[rid][-1].finish_reason == "length" and outs[rid][-1].error is None for rid in PROMPTS)
    tiny_engine.check_integrity()
    assert tiny_engine.pool.num_used == 0


def test_a_fault_in_the_stop_checker_fails_that_request_alone(tiny_engine):
    clean = clean_run(tiny_engine, "clean-")
    for i, (rid, p) in enumerate(PROMPTS.items()):
        tiny_engine.add_request(rid, p, good_params(i))
    tiny_engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))

    def broken_push(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")

    tiny_engine._requests["bad"].stop_checker.push = broken_push
    outs: dict[str, list] = {rid: [] for rid in [*PROMPTS, "bad"]}
    while tiny_engine.has_unfinished():
        for out in tiny_engine.step().outputs:
            outs[out.request_id].append(out)
    assert isinstance(outs["bad"][-1].error, UnicodeDecodeError)
    assert {rid: tokens(outs[rid]) for rid in PROMPTS} == clean
    tiny_engine.check_integrity()


def run_streams(engine: AsyncLLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    async def one(rid, prompt, params):
        try:
            return [out async for out in engine.generate(rid, prompt, params)]
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return e

    async def main():
        return await asyncio.gather(*(one(rid, *req) for rid, req in requests.items()))

    return dict(zip(requests, asyncio.run(main())))


@pytest.mark.slow
def test_poisoned_request_in_8_concurrent_streams_on_the_default_model(default_model_dir):
    """8 concurrent streams on the real default model, one poisoned: 7 complete, token-identical to
    a run of those 7 alone; the poisoned one gets StepFailed; the engine keeps serving."""
    engine = AsyncLLMEngine(engine=LLMEngine(EngineConfig(
        model=str(default_model_dir), dtype="fp32", max_model_len=128, block_size=16, reserve="64MiB",
        memory_budget="1GiB", enable_morphing=False)))
    try:
        good = {rid: (p, good_params(i)) for i, (rid, p) in enumerate(PROMPTS.items())}
        clean = run_streams(engine, good)
        poisoned = run_streams(engine, {**{f"p-{rid}": req for rid, req in good.items()},
                                        "bad": ([1, 2, 3], poisoned_params())})
        assert isinstance(poisoned["bad"], StepFailed) and "bad" in str(poisoned["bad"])
        for rid in PROMPTS:
            outs = poisoned[f"p-{rid}"]
            assert not isinstance(outs, Exception), outs
            assert outs[-1].finish_reason == "length" and tokens(outs) == tokens(clean[rid])
        snapshot = asyncio.run(engine.run_at_step_boundary(lambda e: (e.pool.num_used, e.has_unfinished())))
        assert snapshot == (0, False)
    finally:
        engine.shutdown()


def test_queue_time_ends_at_the_first_schedule(tiny_engine):
    outs = run_sync(tiny_engine, {"a": ([5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))})
    last = outs["a"][-1]
    assert last.first_scheduled_time is not None
    assert last.arrival_time <= last.first_scheduled_time <= last.first_token_time
    assert last.queue_time_s == pytest.approx(last.first_scheduled_time - last.arrival_time)
