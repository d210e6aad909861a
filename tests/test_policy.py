"""The morph policy on hand-built pressure sequences: no Ray, no model."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.directive import Directive
from controller.policy import PolicyRunner, decide
from controller.policy_config import MODE_NAMES, PolicyConfig
from engine.morph.actions import MorphState, SetQuantizedTarget
from engine.precision import Precision
from engine.pressure import LedgerFigures, PressureSnapshot

LEDGER = LedgerFigures(budget=1000, weights=500, kv=400, reserve=50)
BASE_BLOCKS, BLOCKS_PER_LAYER = 100, 10  # the fake engine's KV: grows 10 blocks per quantized layer


def snap(t: float, kv_usage: float, capacity: int = BASE_BLOCKS, delay: float = 0.0) -> PressureSnapshot:
    return PressureSnapshot(time=t, step=int(t * 10), kv_used_blocks=min(capacity, round(kv_usage * capacity)),
                            kv_capacity_blocks=capacity, kv_max_blocks=400, num_running=4,
                            num_waiting=1 if delay else 0, queue_delay_s=delay, ttft_recent_s=None,
                            tpot_recent_s=None, throughput_tok_s=100.0, preemptions_total=0, ledger=LEDGER)


def make_state(num_layers: int = 20, quantized: int = 0, precision: Precision = Precision.INT4,
               swap_order: tuple[int, ...] | None = None, pending=()) -> MorphState:
    order = swap_order if swap_order is not None else tuple(range(num_layers))
    low = set(order[:quantized])
    precisions = tuple(precision if i in low else Precision.BF16 for i in range(num_layers))
    return MorphState(layer_precisions=precisions, full_precision=Precision.BF16, swap_order=order,
                      swap_order_source="front-to-back", kv_capacity_blocks=BASE_BLOCKS + BLOCKS_PER_LAYER * quantized,
                      kv_max_blocks=400, pending=tuple(pending))


def apply(state: MorphState, action: SetQuantizedTarget) -> MorphState:
    """What the executor does with SetQuantizedTarget: the first `count` layers of the swap order at
    `precision`, every other layer at full precision; KV grows by the freed memory."""
    low = set(state.swap_order[:action.count])
    precisions = tuple(action.precision if i in low else state.full_precision
                       for i in range(len(state.layer_precisions)))
    return dataclasses.replace(state, layer_precisions=precisions,
                               kv_capacity_blocks=BASE_BLOCKS + BLOCKS_PER_LAYER * action.count)


def run_closed_loop(loads, config: PolicyConfig, state: MorphState, cap: int | None = None,
                    delay_of=lambda load: 0.0):
    """Feed `loads` (demanded KV blocks / base capacity) to a PolicyRunner and apply every directive
    that changes the target. Returns (final state, [(snapshot index, directive) for each action])."""
    runner, actions = PolicyRunner(config), []
    for i, load in enumerate(loads):
        capacity = state.kv_capacity_blocks
        directive = runner.step(snap(0.25 * i, min(1.0, load * BASE_BLOCKS / capacity), capacity,
                                     delay_of(load)), state, cap)
        assert directive.source == "local"
        if directive.target_quantized != state.num_quantized:
            actions.append((i, directive))
            state = apply(state, directive.to_action())
    return state, actions


def test_burst_steps_up_by_layers_per_action_until_the_cap_then_asks_to_scale_out():
    config = PolicyConfig(mode="balanced")
    # Queue delay stays high whatever the KV capacity: the burst is sustained.
    state, actions = run_closed_loop([1.2] * 60, config, make_state(20), delay_of=lambda _: 0.5)
    targets = [d.target_quantized for _, d in actions]
    assert targets == list(range(2, 13, 2))  # balanced: +2 per action, cap floor(0.6 * 20) = 12
    gaps = [b - a for (a, _), (b, _) in zip(actions, actions[1:])]
    assert min(gaps) >= config.enter_after  # a fresh pressured window after each morph
    assert state.num_quantized == 12
    final = decide([snap(100 + i, 1.0, state.kv_capacity_blocks, 0.5) for i in range(3)], state, config)
    assert final.target_quantized == 12 and final.scale_out


def test_directive_counts_map_onto_the_swap_order():
    order = (7, 2, 9, 0, 5, 1, 3, 4, 6, 8)
    state = make_state(10, swap_order=order)
    config = PolicyConfig(mode="performance")  # 4 layers per action, the whole depth
    seen = []
    for step in range(3):
        history = [snap(10 * step + i, 0.95, state.kv_capacity_blocks) for i in range(3)]
        directive = decide(history, state, config)
        action = directive.to_action(max_layers_per_step=2)
        assert action == SetQuantizedTarget(count=directive.target_quantized, precision=Precision.INT4,
                                            max_layers_per_step=2)
        state = apply(state, action)
        quantized = {i for i, p in enumerate(state.layer_precisions) if p == Precision.INT4}
        assert quantized == set(order[:directive.target_quantized]) == set(directive.planned_layers(state))
        assert directive.is_noop_for(state)
        seen.append(directive.target_quantized)
    assert seen == [4, 8, 10]


def test_quiet_period_brings_the_target_back_to_zero():
    config = PolicyConfig(mode="balanced")
    state, actions = run_closed_loop([0.3] * 80, config, make_state(20, quantized=12))
    assert [d.target_quantized for _, d in actions] == [10, 8, 6, 4, 2, 0]
    assert actions[0][0] == config.relax_after - 1  # not before a full relaxed window
    assert all(b - a >= config.relax_after for (a, _), (b, _) in zip(actions, actions[1:]))
    assert state.num_quantized == 0


def test_between_the_bands_holds():
    state = make_state(20, quantized=4)
    history = [snap(i, 0.75, state.kv_capacity_blocks) for i in range(30)]
    directive = decide(history, state, PolicyConfig())
    assert directive.target_quantized == 4 and directive.reason == "hold"


@pytest.mark.parametrize("period", [1, 2])
def test_fast_oscillation_around_the_entry_threshold_never_morphs(period):
    loads = [0.84 if (i // period) % 2 else 0.86 for i in range(400)]
    _, actions = run_closed_loop(loads, PolicyConfig(mode="balanced"), make_state(20))
    assert actions == []


def test_slow_oscillation_morphs_a_bounded_number_of_times():
    # 6 snapshots above the entry band, 6 between the bands, for 400 snapshots: without hysteresis a
    # naive threshold policy would act about 130 times; here it only climbs, to the cap, and holds.
    config = PolicyConfig(mode="balanced")
    loads = [0.95 if (i // 6) % 2 == 0 else 0.7 for i in range(400)]
    queue_delay = lambda load: 0.3 if load > 0.9 else 0.05  # noqa: E731 - also between the bands when low
    state, actions = run_closed_loop(loads, config, make_state(20), delay_of=queue_delay)
    assert 0 < len(actions) <= config.active.cap_layers(20) // config.active.layers_per_action
    assert all(b.target_quantized > a.target_quantized for (_, a), (_, b) in zip(actions, actions[1:]))


def test_oscillation_around_the_relax_threshold_does_not_restore():
    state = make_state(20, quantized=6)
    scale = state.kv_capacity_blocks / BASE_BLOCKS  # loads are in base-capacity units
    loads = [(0.58 if i % 2 else 0.62) * scale for i in range(300)]
    _, actions = run_closed_loop(loads, PolicyConfig(), state)
    assert actions == []


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([0.3, 0.7, 0.9, 1.3]), min_size=1, max_size=150))
def test_any_load_respects_windows_and_caps(loads):
    config = PolicyConfig(mode="balanced")
    _, actions = run_closed_loop(loads, config, make_state(20), cap=8)
    assert all(0 <= d.target_quantized <= 8 for _, d in actions)
    # every reversal (up then down, or down then up) needs at least the entry window in between
    assert all(b - a >= config.enter_after for (a, _), (b, _) in zip(actions, actions[1:]))
    assert len(actions) <= len(loads) // config.enter_after


@pytest.mark.parametrize("mode", MODE_NAMES)
def test_each_mode_cap_and_rung_hold(mode):
    config = PolicyConfig(mode=mode)
    state, actions = run_closed_loop([1.5] * 150, config, make_state(24), delay_of=lambda _: 1.0)
    expected_cap = {"accuracy": 7, "balanced": 14, "performance": 24}[mode]  # floor(fraction * 24)
    assert state.num_quantized == expected_cap
    assert max(d.target_quantized for _, d in actions) == expected_cap
    steps = {d.target_quantized - a.target_quantized for (_, a), (_, d) in zip(actions, actions[1:])}
    assert max(steps) == config.active.layers_per_action
    expected_rung = {"accuracy": Precision.INT8, "balanced": Precision.INT4, "performance": Precision.INT4}[mode]
    assert all(d.precision == expected_rung and d.mode == mode for _, d in actions)


def test_fleet_cap_holds_and_forces_a_restore_above_it():
    config = PolicyConfig(mode="performance")
    state, actions = run_closed_loop([1.5] * 60, config, make_state(20), cap=6, delay_of=lambda _: 1.0)
    assert [d.target_quantized for _, d in actions] == [4, 6]
    over = decide([snap(0, 0.99)] * 3, make_state(20, quantized=10), config, cap=3)
    assert over.target_quantized == 3 and "cap" in over.reason


def test_pending_target_is_the_base_and_disabled_morphing_holds():
    config = PolicyConfig(mode="balanced")
    pending = make_state(20, quantized=2, pending=[SetQuantizedTarget(6, Precision.INT4)])
    history = [snap(i, 0.95, pending.kv_capacity_blocks) for i in range(3)]
    assert decide(history, pending, config).target_quantized == 8
    disabled = dataclasses.replace(make_state(20, quantized=2), morphing_enabled=False)
    assert decide(history, disabled, config).target_quantized == 2


def test_decide_is_pure_and_window_must_follow_the_last_morph():
    config = PolicyConfig()
    state = make_state(20, quantized=2)
    # the first pressured snapshot was taken before the last KV resize: only 2 count, not 3
    history = (snap(0, 0.95, capacity=100), snap(1, 0.95, capacity=120), snap(2, 0.95, capacity=120))
    first = decide(history, state, config)
    assert first == decide(history, state, config) and first.target_quantized == 2
    assert decide(history + (snap(3, 0.95, capacity=120),), state, config).target_quantized == 4


def test_runner_keeps_a_bounded_history_and_drops_stale_snapshots():
    runner = PolicyRunner(PolicyConfig(history_len=12))
    for i in range(20):
        runner.observe(snap(i, 0.5))
    assert not runner.observe(snap(5, 0.99))
    assert len(runner.history) == 12 and runner.history[-1].time == 19
    runner.set_config(PolicyConfig(mode="accuracy", history_len=10))
    assert len(runner.history) == 10 and runner.decide(make_state(20)).mode == "accuracy"


@pytest.mark.parametrize("kwargs, hint", [
    ({"relax_kv_usage": 0.9}, "lower relax_kv_usage"),
    ({"relax_queue_delay_s": 0.2}, "lower relax_queue_delay_s"),
    ({"relax_after": 2, "enter_after": 3}, "relax_after"),
    ({"history_len": 5}, "raise history_len"),
    ({"mode": "turbo"}, "accuracy"),
    ({"modes": {"balanced": {"layers_per_action": 1, "max_quantized_fraction": 0.5, "precision": "int8"}}},
     "missing"),
])
def test_config_errors_say_what_to_change(kwargs, hint):
    with pytest.raises(ValueError, match=hint):
        PolicyConfig(**kwargs)
    with pytest.raises(ValueError, match="use one of"):
        PolicyConfig().with_mode("fast")


def test_directive_rejects_bad_values():
    with pytest.raises(ValueError, match="int8/int4"):
        Directive(2, Precision.BF16, "balanced", "", "local")
    with pytest.raises(ValueError, match=">= 0"):
        Directive(-1, Precision.INT4, "balanced", "", "local")
    with pytest.raises(ValueError, match="max_layers_per_step"):
        Directive(1, Precision.INT4, "balanced", "", "local").to_action(0)


# -- admission headroom (the fleet's grant beyond a replica's target) -------------------------------
def _demand_snap(waiting: int, used: int, capacity: int, block: int, free: int, gain: int) -> PressureSnapshot:
    from engine.morph.sizing import growth_blocks

    first = growth_blocks(free, block, 10**6, [gain])[1]
    return dataclasses.replace(
        snap(1.0, used / capacity, capacity), kv_used_blocks=used, waiting_demand_blocks=waiting,
        head_demand_blocks=waiting, num_waiting=1, rung_gain_blocks=(("int8", first // 2), ("int4", first)),
        ledger=LedgerFigures(budget=capacity * block + free + 100, weights=100, kv=capacity * block, reserve=0))


@settings(max_examples=300, deadline=None)
@given(block=st.integers(50, 500), per_block=st.integers(8, 30), free=st.integers(0, 1500),
       capacity=st.integers(20, 100), used_frac=st.floats(0.0, 1.0), waiting=st.integers(0, 300))
def test_deficit_layers_never_falls_short_of_the_engines_admission_sizing(block, per_block, free, capacity,
                                                                          used_frac, waiting):
    """The policy's estimate from a snapshot, against engine/morph/sizing.py on the same figures: never
    fewer layers (the grant does not make admission wait for the next report), and close above."""
    from controller.policy import deficit_layers
    from engine.morph.sizing import growth_blocks, plan_admission

    gain, used = per_block * block, round(used_frac * capacity)
    plan = plan_admission((waiting,) if waiting else (), capacity - used,
                          growth_blocks(free, block, 10**6, [gain] * 60))
    need = deficit_layers(_demand_snap(waiting, used, capacity, block, free, gain), PolicyConfig().active)
    expected = plan.layers if waiting and capacity - used < waiting else 0
    assert expected <= need <= expected + expected // 7 + 1


def test_admission_headroom_is_the_deficit_plus_one_step_and_unknown_without_figures():
    from controller.policy import admission_headroom

    mode = PolicyConfig().active  # balanced: 2 layers per step, INT4
    block = 100
    # 60 blocks lacking at 10 blocks per layer (no free bytes): 6 layers, + one step
    s = _demand_snap(waiting=100, used=60, capacity=100, block=block, free=0, gain=10 * block)
    assert admission_headroom(s, mode) == 6 + 2
    assert admission_headroom(dataclasses.replace(s, waiting_demand_blocks=0), mode) == 2  # nothing lacking
    assert admission_headroom(None, mode) == 2  # no report yet: one step
    assert admission_headroom(dataclasses.replace(s, rung_gain_blocks=()), mode) is None  # cannot size it
    assert admission_headroom(dataclasses.replace(s, rung_gain_blocks=(("int4", 0),)), mode) == 2  # no room to grow
