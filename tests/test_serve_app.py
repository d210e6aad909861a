"""The Serve application end to end: the real default model (bf16) behind the real app on a local
Ray cluster, driven by the official `openai` client and raw HTTP; and build_app's argument checks."""
from __future__ import annotations

import concurrent.futures
import json
import urllib.request
from pathlib import Path

import pytest
import yaml

from engine.errors import InvalidRequestError
from tests.serve_helpers import CHAT_PROMPT, auto_budget, http, serve_app

ROOT = Path(__file__).resolve().parents[1]
API_KEY, ADMIN = "sk-test-key", "admin-test-token"
CONTROLLER = {"controller_name": "test-serve-app-controller", "controller_namespace": "morphserve-test-app"}


# ---- build_app: arguments, no cluster --------------------------------------------------------

def test_build_app_accepts_the_shipped_configs():
    from ray.serve.deployment import Application

    from deployments import build_app

    rayservice = yaml.safe_load((ROOT / "kubernetes" / "rayservice.yaml").read_text())
    serve_v2 = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    example = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())
    for config in (serve_v2, example):
        for app in config["applications"]:
            assert app["import_path"] == "deployments:build_app"
            assert isinstance(build_app(app.get("args", {})), Application)
            assert {d["name"] for d in app.get("deployments", [])} <= {"OpenAIIngress", "LLMServer"}


