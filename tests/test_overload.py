"""Overload and disconnects against the real app (local Ray on 127.0.0.1, the real default model).

One small replica: max_num_seqs=2 + max_waiting=2 live requests, and a memory budget so small that
pinning layers low or back high really swaps weights and resizes the KV cache.
  * 10x overload: every request beyond what the engine holds gets 503 + Retry-After within 1 s,
    none hangs, and /health and GET /admin/morph answer within 1 s throughout.
  * 100 streams dropped mid-way while layers swap down and up: no KV block leaks, and the integrity
    check (block pool, block tables, ledger) that follows every morph action never fails.
"""
from __future__ import annotations

import concurrent.futures
import os
import http.client as httpclient
import json
import threading
import time
import urllib.parse

import pytest

from tests.serve_helpers import admin_status, auto_budget, http, serve_app, until

ADMIN = "admin-overload-test"
MODEL = "SmolLM2-135M-Instruct"
CAPACITY = 4  # max_num_seqs + max_waiting
# The bound the issue sets; a machine whose cores are oversubscribed many times over (load average
# 20 on 2 cores) cannot meet it and may set MORPHSERVE_OVERLOAD_DEADLINE_S, which the report names.
DEADLINE_S = float(os.environ.get("MORPHSERVE_OVERLOAD_DEADLINE_S", "1.0"))
ARGS = {
    "admin_token": ADMIN, "memory_budget": auto_budget("300MiB"), "mode": "performance", "report_interval_s": 0.1,
    "max_layers_per_step": 4, "max_waiting": 2, "retry_after_s": 2,
    "engine": {"max_model_len": 512, "max_num_seqs": 2, "max_num_batched_tokens": 128},
    "controller_name": "test-overload-controller", "controller_namespace": "morphserve-test-overload",
}
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def app():
    with serve_app(ARGS) as (_, url):
        yield url


def _timed(method: str, url: str, body=None, headers=None, timeout_s: float = 120.0) -> tuple[int, float, dict]:
    """(status, seconds, headers) with the raw response headers (urllib hides them on errors)."""
    parts = urllib.parse.urlsplit(url)
    conn = httpclient.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    started = time.monotonic()
    try:
        conn.request(method, parts.path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, time.monotonic() - started, {"retry-after": resp.getheader("Retry-After"), "_body": data}
    except (OSError, httpclient.HTTPException) as e:
        return 0, time.monotonic() - started, {"_error": repr(e)}
    finally:
        conn.close()


def _chat_body(i: int, max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": f"Count to ten, attempt {i}."}]}


class Prober:
    """GET `path` every 0.2 s from its own thread until stopped; keeps (status, seconds)."""

    def __init__(self, url: str, headers: dict | None = None):
        self.results: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, headers), daemon=True)
        self._thread.start()

    def _run(self, url: str, headers: dict | None) -> None:
        while not self._stop.wait(0.2):  # probe interval, not a synchronisation
            status, seconds, _ = _timed("GET", url, headers=headers, timeout_s=10)
            self.results.append((status, seconds))

    def stop(self) -> list[tuple[int, float]]:
        self._stop.set()
        self._thread.join(30)
        return self.results


@pytest.mark.slow
def test_ten_times_overload_is_refused_fast_and_health_stays_responsive(app):
    # One served request first: the bound is about a serving app under overload, not about the
    # ingress's first call (its handle to the engine deployment and the router are set up lazily,
    # ~0.7 s on 2 cores, which every request of a cold burst would otherwise wait behind).
    status, _, _ = _timed("POST", app + "/v1/chat/completions", _chat_body(-1, 1), timeout_s=120)
    assert status == 200
    before = admin_status(app, ADMIN)
    n = 10 * CAPACITY
    health, admin = Prober(app + "/health"), Prober(app + "/admin/morph", AUTH)
    barrier = threading.Barrier(n)

    def one(i: int):
        barrier.wait(60)
        return _timed("POST", app + "/v1/chat/completions", _chat_body(i, 24), timeout_s=180)

    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            results = list(pool.map(one, range(n)))
    finally:
        health_results, admin_results = health.stop(), admin.stop()
    statuses = [s for s, _, _ in results]
    refused = [(t, h) for s, t, h in results if s == 503]
    times = sorted(round(t, 2) for t, _ in refused)
    seen = (f"statuses {sorted(statuses)}; refusal seconds {times}; health {[(s, round(t, 2)) for s, t in health_results]}; "
            f"admin {[(s, round(t, 2)) for s, t in admin_results]}")
    print(seen)  # pytest -s shows the figures of a passing run
    assert set(statuses) <= {200, 503}, seen  # 0 hangs, 0 other errors
    assert len(refused) >= n - 2 * CAPACITY, seen  # the excess is refused, not queued
    assert statuses.count(200) >= 1, seen
    for _, headers in refused:
        assert headers["retry-after"] == "2", headers
        assert json.loads(headers["_body"])["error"]["message"], headers  # an OpenAI error body
    assert health_results and admin_results
    assert all(t < DEADLINE_S for t in times), seen
    assert all(s == 200 and t < DEADLINE_S for s, t in health_results), seen
    assert all(s == 200 and t < DEADLINE_S for s, t in admin_results), seen
    after = admin_status(app, ADMIN)
    assert after["replica_id"] == before["replica_id"]  # Serve's health check never failed it


