"""The OpenAI/vLLM sampling surface in the engine: raw logprobs and prompt logprobs, penalties,
min_tokens, min_p, logit_bias, seeds, and structured output through xgrammar."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine.batch import ScheduledChunk, SchedulerOutput
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.logits_processors import RowContext, apply_processors, min_p_filter
from engine.sampling_params import SamplingParams, StructuredOutput
from tests.test_engine import tiny_engine

PROMPT = [5, 17, 33, 9, 120, 64, 7]


def run(engine: LLMEngine, prompt, params: SamplingParams, rid: str = "r"):
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step().outputs if o.request_id == rid]
    engine.check_integrity()
    tokens = [t for o in outs for t in o.token_ids]
    logprobs = [lp for o in outs for lp in (o.logprobs or ())]
    return tokens, logprobs, outs


def raw_logits(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """The model's logits for the token after `tokens`, straight from the runner."""
    engine.kv_manager.allocate_slots("probe", len(tokens))
    chunk = ScheduledChunk("probe", tuple(tokens), 0, engine.kv_manager.block_table("probe"), True)
    try:
        return engine.runner.execute(SchedulerOutput((chunk,)))[0]
    finally:
        engine.kv_manager.free("probe")


def test_sampled_logprobs_are_the_log_softmax_of_the_model_logits(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True, logprobs=4,
                            repetition_penalty=1.3)  # processors change the draw, not the (raw) logprobs
    tokens, logprobs, _ = run(engine, PROMPT, params)
    assert len(logprobs) == len(tokens) == 6
    for i, (token, lp) in enumerate(zip(tokens, logprobs)):
        expected = torch.log_softmax(raw_logits(engine, PROMPT + tokens[:i]), dim=-1)
        assert lp.chosen.token_id == token
        assert lp.chosen.logprob == pytest.approx(expected[token].item(), abs=1e-4)
        assert lp.chosen.rank == int((expected > expected[token]).sum()) + 1
        top_ids = expected.topk(4).indices.tolist()
        assert [t.token_id for t in lp.top] == top_ids
        assert [t.logprob for t in lp.top] == pytest.approx(expected[top_ids].tolist(), abs=1e-4)


@pytest.mark.parametrize("chunk", [256, 16])
def test_prompt_logprobs_match_sampled_logprobs_and_survive_chunking(tiny_model_dir, chunk):
    prompt = PROMPT * 4  # 28 tokens: two prefill chunks when the step budget is 16
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    tokens, sampled, _ = run(tiny_engine(tiny_model_dir), prompt, greedy)
    engine = tiny_engine(tiny_model_dir, max_num_batched_tokens=chunk)
    echo = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    _, _, outs = run(engine, prompt + tokens, echo)
    prompt_lps = outs[0].prompt_logprobs
    assert len(prompt_lps) == len(prompt) + len(tokens) and prompt_lps[0] is None
    assert all(o.prompt_logprobs is None for o in outs[1:])
    for lp, want in zip(prompt_lps[len(prompt):], sampled):
        assert lp.chosen.token_id == want.chosen.token_id
        assert lp.chosen.logprob == pytest.approx(want.chosen.logprob, abs=1e-4)
        assert [t.token_id for t in lp.top] == [t.token_id for t in want.top]


def test_penalties_follow_vllm():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    ctx = RowContext(prompt_ids=(0,), output_ids=(1, 3, 3))
    rep = apply_processors(logits, [SamplingParams(repetition_penalty=2.0)], [ctx])
    assert rep.tolist() == [[1.0, -4.0, 1.0, 0.25]]  # seen in prompt or output: /2 if > 0, x2 if < 0
    freq = apply_processors(logits, [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)], [ctx])
    assert freq.tolist() == [[2.0, -2.75, 1.0, -0.75]]  # output only: 0.5 x count + 0.25 once
    assert logits.tolist() == [[2.0, -2.0, 1.0, 0.5]]  # the raw logits are left alone (raw logprobs)


def test_min_p_logit_bias_and_min_tokens_masks():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert min_p_filter(probs, [0.4])[0].tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    logits = torch.zeros(1, 4)
    biased = apply_processors(logits, [SamplingParams(logit_bias=((2, 5.0),))], [RowContext((), ())])
    assert biased.tolist() == [[0.0, 0.0, 5.0, 0.0]]
    p = SamplingParams(max_tokens=4, min_tokens=2)
    early = apply_processors(logits, [p], [RowContext((), (1,), min_tokens_masked=(3,))])
    late = apply_processors(logits, [p], [RowContext((), (1, 1), min_tokens_masked=(3,))])
    assert early[0, 3] == float("-inf") and late[0, 3] == 0.0


def test_min_tokens_and_logit_bias_in_the_engine(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    first = run(engine, PROMPT, SamplingParams(max_tokens=8, temperature=0))[0][0]
    stops = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(first,))
    assert run(engine, PROMPT, stops)[0] == [first]  # stops at once
    held = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(first,), min_tokens=5)
    assert len(run(engine, PROMPT, held)[0]) >= 5
    forced = SamplingParams.create(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={"77": 100})
    assert run(engine, PROMPT, forced)[0] == [77] * 4


def test_seed_reproducible_with_every_processor(tiny_model_dir):
    params = dict(max_tokens=10, temperature=1.0, min_p=0.05, top_k=50, top_p=0.95, ignore_eos=True,
                  presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
    a = run(tiny_engine(tiny_model_dir), PROMPT, SamplingParams(seed=11, **params))[0]
    b = run(tiny_engine(tiny_model_dir, seed=99), PROMPT, SamplingParams(seed=11, **params))[0]
    c = run(tiny_engine(tiny_model_dir), PROMPT, SamplingParams(seed=12, **params))[0]
    assert a == b and a != c


@pytest.mark.parametrize("field,value", [("presence_penalty", 3.0), ("frequency_penalty", -2.5),
                                         ("repetition_penalty", 0.0), ("min_p", 1.5), ("min_tokens", 99),
                                         ("logprobs", 21), ("prompt_logprobs", -1)])
def test_out_of_range_values_name_their_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_tokens=16, **{field: value})
    assert e.value.param == field


@pytest.fixture(scope="module")
def real_engine(default_model_dir):
    return LLMEngine(EngineConfig(model=str(default_model_dir), dtype="fp32", memory_budget="1GiB",
                                  max_model_len=512, enable_morphing=False, seed=0))


@pytest.mark.slow
def test_json_schema_output_validates_on_the_real_model(real_engine):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"],
              "additionalProperties": False}
    spec = StructuredOutput("json_schema", json.dumps(schema))
    prompt = real_engine.tokenizer.encode("Describe a person as JSON:")
    for seed in (1, 2):
        tokens, _, outs = run(real_engine, prompt, SamplingParams(max_tokens=60, temperature=1.0, seed=seed,
                                                                  structured_output=spec), rid=f"j{seed}")
        assert outs[-1].finish_reason == "stop"
        jsonschema.validate(json.loads("".join(o.text for o in outs)), schema)
    tokens, _, outs = run(real_engine, prompt, SamplingParams(max_tokens=40, temperature=0,
                                                              structured_output=StructuredOutput("json_object")))
    assert isinstance(json.loads("".join(o.text for o in outs)), dict)


@pytest.mark.slow
def test_a_schema_xgrammar_cannot_compile_is_a_400(real_engine):
    bad = StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "nonsense"}}}')
    with pytest.raises(InvalidRequestError) as e:
        real_engine.add_request("bad", [1, 2, 3], SamplingParams(structured_output=bad))
    assert e.value.param == "response_format"
