"""Policy configuration: when a replica counts as under pressure, when it counts as relaxed, and how
far each of the three modes may morph. Immutable and validated up front; every threshold is here,
none is a constant in policy code."""
from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.precision import Precision

ModeName = Literal["accuracy", "balanced", "performance"]
MODE_NAMES: tuple[str, ...] = ("accuracy", "balanced", "performance")


class ModeSettings(BaseModel):
    """How aggressively one mode morphs. Thresholds left at None use the PolicyConfig's."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    layers_per_action: int = Field(ge=1, description="layers added to / removed from the target per decision")
    max_quantized_fraction: float = Field(gt=0.0, le=1.0, description="cap on quantized layers, as a fraction of the model's layers")
    precision: Precision = Field(description="the rung swapped layers go to; must be in the engine's morph_ladder")
    enter_kv_usage: float | None = Field(None, gt=0.0, le=1.0, description="override of PolicyConfig.enter_kv_usage")
    enter_queue_delay_s: float | None = Field(None, gt=0.0, description="override of PolicyConfig.enter_queue_delay_s")

    @model_validator(mode="after")
    def _lower_rung(self) -> "ModeSettings":
        if self.precision.is_full:
            raise ValueError(f"a mode's precision is the rung layers are swapped to; use int8 or int4, not {self.precision.value}")
        return self


def _default_modes() -> dict[str, ModeSettings]:
    # accuracy: one layer at a time to INT8 (near lossless), at most 30% of the model.
    # balanced: two layers at a time to INT4 (the paper's rung, 4x smaller), at most 60%.
    # performance: four layers at a time to INT4, the whole depth.
    # Accuracy waits for more pressure before giving up precision; performance reacts earlier.
    return {
        "accuracy": ModeSettings(layers_per_action=1, max_quantized_fraction=0.3, precision=Precision.INT8,
                                 enter_kv_usage=0.90, enter_queue_delay_s=0.150),
        "balanced": ModeSettings(layers_per_action=2, max_quantized_fraction=0.6, precision=Precision.INT4),
        "performance": ModeSettings(layers_per_action=4, max_quantized_fraction=1.0, precision=Precision.INT4,
                                    enter_kv_usage=0.80, enter_queue_delay_s=0.075),
    }


class ActiveMode(BaseModel):
    """A mode with its thresholds resolved (what decide() reads)."""
    model_config = ConfigDict(frozen=True)

    name: str
    layers_per_action: int
    max_quantized_fraction: float
    precision: Precision
    enter_kv_usage: float
    enter_queue_delay_s: float

    def cap_layers(self, num_layers: int) -> int:
        """Most layers this mode may quantize in a model of `num_layers` layers (at least 1)."""
        return max(1, min(num_layers, math.floor(self.max_quantized_fraction * num_layers + 1e-9)))


class SloFeedbackConfig(BaseModel):
    """SLO feedback (controller/slo.py): with `slo_ttft_s` set, each replica's entry thresholds and
    output reservation follow its observed TTFT. `level` 0 = the configured thresholds, 1 = the most
    eager ones below; TTFT P95 above `tighten_ratio` x SLO for `tighten_after` reports raises the level
    by `tighten_step`; below `loosen_ratio` x SLO for `loosen_after` reports lowers it by `loosen_step`;
    in between it holds (the band and the two windows are the hysteresis)."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    slo_ttft_s: float | None = Field(None, gt=0.0, description="TTFT target in seconds; None turns the feedback off")
    tighten_ratio: float = Field(0.8, gt=0.0, description="TTFT P95 / SLO above this counts as hot")
    loosen_ratio: float = Field(0.4, gt=0.0, description="TTFT P95 / SLO below this counts as calm")
    tighten_after: int = Field(2, ge=1, description="hot reports in a row before one step up")
    loosen_after: int = Field(8, ge=1, description="calm reports in a row before one step down")
    tighten_step: float = Field(0.25, gt=0.0, le=1.0, description="level added per step up")
    loosen_step: float = Field(0.1, gt=0.0, le=1.0, description="level removed per step down")
    eager_kv_usage: float = Field(0.65, gt=0.0, le=1.0, description="entry KV usage at level 1 (must stay above relax_kv_usage)")
    eager_queue_delay_fraction: float = Field(0.3, gt=0.0, le=1.0, description="entry queue delay at level 1, as a fraction of the mode's")
    max_reservation_factor: float = Field(4.0, ge=1.0, description="output reservation multiplier at level 1")

    @model_validator(mode="after")
    def _band(self) -> "SloFeedbackConfig":
        if self.loosen_ratio >= self.tighten_ratio:
            raise ValueError(f"loosen_ratio ({self.loosen_ratio}) must be below tighten_ratio ({self.tighten_ratio}): "
                             "the gap between them is the feedback's hysteresis")
        return self