def _drop_mid_stream(url: str, i: int) -> int:
    """Open a streaming chat, read until two tokens have arrived, then hang up. Returns data events read.
    A 503 (the server still holds streams whose clients just left) is retried after its Retry-After,
    as a client would, for up to 120 s."""
    deadline = time.monotonic() + 120
    while True:
        parts = urllib.parse.urlsplit(url)
        conn = httpclient.HTTPConnection(parts.hostname, parts.port, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(_chat_body(i, 200, stream=True)),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status == 503 and time.monotonic() < deadline:
                time.sleep(float(resp.getheader("Retry-After", "1")))  # the server's back-off, not a sync
                continue
            assert resp.status == 200, resp.read()[:300]
            events = 0
            while events < 3:  # the role chunk, then two tokens
                line = resp.fp.readline()
                assert line, "the stream ended before the client hung up"
                events += line.startswith(b"data: ")
            return events
        finally:
            if conn.sock is not None:
                conn.sock.close()  # hang up mid-stream
            conn.close()


@pytest.mark.slow
def test_hundred_mid_stream_disconnects_under_morphing_leak_nothing(app):
    start = admin_status(app, ADMIN)
    checks0, done0 = start["integrity"]["checks"], start["action_results"].get("done", 0)
    stop = threading.Event()
    pins = []

    def morph_back_and_forth() -> None:  # an operator swapping 8 layers down and back up, over and over
        low = True
        while not stop.wait(0.4):  # pin interval, not a synchronisation
            status, body = http("POST", app + "/admin/morph", {"quantized_layers": 8 if low else 0,
                                                              "precision": "int4"}, headers=AUTH)
            pins.append(status)
            low = not low

    morpher = threading.Thread(target=morph_back_and_forth, daemon=True)
    morpher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # max_num_seqs streams at a time
            events = list(pool.map(lambda i: _drop_mid_stream(app, i), range(100)))
    finally:
        stop.set()
        morpher.join(30)
        http("POST", app + "/admin/morph", {"morphing_enabled": True}, headers=AUTH)
    assert len(events) == 100 and pins and set(pins) == {200}
    idle = until(lambda: (lambda s: s if s["pressure"]["num_running"] == 0 and s["pressure"]["num_waiting"] == 0
                          and s["pressure"]["kv_used_blocks"] == 0 and s["queue"]["live_requests"] == 0
                          else None)(admin_status(app, ADMIN)), 60, "every dropped stream aborted and its blocks freed")
    end = until(lambda: (lambda s: s if s["integrity"]["checks"] > idle["integrity"]["checks"] else None)(
        admin_status(app, ADMIN)), 30, "an integrity check on the idle engine")
    assert end["action_results"].get("done", 0) - done0 >= 4, end["action_results"]  # layers really moved
    assert end["integrity"]["failures"] == 0, end["integrity"]
    # The executor checks pool and ledger after every action (a broken invariant raises there); these
    # are the morph loop's own checks, one per round, all through the run.
    assert end["integrity"]["checks"] - checks0 >= 10, end["integrity"]
    assert end["pressure"]["kv_used_blocks"] == 0
    status, body = http("POST", app + "/v1/chat/completions", _chat_body(0, 4))
    assert status == 200, body


@pytest.mark.slow
def test_fuzzing_the_real_app_gets_no_5xx(app):
    """A smaller schemathesis run against the real app (the 2,000-request run is in test_fuzz_api.py,
    against the HTTP layer with the FakeEngine). Valid bodies name the served model, so they reach
    the real engine's validation; max_tokens is clamped to 4 to keep each one a few decode steps."""
    pytest.importorskip("schemathesis")
    from schemathesis import GenerationMode

    from tests import test_fuzz_api as fuzz

    def send(kwargs: dict) -> tuple[int, str]:
        body = kwargs.get("json")
        if isinstance(body, dict):
            body = {**body, "model": MODEL} if "model" in body else body
            if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
                body = {**body, "max_tokens": 4}
            if isinstance(body.get("max_completion_tokens"), int) and body["max_completion_tokens"] > 4:
                body = {**body, "max_completion_tokens": 4}
            if ("messages" in body or "prompt" in body) and "max_tokens" not in body \
                    and "max_completion_tokens" not in body:
                body = {**body, "max_tokens": 4}  # chat's default is the whole context left
        raw = kwargs.get("content")
        data = raw.encode() if isinstance(raw, str) else raw if raw is not None else (
            json.dumps(body).encode() if body is not None else None)
        query = urllib.parse.urlencode(kwargs["params"] or {}, doseq=True)
        headers = {**kwargs["headers"], "Authorization": f"Bearer {ADMIN}"}
        status, seconds, detail = _timed_raw(kwargs["method"], app + kwargs["url"] + (f"?{query}" if query else ""),
                                             data, headers)
        return status, str(detail)[:300]

    operations = {(op.method.upper(), op.path): op for op in fuzz._operations(fuzz._ingress())}
    sent = 0
    for key in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/admin/morph")):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            sent += fuzz._fuzz(operations[key], mode, 15, send)
    assert sent >= 60
    assert http("GET", app + "/health")[0] == 200


def _timed_raw(method: str, url: str, data: bytes | None, headers: dict) -> tuple[int, float, bytes]:
    parts = urllib.parse.urlsplit(url)
    conn = httpclient.HTTPConnection(parts.hostname, parts.port, timeout=120)
    started = time.monotonic()
    try:
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, time.monotonic() - started, resp.read()
    finally:
        conn.close()
