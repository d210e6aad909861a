"""The OpenAI HTTP layer over the FakeEngine: response shapes, every refusal with its status and
OpenAI error body, auth, overload, disconnects, metrics, and the official `openai` client over a
real socket (uvicorn in a thread)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading

import pytest
from starlette.testclient import TestClient

from deployments.engine_client import HandleEngineClient
from tests.fakes import FakeEngine
from deployments.ingress import IngressSettings, build_ingress_app
from deployments.metrics import InMemoryBackend, ServeMetrics
from engine.errors import InvalidRequestError

MODEL = "fake-echo"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def user(text: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}]}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(model_name=MODEL, max_model_len=64)


@pytest.fixture
def backend() -> InMemoryBackend:
    return InMemoryBackend()


@pytest.fixture
def client(engine, backend):
    app = build_ingress_app(engine, IngressSettings(retry_after_s=3), ServeMetrics(MODEL, backend))
    with TestClient(app) as c:
        yield c


def sse_data(text: str) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except the final [DONE]."""
    events = [block.removeprefix("data: ") for block in text.split("\n\n") if block]
    assert events[-1] == "[DONE]", events[-1]
    return [json.loads(e) for e in events[:-1]]


def assert_openai_error(response, status: int, param: str | None = "ANY") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "ANY":
        assert error["param"] == param, error
    return error


# ---- shapes ------------------------------------------------------------------------------------

def test_chat_completion_body(client):
    r = client.post(CHAT, json=user("Hello"))
    body = r.json()
    assert r.status_code == 200 and body["id"] == "chatcmpl-" + r.headers["x-request-id"]
    assert body["object"] == "chat.completion" and body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                                "finish_reason": "stop", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # + eos, as LLMEngine counts it