class PolicyConfig(BaseModel):
    """Thresholds and windows of the morph policy. Pressure must be *sustained* (enter_after snapshots
    in a row) to morph down, and relief sustained for longer (relax_after) with both signals well
    below the entry thresholds to restore: the gap between the two bands and the two windows is the
    hysteresis that keeps a load hovering at a threshold from flapping layers back and forth."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: ModeName = Field("balanced", description="accuracy | balanced | performance")
    enter_kv_usage: float = Field(0.85, gt=0.0, le=1.0, description="pressure when KV usage (used / committed blocks) >= this")
    enter_queue_delay_s: float = Field(0.100, gt=0.0, description="pressure when the oldest waiting request waited >= this many seconds")
    enter_after: int = Field(3, ge=1, description="consecutive pressured snapshots before one more step down")
    relax_kv_usage: float = Field(0.60, ge=0.0, lt=1.0, description="relaxed when KV usage <= this (and queue delay below relax_queue_delay_s)")
    relax_queue_delay_s: float = Field(0.020, ge=0.0, description="relaxed when queue delay <= this (and KV usage below relax_kv_usage)")
    relax_after: int = Field(10, ge=1, description="consecutive relaxed snapshots before one step of restore")
    history_len: int = Field(64, ge=1, description="snapshots a PolicyRunner / the fleet keeps per replica")
    queue_delay_sustained_s: float = Field(1.0, gt=0.0, description="a queue delay this long is sustained pressure by itself (the request has waited that long), however few reports saw it")
    quantized_faster_max_batch: int = Field(1, ge=0, description="running requests up to which quantized layers decode faster than full precision on this hardware (1 on the reference CPU); queueing for compute morphs only up to it, else it asks for scale-out")
    slo: SloFeedbackConfig = Field(default_factory=SloFeedbackConfig, description="SLO feedback on thresholds and output reservation")
    modes: dict[str, ModeSettings] = Field(default_factory=_default_modes, description="the three modes' settings")

    @model_validator(mode="after")
    def _consistent(self) -> "PolicyConfig":
        missing = [m for m in MODE_NAMES if m not in self.modes]
        extra = [m for m in self.modes if m not in MODE_NAMES]
        if missing or extra:
            raise ValueError(f"modes must define exactly {list(MODE_NAMES)}; missing {missing}, unknown {extra}")
        for name in MODE_NAMES:
            active = self._resolve(name)
            if self.relax_kv_usage >= active.enter_kv_usage:
                raise ValueError(f"relax_kv_usage ({self.relax_kv_usage}) must be below the entry KV usage of mode "
                                 f"{name!r} ({active.enter_kv_usage}); lower relax_kv_usage or raise the entry threshold")
            if self.relax_queue_delay_s >= active.enter_queue_delay_s:
                raise ValueError(f"relax_queue_delay_s ({self.relax_queue_delay_s}) must be below the entry queue delay "
                                 f"of mode {name!r} ({active.enter_queue_delay_s}); lower relax_queue_delay_s")
        if self.relax_after < self.enter_after:
            raise ValueError(f"relax_after ({self.relax_after}) must be at least enter_after ({self.enter_after}): "
                             "restoring should need a longer quiet period than morphing needs pressure")
        if self.slo.slo_ttft_s is not None:
            if self.slo.eager_kv_usage <= self.relax_kv_usage:
                raise ValueError(f"slo.eager_kv_usage ({self.slo.eager_kv_usage}) must be above relax_kv_usage "
                                 f"({self.relax_kv_usage})")
            for name in MODE_NAMES:
                eager_q = self._resolve(name).enter_queue_delay_s * self.slo.eager_queue_delay_fraction
                if eager_q <= self.relax_queue_delay_s:
                    raise ValueError(f"slo.eager_queue_delay_fraction makes mode {name!r} enter at {eager_q:g} s, not "
                                     f"above relax_queue_delay_s ({self.relax_queue_delay_s}); raise the fraction")
        if self.history_len < max(self.enter_after, self.relax_after):
            raise ValueError(f"history_len ({self.history_len}) must hold the longest window "
                             f"({max(self.enter_after, self.relax_after)}); raise history_len")
        return self

    def _resolve(self, name: str) -> ActiveMode:
        m = self.modes[name]
        return ActiveMode(name=name, layers_per_action=m.layers_per_action,
                          max_quantized_fraction=m.max_quantized_fraction, precision=m.precision,
                          enter_kv_usage=m.enter_kv_usage if m.enter_kv_usage is not None else self.enter_kv_usage,
                          enter_queue_delay_s=(m.enter_queue_delay_s if m.enter_queue_delay_s is not None
                                               else self.enter_queue_delay_s))

    @property
    def active(self) -> ActiveMode:
        """The selected mode with its thresholds resolved."""
        return self._resolve(self.mode)

    def with_mode(self, mode: str) -> "PolicyConfig":
        """A copy with another mode selected (validated: an unknown mode raises ValueError)."""
        if mode not in MODE_NAMES:
            raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODE_NAMES)}")
        return PolicyConfig.model_validate({**self.model_dump(), "mode": mode})


class FleetConfig(BaseModel):
    """Fleet-level rules the FleetController applies on top of every replica's policy."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    fleet_max_quantized_layers: int | None = Field(
        None, ge=0, description="accuracy budget: most quantized layers over all replicas together; None = no fleet cap")
    replica_timeout_s: float = Field(10.0, gt=0.0, description="a replica silent this long (controller clock) is forgotten")
    scale_out_after_s: float = Field(30.0, ge=0.0, description="a replica at its morph cap under pressure this long asks for a peer")
    scale_out_reset_after_s: float = Field(
        5.0, ge=0.0, description="saturation ends (and a scale-out request is withdrawn) only after this long without it: "
                                 "single unpressured snapshots under a steady overload do not restart the clock")
    max_extra_replicas: int = Field(4, ge=0, description="most extra replicas scale_out_signal() asks for at once")
    fleet_restore_quiet_s: float | None = Field(
        0.5, ge=0.0, description="once every replica has been calm for fleet_restore_calm_s, a replica's demand "
                                 "restores need only this much quiet (the others take the load it gives back); "
                                 "None: always the engine's restore_quiet_s")
    fleet_restore_calm_s: float = Field(
        1.0, ge=0.0, description="how long every replica, the restoring one included, must have absorbed load "
                                 "(relaxed, nothing waiting; its own snapshot clock) before fleet_restore_quiet_s "
                                 "applies: longer than a lull inside a burst")
