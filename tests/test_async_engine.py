"""AsyncLLMEngine: concurrent streams, cancellation frees blocks at once, faults fail only their requests."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError, StepFailed
from engine.llm_engine import LLMEngine
from engine.morph.actions import RestoreLayer
from engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_dir):
    eng = AsyncLLMEngine(engine=LLMEngine(EngineConfig(
        model=str(tiny_model_dir), dtype="fp32", memory_budget="32MiB", max_model_len=64,
        block_size=4, reserve="1MiB", enable_morphing=False)))
    yield eng
    eng.shutdown()


async def collect(engine: AsyncLLMEngine, rid: str, prompt, params=PARAMS) -> list:
    return [out async for out in engine.generate(rid, prompt, params)]


def test_concurrent_generates_all_complete_and_match_a_lone_run(engine):
    prompts = {f"r{i}": [5 + i] * (3 + 2 * i) for i in range(6)}

    async def main():
        return await asyncio.gather(*(collect(engine, rid, p) for rid, p in prompts.items()))

    results = asyncio.run(main())
    for rid, outs in zip(prompts, results):
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 6
        assert [o.request_id for o in outs] == [rid] * len(outs)
    alone = asyncio.run(collect(engine, "again", prompts["r2"]))
    assert [t for o in alone for t in o.token_ids] == [t for o in results[2] for t in o.token_ids]
    assert engine.engine.pool.num_used == 0
    # Every step that prefilled fed the prefill speed the replica reports to the pressure router.
    assert engine.prefill_tokens_per_s() > 0


def test_closing_a_stream_mid_way_frees_its_blocks(engine):
    async def main():
        stream = engine.generate("a", list(range(5, 25)), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        first = await stream.__anext__()
        used_while_running = await engine.run_at_step_boundary(lambda e: e.pool.num_used)
        await stream.aclose()
        used_after = await engine.run_at_step_boundary(lambda e: e.pool.num_used)
        return first, used_while_running, used_after

    first, during, after = asyncio.run(main())
    assert first.finish_reason is None and during >= 5 and after == 0


def test_cancelling_the_consumer_task_frees_its_blocks(engine):
    async def main():
        got_one = asyncio.Event()

        async def consume():
            async for _ in engine.generate("a", [7] * 10, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)):
                got_one.set()

        task = asyncio.create_task(consume())
        await got_one.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await engine.run_at_step_boundary(lambda e: (e.pool.num_used, e.has_unfinished()))

    assert asyncio.run(main()) == (0, False)


def test_a_failing_step_fails_only_its_requests_and_the_loop_keeps_serving(engine):
    real_execute = engine.engine.runner.execute
    calls = {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if any(c.request_id == "bad" for c in out.chunks):
            raise RuntimeError("injected kernel fault")
        return real_execute(out)

    engine.engine.runner.execute = flaky

    async def main():
        with pytest.raises(StepFailed, match="bad"):
            await collect(engine, "bad", [5, 6, 7])
        return await collect(engine, "good", [5, 6, 7])

    good = asyncio.run(main())
    assert good[-1].finish_reason == "length" and engine.engine.pool.num_used == 0


def test_bad_requests_raise_in_the_caller_and_apply_runs_on_the_thread(engine):
    async def main():
        with pytest.raises(InvalidRequestError):
            await collect(engine, "x", [])
        return await engine.apply(RestoreLayer(0))

    assert asyncio.run(main()).status == "rejected"
    assert engine.pressure().num_running == 0 and engine.morph_state().num_quantized == 0


def test_a_request_posted_during_a_step_is_after_the_cutoff_published_at_its_end(engine):
    """What the pressure-aware router relies on: a snapshot holds exactly the requests posted before its
    cutoff. One posted while a step runs is not in the snapshot published when that step ends (whose
    own time is after the post, so counting from it would miss the request), and that snapshot's cutoff
    is before the post; the next round's snapshot holds it, with a cutoff after the post."""
    real_step = engine.engine.step
    published, in_step, release = [], threading.Event(), threading.Event()

    def step():  # on the stepping thread: what was published before this round's step, then hold step 1
        published.append(engine.pressure_with_cutoff())
        if len(published) == 1:
            in_step.set()
            release.wait(30)
        return real_step()

    engine.engine.step = step
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def main():
        first = asyncio.create_task(collect(engine, "a", [5] * 8, params))
        assert await asyncio.to_thread(in_step.wait, 30)
        before_post = time.monotonic()
        second = asyncio.create_task(collect(engine, "b", [6] * 8, params))
        await asyncio.sleep(0)  # one turn of the loop: the new task runs up to its posted add
        after_post = time.monotonic()
        assert len(engine._commands) == 1, "b's add should be queued behind the running step"
        release.set()
        await asyncio.gather(first, second)
        return before_post, after_post

    before_post, after_post = asyncio.run(main())
    (end_of_step_1, cutoff_1), (end_of_step_2, cutoff_2) = published[1], published[2]
    assert end_of_step_1.num_running + end_of_step_1.num_waiting == 1  # "a" only
    assert cutoff_1 < before_post < after_post < end_of_step_1.time
    assert end_of_step_2.num_running + end_of_step_2.num_waiting == 2  # "a" and "b"
    assert cutoff_2 > after_post


def test_after_shutdown_requests_get_engine_dead(engine):
    engine.shutdown()

    async def main():
        with pytest.raises(EngineDeadError):
            await collect(engine, "late", [5, 6])

    asyncio.run(main())


def test_a_pending_target_finishes_while_idle_and_every_move_is_logged(tiny_model_dir, tmp_path):
    from engine.morph.actions import SetQuantizedTarget
    from engine.precision import Precision
    from tests.morph_helpers import engine_for
    from tests.serve_helpers import until

    eng = AsyncLLMEngine(engine=engine_for(tiny_model_dir, tmp_path))
    try:
        first = asyncio.run(eng.apply(SetQuantizedTarget(4, Precision.INT4, max_layers_per_step=1)))
        assert first.status == "waiting" and first.layers_changed == (0,)
        # No request runs: the stepping thread continues the target by itself, one layer per step.
        until(lambda: eng.morph_state().num_quantized == 4 and not eng.morph_state().pending, 60,
              "the target to be reached while idle")
        cursor, results = eng.morph_results_since(0)
        assert [r.layers_changed for r in results] == [(0,), (1,), (2,), (3,)]
        assert [r.status for r in results] == ["waiting", "waiting", "waiting", "done"]
        assert eng.morph_results_since(cursor) == (cursor, ())
        assert eng.morph_results_since(cursor - 1) == (cursor, results[-1:])
    finally:
        eng.shutdown()
