"""Admission-time morphing on a tiny engine (engine/morph/admission.py): the swap is sized to the
queue's deficit in exact layers, made at the step boundary before the scheduler runs, bounded by
the grant; restores follow demand after a quiet period and never preempt.

The tiny model (tests/conftest.py) in fp32 with 4-token blocks: one KV block is 4,096 bytes; one
layer is 147,456 bytes at fp32, 20,480 at INT4 (frees exactly 31 blocks) and 38,912 at INT8 (frees
26.5 blocks: two INT8 layers free 53 blocks, not 52)."""
from __future__ import annotations

import pytest

from engine.morph.actions import SetQuantizedTarget
from engine.morph.admission import AdmissionGrant, enact
from engine.precision import Precision
from engine.sampling_params import SamplingParams
from tests.morph_helpers import engine_for, one_thread  # noqa: F401 (one_thread is a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

I8, I4 = Precision.INT8, Precision.INT4
BLOCK = 4096
WEIGHTS, RESERVE = 788_736, 1_048_576  # the tiny model's fp32 weights; the 1 MiB reserve of engine_for


def tiny(model_dir, cache_dir, kv_blocks: int, **overrides):
    """An engine whose budget commits exactly `kv_blocks` KV blocks at full precision."""
    cfg = dict(max_model_len=256, memory_budget=WEIGHTS + RESERVE + kv_blocks * BLOCK, output_reservation_tokens=8)
    cfg.update(overrides)
    engine = engine_for(model_dir, cache_dir, **cfg)
    assert engine.pool.capacity == kv_blocks and engine.storage.block_bytes == BLOCK
    return engine


def prompt(i: int, n: int = 100) -> list[int]:
    return [(7 * i + j) % 200 + 3 for j in range(n)]


