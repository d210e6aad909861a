"""The open-loop load generator against a tiny fake OpenAI-compatible streaming server on 127.0.0.1."""
from __future__ import annotations

import asyncio
import json
import socket
import multiprocessing
import time
import urllib.request

import pytest
from aiohttp import web

from ops.bench import BenchmarkInputError
from ops.bench.loadgen import (LoadGenConfig, LoadRequest, closed_loop, load_requests, prometheus_status_parser,
                               reference_answers, replay)
from ops.bench.metrics import percentile
from ops.bench.prompts import BenchPrompt
from ops.bench.traces import TraceRequest


class FakeServer:
    """Streams max_tokens chunks "t0 ", "t1 ", ... at once, then usage and [DONE]. Prompt "bad" gets
    a 400; prompt "hang" streams one token and then never finishes. It runs in its own process, as
    a real server would, so its work never holds this process's GIL and shows up as client lag."""

    def __enter__(self) -> "FakeServer":
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child,), daemon=True)
        self._process.start()
        if not parent.poll(60):
            self._process.kill()
            raise RuntimeError("fake server did not start")
        self.url = f"http://127.0.0.1:{parent.recv()}"
        return self

    def __exit__(self, *exc):
        self._process.terminate()
        self._process.join(10)

    def bodies(self) -> list[dict]:
        with urllib.request.urlopen(self.url + "/bodies", timeout=10) as resp:
            return json.loads(resp.read())


@pytest.fixture(scope="module")
def server():
    with FakeServer() as s:
        yield s


def _serve(conn) -> None:
    bodies: list[dict] = []
    in_flight = {"now": 0, "max": 0}

    async def complete(request):
        in_flight["now"] += 1
        in_flight["max"] = max(in_flight["max"], in_flight["now"])
        try:
            return await _complete(request)
        finally:
            in_flight["now"] -= 1

    async def _complete(request):
        body = await request.json()
        bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if prompt == "bad":
            return web.json_response({"error": {"message": "prompt is bad"}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(body["max_tokens"]):
            choice = {"index": 0, "delta": {"content": f"t{k} "}} if chat else {"index": 0, "text": f"t{k} "}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            if prompt == "hang":
                await asyncio.Event().wait()  # never set: the client's deadline must end this
            if prompt == "slow":
                await asyncio.sleep(0.02)
        usage = {"prompt_tokens": 3, "completion_tokens": body["max_tokens"], "total_tokens": 3 + body["max_tokens"],
                 "prompt_tokens_details": {"cached_tokens": 2}}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage, 'queue_time_s': 0.125})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def status(request):
        return web.json_response({"kv_usage": 0.25, "engine": {"quantized_layers": 3, "ready": True}})

    async def seen(request):
        return web.json_response(bodies)

    async def max_in_flight(request):
        seen_max, in_flight["max"] = in_flight["max"], 0
        return web.json_response(seen_max)

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        app.router.add_post("/v1/chat/completions", complete)
        app.router.add_get("/status", status)
        app.router.add_get("/bodies", seen)
        app.router.add_get("/max_in_flight", max_in_flight)
        runner = web.AppRunner(app, handler_cancellation=True)  # a client disconnect ends the handler
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock, shutdown_timeout=1).start()
        conn.send(sock.getsockname()[1])
        await asyncio.Event().wait()  # until the test terminates this process

    asyncio.run(main())


def test_all_requests_recorded_and_send_lag_small(server):
    n = 200
    requests = [LoadRequest(f"r{i}", scheduled_s=i * 0.005, prompt=f"p{i}", max_tokens=1 + i % 8) for i in range(n)]
    before = len(server.bodies())
    config = LoadGenConfig(base_url=server.url, model="fake", status_url=server.url + "/status",
                           status_interval_s=0.05, deadline_s=30)
    result = replay(requests, config)
    bodies = server.bodies()[before:]
    assert len(result.records) == n and not result.deadline_hit
    assert [r.request_id for r in result.records] == [q.request_id for q in requests]
    for req, rec in zip(requests, result.records):
        assert rec.ok, rec.error
        assert rec.output_tokens == len(rec.token_times_s) == req.max_tokens
        assert rec.output_text == "".join(f"t{k} " for k in range(req.max_tokens))
        assert rec.sent_s <= rec.first_token_s <= rec.end_s and rec.queue_s == 0.125
    assert len(bodies) == n
    assert all(b["ignore_eos"] is True and b["temperature"] == 0.0 and b["stream"] for b in bodies)
    # Typical: P50 ~1 ms, P99 ~10 ms. The P99 bound leaves room for the OS descheduling this process
    # on a loaded 2-core machine; a generator that waited on responses would lag by seconds here.
    lags = [r.send_lag_s for r in result.records]
    assert percentile(lags, 50) < 0.02, f"load generator lags: P50 {percentile(lags, 50):.4f} s"
    assert result.send_lag_p99_s < 0.25, f"load generator lags: P99 {result.send_lag_p99_s:.4f} s"
    assert result.samples and result.samples[0].values == {"kv_usage": 0.25, "engine.quantized_layers": 3.0}


