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
    scale_out: bool = False  # sustained pressure with no morph headroom left: more replicas would help
    grant: int | None = None  # the fleet budget's share for this replica (None: no fleet cap / local)

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
                "reason": self.reason, "source": self.source, "scale_out": self.scale_out, "grant": self.grant}
