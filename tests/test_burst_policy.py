"""The policy side of burst-speed morphing, on hand-built records (no Ray, no model):

- the queue-delay fault: a replica whose steps are slower than the controller's replica timeout kept
  losing its history in the controller, so `enter_after` reports never accumulated and the directive
  stayed "hold" while requests queued for seconds;
- memory vs compute queueing: morph for memory; for compute only at batch sizes where quantized
  layers are faster, else hold and ask for a replica, saying why;
- the forced start state: a budget that forces more layers than the mode's cap raises the cap;
- every directive carries the allowed maximum that bounds the engine's admission-time morphs;
- SLO feedback converges on a synthetic TTFT series and does not oscillate.
"""
from __future__ import annotations

import dataclasses

import pytest

from controller.fleet import FleetController
from controller.policy import PolicyRunner, decide
from controller.policy_config import FleetConfig, PolicyConfig, SloFeedbackConfig
from controller.slo import SloState, tune, tuning_for
from engine.morph.actions import MorphState
from engine.precision import Precision
from engine.pressure import LedgerFigures, PressureSnapshot

LEDGER = LedgerFigures(budget=1000, weights=500, kv=400, reserve=50)


def snap(t: float, *, delay: float = 0.0, used: int = 40, capacity: int = 100, waiting: int = 0,
         head: int = 0, running: int = 4, ttft_p95: float | None = None) -> PressureSnapshot:
    return PressureSnapshot(time=t, step=int(t * 10), kv_used_blocks=used, kv_capacity_blocks=capacity,
                            kv_max_blocks=400, num_running=running, num_waiting=waiting, queue_delay_s=delay,
                            ttft_recent_s=ttft_p95, tpot_recent_s=None, throughput_tok_s=10.0, preemptions_total=0,
                            ledger=LEDGER, waiting_demand_blocks=head * waiting, head_demand_blocks=head,
                            ttft_recent_p95_s=ttft_p95)


def state(num_layers: int = 30, quantized: int = 0, forced: int = 0) -> MorphState:
    precisions = tuple(Precision.INT4 if i < quantized else Precision.BF16 for i in range(num_layers))
    return MorphState(precisions, Precision.BF16, tuple(range(num_layers)), "front-to-back", 100, 400,
                      forced_quantized=forced)


def test_a_replica_slower_than_the_controller_timeout_keeps_its_history_and_morphs():
    # The fault at memory_budget=520MiB: 24 long prompts, steps of >10 s under load, one report per
    # step (reports wait for a step boundary). The controller forgot the replica before each report.
    clock = [0.0]
    fleet = FleetController(FleetConfig(replica_timeout_s=10.0, policy=PolicyConfig(queue_delay_sustained_s=60.0)),
                            clock=lambda: clock[0])
    directives = []
    for i in range(3):
        clock[0] = 12.0 * i
        directives.append(fleet.report("slow", snap(12.0 * i + 1, delay=0.5 + i, waiting=20, head=29, used=80),
                                       state()))
    assert [d.target_quantized for d in directives] == [0, 0, 2]  # balanced: 2 layers after 3 reports
    assert directives[-1].waiting_for == "memory" and "quantize 2 more" in directives[-1].reason
    clock[0] = 100.0
    assert "slow" not in fleet.status()["replicas"]  # a replica that really went silent is still forgotten


def test_a_long_queue_delay_is_sustained_pressure_by_itself():
    runner = PolicyRunner(PolicyConfig(queue_delay_sustained_s=1.0))
    d = runner.step(snap(1.0, delay=12.6, waiting=20, head=29, used=80), state())  # the first report
    assert d.target_quantized == 2 and d.waiting_for == "memory"
    assert PolicyRunner(PolicyConfig()).step(snap(1.0, delay=0.5, waiting=2, head=29, used=80), state()) \
        .target_quantized == 0  # a short delay still needs enter_after reports


def test_queueing_for_compute_asks_for_a_replica_unless_quantized_layers_are_faster():
    # 24 requests wait, KV usage 0.48: the head's 29 blocks fit in the 52 free ones, the token budget holds it
    compute = snap(1.0, delay=12.6, waiting=24, head=29, used=48, running=3)
    assert compute.waiting_for == "compute"
    d = decide([compute], state(), PolicyConfig())
    assert (d.target_quantized, d.scale_out, d.waiting_for) == (0, True, "compute")
    assert "not faster" in d.reason and "more replicas" in d.reason
    batch1 = dataclasses.replace(compute, num_running=1)
    assert decide([batch1], state(), PolicyConfig()).target_quantized == 2  # batch 1: INT4 decodes faster here
    memory = snap(1.0, delay=12.6, waiting=24, head=29, used=80, running=3)
    assert memory.waiting_for == "memory" and decide([memory], state(), PolicyConfig()).target_quantized == 2


def test_compute_bound_replica_is_counted_for_scale_out():
    clock = [0.0]
    fleet = FleetController(FleetConfig(scale_out_after_s=2.0), clock=lambda: clock[0])
    for i in range(6):
        clock[0] = float(i)
        fleet.report("r", snap(float(i), delay=5.0 + i, waiting=24, head=29, used=48, running=3), state())
    assert fleet.scale_out_signal()["saturated_replicas"] == ["r"]