def test_http_errors_and_chat_api_are_recorded(server):
    requests = [LoadRequest("ok", 0.0, "hello", 3), LoadRequest("bad", 0.0, "bad", 3),
                LoadRequest("sys", 0.0, "hi", 2, system="You answer briefly.")]
    before = len(server.bodies())
    result = replay(requests, LoadGenConfig(base_url=server.url, model="fake", api="chat", deadline_s=30))
    ok, bad, sys_ = result.records
    assert ok.ok and ok.output_text == "t0 t1 t2 " and ok.cached_prompt_tokens == 2
    messages = {b["messages"][-1]["content"]: b["messages"] for b in server.bodies()[before:]}
    assert messages["hi"] == [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "hi"}]
    assert messages["hello"] == [{"role": "user", "content": "hello"}] and sys_.ok
    assert not bad.ok and bad.status == 400 and "prompt is bad" in bad.error and bad.first_token_s is None


def test_hard_deadline_stops_the_run(server):
    requests = [LoadRequest("hang", 0.0, "hang", 4), LoadRequest("late", 5.0, "p", 4)]
    started = time.perf_counter()
    result = replay(requests, LoadGenConfig(base_url=server.url, model="fake", deadline_s=0.5))
    elapsed = time.perf_counter() - started
    assert result.deadline_hit and elapsed < 4.0
    hung, late = result.records
    assert hung.error == "deadline exceeded" and hung.output_text == "t0 " and len(hung.token_times_s) == 1
    assert not hung.ok and hung.end_s == 0.5  # partial output kept, ended at the deadline
    assert late.error == "not sent before the deadline" and late.sent_s is None


def test_config_refuses_non_loopback_and_bad_api():
    with pytest.raises(BenchmarkInputError, match="loopback"):
        LoadGenConfig(base_url="http://example.com:8000", model="m")
    with pytest.raises(BenchmarkInputError, match="api"):
        LoadGenConfig(base_url="http://127.0.0.1:1", model="m", api="embeddings")
    chat = LoadGenConfig(base_url="http://127.0.0.1:1", model="m", api="chat")
    with pytest.raises(BenchmarkInputError, match="text prompt"):
        replay([LoadRequest("a", 0.0, (1, 2, 3), 4)], chat)
    with pytest.raises(BenchmarkInputError, match="repeat"):
        replay([LoadRequest("a", 0.0, "x", 4), LoadRequest("a", 1.0, "y", 4)], chat)


def test_load_requests_pairs_workload_and_prompts():
    trace = [TraceRequest(0.0, 10, 4), TraceRequest(0.5, 20, 8)]
    prompts = [BenchPrompt(i, f"c{i}", f"prompt {i}", 9 + i, 10, f"ref {i}") for i in range(2)]
    reqs = load_requests(trace, prompts)
    assert [(r.request_id, r.scheduled_s, r.prompt, r.max_tokens) for r in reqs] == [
        ("req-00000", 0.0, "prompt 0", 4), ("req-00001", 0.5, "prompt 1", 8)]
    assert reference_answers(prompts) == {"req-00000": "ref 0", "req-00001": "ref 1"}
    with pytest.raises(BenchmarkInputError):
        load_requests(trace, prompts[:1])


def test_prometheus_status_parser_sums_label_sets():
    text = ("# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
            "# TYPE vllm:num_preemptions counter\n"
            'vllm:num_preemptions_total{model_name="m",engine="0"} 2\n'
            'vllm:num_preemptions_total{model_name="m",engine="1"} 3\n')
    parse = prometheus_status_parser({"kv_usage": "vllm:kv_cache_usage_perc",
                                      "preemptions_total": "vllm:num_preemptions_total"})
    assert parse(text) == {"kv_usage": 0.5, "preemptions_total": 5.0}


def test_closed_loop_keeps_concurrency_in_flight(server):
    requests = [LoadRequest(f"c{i}", scheduled_s=0.0, prompt="slow", max_tokens=3) for i in range(12)]
    urllib.request.urlopen(server.url + "/max_in_flight", timeout=10).read()  # reset the fake's counter
    result = closed_loop(requests, LoadGenConfig(base_url=server.url, model="fake", deadline_s=30), concurrency=3)
    with urllib.request.urlopen(server.url + "/max_in_flight", timeout=10) as resp:
        assert json.loads(resp.read()) == 3
    assert all(r.ok and r.output_tokens == 3 and r.served_prompt_tokens == 3 for r in result.records)
    assert all(r.scheduled_s == r.sent_s for r in result.records)
    # The 4th request waits for one of the first three: 3 tokens x 20 ms each.
    first_ends = sorted(r.end_s for r in result.records[:3])
    assert result.records[3].sent_s >= first_ends[0] - 1e-3
