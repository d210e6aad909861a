"""The OpenAI surface on the real Serve app and the real default model, through real clients:
the `openai` SDK (structured output for 10 schemas, streaming and not; n; seed; logprobs),
LangChain's ChatOpenAI.with_structured_output, and lm-eval's local-completions model
(a log-likelihood task and a generate-until task on local data). Bounded: small max_tokens, few items."""
from __future__ import annotations

import concurrent.futures
import json
import math

import jsonschema
import pytest

from tests.serve_helpers import auto_budget, http, serve_app

pytestmark = pytest.mark.slow
CONTROLLER = {"controller_name": "test-openai-clients-controller", "controller_namespace": "morphserve-test-clients"}
S = {"type": "string", "maxLength": 10}
# Every value is bounded, so every valid answer fits in max_tokens: an unbounded integer sampled at
# temperature 0.7 once ran to 120 digits ("length", not "stop"). Numbers keep a free fraction.
I = {"type": "integer", "minimum": -1000, "maximum": 100000}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": I}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]},
    {"type": "object", "properties": {"city": S, "pop": {**I, "minimum": 0}}, "required": ["city", "pop"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"a": I},
                                                "required": ["a"]}}, "required": ["point"]},
    {"type": "array", "items": I, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "why": S},
     "required": ["answer", "why"]},
    {"type": "object", "properties": {"id": I, "note": {"anyOf": [S, {"type": "null"}]}},
     "required": ["id", "note"]},
]
for schema in SCHEMAS:
    if schema["type"] == "object":
        schema["additionalProperties"] = False


@pytest.fixture(scope="module")
def app_url():
    with serve_app({"memory_budget": auto_budget("600MiB"), "engine": {"max_model_len": 1024}, **CONTROLLER}) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(app_url):
    import openai

    return openai.OpenAI(base_url=app_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _structured(client, model, i: int, stream: bool) -> str:
    kwargs = dict(model=model, max_tokens=120, temperature=0.7, seed=i,
                  messages=[{"role": "user", "content": "Reply with a small JSON value."}],
                  response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i]}})
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content
    parts, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert finish == "stop"
    return "".join(parts)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates_for_10_schemas(client, model, stream):
    with concurrent.futures.ThreadPoolExecutor(5) as pool:  # batched in the engine, so bounded in time
        texts = list(pool.map(lambda i: _structured(client, model, i, stream), range(len(SCHEMAS))))
    for schema, text in zip(SCHEMAS, texts):
        jsonschema.validate(json.loads(text), schema)


def test_n_choices_seed_and_logprobs(client, model):
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=3, seed=5, logprobs=2)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seed: same output
    assert len({c.text for c in first.choices}) > 1  # n choices draw differently (seed + j)
    assert first.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in first.choices)
    for c in first.choices:
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert all(len(top) >= 2 for top in c.logprobs.top_logprobs)
    # echo: the prompt logprobs of prompt + sampled tokens equal the logprobs sampled with them
    base = f"{client.base_url.scheme}://{client.base_url.host}:{client.base_url.port}"
    ids = http("POST", base + "/tokenize", {"prompt": "Once upon a time"})[1]["tokens"]
    greedy = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0, logprobs=0)
    gen = greedy.choices[0].logprobs
    gen_ids = http("POST", base + "/tokenize", {"prompt": greedy.choices[0].text, "add_special_tokens": False})[1]
    echo = client.completions.create(model=model, prompt=ids + gen_ids["tokens"], max_tokens=1,
                                     temperature=0, logprobs=0, echo=True)
    echoed = echo.choices[0].logprobs
    assert echoed.token_logprobs[0] is None and echo.choices[0].text.startswith("Once upon a time")
    assert echoed.tokens[len(ids):len(ids) + len(gen.tokens)] == gen.tokens  # the same tokens, re-tokenized
    # The server runs bf16, where a prefill row and a decode step round differently (~0.05 nat); the
    # exact (fp32, 1e-4) comparison with the model's log-softmax is in tests/test_sampling_features.py.
    assert echoed.token_logprobs[len(ids):len(ids) + len(gen.tokens)] == pytest.approx(gen.token_logprobs, abs=0.15)


def test_chat_logprobs_streamed_and_not(client, model):
    kwargs = dict(model=model, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                  messages=[{"role": "user", "content": "Say hi"}])
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kwargs) for c in chunk.choices
                if c.logprobs for e in c.logprobs.content]
    assert 1 <= len(whole) == len(streamed) <= 5
    assert [e.token for e in whole] == [e.token for e in streamed]
    assert [e.logprob for e in whole] == pytest.approx([e.logprob for e in streamed], abs=1e-3)
    for e in whole:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6


def test_langchain_structured_output(app_url, model):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int

    llm = ChatOpenAI(base_url=app_url + "/v1", api_key="unused", model=model, temperature=0, max_tokens=80,
                     max_retries=0, timeout=300)
    person = llm.with_structured_output(Person).invoke("Invent a person. Give their name and age.")
    assert isinstance(person, Person) and person.name and isinstance(person.age, int)


LL_ITEMS = [{"q": "The sky is", "choices": [" blue", " made of cheese"], "gold": 0},
            {"q": "Two plus two is", "choices": [" four", " banana"], "gold": 0},
            {"q": "Water is", "choices": [" wet", " a planet"], "gold": 0}]
GEN_ITEMS = [{"q": "Q: What is 1+1?\nA:", "a": "2"}, {"q": "Q: What color is grass?\nA:", "a": "green"}]


def _lm_eval_tasks(tmp_path) -> None:
    (tmp_path / "ll.jsonl").write_text("".join(json.dumps(x) + "\n" for x in LL_ITEMS))
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps(x) + "\n" for x in GEN_ITEMS))
    (tmp_path / "tiny_ll.yaml").write_text(f"""task: tiny_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / 'll.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
""")
    (tmp_path / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")


def test_lm_eval_loglikelihood_and_generate_until(app_url, model, tmp_path, default_model_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    _lm_eval_tasks(tmp_path)
    args = (f"base_url={app_url}/v1/completions,model={model},tokenizer={default_model_dir},"
            f"tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,max_length=1024")
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["tiny_ll", "tiny_gen"],
                                  task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    acc = out["results"]["tiny_ll"]["acc,none"]
    assert isinstance(acc, float) and 0 <= acc <= 1
    assert 0 <= out["results"]["tiny_gen"]["exact_match,none"] <= 1
    assert all(isinstance(s["resps"][0][0], str) for s in out["samples"]["tiny_gen"])
    # lm-eval's log-likelihoods are our engine's: recompute one through echo on /v1/completions
    sample = out["samples"]["tiny_ll"][0]
    (context, continuation) = sample["arguments"][0]
    ll_lm_eval = sample["resps"][0][0][0]
    ctx = http("POST", app_url + "/tokenize", {"prompt": context, "add_special_tokens": False})[1]["tokens"]
    cont = http("POST", app_url + "/tokenize", {"prompt": continuation, "add_special_tokens": False})[1]["tokens"]
    status, body = http("POST", app_url + "/v1/completions", {"prompt": ctx + cont, "max_tokens": 1, "echo": True,
                                                              "logprobs": 0, "temperature": 0})
    assert status == 200, body
    ours = sum(body["choices"][0]["logprobs"]["token_logprobs"][len(ctx):len(ctx) + len(cont)])
    assert math.isfinite(ll_lm_eval) and ll_lm_eval == pytest.approx(ours, abs=0.05)
