"""Dashboard rows beyond one replica's latency and morph state: the fleet controller and the request
router, admission-time morphing and SLO feedback, request lengths and engine steps, Serve
deployments, and the cluster's resources."""
from __future__ import annotations

from ops.monitoring.grafana_json import Panel, Query, Row
from ops.monitoring.promql import (APP_SEL, CLUSTER_SEL, FLEET_SEL, SEL, buckets, gauge, latency_panel,
                                   quantile, rate)

FLEET = "ray_morphserve_fleet_"


def fleet_control_row() -> Row:
    per_replica = "{{replica}}"
    return Row("Fleet controller and routing", (
        Panel("Fleet accuracy budget: used / budget", (
            Query(f"max({FLEET}budget_layers{{{CLUSTER_SEL}}})", "budget"),
            Query(f"max({FLEET}budget_used_layers{{{CLUSTER_SEL}}})", "quantized layers held, all replicas")),
            description="fleet_max_quantized_layers and the layers the replicas hold, as the controller "
            "sees them; used never exceeds the budget (a grant moves only as layers are given back)."),
        Panel("Grant per replica (layers it may quantize)", (Query(gauge(
            f"{FLEET}grant_layers", "replica", agg="max", sel=FLEET_SEL), per_replica),),
            description="Its share of the budget (most pressed first), or its mode's cap without a budget. "
            "A forgotten replica drops to 0."),
        Panel("Quantized layers held / directed per replica", (
            Query(gauge(f"{FLEET}quantized_layers", "replica", agg="max", sel=FLEET_SEL), "held " + per_replica),
            Query(gauge(f"{FLEET}target_layers", "replica", agg="max", sel=FLEET_SEL), "target " + per_replica))),
        Panel("Pressure score per replica", (Query(gauge(
            f"{FLEET}pressure_score", "replica", agg="max", sel=FLEET_SEL), per_replica),),
            description="Mean over the entry window of max(kv usage / entry, queue delay / entry); "
            "1 = at the entry threshold. The budget goes to the highest first."),
        Panel("Scale-out signal", (
            Query(f"max({FLEET}scale_out_replicas{{{CLUSTER_SEL}}})", "extra replicas asked"),
            Query(gauge(f"{FLEET}saturated_seconds", "replica", agg="max", sel=FLEET_SEL),
                  "at cap under pressure (s) " + per_replica)),
            description="A replica at its cap under pressure for scale_out_after_s asks for one more replica "
            "(deployments/autoscaling.py); scale-in waits until every replica is back at full precision."),
        Panel("Replicas asking to scale out", (Query(gauge(
            f"{FLEET}scale_out", "replica", agg="max", sel=FLEET_SEL), per_replica),), stacked=True),
        Panel("Replicas in the controller's view / forgotten", (
            Query(f"max({FLEET}replicas{{{CLUSTER_SEL}}})", "reporting"),
            Query(f"max({FLEET}forgotten_replicas{{{CLUSTER_SEL}}})",
                  "forgotten since the controller started (silent for replica_timeout_s)"))),
        Panel("Router decisions", (Query(rate(
            "ray_morphserve_router_decisions_total", "decision", sel=APP_SEL), "{{decision}}"),),
            description="The chosen replica's class: fits (at its full-precision room), fits_morphed (only in "
            "the blocks its morph added), no_fit (it waits or morphs there); replicas are ranked by queue "
            "length plus a penalty per class. stale: routing stats too old; no_queue_len: a queue length "
            "unknown (both Serve's default router); other_call: not a generation.", unit="ops", stacked=True, width=16),
        Panel("Router choices per replica", (Query(rate(
            "ray_morphserve_router_choices_total", "engine_replica", sel=APP_SEL), "{{engine_replica}}"),),
            description="Generate calls the pressure-aware router sent to each engine replica: even lines "
            "mean the load is spread; one line far above the others means it concentrates load.",
            unit="ops", stacked=True, width=8),
        latency_panel("Directive wait per replica (its report's round trip to the controller)",
                      "ray_morphserve_directive_wait_seconds", "replica", percentiles=(0.5, 0.95, 0.99),
                      description="How long a replica's morph-loop round waits for its directive before it can "
                      "act: the controller actor's round trip (source=controller), the local policy's decision "
                      "(source=local). Near controller_timeout_s means the controller is too slow to answer and "
                      "replicas fall back to their local policy. An estimate from the histogram's buckets."),
    ))