@pytest.mark.parametrize("args, param", [
    ({"modle": "default"}, "modle"),
    ({"dtype": "int3"}, "dtype"),
    ({"memory_budget": "lots"}, "memory_budget"),
    ({"mode": "turbo"}, "mode"),
    ({"num_replicas": 2, "autoscaling_config": {"max_replicas": 2}}, None),
    ({"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}, None),
    ({"policy": {"enter_after": 0}}, "enter_after"),
    ({"policy": {"mode": "accuracy"}}, None),
    ({"engine": {"model": "other"}}, "engine"),
    ({"engine": {"block_size": "big"}}, "block_size"),
    ({"report_interval_s": 0}, "report_interval_s"),
    ({"router_transit_s": -0.1}, "router_transit_s"),
    ({"fleet_restore_calm_s": -1.0}, "fleet_restore_calm_s"),
    ({"fleet_restore_calm_s": 16.0}, None),  # not shorter than 64 reports x 0.25 s: never calm long enough
])
def test_bad_args_fail_before_anything_is_deployed(args, param):
    from deployments import build_app

    with pytest.raises(InvalidRequestError) as err:
        build_app(args)
    assert str(err.value).startswith("invalid MorphServe application args")
    if param is not None:
        assert err.value.param == param and param in str(err.value)


def test_secrets_come_from_the_environment_unless_given(monkeypatch):
    from deployments.app_args import parse_app_args

    monkeypatch.setenv("MORPHSERVE_API_KEY", "from-env")
    monkeypatch.setenv("MORPHSERVE_ADMIN_TOKEN", "admin-from-env")
    assert parse_app_args({}).ingress_settings().api_key == "from-env"
    assert parse_app_args({}).ingress_settings().admin_token == "admin-from-env"
    assert parse_app_args({"api_key": "given"}).ingress_settings().api_key == "given"
    monkeypatch.delenv("MORPHSERVE_API_KEY")
    assert parse_app_args({}).ingress_settings().api_key is None


def test_autoscaling_gets_the_morph_aware_policy_and_counts_scale_out_requests():
    from types import SimpleNamespace

    from ray.serve.config import AutoscalingConfig

    from deployments.autoscaling import POLICY_IMPORT_PATH, SCALE_OUT_METRIC, morph_aware_policy, with_morph_policy

    config = with_morph_policy({"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8})
    assert config["policy"] == {"policy_function": POLICY_IMPORT_PATH}
    assert with_morph_policy({"policy": {"policy_function": "x:y"}})["policy"] == {"policy_function": "x:y"}

    def ctx(ongoing: float, scale_out: list[float]) -> SimpleNamespace:
        return SimpleNamespace(current_num_replicas=2, target_num_replicas=2, total_num_requests=ongoing,
                               config=AutoscalingConfig(**{k: v for k, v in config.items() if k != "policy"}),
                               aggregated_metrics={SCALE_OUT_METRIC: dict(enumerate(scale_out))}, policy_state={})

    assert morph_aware_policy(ctx(16, [0.0, 0.0]))[0] == pytest.approx(2.0)  # queue at target: hold
    assert morph_aware_policy(ctx(4, [0.0, 0.0]))[0] == pytest.approx(0.5)  # quiet: Ray's policy shrinks
    assert morph_aware_policy(ctx(4, [1.0, 0.0]))[0] == 3  # one replica fully morphed and pressured
    assert morph_aware_policy(ctx(48, [1.0, 1.0]))[0] == pytest.approx(6.0)  # the queue asks for more


def test_autoscaling_scales_in_only_once_every_replica_is_back_at_full_precision():
    from deployments.autoscaling import QUANTIZED_METRIC, SCALE_OUT_METRIC, morph_rules

    quiet = {SCALE_OUT_METRIC: {0: 0.0, 1: 0.0}}
    assert morph_rules(0.5, 2, {**quiet, QUANTIZED_METRIC: {0: 0.0, 1: 3.0}}) == 2  # still morphed: hold
    assert morph_rules(0.5, 2, {**quiet, QUANTIZED_METRIC: {0: 0.0, 1: 0.0}}) == 0.5  # restored: shrink
    assert morph_rules(3.0, 2, {**quiet, QUANTIZED_METRIC: {0: 2.0}}) == 3.0  # growing is never held back


def test_autoscaling_never_cancels_a_replica_that_is_still_starting():
    from deployments.autoscaling import QUANTIZED_METRIC, SCALE_OUT_METRIC, morph_rules

    # One replica runs, a second (asked for) is starting; its flag dropped meanwhile, nothing morphed.
    quiet = {SCALE_OUT_METRIC: {0: 0.0}, QUANTIZED_METRIC: {0: 0.0}}
    assert morph_rules(1.0, 1, quiet, target=2) == 2  # starting: hold the target
    assert morph_rules(1.0, 1, {**quiet, QUANTIZED_METRIC: {0: 2.0}}, target=2) == 2  # morphed: hold the target
    assert morph_rules(0.5, 2, quiet, target=2) == 0.5  # both running and quiet: Ray's policy shrinks
    assert morph_rules(1.0, 1, {**quiet, SCALE_OUT_METRIC: {0: 1.0}}, target=2) == 2  # still asking: no third


# ---- the running application ------------------------------------------------------------------

@pytest.fixture(scope="module")
def app_url():
    with serve_app({"api_key": API_KEY, "admin_token": ADMIN, "memory_budget": auto_budget("600MiB"),
                    "engine": {"max_model_len": 1024}, **CONTROLLER}) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(app_url):
    import openai

    return openai.OpenAI(base_url=app_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected_prompt_tokens(default_model_dir) -> int:
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(default_model_dir)
    return len(tokenizer.encode(tokenizer.apply_chat_template(CHAT_PROMPT)))


@pytest.mark.slow
def test_models_and_health(app_url, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert http("GET", app_url + "/health") == (200, {"status": "ok"})


@pytest.mark.slow
def test_chat_non_streaming_and_streaming_agree(app_url, client, expected_prompt_tokens):
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(model=model, messages=CHAT_PROMPT, max_tokens=12, temperature=0)
    text = answer.choices[0].message.content
    assert text.strip() and answer.choices[0].finish_reason in ("stop", "length")
    usage = answer.usage
    assert usage.prompt_tokens == expected_prompt_tokens
    assert 1 <= usage.completion_tokens <= 12 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if answer.choices[0].finish_reason == "length":
        assert usage.completion_tokens == 12

    stream = client.chat.completions.create(model=model, messages=CHAT_PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # greedy: the same tokens either way
    assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == usage.completion_tokens
    # The second request found the first's prompt in the (one) replica's prefix cache: every full block
    # but the one holding the last token, whose logits it needs; and its answer is the same.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (expected_prompt_tokens - 1) // 16 * 16 > 0


@pytest.mark.slow
def test_raw_stream_ends_with_done_and_reports_queue_time(app_url):
    body = {"model": "SmolLM2-135M-Instruct", "messages": CHAT_PROMPT, "max_tokens": 4, "stream": True}
    request = urllib.request.Request(app_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line.strip() for line in resp.read().decode().splitlines() if line.strip()]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert events[-1]["queue_time_s"] >= 0.0


@pytest.mark.slow
def test_concurrent_requests_all_complete(client):
    prompts = [f"Count from {i} to {i + 5}." for i in range(8)]

    def ask(prompt: str):
        return client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=10,
                                              messages=[{"role": "user", "content": prompt}])

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    assert len({a.id for a in answers}) == len(prompts)
    for a in answers:
        assert a.choices[0].message.content and a.usage.completion_tokens >= 1


BAD_REQUESTS = [  # (body changes, status, param)
    ({"model": "gpt-4"}, 400, "model"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"max_tokens": "12"}, 400, "max_tokens"),
    ({"max_tokens": 10**6}, 400, "max_tokens"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, None),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ({"messages": []}, 400, None),
    ({"n": 0}, 400, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),  # issue 13: refused, not dropped
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, 400,
     "response_format"),  # xgrammar cannot compile it
    ({"top_p": 1.5}, 400, "top_p"),
    # issue 12: values that used to reach the engine and fail there (500, or the whole batch)
    ({"top_k": 2**63}, 400, "top_k"),
    ({"top_k": 4611686018427387904000}, 400, "top_k"),
    ({"seed": 2**64}, 400, "seed"),
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, 400, "messages.0.content"),
    ({"stop": [f"s{i}" for i in range(17)]}, 400, "stop"),  # beyond max_stop_strings (engine config)
    ({"stop": ["x" * 257]}, 400, "stop"),  # beyond max_stop_string_chars
    ({"messages": [{"role": "user", "content": "x" * (1 << 20)}]}, 413, None),  # beyond max_body_bytes
]


@pytest.mark.slow
def test_bad_requests_get_openai_errors_and_the_replica_keeps_serving(app_url, client):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    base = {"model": "SmolLM2-135M-Instruct", "messages": CHAT_PROMPT, "max_tokens": 4}
    for change, status, param in BAD_REQUESTS:
        got, body = http("POST", app_url + "/v1/chat/completions", {**base, **change}, auth)
        assert got == status, (change, body)
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], body
        assert error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param, (change, body)
    assert http("POST", app_url + "/v1/chat/completions", b"{not json", auth)[0] == 400
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        got, body = http("POST", app_url + "/v1/chat/completions", base, headers)
        assert got == 401 and body["error"]["code"] == "invalid_api_key"
    assert http("GET", app_url + "/admin/morph", headers=auth)[0] == 401  # the api key is not the admin token
    admin = {"Authorization": f"Bearer {ADMIN}"}
    got, body = http("POST", app_url + "/admin/morph", {"quantized_layers": 1000}, admin)
    assert got == 400 and body["error"]["param"] == "quantized_layers" and "[0, 30]" in body["error"]["message"]
    assert http("GET", app_url + "/admin/morph", headers=admin)[1]["pins"]["quantized_layers"] is None
    answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT_PROMPT, max_tokens=4)
    assert answer.choices[0].message.content
    assert http("GET", app_url + "/health")[0] == 200
