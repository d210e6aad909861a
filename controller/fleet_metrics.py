"""The fleet controller's own metrics: the accuracy budget, each replica's grant, what it holds, and
the scale-out signal (Ray exports them with the `ray_` prefix, like the replicas' metrics).

Per-replica series carry `replica` = the Serve replica id, the same value Ray Serve puts in the
`replica` label of the replicas' own metrics, so dashboards join them. A replica the controller
forgets gets its series set to 0 (Ray cannot delete a series), so sums over replicas stay right.
"""
from __future__ import annotations

from typing import Any, Protocol

PREFIX = "morphserve_fleet_"


class GaugeBackend(Protocol):
    def gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any: ...


class RayUtilBackend:
    """ray.util.metrics: works in any Ray actor (the controller is not a Serve replica)."""

    def gauge(self, name, description, tag_keys):
        from ray.util.metrics import Gauge
        return Gauge(name, description=description, tag_keys=tag_keys)


class FleetMetrics:
    def __init__(self, backend: GaugeBackend):
        b, r = backend, ("replica",)
        self.budget = b.gauge(PREFIX + "budget_layers", "Fleet accuracy budget: most quantized layers over all replicas", ())
        self.budget_used = b.gauge(PREFIX + "budget_used_layers", "Quantized layers held over all replicas", ())
        self.replicas = b.gauge(PREFIX + "replicas", "Replicas in the controller's view", ())
        self.extra = b.gauge(PREFIX + "scale_out_replicas", "Extra replicas the controller asks for", ())
        self.grant = b.gauge(PREFIX + "grant_layers", "Most layers this replica may quantize (mode cap and fleet share)", r)
        self.held = b.gauge(PREFIX + "quantized_layers", "Layers this replica holds quantized (last report)", r)
        self.target = b.gauge(PREFIX + "target_layers", "Quantized layers the controller directs this replica to", r)
        self.score = b.gauge(PREFIX + "pressure_score", "Mean pressure score over the entry window (1 = threshold)", r)
        self.saturated = b.gauge(PREFIX + "saturated_seconds", "How long this replica has been at its cap under pressure", r)
        self.scale_out = b.gauge(PREFIX + "scale_out", "1 while this replica's directive asks for another replica", r)
        # A gauge, not a counter: Ray exports a counter only after its first increment, and a
        # dashboard query on a series that never appears cannot be checked.
        self.forgotten = b.gauge(PREFIX + "forgotten_replicas", "Replicas dropped after replica_timeout_s of silence, "
                                 "since this controller started", ())
        self._forgotten = 0
        self._per_replica = (self.grant, self.held, self.target, self.score, self.saturated, self.scale_out)

    def set_replica(self, replica_id: str, *, grant: int, held: int, target: int, score: float,
                    saturated_s: float, scale_out: bool) -> None:
        tags = {"replica": replica_id}
        for gauge, value in zip(self._per_replica, (grant, held, target, score, saturated_s, float(scale_out))):
            gauge.set(float(value), tags)

    def forget(self, replica_id: str) -> None:
        for gauge in self._per_replica:
            gauge.set(0.0, {"replica": replica_id})
        self._forgotten += 1
        self.forgotten.set(float(self._forgotten), {})

    def set_fleet(self, *, budget: int | None, used: int, replicas: int, extra: int) -> None:
        if budget is not None:
            self.budget.set(float(budget), {})
        self.budget_used.set(float(used), {})
        self.replicas.set(float(replicas), {})
        self.extra.set(float(extra), {})
        self.forgotten.set(float(self._forgotten), {})
