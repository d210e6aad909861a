"""LLMServer itself (deployments/replica.py), without Ray Serve: the class behind the Serve
decorator, constructed here over the real default model, its `generate` streamed, its errors
turned into final error chunks, its tokenizing kept off the event loop, and its admin pins checked
when they are made. (A replica outside a Ray cluster reports to the local policy, not a controller.)"""
from __future__ import annotations

import asyncio
import time

import pytest

from deployments.app_args import AppArgs
from deployments.engine_client import AdminUpdate, EngineErrorInfo, GenerateRequest
from deployments.replica import LLMServer

pytestmark = pytest.mark.slow

ARGS = dict(model="default", dtype="fp32", device="cpu", memory_budget="1GiB", report_interval_s=5.0,
            engine={"max_model_len": 256, "reserve": "64MiB", "max_num_seqs": 8})


async def make_server(**overrides) -> LLMServer:
    server = object.__new__(LLMServer)  # LLMServer's __init__ is async (Ray Serve awaits it)
    await server.__init__(AppArgs.model_validate({**ARGS, **overrides}))
    return server


async def close(server: LLMServer) -> None:
    await server.morph_loop.stop()
    await asyncio.to_thread(server.engine.shutdown, 10.0)


async def stream(server: LLMServer, request: GenerateRequest) -> list:
    return [chunk async for chunk in server.generate(request)]


@pytest.fixture(scope="module")
def results():
    """One replica for the module: every check runs in one event loop and reports what it saw."""

    async def main():
        server = await make_server()
        try:
            seen = {}
            prompt = tuple(await server.tokenize_chat([{"role": "user", "content": "Name a colour."}]))
            seen["ok"] = await stream(server, GenerateRequest("ok", prompt, 6, temperature=0.0, ignore_eos=True))
            seen["bad_top_k"] = await stream(server, GenerateRequest("bad", prompt, 6, top_k=2**63))
            seen["bad_stops"] = await stream(server, GenerateRequest("stops", prompt, 6, stop=("x",) * 17))
            seen["queue_observed"] = server.metrics.queue_time.count(model_name=server.engine.model_name) \
                if hasattr(server.metrics.queue_time, "count") else None
            seen["ticks"] = await ticks_while(server.tokenize("word " * 200_000))
            seen["pin_too_many"] = await server.admin_set(AdminUpdate(quantized_layers=1000))
            seen["pin_ok"] = await server.admin_set(AdminUpdate(quantized_layers=2, precision="int8"))
            seen["num_layers"] = len(server.engine.morph_state().layer_precisions)
            return seen
        finally:
            await close(server)

    return asyncio.run(main())


async def ticks_while(work) -> tuple[int, float]:
    """How often a 10 ms ticker ran on the event loop while `work` ran, and how long the work took."""
    count, done = 0, asyncio.Event()

    async def ticker():
        nonlocal count
        while not done.is_set():
            await asyncio.sleep(0.01)
            count += 1

    task = asyncio.create_task(ticker())
    started = time.monotonic()
    await work
    elapsed = time.monotonic() - started
    done.set()
    await task
    return count, elapsed


def test_generate_streams_to_a_finish_with_the_true_queue_time(results):
    chunks = results["ok"]
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_output_tokens == 6
    assert all(c.error is None and c.request_id == "ok" for c in chunks)
    assert sum(len(c.token_ids) for c in chunks) == 6
    # Queue time = arrival to first schedule: present, and not the time to the first token.
    assert chunks[-1].queue_time_s is not None and 0.0 <= chunks[-1].queue_time_s < 5.0
    assert results["queue_observed"] in (None, 1)


def test_bad_parameters_end_the_stream_with_a_400_error_chunk(results):
    for key, param in (("bad_top_k", "top_k"), ("bad_stops", "stop")):
        last = results[key][-1]
        assert last.error is not None and last.error.kind == "invalid_request" and last.error.param == param


def test_tokenizing_a_long_prompt_leaves_the_event_loop_free(results):
    ticks, elapsed = results["ticks"]
    # A blocked loop would tick ~once; a free one ticks about every 10 ms of the work (generous margin).
    assert elapsed > 0.1 and ticks >= max(3, int(elapsed / 0.01) // 5), (ticks, elapsed)


def test_impossible_pins_are_refused_at_the_call_naming_the_range(results):
    refused = results["pin_too_many"]
    n = results["num_layers"]
    assert isinstance(refused, EngineErrorInfo) and refused.kind == "invalid_request"
    assert refused.param == "quantized_layers" and f"[0, {n}]" in refused.message
    assert results["pin_ok"]["pins"]["quantized_layers"] == 2