def burst(engine, n: int, max_tokens: int = 8, start: int = 0, prompt_len: int = 100) -> None:
    # 100-token prompt + 8 reserved output tokens = 108 tokens = 27 blocks of demand each
    for i in range(start, start + n):
        engine.add_request(f"r{i}", prompt(i, prompt_len),
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def spy_on_schedule(engine) -> list[tuple]:
    """(demand, quantized layers) as the scheduler is about to run, each step."""
    seen, schedule = [], engine.scheduler.schedule

    def recording():
        seen.append((engine.admission.demand(), engine.morph_state().num_quantized))
        return schedule()

    engine.scheduler.schedule = recording
    return seen


def drain(engine, max_steps: int = 500) -> dict[str, int]:
    tokens: dict[str, int] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return tokens
        for out in engine.step().outputs:
            tokens[out.request_id] = out.num_output_tokens
        engine.check_integrity()
    raise AssertionError("the engine did not finish its requests")


@pytest.mark.parametrize("precision, kv_blocks, layers, grown", [
    (I4, 70, 3, 93),  # deficit 5 x 27 - 70 = 65 blocks: 2 INT4 layers free 62, 3 free 93
    (I8, 82, 2, 53),  # deficit 53: two INT8 layers free exactly 53 (26.5 each), not ceil(53 / 26) = 3
])
def test_admission_swaps_exactly_the_layers_the_queue_deficit_needs(tiny_model_dir, tmp_path, precision,
                                                                    kv_blocks, layers, grown):
    engine = tiny(tiny_model_dir, tmp_path, kv_blocks)
    engine.set_admission_grant(AdmissionGrant(max_quantized=4, min_quantized=0, precision=precision))
    burst(engine, 5)
    before = engine.pressure()
    assert (before.waiting_demand_blocks, before.head_demand_blocks, before.waiting_for) == (135, 27, "compute")
    assert dict(before.rung_gain_blocks) == {"int8": 26, "int4": 31}
    assert before.prefill_backlog_tokens == 5 * 100  # every prompt waits to be prefilled
    engine.step()  # one step: the swap happens at its boundary, then all five are admitted
    state = engine.morph_state()
    assert state.num_quantized == layers and state.count(precision) == layers
    assert state.kv_capacity_blocks == kv_blocks + grown
    assert engine.scheduler.num_waiting == 0 and engine.scheduler.num_running == 5
    (event,) = engine.admission.events
    assert (event.kind, event.quantized_before, event.quantized_after, event.deficit_blocks, event.admits) == (
        "swap", 0, layers, 135 - kv_blocks, 5)
    snap = engine.pressure()
    assert (snap.admission_swaps_total, snap.admission_layers_total) == (1, layers)
    # All five prompts fit the step's token budget: nothing is left to prefill (decoding is not backlog).
    assert snap.prefill_backlog_tokens == 0 and all(s.num_computed_tokens >= 100 for s in engine.scheduler.running)
    (wait,) = engine.admission.waits  # the swap ended the wait at the same boundary: reaction = swap time
    assert wait.swaps == 1 and not wait.capped and 0 <= wait.end - wait.start < 5.0
    assert wait.start == event.blocked_since and snap.head_blocked_since is None
    assert drain(engine) == {f"r{i}": 8 for i in range(5)}


def test_without_a_grant_the_engine_does_not_morph_on_its_own(tiny_model_dir, tmp_path):
    engine = tiny(tiny_model_dir, tmp_path, 70)
    burst(engine, 5)
    engine.step()
    assert engine.morph_state().num_quantized == 0 and engine.scheduler.num_waiting > 0
    assert engine.pressure().waiting_for == "memory"


def test_a_burst_never_waits_a_step_for_memory_it_could_have_had(tiny_model_dir, tmp_path):
    engine = tiny(tiny_model_dir, tmp_path, 70)
    engine.set_admission_grant(AdmissionGrant(max_quantized=4, min_quantized=0, precision=I4))
    seen = spy_on_schedule(engine)
    done: dict[str, int] = {}
    for wave in range(4):  # waves of 3 arrivals (12 blocks each), two steps apart, while earlier ones decode
        burst(engine, 3, start=3 * wave, prompt_len=40)
        for _ in range(2):
            for out in engine.step().outputs:
                done[out.request_id] = out.num_output_tokens
    done.update(drain(engine))
    assert done == {f"r{i}": 8 for i in range(12)}
    # Whenever the scheduler ran, everything it could start fitted: nobody waited for memory.
    assert all(demand.step_fits for demand, _ in seen)
    assert engine.scheduler.num_preemptions == 0
    assert engine.admission.swaps_total >= 1 and max(q for _, q in seen) < 4


def test_the_grant_bounds_admission_swaps_and_a_lower_grant_vetoes(tiny_model_dir, tmp_path):
    engine = tiny(tiny_model_dir, tmp_path, 70)
    engine.set_admission_grant(AdmissionGrant(max_quantized=1, min_quantized=0, precision=I4))
    burst(engine, 5)
    engine.step()
    assert engine.morph_state().num_quantized == 1  # the queue wanted 3
    assert engine.admission.events[-1].capped and engine.admission.capped_total >= 1
    assert engine.admission.blocked_since is not None and not engine.admission.waits  # still waiting
    assert engine.scheduler.num_waiting > 0 and engine.pressure().waiting_for == "memory"
    # The controller re-grants 0 and asks for 0: the grant is set first, the target runs, and no
    # admission swap follows at that boundary, though requests still wait for memory.
    seen = engine.admission.moves_total()
    result, _ = enact(engine, AdmissionGrant(0, 0, I4), SetQuantizedTarget(0, I4, 1), seen)
    assert result.status in ("done", "waiting") and engine.morph_state().num_quantized <= 1
    drain(engine)
    assert engine.morph_state().num_quantized == 0 and engine.admission.moves_total() == seen


def test_a_directive_older_than_an_admission_swap_is_not_applied(tiny_model_dir, tmp_path):
    engine = tiny(tiny_model_dir, tmp_path, 70)
    grant = AdmissionGrant(max_quantized=4, min_quantized=0, precision=I4)
    engine.set_admission_grant(grant)
    stale = engine.pressure().admission_swaps_total  # the report the directive answers
    burst(engine, 5)
    engine.step()
    assert engine.morph_state().num_quantized == 3
    result, _ = enact(engine, grant, SetQuantizedTarget(0, I4, 4), stale)  # "hold at 0", decided before the swap
    assert result.status == "noop" and engine.morph_state().num_quantized == 3


def test_restore_follows_demand_after_the_quiet_period_and_never_preempts(tiny_model_dir, tmp_path):
    engine = tiny(tiny_model_dir, tmp_path, 70, restore_quiet_s=0.0, restore_max_usage=0.6)
    engine.set_admission_grant(AdmissionGrant(max_quantized=4, min_quantized=0, precision=I4))
    burst(engine, 4, max_tokens=8)
    engine.add_request("long", prompt(9), SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    engine.step()
    assert engine.morph_state().num_quantized == 3
    restored_while_live = []
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        if engine.admission.restores_total and not restored_while_live:
            restored_while_live.append(engine.scheduler.num_running)
    assert restored_while_live and restored_while_live[0] >= 1  # "long" was still decoding
    assert engine.scheduler.num_preemptions == 0
    assert engine.admission.events[-1].kind == "restore"
    enact(engine, AdmissionGrant(4, 0, I4), None, engine.admission.moves_total())  # idle: the loop's tick
    assert engine.morph_state().num_quantized == 0 and engine.pool.capacity == 70


def test_restore_waits_for_its_quiet_period_and_keeps_the_floor(tiny_model_dir, tmp_path):
    engine = tiny(tiny_model_dir, tmp_path, 70, restore_quiet_s=3600.0)
    engine.set_admission_grant(AdmissionGrant(max_quantized=4, min_quantized=0, precision=I4))
    burst(engine, 5)
    drain(engine)
    for _ in range(3):
        enact(engine, AdmissionGrant(4, 0, I4), None, engine.admission.moves_total())
    assert engine.morph_state().num_quantized == 3  # quiet, but not for an hour yet
    fast = tiny(tiny_model_dir, tmp_path, 70, restore_quiet_s=0.0)
    fast.set_admission_grant(AdmissionGrant(max_quantized=4, min_quantized=0, precision=I4))
    burst(fast, 5)
    drain(fast)
    enact(fast, AdmissionGrant(4, 2, I4), None, fast.admission.moves_total())
    assert fast.morph_state().num_quantized == 2  # the floor (forced layers or a pin) stays


def test_a_grant_may_shorten_the_restore_quiet_period(tiny_model_dir, tmp_path):
    """The fleet's shorter quiet period (AdmissionGrant.restore_quiet_s) replaces the engine's own:
    the same drained engine restores at once under it, and not under the engine's hour."""
    engine = tiny(tiny_model_dir, tmp_path, 70, restore_quiet_s=3600.0)
    engine.set_admission_grant(AdmissionGrant(max_quantized=4, min_quantized=0, precision=I4))
    burst(engine, 5)
    drain(engine)
    enact(engine, AdmissionGrant(4, 0, I4), None, engine.admission.moves_total())
    assert engine.morph_state().num_quantized == 3  # the engine's quiet period holds
    enact(engine, AdmissionGrant(4, 0, I4, restore_quiet_s=0.0), None, engine.admission.moves_total())
    assert engine.morph_state().num_quantized == 0 and engine.pool.capacity == 70
    with pytest.raises(ValueError, match="quiet"):
        engine.set_admission_grant(AdmissionGrant(4, 0, I4, restore_quiet_s=-1.0))


def test_the_replica_loop_hands_each_directive_grant_to_the_engine(tiny_model_dir, tmp_path):
    """A real AsyncLLMEngine and MorphLoop with a controller handle that grants `allowed` layers:
    admission morphs stay within the grant, and a raised grant lets the next burst go further."""
    import asyncio

    from controller.client import ControllerClient
    from controller.directive import Directive
    from controller.policy_config import PolicyConfig
    from deployments.metrics import InMemoryBackend, ServeMetrics
    from deployments.morph_loop import MorphLoop
    from engine.async_engine import AsyncLLMEngine

    allowed = [1]

    class Handle:
        class report:  # noqa: N801 (a Ray actor method's shape: handle.report.remote(...))
            @staticmethod
            def remote(replica_id, snapshot, state):
                async def answer():
                    return Directive(state.num_quantized, I4, "performance", "hold", "controller",
                                     max_quantized=allowed[0])
                return answer()

    engine = AsyncLLMEngine(engine=tiny(tiny_model_dir, tmp_path, 70, restore_quiet_s=3600.0))
    metrics = ServeMetrics("tiny", InMemoryBackend())
    loop = MorphLoop(engine, ControllerClient("r", PolicyConfig(mode="performance"), resolve=Handle), metrics)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def finish(rid: str, p: list[int]) -> int:
        return [out async for out in engine.generate(rid, p, params)][-1].num_output_tokens

    async def main():
        await loop.run_once()  # the first directive: 1 layer allowed
        assert await asyncio.gather(*(finish(f"a{i}", prompt(i)) for i in range(5))) == [8] * 5
        capped = engine.engine.morph_state().num_quantized
        allowed[0] = 4
        await loop.run_once()
        assert await asyncio.gather(*(finish(f"b{i}", prompt(i)) for i in range(5))) == [8] * 5
        await loop.run_once()
        return capped, engine.engine.morph_state().num_quantized

    try:
        capped, raised = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        engine.shutdown()
    assert (capped, raised) == (1, 3)  # the queue's deficit needs 3 INT4 layers (see the first test)
    assert metrics.burst.allowed.value(model_name="tiny") == 4
    assert metrics.burst.admission_morphs.value(model_name="tiny", kind="swap") == 2
    assert metrics.actions.value(model_name="tiny", kind="swap_down") == 3  # the engine's results, counted
