"""The morph policy: a pure function of a replica's pressure history and its morph state.

No clocks (only the snapshots' own times), no I/O, no Ray, no randomness, so it is tested with
hand-built records and runs the same inside the fleet controller and as a replica's local fallback.

    pressured snapshot: kv_usage >= enter_kv_usage  or  queue_delay >= enter_queue_delay_s
    relaxed snapshot:   kv_usage <= relax_kv_usage  and queue_delay <= relax_queue_delay_s
    (anything in between is neither: it holds the current target)

A step down (more quantized layers) needs `enter_after` pressured snapshots in a row, a step back
`relax_after` relaxed ones, and either window must lie wholly *after* the last morph the replica
made (seen as a change in committed KV blocks): the policy looks at the effect of its previous step
before taking another, which together with the gap between the two bands is the hysteresis.
"""
from __future__ import annotations

import collections
from collections.abc import Sequence

from controller.directive import Directive
from controller.policy_config import ActiveMode, PolicyConfig
from engine.morph.actions import MorphState, SetQuantizedTarget
from engine.pressure import PressureSnapshot


def is_pressured(s: PressureSnapshot, mode: ActiveMode) -> bool:
    return s.kv_usage >= mode.enter_kv_usage or s.queue_delay_s >= mode.enter_queue_delay_s


def is_relaxed(s: PressureSnapshot, config: PolicyConfig) -> bool:
    return s.kv_usage <= config.relax_kv_usage and s.queue_delay_s <= config.relax_queue_delay_s


def pressure_score(s: PressureSnapshot, mode: ActiveMode) -> float:
    """How far past its entry thresholds a snapshot is (1.0 = at a threshold); ranks replicas."""
    return max(s.kv_usage / mode.enter_kv_usage, s.queue_delay_s / mode.enter_queue_delay_s)


def sustained(history: Sequence[PressureSnapshot], window: int, predicate) -> bool:
    """The last `window` snapshots all satisfy `predicate` and were all taken at one KV capacity,
    i.e. after the replica's last morph took effect."""
    if len(history) < window:
        return False
    tail = list(history)[-window:]
    capacity = tail[-1].kv_capacity_blocks
    return all(predicate(s) and s.kv_capacity_blocks == capacity for s in tail)


def current_target(state: MorphState) -> int:
    """What the replica is heading to: a pending SetQuantizedTarget's count, else what it has."""
    for action in reversed(state.pending):
        if isinstance(action, SetQuantizedTarget):
            return action.count
    return state.num_quantized


def morph_cap(state: MorphState, config: PolicyConfig, cap: int | None = None) -> int:
    """Most layers this replica may quantize: the mode's share of its depth, and the fleet's grant."""
    limit = config.active.cap_layers(len(state.layer_precisions)) if state.layer_precisions else 0
    return limit if cap is None else min(limit, max(0, cap))


def decide(history: Sequence[PressureSnapshot], state: MorphState, config: PolicyConfig,
           cap: int | None = None) -> Directive:
    """The directive for one replica. `cap` is an extra limit (the fleet's accuracy budget share)."""
    mode = config.active
    limit = morph_cap(state, config, cap)
    current = current_target(state)

    def directive(target: int, reason: str, scale_out: bool = False) -> Directive:
        return Directive(target_quantized=target, precision=mode.precision, mode=mode.name, reason=reason,
                         source="local", scale_out=scale_out)

    if not state.morphing_enabled:
        return directive(state.num_quantized, "morphing is disabled on this replica")
    if current > limit:
        return directive(limit, f"{current} quantized layers exceed the cap of {limit}; restoring down to it")
    if not history:
        return directive(current, "no pressure reported yet; hold")
    last = history[-1]
    if sustained(history, config.enter_after, lambda s: is_pressured(s, mode)):
        signal = (f"kv usage {last.kv_usage:.2f}, queue delay {last.queue_delay_s * 1e3:.0f} ms "
                  f"for {config.enter_after} snapshots")
        if current >= limit:
            return directive(limit, f"pressure ({signal}) but at the cap of {limit} layers; more replicas would help",
                             scale_out=True)
        target = min(limit, current + mode.layers_per_action)
        return directive(target, f"pressure ({signal}): quantize {target - current} more layer(s)")
    if current > 0 and sustained(history, config.relax_after, lambda s: is_relaxed(s, config)):
        target = max(0, current - mode.layers_per_action)
        return directive(target, f"relaxed for {config.relax_after} snapshots "
                                 f"(kv usage {last.kv_usage:.2f}): restore {current - target} layer(s)")
    return directive(current, "hold")


class PolicyRunner:
    """A replica's own policy loop: a bounded history of its snapshots plus `decide`. Pure apart from
    the deque; the local fallback of ControllerClient uses it."""

    def __init__(self, config: PolicyConfig):
        self.config = config
        self.history: collections.deque[PressureSnapshot] = collections.deque(maxlen=config.history_len)

    def observe(self, snapshot: PressureSnapshot) -> bool:
        """Append a snapshot; one not newer than the last (a duplicate, a late retry) is ignored."""
        if self.history and snapshot.time <= self.history[-1].time:
            return False
        self.history.append(snapshot)
        return True

    def decide(self, state: MorphState, cap: int | None = None) -> Directive:
        return decide(self.history, state, self.config, cap)

    def step(self, snapshot: PressureSnapshot, state: MorphState, cap: int | None = None) -> Directive:
        self.observe(snapshot)
        return self.decide(state, cap)

    def set_config(self, config: PolicyConfig) -> None:
        """Switch config (e.g. a new mode), keeping the newest snapshots that still fit."""
        self.config = config
        self.history = collections.deque(self.history, maxlen=config.history_len)