def admission_row() -> Row:
    per_replica = "{{replica}}"
    return Row("Admission-time morphing and SLO feedback", (
        Panel("Admission morphs", (Query(rate("ray_morphserve_admission_morphs_total", "replica, kind"),
                                         "{{kind}} " + per_replica),),
            description="swap: layers the engine quantized when the head of the queue did not fit; restore: "
            "layers it gave back when demand fit with margin.", unit="ops"),
        Panel("What queued requests wait for", (Query(rate("ray_morphserve_queue_wait_rounds_total", "replica, cause"),
                                                      "{{cause}} " + per_replica),),
            description="Report rounds per second at which requests waited, by cause. memory: the head of the "
            "queue did not fit in KV, which morphing relieves; compute: it fit and waits for the step's token "
            "budget, which only more replicas (or a faster engine) relieve.", unit="ops"),
        Panel("KV demand (blocks)", (Query(gauge("ray_morphserve_kv_demand_blocks", "replica, kind"),
                                           "{{kind}} " + per_replica),),
            description="waiting: blocks the queue needs to be admitted; running_reserved / running_finish: "
            "what the running requests still need; available = free - running_reserved."),
        Panel("Allowed quantized layers (directive bound)", (Query(gauge(
            "ray_morphserve_morph_allowed_layers", "replica", agg="max"), per_replica),),
            description="max_quantized of the last directive: mode cap and fleet grant, never below what the "
            "budget forces; bounds the engine's own admission-time morphs."),
        Panel("Output reservation (tokens per request)", (Query(gauge(
            "ray_morphserve_output_reservation_tokens", "replica", agg="max"), per_replica),)),
        Panel("SLO feedback level", (Query(gauge(
            "ray_morphserve_slo_feedback_level", "replica", agg="max"), per_replica),),
            description="0: the configured entry thresholds; 1: the most eager (TTFT above slo_ttft_s)."),
        Panel("Entry thresholds in use", (Query(gauge(
            "ray_morphserve_policy_entry_threshold", "replica, signal", agg="max"), "{{signal}} " + per_replica),)),
    ))


def lengths_row() -> Row:
    tokens = "ray_morphserve_request_{}_tokens"
    return Row("Request lengths and engine steps", (
        Panel("Prompt length (tokens)", (Query(buckets(tokens.format("prompt"))),), kind="heatmap"),
        Panel("Generation length (tokens)", (Query(buckets(tokens.format("generation"))),), kind="heatmap"),
        Panel("Tokens per engine step", (Query(buckets("ray_morphserve_iteration_tokens_total")),), kind="heatmap"),
        latency_panel("Prompt length percentiles", tokens.format("prompt"), "", unit="short"),
        latency_panel("Generation length percentiles", tokens.format("generation"), "", unit="short"),
        Panel("Step time P50 / P95 by phase", tuple(
            Query(quantile(q, "ray_morphserve_step_time_seconds", "phase"), f"P{round(q * 100)} {{{{phase}}}}")
            for q in (0.5, 0.95)), unit="s",
            description="Model execution and sampling of one engine step: prefill only, decode only, or mixed."),
    ))


def serve_deployments_row() -> Row:
    return Row("Serve deployments", (
        Panel("Replicas per deployment", (Query(
            f"count by (application, deployment) (ray_serve_deployment_replica_healthy{{{APP_SEL}}} == 1)",
            "{{application}} {{deployment}}"),), description="Healthy replicas, as Serve's health checks see them."),
        Panel("Requests per second per deployment", (Query(rate(
            "ray_serve_deployment_request_counter_total", "deployment", sel=APP_SEL), "{{deployment}}"),),
            unit="reqps"),
        Panel("Errors per second per deployment", (
            Query(rate("ray_serve_num_deployment_http_error_requests_total", "deployment, error_code", sel=APP_SEL),
                  "{{deployment}} HTTP {{error_code}}"),
            Query(rate("ray_serve_deployment_error_counter_total", "deployment", sel=APP_SEL),
                  "{{deployment}} exceptions")),
            description="HTTP responses >= 400 returned by each deployment (at the proxy), and exceptions "
            "raised in a deployment's code (engine replicas are called through handles: those count here).",
            unit="reqps"),
    ))


def resources_row() -> Row:
    node = CLUSTER_SEL
    return Row("Cluster resources", (
        Panel("CPU utilization per node", (Query(
            f"avg by (ip) (ray_node_cpu_utilization{{{node}}}) / 100", "{{ip}}"),), unit="percentunit"),
        Panel("Memory per node", (
            Query(f"sum by (ip) (ray_node_mem_used{{{node}}})", "used {{ip}}"),
            Query(f"sum by (ip) (ray_node_mem_total{{{node}}})", "total {{ip}}")), unit="bytes"),
        Panel("Cluster CPUs and memory", (
            Query(f"sum(ray_node_cpu_count{{{node}}})", "CPUs"),
            Query(f"sum(ray_node_mem_total{{{node}}}) / 2^30", "memory GiB")), kind="stat"),
        Panel("GPU utilization", (Query(
            f"avg by (ip, GpuIndex) (ray_node_gpus_utilization{{{node}}}) / 100", "{{ip}} GPU {{GpuIndex}}"),),
            description="Only nodes with GPUs export this.", unit="percentunit"),
        Panel("GPU memory: used / total", (
            Query(f"sum by (ip, GpuIndex) (ray_node_gram_used{{{node}}}) * 2^20", "used {{ip}} GPU {{GpuIndex}}"),
            Query(f"sum by (ip, GpuIndex) (ray_node_gram_used{{{node}}} + ray_node_gram_available{{{node}}}) * 2^20",
                  "total {{ip}} GPU {{GpuIndex}}")),
            description="The memory MorphServe morphs: weights + KV of the replicas on each GPU (Ray reports MiB).",
            unit="bytes", width=16),
    ))


__all__ = ["admission_row", "fleet_control_row", "lengths_row", "resources_row", "serve_deployments_row", "SEL"]
