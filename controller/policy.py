"""The morph policy: a pure function of a replica's pressure history and its morph state.

No clocks (only the snapshots' own times), no I/O, no Ray, no randomness, so it is tested with
hand-built records and runs the same inside the fleet controller and as a replica's local fallback.

    pressured snapshot: kv_usage >= enter_kv_usage  or  queue_delay >= enter_queue_delay_s
    relaxed snapshot:   kv_usage <= relax_kv_usage  and queue_delay <= relax_queue_delay_s
    (anything in between is neither: it holds the current target)

A step down (more quantized layers) needs `enter_after` pressured snapshots in a row, a step back
`relax_after` relaxed ones, and either window must lie wholly *after* the last morph the replica
made (seen as a change in committed KV blocks): the policy looks at the effect of its previous step
before taking another, which together with the gap between the two bands is the hysteresis. A queue
delay of `queue_delay_sustained_s` or more is sustained by itself: the oldest request has waited that
long, however few reports saw it (a replica whose steps are slow reports rarely).

This is the slower, sampled path. The engine morphs at admission on its own (engine/morph/admission.py)
within `Directive.max_quantized`, which every directive carries.

Why requests queue decides what helps (the snapshot's `waiting_for`):
  memory  (the head's KV demand does not fit): morph, that is what morphing fixes;
  compute (it would fit; the step's token budget holds it back): morph only while the batch is small
          enough that quantized layers decode faster here (`quantized_faster_max_batch`), else hold and
          ask for another replica (scale_out), with the reason saying so.
The cap is never below what the budget forces (`MorphState.forced_quantized`): a replica that had to
start with layers swapped is not told to restore what it cannot.
"""
from __future__ import annotations

import collections
from collections.abc import Sequence

from controller.directive import Directive
from controller.policy_config import ActiveMode, PolicyConfig
from controller.slo import SloState, SloTuning, tune, tuned_mode, tuning_for
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
    """Most layers this replica may quantize: the mode's share of its depth and the fleet's grant,
    but never fewer than its budget forces (those it cannot restore)."""
    limit = config.active.cap_layers(len(state.layer_precisions)) if state.layer_precisions else 0
    limit = limit if cap is None else min(limit, max(0, cap))
    return max(limit, state.forced_quantized)