def test_a_budget_that_forces_layers_above_the_mode_cap_raises_the_cap():
    # memory_budget=400MiB: the engine starts with 19 INT4 layers; balanced allows 60% of 30 = 18.
    forced = state(quantized=19, forced=19)
    config = PolicyConfig(mode="balanced")
    d = decide([snap(1.0)], forced, config)
    assert (d.target_quantized, d.max_quantized) == (19, 19) and "restor" not in d.reason
    relaxed = [snap(0.25 * i, used=10) for i in range(12)]
    assert decide(relaxed, forced, config).target_quantized == 19  # nothing below the forced layers
    assert decide([snap(1.0)], forced, config, cap=5).max_quantized == 19  # a fleet share cannot go below either
    fleet = FleetController(FleetConfig(fleet_max_quantized_layers=10))
    assert fleet.report("r", snap(1.0), forced).target_quantized == 19


def test_every_directive_carries_the_grant_that_bounds_admission_morphs():
    config = PolicyConfig(mode="accuracy")  # cap 30% of 30 = 9 layers
    assert decide([snap(1.0)], state(), config).max_quantized == 9
    assert decide([snap(1.0)], state(), config, cap=4).max_quantized == 4  # the fleet's share
    # Admission morphs the controller did not order appear as the replica's state; above a lower
    # grant (a veto) the directive restores down to it.
    d = decide([snap(1.0)], state(quantized=7), config, cap=4)
    assert (d.target_quantized, d.max_quantized) == (4, 4)


SLO = SloFeedbackConfig(slo_ttft_s=2.0)


def plant(level: float) -> float:
    """A synthetic replica: TTFT P95 falls as the feedback morphs earlier (3.2 s at level 0)."""
    return 2.0 * (1.6 - 1.5 * level)


def test_slo_feedback_converges_and_holds_without_oscillating():
    s, levels = SloState(), []
    for _ in range(200):
        s = tune(s, plant(s.level), SLO)
        levels.append(s.level)
    assert levels[-1] == pytest.approx(0.75)  # TTFT 0.95 s: inside the band (0.4..0.8 x SLO)
    changes = [b - a for a, b in zip(levels, levels[1:]) if b != a]
    assert changes and all(c > 0 for c in changes)  # it only ever went one way: no oscillation
    assert all(lv == levels[-1] for lv in levels[10:])  # and settled within 10 reports


def test_slo_feedback_relaxes_slowly_and_is_bounded():
    s = SloState(level=1.0)
    for _ in range(7):
        s = tune(s, 0.2, SLO)  # calm, but not for loosen_after (8) reports yet
    assert s.level == 1.0
    s = tune(s, 0.2, SLO)
    assert s.level == pytest.approx(0.9)
    for _ in range(500):
        s = tune(s, 0.2, SLO)
    assert s.level == 0.0
    for _ in range(50):
        s = tune(s, 30.0, SLO)
    assert s.level == 1.0
    assert tune(s, None, SLO) == s  # no TTFT seen: hold
    assert tune(SloState(), 30.0, SloFeedbackConfig()).level == 0.0  # no SLO: off


def test_slo_level_moves_thresholds_and_reservation():
    config = PolicyConfig(mode="balanced", slo=SLO)
    mode = config.active
    t0, t1 = tuning_for(SloState(0.0), mode, SLO), tuning_for(SloState(1.0), mode, SLO)
    assert (t0.enter_kv_usage, t0.enter_queue_delay_s, t0.reservation_factor) == (0.85, 0.1, 1.0)
    assert (t1.enter_kv_usage, t1.reservation_factor) == (0.65, 4.0)
    assert t1.enter_queue_delay_s == pytest.approx(0.03)
    # At level 1 a KV usage of 0.7 is pressure; at level 0 it is not.
    hot = [snap(0.25 * i, used=70) for i in range(3)]
    assert decide(hot, state(), config, tuning=t1).target_quantized == 2
    assert decide(hot, state(), config, tuning=t0).target_quantized == 0
    runner = PolicyRunner(config)
    for i in range(4):
        d = runner.step(snap(0.25 * i, used=10, ttft_p95=6.0), state())
    assert d.slo_level == pytest.approx(0.5) and d.reservation_factor == pytest.approx(2.5)


def test_slo_config_is_validated():
    with pytest.raises(ValueError, match="loosen_ratio"):
        SloFeedbackConfig(loosen_ratio=0.9, tighten_ratio=0.8)
    with pytest.raises(ValueError, match="eager_kv_usage"):
        PolicyConfig(slo=SloFeedbackConfig(slo_ttft_s=1.0, eager_kv_usage=0.5))


@pytest.mark.slow
def test_the_400mib_start_state_agrees_with_the_balanced_cap(default_model_dir):
    """The real default model at 400 MiB starts with INT4 layers above balanced mode's cap of 18;
    the controller used to order "restore down to 18" every round, rejected every time."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="default", dtype="bf16", memory_budget="400MiB", num_threads=1))
    start = engine.morph_state()
    assert start.forced_quantized == start.num_quantized > PolicyConfig().active.cap_layers(30) == 18
    d = decide([engine.pressure()], start, PolicyConfig(mode="balanced"))
    assert d.target_quantized == d.max_quantized == start.num_quantized
    assert d.is_noop_for(start) and engine.apply(d.to_action()).status == "noop"
