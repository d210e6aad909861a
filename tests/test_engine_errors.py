"""Bad input gets a clear error that says what to change; never a crash or a hang."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import BudgetError, EngineOverloadedError, InvalidRequestError, ModelLoadError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def config(model_dir, **overrides) -> EngineConfig:
    cfg = dict(model=str(model_dir), dtype="fp32", memory_budget="32MiB", max_model_len=64,
               block_size=4, reserve="1MiB", max_waiting=3,
               enable_morphing=False)  # with morphing the engine may start morphed; see the morph tests
    cfg.update(overrides)
    return EngineConfig(**cfg)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(config(tiny_model_dir))


def test_missing_or_unreadable_model(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(config(tmp_path / "nope"))
    not_a_model = tmp_path / "weights.bin"
    not_a_model.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError):
        LLMEngine(config(not_a_model))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError):
        LLMEngine(config(broken))


def test_budget_below_the_weights_names_the_minimum(tiny_model_dir, engine):
    plan = engine.memory_plan
    minimum = plan.weights + plan.reserve + (64 // 4) * plan.block_bytes
    with pytest.raises(BudgetError) as err:
        LLMEngine(config(tiny_model_dir, memory_budget=plan.weights // 2))
    assert f"at least {minimum} bytes ({minimum / 2**20:.1f} MiB)" in str(err.value)
    LLMEngine(config(tiny_model_dir, memory_budget=minimum))  # exactly the minimum is enough
    with pytest.raises(BudgetError):
        LLMEngine(config(tiny_model_dir, memory_budget=minimum - 1))


def test_max_model_len_beyond_the_model_context(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="max_model_len"):
        LLMEngine(config(tiny_model_dir, max_model_len=4096))


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=2**63), "top_k"), (dict(top_k=-2), "top_k"), (dict(stop=5), "stop"),
    (dict(seed=2**64), "seed"), (dict(seed=-(2**63) - 1), "seed"), (dict(stop_token_ids=[2**63]), "stop_token_ids"),
    (dict(stop=["ok", 3]), "stop"), (dict(stop={"a": 1}), "stop"), (dict(max_tokens="4"), "max_tokens"),
    (dict(temperature=float("nan")), "temperature"), (dict(bogus=1), "bogus"),
])
def test_bad_sampling_params(kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams.create(**kwargs)
    assert err.value.param == param


def test_sampling_params_create_normalizes_stop():
    assert SamplingParams.create(stop="x").stop == ("x",)
    assert SamplingParams.create(stop=["a", "b"], max_tokens=None).stop == ("a", "b")
    assert SamplingParams.create().max_tokens == 16


@pytest.mark.parametrize("prompt, params, param, match", [
    ([], SamplingParams(), "prompt", "empty"),
    ([5] * 64, SamplingParams(max_tokens=1), "prompt", "max_model_len"),
    ([5] * 60, SamplingParams(max_tokens=10), "max_tokens", "at most 4"),
    ([5, 300], SamplingParams(), "prompt", r"\[0, 256\)"),
    ("hello", SamplingParams(), "prompt", "no tokenizer"),
    ([5, True], SamplingParams(), "prompt", "token ids"),
    (None, SamplingParams(), "prompt", "token ids"),
])
def test_bad_prompts(engine, prompt, params, param, match):
    with pytest.raises(InvalidRequestError, match=match) as err:
        engine.add_request("bad", prompt, params)
    assert err.value.param == param
    assert not engine.has_unfinished() and engine.pool.num_used == 0


def test_duplicate_id_and_full_queue_then_the_engine_still_serves(engine):
    engine.add_request("a", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("a", [5, 6], SamplingParams(max_tokens=2))
    engine.add_request("b", [5, 6], SamplingParams(max_tokens=2))
    engine.add_request("c", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(EngineOverloadedError, match="max_waiting=3"):
        engine.add_request("d", [5, 6], SamplingParams(max_tokens=2))
    finished = []
    for _ in range(10):
        finished += [o.request_id for o in engine.step().outputs if o.finished]
        if not engine.has_unfinished():
            break
    assert sorted(finished) == ["a", "b", "c"] and engine.pool.num_used == 0
