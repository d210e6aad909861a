"""Ray Serve autoscaling of the engine replicas, fed by the morph controller's scale-out signal.

Ray Serve 2.60 lets a deployment publish its own numbers through a `record_autoscaling_stats()`
method (a dict of floats, collected every `metrics_interval_s`) and lets `autoscaling_config.policy`
name a function `(AutoscalingContext) -> (desired replicas, policy state)` that reads them from
`ctx.aggregated_metrics[name][replica_id]` (averaged over `look_back_period_s`). Ray wraps a custom
policy with the usual min/max_replicas bounds, up/downscale delays and scaling factors.

`morph_aware_policy` is Ray's default queue-length policy (ongoing requests per replica against
`target_ongoing_requests`), with two morph rules:
  * out: one more replica for every engine replica whose directive asks to scale out (it has been
    at its morph cap under pressure for `scale_out_after_s`: it cannot help itself any more,
    whatever its queue says);
  * in: never fewer replicas than the current target while any replica still holds quantized
    layers. When a burst ends the replicas first restore full precision; only a fleet back at full
    precision shrinks, so the load of a removed replica does not push the others straight back into
    morphing;
  * starting: never fewer replicas than the target while a replica is still starting. Loading the
    model takes far longer than the replica's scale-out flag may stay up (it is withdrawn after
    `scale_out_reset_after_s` without saturation, controller/saturation.py), so without this rule a
    replica asked for could be cancelled before it serves. Limit: a replica Ray cannot place stays
    pending (and counted) until it starts; the queue rule can shrink the fleet once it runs.
"""
from __future__ import annotations

from typing import Any

SCALE_OUT_METRIC = "morphserve_scale_out"  # 1.0 while the replica's directive says scale_out
QUANTIZED_METRIC = "morphserve_quantized_layers"  # layers the replica holds below full precision
WAITING_METRIC = "morphserve_num_waiting"  # the engine's own waiting queue (informational)
KV_USAGE_METRIC = "morphserve_kv_usage"
POLICY_IMPORT_PATH = "deployments.autoscaling:morph_aware_policy"


def morph_aware_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    desired, state = replica_queue_length_autoscaling_policy(ctx)
    return morph_rules(desired, ctx.current_num_replicas, ctx.aggregated_metrics or {},
                       target=ctx.target_num_replicas), state


def morph_rules(desired: float, current: int, metrics: dict[str, dict[Any, float]], target: int | None = None) -> float:
    """The queue policy's `desired`, raised for scale-out requests and held while morphed or while a
    replica is starting (pure). `current`: running replicas; `target`: the autoscaler's current target
    (running + starting; `current` when omitted)."""
    target = current if target is None else target
    asking = sum(1 for value in metrics.get(SCALE_OUT_METRIC, {}).values() if value >= 0.5)
    if asking:
        desired = max(desired, current + asking)
    morphed = any(value > 0 for value in metrics.get(QUANTIZED_METRIC, {}).values())
    starting = target > current
    if (morphed or starting) and desired < target:
        desired = target
    return desired


def with_morph_policy(autoscaling_config: dict[str, Any]) -> dict[str, Any]:
    """The user's autoscaling config, with the morph-aware policy unless it names its own."""
    config = dict(autoscaling_config)
    config.setdefault("policy", {"policy_function": POLICY_IMPORT_PATH})
    return config
