"""Directive: what one replica should look like (how many layers quantized, to which rung). The
policy and the fleet controller produce directives; a replica turns one into a morph action."""
from __future__ import annotations

import dataclasses
from typing import Literal

from engine.morph.actions import MorphState, SetQuantizedTarget
from engine.precision import Precision

DirectiveSource = Literal["controller", "local"]


@dataclasses.dataclass(frozen=True)
class Directive:
    target_quantized: int  # layers below full precision wanted: the first N of the state's swap order
    precision: Precision  # the rung those layers go to
    mode: str  # the policy mode that produced it
    reason: str  # one line for logs and status(): why this target
    source: DirectiveSource  # "controller": the fleet answered; "local": the replica's fallback
    # Sustained pressure that morphing cannot relieve (at the cap, or queueing for compute), held for
    # scale_out_after_s where the fleet or the client's fallback decides: more replicas would help.
    scale_out: bool = False
    # The fleet budget's share for this replica, as the fleet's `_allowance` computed it (None: no fleet
    # cap, or the local fallback). An input to max_quantized, kept for status and metrics.
    grant: int | None = None
    # The effective bound: max(min(mode cap, grant), layers the budget forces) (policy.morph_cap of the
    # same grant). It bounds the engine's own admission-time morphs until the next directive.
    max_quantized: int | None = None
    reservation_factor: float = 1.0  # output reservation multiplier (SLO feedback; 1 = the engine's config)
    waiting_for: str = "none"  # what queued requests waited for at the last report: none | memory | compute | unknown
    slo_level: float | None = None  # SLO feedback level in [0, 1]; None when no SLO is set
    enter_kv_usage: float | None = None  # the entry thresholds this decision used (SLO feedback moves them)
    enter_queue_delay_s: float | None = None
    # The quiet period the engine's demand restores need until the next directive (None: the engine's
    # own restore_quiet_s); the fleet shortens it while every other replica is relaxed.
    restore_quiet_s: float | None = None

    def __post_init__(self) -> None:
        if self.target_quantized < 0:
            raise ValueError(f"target_quantized must be >= 0, got {self.target_quantized}")
        if self.precision.is_full:
            raise ValueError(f"a directive's precision is a lower rung (int8/int4), got {self.precision.value}")

    def to_action(self, max_layers_per_step: int = 1) -> SetQuantizedTarget:
        """The engine action; the executor moves at most `max_layers_per_step` layers per step."""
        if max_layers_per_step < 1:
            raise ValueError(f"max_layers_per_step must be >= 1, got {max_layers_per_step}")
        return SetQuantizedTarget(count=self.target_quantized, precision=self.precision,
                                  max_layers_per_step=max_layers_per_step)

    def planned_layers(self, state: MorphState) -> tuple[int, ...]:
        """The layer ids this directive has quantized on `state`: a prefix of its swap order."""
        return state.swap_order[:min(self.target_quantized, len(state.swap_order))]

    def is_noop_for(self, state: MorphState) -> bool:
        """True when `state` already looks like this directive (nothing to send to the engine)."""
        planned = set(self.planned_layers(state))
        return all((p == self.precision) if i in planned else p.is_full
                   for i, p in enumerate(state.layer_precisions))

    def summary(self) -> dict:
        return {"target_quantized": self.target_quantized, "precision": self.precision.value, "mode": self.mode,
                "reason": self.reason, "source": self.source, "scale_out": self.scale_out,
                "grant": self.grant, "max_quantized": self.max_quantized, "reservation_factor": round(self.reservation_factor, 4),
                "waiting_for": self.waiting_for, "slo_level": self.slo_level,
                "enter_kv_usage": self.enter_kv_usage, "enter_queue_delay_s": self.enter_queue_delay_s,
                "restore_quiet_s": self.restore_quiet_s}
