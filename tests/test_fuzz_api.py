"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis + hypothesis).

Every operation gets requests that follow the schema (positive) and requests that break it
(negative: wrong types, missing fields, out-of-range numbers, junk bodies). The property: no response
is a 5xx, and the server still answers afterwards.

  * The FastAPI app with the FakeEngine (the HTTP layer alone; fakes live under tests/): at least
    2,000 requests (MORPHSERVE_FUZZ_EXAMPLES per operation and mode scales it).
  * The real app (Ray Serve, the real default model): a smaller run, max_tokens clamped so that a
    valid request costs at most a few decode steps on a CPU.
"""
from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

ADMIN = "admin-fuzz-token"
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
# The operations with a body or a path parameter (chat, completions, tokenize, detokenize, admin
# POST, GET /v1/models/{id}), valid and broken: at least 10 runs x 200 = 2,000 requests against the
# HTTP layer; the GETs without parameters have 1 request each to send.
EXAMPLES = int(os.environ.get("MORPHSERVE_FUZZ_EXAMPLES", "200"))


def _ingress():
    from tests.fakes import FakeEngine
    from deployments.ingress import IngressSettings, build_ingress_app
    from deployments.metrics import InMemoryBackend, ServeMetrics

    engine = FakeEngine(max_model_len=256)
    settings_ = IngressSettings(admin_token=ADMIN)
    return build_ingress_app(engine, settings_, ServeMetrics(engine.model_name, InMemoryBackend()))


def _operations(app):
    schema = schemathesis.openapi.from_dict(app.openapi())
    return [result.ok() for result in schema.get_all_operations()]


def _request_kwargs(case) -> dict:
    """What the case sends: method, path, query, headers and body (raw bytes when negative mode made them)."""
    headers = {"Authorization": f"Bearer {ADMIN}", **(case.headers or {})}
    kwargs = {"method": case.method, "url": case.formatted_path, "params": case.query or None, "headers": headers}
    body = case.body
    if isinstance(body, (bytes, str)):
        kwargs["content"] = body
        headers.setdefault("Content-Type", case.media_type or "application/json")
    elif body is not None and not _is_missing(body):
        kwargs["json"] = body
    return kwargs


def _is_missing(body) -> bool:
    return type(body).__name__ == "NotSet"


def _fuzz(operation, mode, examples: int, send) -> int:
    sent = []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(mode))
    def run(case):
        status, detail = send(_request_kwargs(case))
        sent.append(status)
        assert status < 500, f"{case.method} {case.formatted_path} -> {status}: {detail}"

    try:
        run()
    except Unsatisfiable:
        if mode is not GenerationMode.NEGATIVE:
            raise
        return 0  # nothing in this operation to break (GET without parameters)
    return len(sent)


def test_two_thousand_generated_requests_get_no_5xx_from_the_http_layer():
    from starlette.testclient import TestClient

    app = _ingress()
    client = TestClient(app, raise_server_exceptions=False)

    def send(kwargs: dict) -> tuple[int, str]:
        resp = client.request(**kwargs)
        return resp.status_code, resp.text[:300]

    counts = {(op.method, op.path, mode.value): _fuzz(op, mode, EXAMPLES, send)
              for op in _operations(app) for mode in MODES}
    assert sum(1 for n in counts.values() if n) >= 9, counts
    if EXAMPLES >= 200:
        assert sum(counts.values()) >= 2000, counts
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/completions", json={"model": "fake-echo", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "hi"
