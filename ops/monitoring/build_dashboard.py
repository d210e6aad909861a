"""Generate the MorphServe Grafana dashboard and its Kubernetes ConfigMap from one definition.

    python -m ops.monitoring.build_dashboard          # rewrite both files
    python -m ops.monitoring.build_dashboard --check  # exit 1 if either file is out of date

Outputs: ops/monitoring/grafana/dashboards/morphserve.json and
kubernetes/grafana-dashboard-configmap.yaml (the same JSON, verbatim, for Grafana's sidecar).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ops.monitoring.dashboard_rows import (admission_row, fleet_control_row, lengths_row, resources_row,
                                           serve_deployments_row)
from ops.monitoring.grafana_json import (Panel, Query, Row, custom_variable, dashboard,
                                         datasource_variable, query_variable)
from ops.monitoring.promql import APP_SEL, CLUSTER, RATE, SEL, gauge, latency_panel, rate

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_PATH = REPO_ROOT / "ops" / "monitoring" / "grafana" / "dashboards" / "morphserve.json"
CONFIGMAP_PATH = REPO_ROOT / "kubernetes" / "grafana-dashboard-configmap.yaml"

# The SLO choices must be boundaries of the TTFT histogram (see SLO_NOTE); 2 s is the paper's SLO.
SLO_TTFT_CHOICES = ["0.25", "0.5", "1", "2", "5", "10"]
SLO_TTFT_DEFAULT = "2"

TTFT = "ray_morphserve_time_to_first_token_seconds"

SLO_NOTE = (
    "Fraction of TTFT observations above $slo_ttft seconds: 1 - rate(bucket{le=$slo_ttft}) / "
    "rate(count). Prometheus histograms only count observations <= each bucket boundary (le), so "
    "this is exact when $slo_ttft is a boundary of the TTFT histogram (the choices offered are); "
    "a value between boundaries matches no bucket and the panel shows no data rather than a wrong "
    "number. Ray exports boundaries as floats (le=\"2.0\"), hence the regex on le.")


def slo_violation(by: str = "") -> str:
    group = f" by ({by})" if by else ""
    le = 'le=~"${slo_ttft}|${slo_ttft}.0"'
    within = f"sum{group} (rate({TTFT}_bucket{{{SEL}, {le}}}{RATE}))"
    total = f"sum{group} (rate({TTFT}_count{{{SEL}}}{RATE}))"
    return f"1 - ({within} / {total})"


def fleet_row() -> Row:
    return Row("Fleet", (
        Panel("Request rate by finish reason", (Query(rate(
            "ray_morphserve_request_success_total", "finished_reason"), "{{finished_reason}}"),),
            unit="reqps", stacked=True),
        latency_panel("TTFT P50 / P90 / P95 / P99 (fleet)", TTFT, ""),
        Panel("SLO violation rate (TTFT > $slo_ttft s, fleet)",
              (Query(slo_violation(), "fleet"),), description=SLO_NOTE, unit="percentunit"),
        Panel("Token throughput", (
            Query(rate("ray_morphserve_prompt_tokens_total"), "prompt"),
            Query(rate("ray_morphserve_generation_tokens_total"), "generation")), unit="short"),
        latency_panel("Inter-token latency P50 / P90 / P95 / P99 (fleet)",
                      "ray_morphserve_inter_token_latency_seconds", ""),
        Panel("Controller reachable (worst replica)", (Query(gauge(
            "ray_morphserve_controller_reachable", "application", agg="min")),),
            description="0 means at least one replica cannot reach the fleet controller and "
            "runs the local policy.", kind="stat", unit="none",
            value_mappings=((0, "unreachable", "red"), (1, "reachable", "green"))),
    ))


def latency_row() -> Row:
    return Row("Latency per replica", (
        latency_panel("TTFT P50 / P90 / P95 / P99 per replica", TTFT, "replica"),
        latency_panel("Inter-token latency P50 / P90 / P95 / P99 per replica",
                      "ray_morphserve_inter_token_latency_seconds", "replica"),
        Panel("SLO violation rate per replica (TTFT > $slo_ttft s)",
              (Query(slo_violation("replica"), "{{replica}}"),), description=SLO_NOTE,
              unit="percentunit"),
        latency_panel("End-to-end latency P50 / P90 / P95 / P99", "ray_morphserve_e2e_request_latency_seconds",
                      "replica"),
        latency_panel("Request queue time P50 / P90 / P95 / P99", "ray_morphserve_request_queue_time_seconds",
                      "replica"),
    ))


def queue_row() -> Row:
    return Row("Queue", (
        Panel("Requests running / waiting", (
            Query(gauge("ray_morphserve_num_requests_running", "replica"), "running {{replica}}"),
            Query(gauge("ray_morphserve_num_requests_waiting", "replica"), "waiting {{replica}}"))),
        Panel("Queue delay (oldest waiting request)", (Query(gauge(
            "ray_morphserve_queue_delay_seconds", "replica", agg="max"), "{{replica}}"),), unit="s"),
        Panel("Prefill backlog (what a new request's first token waits behind; the router's first key)", (Query(gauge(
            "ray_morphserve_prefill_backlog_tokens", "replica", agg="max"), "{{replica}}"),), unit="short"),
        Panel("Preemptions", (Query(rate("ray_morphserve_num_preemptions_total", "replica"),
                                    "{{replica}}"),), unit="ops"),
    ))


def memory_row() -> Row:
    return Row("Memory and morphing", (
        Panel("KV cache usage", (Query(gauge("ray_morphserve_kv_cache_usage_perc", "replica",
                                             agg="max"), "{{replica}}"),), unit="percentunit"),
        Panel("KV cache capacity (blocks)", (Query(gauge(
            "ray_morphserve_kv_cache_capacity_blocks", "replica"), "{{replica}}"),)),
        Panel("Prefix cache hit rate", (Query(
            f'{rate("ray_morphserve_prefix_cache_hits_total", "replica")} / '
            f'{rate("ray_morphserve_prefix_cache_queries_total", "replica")}', "{{replica}}"),),
            description="Prompt tokens found in the prefix cache / prompt tokens looked up, per replica "
            "(their prefill was skipped). Cached blocks are free KV: they go when a request needs room.",
            unit="percentunit"),
        Panel("Cached KV blocks (free, still holding a prefix)", (Query(gauge(
            "ray_morphserve_kv_cache_cached_blocks", "replica"), "{{replica}}"),)),
        Panel("Quantized layers by precision", (Query(gauge(
            "ray_morphserve_quantized_layers", "replica, precision"), "{{replica}} {{precision}}"),),
            stacked=True),
        Panel("Morph actions by kind", (Query(rate("ray_morphserve_morph_actions_total", "kind"),
                                              "{{kind}}"),), unit="ops"),
        latency_panel("Layer swap latency", "ray_morphserve_layer_swap_latency_seconds",
                      "direction"),
        latency_panel("KV resize latency", "ray_morphserve_kv_resize_latency_seconds", "direction"),
        Panel("Memory ledger", (Query(gauge("ray_morphserve_memory_bytes", "replica, kind"),
                                      "{{replica}} {{kind}}"),),
              description="weights + kv + reserve <= budget on every replica.", unit="bytes",
              width=16),
        Panel("Controller reachable per replica", (Query(gauge(
            "ray_morphserve_controller_reachable", "replica", agg="min"), "{{replica}}"),),
            unit="none"),
    ))


def ray_serve_row() -> Row:
    app = APP_SEL
    return Row("Ray Serve", (
        Panel("HTTP request rate by status", (Query(rate(
            "ray_serve_num_http_requests_total", "status_code", sel=app), "{{status_code}}"),),
            unit="reqps", stacked=True),
        latency_panel("Processing latency per deployment",
                      "ray_serve_deployment_processing_latency_ms", "deployment", unit="ms"),
        Panel("Ongoing requests", (
            Query(f"sum by (node_ip_address) (ray_serve_num_ongoing_http_requests{{{CLUSTER}}})",
                  "HTTP proxy {{node_ip_address}}"),
            Query(gauge("ray_serve_replica_processing_queries", "replica"), "replica {{replica}}"))),
    ))


def build() -> dict:
    label_source = "ray_serve_deployment_replica_healthy"
    variables = [
        datasource_variable(),
        query_variable("cluster", "Ray cluster", f"label_values({label_source}, ray_io_cluster)",
                       "The RayCluster (ray_io_cluster, set by the PodMonitors); empty when run locally."),
        query_variable("application", "Application", f'label_values({label_source}{{{CLUSTER}}}, application)'),
        query_variable("deployment", "Deployment", f'label_values({label_source}'
                       f'{{{APP_SEL}}}, deployment)'),
        query_variable("replica", "Replica", f'label_values({label_source}{{{APP_SEL}, '
                       f'deployment=~"$deployment"}}, replica)'),
        custom_variable("slo_ttft", "TTFT SLO (s)", SLO_TTFT_CHOICES, SLO_TTFT_DEFAULT,
                        "TTFT service-level objective in seconds; must be a TTFT bucket boundary."),
    ]
    rows = [fleet_row(), fleet_control_row(), latency_row(), queue_row(), memory_row(), admission_row(),
            lengths_row(), ray_serve_row(), serve_deployments_row(), resources_row()]
    return dashboard("morphserve", "MorphServe", rows, variables,
                     "MorphServe engine replicas on Ray Serve: latency, queues, KV, morph state, the fleet "
                     "controller and router, admission-time morphing, Serve deployments, cluster resources.")


def dashboard_text() -> str:
    return json.dumps(build(), indent=2) + "\n"


def configmap_text(dashboard_json: str) -> str:
    header = (
        "# Generated by `python -m ops.monitoring.build_dashboard`; do not edit by hand.\n"
        "# Grafana's dashboard sidecar (kube-prometheus-stack) loads ConfigMaps labelled\n"
        "# grafana_dashboard: \"1\".\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: morphserve-grafana-dashboard\n"
        "  labels:\n    grafana_dashboard: \"1\"\n    app.kubernetes.io/part-of: morphserve\n"
        "  annotations:\n    grafana_folder: MorphServe\ndata:\n  morphserve.json: |\n")
    return header + "".join(f"    {line}\n" for line in dashboard_json.splitlines())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the files are out of date")
    args = parser.parse_args(argv)
    text = dashboard_text()
    wanted = {DASHBOARD_PATH: text, CONFIGMAP_PATH: configmap_text(text)}
    stale = [p for p, t in wanted.items() if not p.exists() or p.read_text() != t]
    if args.check:
        for path in stale:
            print(f"out of date: {path}; run python -m ops.monitoring.build_dashboard")
        return 1 if stale else 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(wanted[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