def test_completion_body_with_max_tokens(client, engine):
    r = client.post(COMPLETIONS, json={"model": MODEL, "prompt": "abcdef", "max_tokens": 4, "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "abcd" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    sent = engine.requests[-1]
    assert sent.request_id == body["id"] and sent.max_tokens == 4 and sent.temperature == 0.0


def test_cache_salt_reaches_the_engine(client, engine):
    assert client.post(CHAT, json={**user("abc"), "cache_salt": "tenant-7"}).status_code == 200
    assert engine.requests[-1].cache_salt == "tenant-7"
    assert client.post(COMPLETIONS, json={"model": MODEL, "prompt": "x"}).status_code == 200
    assert engine.requests[-1].cache_salt is None


def test_completion_defaults_to_16_tokens_and_chat_to_the_context_left(client, engine):
    client.post(COMPLETIONS, json={"model": MODEL, "prompt": "x", "ignore_eos": True})
    assert engine.requests[-1].max_tokens == 16
    client.post(CHAT, json=user("abc"))
    assert engine.requests[-1].max_tokens == 64 - 3


def test_chat_stream_with_usage(client):
    r = client.post(CHAT, json={**user("Hi!"), "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_data(r.text)
    assert {c["id"] for c in chunks} == {"chatcmpl-" + r.headers["x-request-id"]}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == "Hi!"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4  # "Hi!" + eos


def test_completion_stream(client):
    r = client.post(COMPLETIONS, json={"model": MODEL, "prompt": [104, 105], "stream": True})
    chunks = sse_data(r.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hi"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and all("usage" not in c for c in chunks)


def test_models_and_health(client, engine):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 64
    assert client.get("/health").json() == {"status": "ok"}
    engine.healthy = False
    assert_openai_error(client.get("/health"), 503)


# ---- refusals ----------------------------------------------------------------------------------

BAD_REQUESTS = [
    (CHAT, {**user("x"), "model": "gpt-4"}, "model"),
    (CHAT, {**user("x"), "temperature": "hot"}, "temperature"),
    (CHAT, {**user("x"), "temperature": -0.5}, "temperature"),
    (CHAT, {**user("x"), "top_p": 0}, "top_p"),
    (CHAT, {**user("x"), "top_p": 1.5}, "top_p"),
    (CHAT, {**user("x"), "max_tokens": 64}, "max_tokens"),  # one prompt token leaves 63 of 64
    (CHAT, {**user("x"), "max_tokens": 0}, "max_tokens"),
    (CHAT, user("y" * 64), "messages"),
    (CHAT, {"model": MODEL, "messages": []}, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user"}]}, "messages.0.content"),
    (CHAT, {"model": MODEL, "messages": "hello"}, "messages"),
    (CHAT, {**user("x"), "stop": 3}, "stop"),
    (CHAT, {**user("x"), "stop": ["ok", 4]}, "stop"),
    (CHAT, {**user("x"), "n": 0}, "n"),
    (CHAT, {**user("x"), "n": 1000}, "n"),
    (CHAT, {**user("x"), "top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    (CHAT, {**user("x"), "logprobs": True, "top_logprobs": 21}, "logprobs"),  # OpenAI's limit is 20
    # issue 13: every known field we cannot honour is a 400 naming it, never dropped
    (CHAT, {**user("x"), "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {**user("x"), "tool_choice": "auto"}, "tool_choice"),
    (CHAT, {**user("x"), "functions": [{"name": "f"}]}, "functions"),
    (CHAT, {**user("x"), "echo": True}, "echo"),
    (CHAT, {**user("x"), "use_beam_search": True}, "use_beam_search"),
    (CHAT, {**user("x"), "guided_regex": "a+"}, "guided_regex"),
    (CHAT, {**user("x"), "skip_special_tokens": False}, "skip_special_tokens"),
    (CHAT, {**user("x"), "response_format": {"type": "json_schema"}}, "response_format"),
    (CHAT, {**user("x"), "response_format": {"type": "yaml"}}, "response_format.type"),
    (CHAT, {**user("x"), "presence_penalty": 3}, "presence_penalty"),
    (CHAT, {**user("x"), "frequency_penalty": -2.5}, "frequency_penalty"),
    (CHAT, {**user("x"), "repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {**user("x"), "min_p": 1.5}, "min_p"),
    (CHAT, {**user("x"), "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    (CHAT, {**user("x"), "logit_bias": {"abc": 1}}, "logit_bias"),
    (CHAT, {**user("x"), "logit_bias": {"3": 500}}, "logit_bias"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"model": MODEL, "prompt": ["x", ""]}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [[1, 2], "x", 3]}, "prompt"),
    (CHAT, {**user("x"), "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {**user("x"), "stop_token_ids": [-1]}, "stop_token_ids"),  # refused by the engine itself
    (COMPLETIONS, {"model": MODEL, "prompt": ""}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": []}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [0x110000]}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "best_of": 3}, "best_of"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "top_k": -3}, "top_k"),
    # issue 12: ranges the sampler cannot hold, and text no tokenizer can encode
    (CHAT, {**user("x"), "top_k": 2**63}, "top_k"),
    (CHAT, {**user("x"), "top_k": 4611686018427387904000}, "top_k"),
    (CHAT, {**user("x"), "seed": 2**64}, "seed"),
    (CHAT, {**user("x"), "seed": -(2**63) - 1}, "seed"),
    (CHAT, {**user("x"), "stop": [""]}, "stop"),
    (CHAT, {**user("x"), "stop_token_ids": [2**63]}, "stop_token_ids"),
    (CHAT, {**user("x"), "max_completion_tokens": -1}, "max_tokens"),
    (CHAT, user("a\ud800b"), "messages.0.content"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages.0.content"),
    (CHAT, {**user("x"), "stop": ["\ud800"]}, "stop.0"),
    (CHAT, {**user("x"), "stop": ["a", "b", "c", "d", "e"]}, "stop"),  # the fake engine's limit: 4 strings
    (CHAT, {**user("x"), "stop": ["123456789"]}, "stop"),  # ... of at most 8 characters
    (COMPLETIONS, {"model": MODEL, "prompt": "\ud800"}, "prompt"),
    (CHAT, {**user("x"), "cache_salt": ""}, "cache_salt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "cache_salt": 7}, "cache_salt"),
]


@pytest.mark.parametrize("path, body, param", BAD_REQUESTS)
def test_bad_requests_are_400_with_an_openai_body(client, engine, path, body, param):
    raw = json.dumps(body)  # ASCII escapes: JSON can carry a lone surrogate that UTF-8 cannot
    error = assert_openai_error(client.post(path, content=raw, headers={"content-type": "application/json"}),
                                400, param)
    assert error["type"] == "invalid_request_error"
    assert engine.in_flight == set()


def test_malformed_json_is_400(client):
    r = client.post(CHAT, content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


def test_engine_side_invalid_request_keeps_its_param(client, engine):
    engine.inject_fault(InvalidRequestError("seed is out of range", param="seed"))
    error = assert_openai_error(client.post(CHAT, json={**user("x"), "stream": True}), 400, "seed")
    assert "seed is out of range" in error["message"]


def test_internal_fault_is_500_logged_and_the_server_keeps_serving(client, engine, caplog):
    engine.inject_fault(RuntimeError("kaboom"))
    with caplog.at_level(logging.ERROR, logger="morphserve.ingress"):
        r = client.post(CHAT, json=user("x"))
    error = assert_openai_error(r, 500)
    assert r.headers["x-request-id"] in error["message"] and "kaboom" not in error["message"]
    assert any(r.headers["x-request-id"] in rec.getMessage() for rec in caplog.records)
    assert client.post(CHAT, json=user("ok")).status_code == 200


def test_fault_mid_stream_becomes_an_error_event(client, engine):
    engine.inject_fault(RuntimeError("kaboom"), after_tokens=2)
    r = client.post(CHAT, json={**user("abcdef"), "stream": True})
    chunks = sse_data(r.text)
    assert r.status_code == 200 and chunks[-1]["error"]["type"] == "server_error"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "ab"


def test_unknown_route_has_an_openai_body(client):
    assert_openai_error(client.get("/v1/nothing"), 404)


# ---- overload and disconnects ------------------------------------------------------------------

def test_full_queue_is_503_with_retry_after_and_closing_a_stream_aborts(backend):
    engine = FakeEngine(model_name=MODEL, token_delay_s=0.01, queue_limit=1)
    app = build_ingress_app(engine, IngressSettings(retry_after_s=3), ServeMetrics(MODEL, backend))
    with TestClient(app) as c:
        with c.stream("POST", CHAT, json={**user("a long enough prompt"), "stream": True}) as first:
            lines = first.iter_lines()  # keep a reference: a collected iterator closes the response
            next(lines)  # the first request is in flight now
            for body in (user("x"), {**user("x"), "stream": True}):
                r = c.post(CHAT, json=body)
                assert_openai_error(r, 503)
                assert r.headers["retry-after"] == "3"
            rid = "chatcmpl-" + first.headers["x-request-id"]
        assert engine.abort_event.wait(5)
    assert engine.aborted == [rid] and engine.in_flight == set()
    assert backend.metrics["morphserve_request_success"].value(model_name=MODEL, finished_reason="abort") == 1


def test_ray_back_pressure_is_503():
    from ray.serve.exceptions import BackPressureError
    from tests.test_protocol import FakeHandle, FakeReplica

    handle = FakeHandle(FakeReplica(FakeEngine(model_name=MODEL)))
    app = build_ingress_app(HandleEngineClient(handle), IngressSettings())
    with TestClient(app) as c:
        assert c.post(CHAT, json=user("x")).status_code == 200  # model info and tokenizing work
        handle.reject = BackPressureError(num_queued_requests=8, max_queued_requests=8)
        assert_openai_error(c.post(CHAT, json=user("x")), 503)


async def _asgi_call(app, body: dict, disconnect_after_body: bool) -> list[dict]:
    """Drive the ASGI app by hand; the client 'disconnects' once the first body bytes arrive (or,
    with disconnect_after_body False, right after sending the request)."""
    sent: list[dict] = []
    got_body = asyncio.Event()
    request = {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
    messages = [request]

    async def receive():
        if messages:
            return messages.pop()
        if disconnect_after_body:
            await got_body.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            got_body.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("t", 1),
             "server": ("t", 80)}
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_engine_request(stream):
    engine = FakeEngine(model_name=MODEL, token_delay_s=0.01)
    app = build_ingress_app(engine, IngressSettings())
    body = {**user("abcdefghij" * 5), "stream": stream}
    asyncio.run(_asgi_call(app, body, disconnect_after_body=stream))
    assert len(engine.aborted) == 1 and engine.finished == [] and engine.in_flight == set()


# ---- auth --------------------------------------------------------------------------------------

def test_api_key_is_required_on_v1_but_not_on_health(engine):
    app = build_ingress_app(engine, IngressSettings(api_key="sk-good"))
    with TestClient(app) as c:
        for headers in ({}, {"Authorization": "Bearer sk-bad"}, {"Authorization": "sk-good"}):
            error = assert_openai_error(c.post(CHAT, json=user("x"), headers=headers), 401)
            assert error["code"] == "invalid_api_key"
        assert_openai_error(c.get("/v1/models"), 401)
        # auth comes before validation: a bad body without a key is still 401
        assert_openai_error(c.post(CHAT, json={"bad": 1}), 401)
        ok = {"Authorization": "Bearer sk-good"}
        assert c.post(CHAT, json=user("x"), headers=ok).status_code == 200
        assert c.get("/health").status_code == 200


def test_admin_router_gives_this_processs_routing_decisions(engine):
    from deployments.router_decisions import decision_totals, tally

    app = build_ingress_app(engine, IngressSettings(admin_token="root"))
    with TestClient(app) as c:
        assert_openai_error(c.get("/admin/router"), 401)
        admin = {"Authorization": "Bearer root"}
        before = c.get("/admin/router", headers=admin).json()["decisions"]
        assert before == decision_totals()
        tally("overflow")
        tally("stale")
        after = c.get("/admin/router", headers=admin).json()["decisions"]
        assert after["overflow"] == before.get("overflow", 0) + 1 and after["stale"] == before.get("stale", 0) + 1


def test_admin_is_forbidden_without_a_configured_token(client):
    assert_openai_error(client.get("/admin/morph"), 403)
    assert_openai_error(client.post("/admin/morph", json={"mode": "accuracy"},
                                    headers={"Authorization": "Bearer anything"}), 403)


def test_admin_with_a_token(engine):
    app = build_ingress_app(engine, IngressSettings(api_key="sk-user", admin_token="root"))
    with TestClient(app) as c:
        assert_openai_error(c.get("/admin/morph"), 401)
        assert_openai_error(c.get("/admin/morph", headers={"Authorization": "Bearer sk-user"}), 401)
        admin = {"Authorization": "Bearer root"}
        assert c.get("/admin/morph", headers=admin).json()["morphing_enabled"] is True
        r = c.post("/admin/morph", json={"mode": "accuracy", "morphing_enabled": False}, headers=admin)
        assert r.status_code == 200 and r.json()["mode"] == "accuracy" and r.json()["morphing_enabled"] is False
        assert engine.admin_updates[-1].mode == "accuracy"
        assert_openai_error(c.post("/admin/morph", json={"mode": "turbo"}, headers=admin), 400, "mode")
        assert_openai_error(c.post("/admin/morph", json={"modee": "accuracy"}, headers=admin), 400, "modee")
        assert_openai_error(c.post("/admin/morph", json={}, headers=admin), 400)
        assert_openai_error(c.post("/admin/morph", json={"precision": "int4"}, headers=admin), 400, "precision")
        assert len(engine.admin_updates) == 1


# ---- metrics -----------------------------------------------------------------------------------

def test_ingress_records_request_metrics(backend):
    engine = FakeEngine(model_name=MODEL, token_delay_s=0.002)
    app = build_ingress_app(engine, IngressSettings(), ServeMetrics(MODEL, backend))
    with TestClient(app) as c:
        c.post(CHAT, json={**user("abcd"), "stream": True})
        c.post(COMPLETIONS, json={"model": MODEL, "prompt": "abcdef", "max_tokens": 2})
    m, tags = backend.metrics, {"model_name": MODEL}
    assert m["morphserve_time_to_first_token_seconds"].count(**tags) == 2
    assert m["morphserve_inter_token_latency_seconds"].count(**tags) == 4 + 1  # gaps: 5 tokens of "abcd" + eos, 2 of "ab"
    assert m["morphserve_e2e_request_latency_seconds"].count(**tags) == 2
    assert m["morphserve_request_success"].value(finished_reason="stop", **tags) == 1
    assert m["morphserve_request_success"].value(finished_reason="length", **tags) == 1
    assert m["morphserve_prompt_tokens"].value(**tags) == 4 + 6
    assert m["morphserve_generation_tokens"].value(**tags) == 5 + 2
    assert m["morphserve_inter_token_latency_seconds"].value(**tags) > 0


# ---- the official openai client over a real socket ---------------------------------------------

@contextlib.contextmanager
def serve_in_thread(app):
    """uvicorn on 127.0.0.1, a free port, in a thread. The socket listens before the thread starts,
    so clients can connect at once; leaving the block stops the server."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
    assert not thread.is_alive(), "uvicorn did not stop"


def test_official_openai_client(engine):
    import openai

    app = build_ingress_app(engine, IngressSettings(api_key="sk-test"))
    with serve_in_thread(app) as url, contextlib.ExitStack() as stack:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=20)
        stack.callback(client.close)  # no idle keep-alive connection to hold up the server's stop
        assert [m.id for m in client.models.list()] == [MODEL]
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}])
        assert answer.choices[0].message.content == "Hello" and answer.usage.total_tokens == 11
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hey"}],
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hey"
        assert chunks[-1].usage.completion_tokens == 4
        text = client.completions.create(model=MODEL, prompt="abc", max_tokens=2)
        assert text.choices[0].text == "ab" and text.choices[0].finish_reason == "length"
        pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="xyz", stream=True)]
        assert "".join(pieces) == "xyz"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.AuthenticationError):
            stack.enter_context(openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)).models.list()


def test_openai_client_closing_a_stream_aborts_the_request():
    import openai

    engine = FakeEngine(model_name=MODEL, token_delay_s=0.02)
    with serve_in_thread(build_ingress_app(engine, IngressSettings())) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=20)
        stream = client.chat.completions.create(model=MODEL, stream=True,
                                                messages=[{"role": "user", "content": "z" * 50}])
        next(iter(stream))
        stream.close()
        assert engine.abort_event.wait(10), "the engine request was not aborted"
    assert len(engine.aborted) == 1 and engine.finished == []


# ---- ServeMetrics from the replica's side ------------------------------------------------------

def _snapshot(preemptions: int, kv_used: int = 30):
    from engine.pressure import LedgerFigures, PressureSnapshot

    ledger = LedgerFigures(budget=1000, weights=600, kv=300, reserve=50)
    return PressureSnapshot(time=0.0, step=1, kv_used_blocks=kv_used, kv_capacity_blocks=40, kv_max_blocks=64,
                            num_running=3, num_waiting=2, queue_delay_s=0.25, ttft_recent_s=None,
                            tpot_recent_s=None, throughput_tok_s=0.0, preemptions_total=preemptions, ledger=ledger,
                            prefill_backlog_tokens=120)


def test_pressure_gauges_and_preemption_counter(backend):
    metrics = ServeMetrics(MODEL, backend)
    m, tags = backend.metrics, {"model_name": MODEL}
    for total in (2, 2, 5):  # the snapshot has a running total; the counter must not double count
        metrics.set_pressure(_snapshot(total))
    assert m["morphserve_num_preemptions"].value(**tags) == 5
    assert m["morphserve_kv_cache_usage_perc"].value(**tags) == 30 / 40
    assert m["morphserve_num_requests_waiting"].value(**tags) == 2
    assert m["morphserve_queue_delay_seconds"].value(**tags) == 0.25
    assert m["morphserve_prefill_backlog_tokens"].value(**tags) == 120
    assert m["morphserve_memory_bytes"].value(kind="weights", **tags) == 600
    assert m["morphserve_memory_bytes"].value(kind="budget", **tags) == 1000


def test_morph_state_and_actions(backend):
    from engine.morph.actions import ActionResult, MorphState, RestoreLayer, SwapLayer
    from engine.precision import Precision

    metrics = ServeMetrics(MODEL, backend)
    m, tags = backend.metrics, {"model_name": MODEL}
    state = MorphState(layer_precisions=(Precision.INT4, Precision.INT8, Precision.INT4, Precision.BF16),
                       full_precision=Precision.BF16, swap_order=(0, 2, 1, 3), swap_order_source="front-to-back",
                       kv_capacity_blocks=77, kv_max_blocks=100)
    metrics.set_morph_state(state)
    assert m["morphserve_quantized_layers"].value(precision="int4", **tags) == 2
    assert m["morphserve_quantized_layers"].value(precision="int8", **tags) == 1
    assert m["morphserve_kv_cache_capacity_blocks"].value(**tags) == 77
    down = ActionResult(SwapLayer(0, Precision.INT4), "done", (0,), -500, 12, swap_seconds=0.02, resize_seconds=0.01)
    up = ActionResult(RestoreLayer(0), "done", (0,), 500, -12, swap_seconds=0.03, resize_seconds=0.005)
    for result in (down, up, ActionResult(RestoreLayer(1), "waiting")):
        metrics.count_action(result)
    actions = m["morphserve_morph_actions"]
    assert [actions.value(kind=k, **tags) for k in ("swap_down", "restore", "kv_grow", "kv_shrink")] == [1, 1, 1, 1]
    assert m["morphserve_layer_swap_latency_seconds"].value(direction="up", **tags) == 0.03
    assert m["morphserve_kv_resize_latency_seconds"].count(direction="grow", **tags) == 1
    metrics.set_controller_reachable(False)
    assert m["morphserve_controller_reachable"].value(**tags) == 0.0


def test_ray_backend_accepts_every_metric_and_tag():
    """ray.serve.metrics checks names, buckets and that every declared tag has a value; outside a
    replica it records locally, so a bad definition shows up here without a cluster."""
    from deployments.metrics import RayBackend, RequestRecord, default_backend

    assert isinstance(default_backend(), InMemoryBackend)  # not inside a Serve replica here
    metrics = ServeMetrics(MODEL, RayBackend())
    metrics.observe_request(RequestRecord("stop", 3, 2, 0.5, 0.1, (0.01,)))
    metrics.observe_queue_time(0.01)
    metrics.set_pressure(_snapshot(1))
    metrics.set_controller_reachable(True)


def test_fault_while_collecting_a_non_streamed_answer_is_500(client, engine):
    engine.inject_fault(RuntimeError("kaboom"), after_tokens=2)
    assert_openai_error(client.post(CHAT, json=user("abcdef")), 500)
    assert client.post(CHAT, json=user("ok")).json()["choices"][0]["message"]["content"] == "ok"


def test_a_sane_incoming_request_id_is_adopted(client, engine):
    r = client.post(CHAT, json=user("x"), headers={"x-request-id": "trace-42"})
    assert r.json()["id"] == "chatcmpl-trace-42" and r.headers["x-request-id"] == "trace-42"
    assert engine.requests[-1].request_id == "chatcmpl-trace-42"
    r = client.post(CHAT, json=user("x"), headers={"x-request-id": "bad id\twith spaces"})
    assert r.headers["x-request-id"] != "bad id\twith spaces" and r.json()["id"].endswith(r.headers["x-request-id"])


def test_request_id_header_can_be_left_to_a_proxy(engine):
    with TestClient(build_ingress_app(engine, IngressSettings(echo_request_id=False))) as c:
        r = c.post(CHAT, json=user("x"), headers={"x-request-id": "from-proxy"})
    assert "x-request-id" not in r.headers and r.json()["id"] == "chatcmpl-from-proxy"


def test_a_body_over_the_limit_is_413_with_an_openai_body(engine):
    app = build_ingress_app(engine, IngressSettings(max_body_bytes=4096))
    big = user("x" * 5000)
    with TestClient(app) as c:
        assert_openai_error(c.post(CHAT, json=big), 413)  # Content-Length says so: refused unread

        def chunks():  # no Content-Length (chunked upload): refused once the bytes pass the limit
            raw = json.dumps(big).encode()
            for i in range(0, len(raw), 1000):
                yield raw[i:i + 1000]
        assert_openai_error(c.post(CHAT, content=chunks(), headers={"content-type": "application/json"}), 413)
        assert c.post(CHAT, json=user("small")).status_code == 200
    assert engine.requests and all(r.prompt_token_ids == tuple(map(ord, "small")) for r in engine.requests)
