"""Saturation: a replica at its morph cap (the mode's, or its fleet grant), or queueing for compute
that morphing cannot help, while still under pressure. Only *sustained* saturation asks for another
replica: `scale_out_after_s` of it, measured on the replica's own snapshot clock, so a burst that one
more morph step or a few seconds of queueing absorbs never starts a replica (which takes far longer to
load than the burst lasts).

Hysteresis: saturation ends only after `reset_after_s` of its sustained *absence*. Under a steady
overload single snapshots still fall below the entry thresholds (a request finishes and frees its
blocks just before the snapshot, a slow step delays the next report); without the hysteresis one such
snapshot restarted the clock, so on a loaded machine the request for a peer never came, or flickered
off while the autoscaler was still starting the replica. A gap shorter than `reset_after_s` counts
as saturated.

Used by the fleet controller for every replica and by a replica's local fallback for itself.
"""
from __future__ import annotations

import dataclasses

from controller.policy import current_target, is_pressured, morph_cap
from controller.directive import Directive
from controller.policy_config import PolicyConfig
from engine.morph.actions import MorphState
from engine.pressure import PressureSnapshot


def compute_bound(directive: Directive) -> bool:
    """The policy found the queue waiting for compute at a batch where quantized layers are not
    faster: morphing cannot help, below the cap or not."""
    return directive.scale_out and directive.waiting_for == "compute"


def is_saturated(latest: PressureSnapshot | None, state: MorphState, policy: PolicyConfig,
                 grant: int | None = None, compute_bound: bool = False) -> bool:
    """At its cap (mode or fleet grant), or compute-bound, and the latest snapshot still pressured."""
    if latest is None:
        return False
    at_cap = current_target(state) >= morph_cap(state, policy, grant)
    return (at_cap or compute_bound) and is_pressured(latest, policy.active)


@dataclasses.dataclass
class SaturationTimer:
    """Since when one replica has been saturated; `update` says whether that has lasted `after_s`.
    `reset_after_s`: how long saturation must stay absent before the clock stops (hysteresis)."""
    after_s: float
    reset_after_s: float = 0.0
    since: float | None = None  # snapshot time at which the policy first asked to scale out
    absent_since: float | None = None  # first unsaturated snapshot of the current gap

    def update(self, saturated: bool, policy_asks: bool, now: float) -> bool:
        """`saturated`: at the cap under pressure now; `policy_asks`: the policy's own scale-out flag
        (pressure sustained over its entry window). The clock starts when the policy first asks and
        stops once the replica has not been saturated for `reset_after_s`."""
        if saturated:
            self.absent_since = None
            if policy_asks and self.since is None:
                self.since = now
        elif self.since is not None:
            if self.absent_since is None:
                self.absent_since = now
            if now - self.absent_since >= self.reset_after_s:
                self.since = self.absent_since = None
        return self.since is not None and self.held_for(now) >= self.after_s

    def held_for(self, now: float) -> float:
        return 0.0 if self.since is None else max(0.0, now - self.since)
