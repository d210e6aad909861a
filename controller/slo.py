"""SLO feedback: a replica's entry thresholds and output reservation follow its TTFT against the SLO.

One number per replica, `level` in [0, 1], moves with the observed TTFT P95 (the snapshot's window):

    TTFT / SLO > tighten_ratio   for tighten_after reports  -> level += tighten_step   (morph earlier)
    TTFT / SLO < loosen_ratio    for loosen_after reports   -> level -= loosen_step    (morph later)
    in between, or no TTFT seen                             -> hold

and the thresholds are read off it: entry KV usage and queue delay slide from the mode's own values
(level 0) to the eager ones (level 1); the output reservation grows by up to max_reservation_factor.
Steps up are bigger and quicker than steps down, and the band between the two ratios is wide, so a
replica settles where its TTFT sits inside the band instead of flapping. Pure: no clocks, no I/O.
"""
from __future__ import annotations

import dataclasses

from controller.policy_config import ActiveMode, SloFeedbackConfig


@dataclasses.dataclass(frozen=True)
class SloState:
    level: float = 0.0
    hot: int = 0  # reports in a row above the tighten ratio
    calm: int = 0  # reports in a row below the loosen ratio
    last_ratio: float | None = None  # TTFT P95 / SLO of the latest report that had one


@dataclasses.dataclass(frozen=True)
class SloTuning:
    """What the level means for one mode."""
    level: float
    enter_kv_usage: float
    enter_queue_delay_s: float
    reservation_factor: float


def tune(state: SloState, ttft_p95_s: float | None, config: SloFeedbackConfig) -> SloState:
    """The next state after one report. Off (slo_ttft_s None) or no TTFT observed: unchanged."""
    if config.slo_ttft_s is None or ttft_p95_s is None:
        return state
    ratio = ttft_p95_s / config.slo_ttft_s
    if ratio > config.tighten_ratio:
        hot = state.hot + 1
        if hot >= config.tighten_after:
            return SloState(min(1.0, state.level + config.tighten_step), 0, 0, ratio)
        return SloState(state.level, hot, 0, ratio)
    if ratio < config.loosen_ratio:
        calm = state.calm + 1
        if calm >= config.loosen_after:
            return SloState(max(0.0, state.level - config.loosen_step), 0, 0, ratio)
        return SloState(state.level, 0, calm, ratio)
    return SloState(state.level, 0, 0, ratio)


def tuning_for(state: SloState, mode: ActiveMode, config: SloFeedbackConfig) -> SloTuning:
    level = state.level if config.slo_ttft_s is not None else 0.0
    eager_kv = min(mode.enter_kv_usage, config.eager_kv_usage)
    return SloTuning(
        level=level,
        enter_kv_usage=mode.enter_kv_usage - level * (mode.enter_kv_usage - eager_kv),
        enter_queue_delay_s=mode.enter_queue_delay_s * (1.0 - level * (1.0 - config.eager_queue_delay_fraction)),
        reservation_factor=1.0 + level * (config.max_reservation_factor - 1.0))


def tuned_mode(mode: ActiveMode, tuning: SloTuning | None) -> ActiveMode:
    if tuning is None:
        return mode
    return mode.model_copy(update={"enter_kv_usage": tuning.enter_kv_usage,
                                   "enter_queue_delay_s": tuning.enter_queue_delay_s})