def deficit_layers(s: PressureSnapshot, mode: ActiveMode) -> int | None:
    """Layers at the mode's rung that free the KV deficit of the snapshot's whole queue (its demand
    less the blocks not owed to running requests): what admission sizing (engine/morph/sizing.py) would
    swap for that queue, from the snapshot's figures. `rung_gain_blocks` is the growth one more layer
    allows, free ledger bytes included: floor((free + gain) / block), so gain >= that x block - free,
    and the layers are counted at that lower bound (never fewer than the engine's sizing takes, for
    layers of one size). 0 when nothing is lacking; None when the snapshot has no gain figure for the
    rung (an engine without admission morphing, a test double)."""
    deficit = s.waiting_demand_blocks - s.available_blocks
    if deficit <= 0:
        return 0
    gains = dict(s.rung_gain_blocks)
    if mode.precision.value not in gains:
        return None
    first = gains[mode.precision.value]
    block_bytes = s.ledger.kv // s.kv_capacity_blocks if s.kv_capacity_blocks else 0
    free = max(0, s.ledger.free)
    if first <= 0 or block_bytes <= 0:
        return 0 if first <= 0 else 1  # no room left to grow into: more layers free nothing
    gain = first * block_bytes - free
    if gain <= 0:  # the first layer frees no whole block beyond the free bytes (or the room caps it)
        return 1
    return max(0, -(-(deficit * block_bytes - free) // gain))


def admission_headroom(s: PressureSnapshot | None, mode: ActiveMode) -> int | None:
    """Layers beyond what a replica is heading to that it may morph at admission before its next report:
    what frees its queue's deficit (`deficit_layers`, what its own admission sizing would take for the
    queue it reported) plus one policy step (`layers_per_action`) for what arrives between reports.
    None: the snapshot cannot size it (the caller gives what is left, as before the figures existed)."""
    if s is None:
        return mode.layers_per_action
    need = deficit_layers(s, mode)
    return None if need is None else need + mode.layers_per_action


def pressure_sustained(history: Sequence[PressureSnapshot], config: PolicyConfig, mode: ActiveMode) -> bool:
    if sustained(history, config.enter_after, lambda s: is_pressured(s, mode)):
        return True
    last = history[-1] if history else None
    return last is not None and last.queue_delay_s >= max(config.queue_delay_sustained_s, mode.enter_queue_delay_s)


def waiting_cause(s: PressureSnapshot, mode: ActiveMode) -> str:
    """memory | compute | none | unknown: why the replica is pressured (KV usage counts as memory)."""
    if s.kv_usage >= mode.enter_kv_usage:
        return "memory"
    return s.waiting_for


def decide(history: Sequence[PressureSnapshot], state: MorphState, config: PolicyConfig,
           cap: int | None = None, tuning: SloTuning | None = None) -> Directive:
    """The directive for one replica. `cap` is an extra limit (the fleet's accuracy budget share);
    `tuning` the replica's SLO-feedback thresholds (controller/slo.py)."""
    mode = tuned_mode(config.active, tuning)
    limit = morph_cap(state, config, cap)
    current = current_target(state)
    cause = waiting_cause(history[-1], mode) if history else "none"

    def directive(target: int, reason: str, scale_out: bool = False) -> Directive:
        return Directive(target_quantized=target, precision=mode.precision, mode=mode.name, reason=reason,
                         source="local", scale_out=scale_out, max_quantized=limit,
                         reservation_factor=tuning.reservation_factor if tuning else 1.0, waiting_for=cause,
                         slo_level=tuning.level if tuning and config.slo.slo_ttft_s is not None else None,
                         enter_kv_usage=mode.enter_kv_usage, enter_queue_delay_s=mode.enter_queue_delay_s)

    if not state.morphing_enabled:
        return directive(state.num_quantized, "morphing is disabled on this replica")
    if current > limit:
        return directive(limit, f"{current} quantized layers exceed the cap of {limit}; restoring down to it")
    if not history:
        return directive(current, "no pressure reported yet; hold")
    last = history[-1]
    if pressure_sustained(history, config, mode):
        signal = (f"kv usage {last.kv_usage:.2f}, queue delay {last.queue_delay_s * 1e3:.0f} ms, "
                  f"queueing for {cause}")
        if cause == "compute" and last.num_running > config.quantized_faster_max_batch:
            return directive(current, f"pressure ({signal}: the head's KV demand fits): at batch {last.num_running} "
                                      f"quantized layers are not faster on this hardware, so morphing would not help; "
                                      f"more replicas would", scale_out=True)
        if current >= limit:
            return directive(limit, f"pressure ({signal}) but at the cap of {limit} layers; more replicas would help",
                             scale_out=True)
        target = min(limit, current + mode.layers_per_action)
        return directive(target, f"pressure ({signal}): quantize {target - current} more layer(s)")
    floor = state.forced_quantized  # what the budget forces cannot be restored
    if current > floor and sustained(history, config.relax_after, lambda s: is_relaxed(s, config)):
        target = max(floor, current - mode.layers_per_action)
        return directive(target, f"relaxed for {config.relax_after} snapshots "
                                 f"(kv usage {last.kv_usage:.2f}): restore {current - target} layer(s)")
    return directive(current, "hold")


class PolicyRunner:
    """A replica's own policy loop: a bounded history of its snapshots plus `decide`. Pure apart from
    the deque; the local fallback of ControllerClient uses it."""

    def __init__(self, config: PolicyConfig):
        self.config = config
        self.history: collections.deque[PressureSnapshot] = collections.deque(maxlen=config.history_len)
        self.slo = SloState()

    def observe(self, snapshot: PressureSnapshot) -> bool:
        """Append a snapshot (and feed its TTFT to the SLO feedback); one not newer than the last
        (a duplicate, a late retry) is ignored."""
        if self.history and snapshot.time <= self.history[-1].time:
            return False
        self.history.append(snapshot)
        self.slo = tune(self.slo, snapshot.ttft_recent_p95_s, self.config.slo)
        return True

    def tuning(self) -> SloTuning | None:
        return tuning_for(self.slo, self.config.active, self.config.slo) if self.config.slo.slo_ttft_s else None

    def decide(self, state: MorphState, cap: int | None = None) -> Directive:
        return decide(self.history, state, self.config, cap, self.tuning())

    def step(self, snapshot: PressureSnapshot, state: MorphState, cap: int | None = None) -> Directive:
        self.observe(snapshot)
        return self.decide(state, cap)

    def set_config(self, config: PolicyConfig) -> None:
        """Switch config (e.g. a new mode), keeping the newest snapshots that still fit."""
        self.config = config
        self.history = collections.deque(self.history, maxlen=config.history_len)
