"""The ingress over the fake engine: n choices x batched prompts (ids, seeds, order, usage),
streaming merge, echo, model optional, unknown fields logged, /tokenize, /detokenize, /version,
/v1/models/{id}."""
from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from deployments.ingress import IngressSettings, build_ingress_app
from tests.fakes import FakeEngine
from tests.test_ingress import sse_data

MODEL = "fake-echo"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(model_name=MODEL, max_model_len=64)


@pytest.fixture
def client(engine):
    with TestClient(build_ingress_app(engine, IngressSettings())) as c:
        yield c


def test_batched_prompts_times_n_are_numbered_as_vllm(client, engine):
    r = client.post("/v1/completions", json={"prompt": ["ab", "xyz"], "n": 2, "max_tokens": 8, "seed": 10})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["ab", "ab", "xyz", "xyz"]  # the fake echoes its prompt
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3 + 3 + 4 + 4, "total_tokens": 19,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    ids = [q.request_id for q in engine.requests]
    assert len(set(ids)) == 4 and all(i.startswith(body["id"]) for i in ids)
    assert sorted(q.seed for q in engine.requests) == [10, 10, 11, 11]  # choice j: seed + j


def test_streamed_choices_merge_and_usage_comes_last(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hey"}], "n": 3,
                                                  "stream": True, "stream_options": {"include_usage": True}})
    events = sse_data(r.text)
    texts, finishes = {}, {}
    for e in events[:-1]:
        (c,) = e["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
        if c["finish_reason"]:
            finishes[c["index"]] = c["finish_reason"]
    assert texts == {0: "hey", 1: "hey", 2: "hey"} and finishes == {0: "stop", 1: "stop", 2: "stop"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == 3
    assert events[-1]["usage"]["completion_tokens"] == 3 * 4


def test_echo_returns_the_prompt_first(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "echo": True, "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "hihi"
    events = sse_data(client.post("/v1/completions", json={"prompt": [104, 105], "echo": True, "max_tokens": 2,
                                                           "stream": True}).text)
    assert "".join(c["text"] for e in events for c in e["choices"]) == "hihi"


def test_unknown_fields_are_accepted_and_logged(client, caplog):
    with caplog.at_level(logging.WARNING, logger="morphserve.ingress"):
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "frobnicate": True})
    assert r.status_code == 200
    assert any("frobnicate" in rec.getMessage() for rec in caplog.records)


def test_tokenize_detokenize_version_and_model_by_id(client):
    tok = client.post("/tokenize", json={"prompt": "abc"}).json()
    assert tok == {"count": 3, "max_model_len": 64, "tokens": [97, 98, 99]}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == [104, 105]
    assert client.post("/detokenize", json={"tokens": [97, 98]}).json() == {"prompt": "ab"}
    assert client.post("/tokenize", json={"prompt": "a", "model": "other"}).status_code == 400
    assert isinstance(client.get("/version").json()["version"], str)
    card = client.get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model"
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_completions_tokenize_with_special_tokens_as_vllm_chat_does_not():
    class Recording(FakeEngine):
        calls: list = []

        async def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
            self.calls.append(add_special_tokens)
            return await super().tokenize(text, add_special_tokens)

    engine = Recording(model_name=MODEL, max_model_len=64)
    with TestClient(build_ingress_app(engine, IngressSettings())) as c:
        assert c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1}).status_code == 200
        assert c.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False}).status_code == 200
    assert engine.calls == [True, False]  # BOS as the tokenizer adds it on /v1/completions (vLLM's default)
