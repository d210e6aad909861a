"""Which Prometheus series exist: the project's metrics and Ray Serve's own, as Ray 2.60 exports them.

Ray's metrics agent exports every `ray.serve.metrics` metric with a `ray_` prefix; counters get a
`_total` suffix and histograms the usual `_bucket` / `_count` / `_sum` series. Ray Serve adds the
labels `application`, `deployment`, `replica` to metrics recorded inside a replica. All of this was
observed on a local Ray 2.60.0 cluster (a throwaway deployment, scraped from the metrics agent), not
taken from documentation; the Ray Serve names below are the ones that cluster exported.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

MetricKind = Literal["counter", "gauge", "histogram"]

RAY_PREFIX = "ray_"

# Ray Serve's own metrics (exported names, after prefix and suffix), with the labels they carry.
RAY_SERVE_METRICS: dict[str, MetricKind] = {
    "ray_serve_num_http_requests_total": "counter",         # application, route, method, status_code
    "ray_serve_http_request_latency_ms": "histogram",        # application, route, method, status_code
    "ray_serve_num_ongoing_http_requests": "gauge",          # node_id, node_ip_address (per proxy)
    "ray_serve_deployment_request_counter_total": "counter",  # application, deployment, replica, route
    "ray_serve_deployment_processing_latency_ms": "histogram",  # application, deployment, replica, route
    "ray_serve_replica_processing_queries": "gauge",         # application, deployment, replica
    "ray_serve_deployment_replica_healthy": "gauge",         # application, deployment, replica
    "ray_serve_deployment_queued_queries": "gauge",          # application, deployment, handle, actor_id
    "ray_serve_num_ongoing_requests_at_replicas": "gauge",   # application, deployment, handle, actor_id
    "ray_serve_autoscaling_target_replicas": "gauge",
    "ray_serve_deployment_replica_starts_total": "counter",
    "ray_serve_application_status": "gauge",
    "ray_serve_deployment_status": "gauge",
    "ray_serve_num_http_error_requests_total": "counter",   # application, route, method, error_code
    "ray_serve_num_deployment_http_error_requests_total": "counter",  # application, deployment, error_code
    "ray_serve_deployment_error_counter_total": "counter",   # application, deployment, replica, exception_type
}

# Ray's node metrics (the metrics agent on every node; labels ip, SessionName, and GpuIndex /
# GpuDeviceName for the GPU ones, which exist only on nodes with a GPU).
RAY_NODE_METRICS: dict[str, MetricKind] = {
    "ray_node_cpu_utilization": "gauge",
    "ray_node_cpu_count": "gauge",
    "ray_node_mem_used": "gauge",
    "ray_node_mem_total": "gauge",
    "ray_node_gpus_utilization": "gauge",
    "ray_node_gram_used": "gauge",
    "ray_node_gram_available": "gauge",
}
GPU_ONLY_METRICS = frozenset({"ray_node_gpus_utilization", "ray_node_gram_used", "ray_node_gram_available"})

_HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")
_DOC_KINDS = {"(histograms)": "histogram", "(gauges)": "gauge", "(counters)": "counter"}


def project_metrics_from_doc(architecture_md: Path) -> dict[str, MetricKind]:
    """The metric list in docs/ARCHITECTURE.md ("Metric names"): backticked names, each group of
    them closed by "(histograms)", "(gauges)" or "(counters)"."""
    text = architecture_md.read_text()
    start = text.find("### Metric names")
    if start < 0:
        raise ValueError(f"{architecture_md} has no '### Metric names' section")
    section = text[start:text.find("\n## ", start)]
    found: dict[str, MetricKind] = {}
    pending: list[str] = []
    for token in re.findall(r"`(morphserve_[a-z0-9_]+)[^`]*`|(\((?:histograms|gauges|counters)\))", section):
        name, marker = token
        if name:
            pending.append(name)
        else:
            found.update({n: _DOC_KINDS[marker] for n in pending})  # type: ignore[misc]
            pending = []
    if pending:
        raise ValueError(f"metric names without a kind in {architecture_md}: {pending}")
    return found


def project_metrics_from_code() -> dict[str, MetricKind] | None:
    """The metrics deployments/metrics.py creates (ServeMetrics on its in-memory backend), or
    None while that module cannot be imported."""
    try:
        from controller.fleet_metrics import FleetMetrics
        from deployments.metrics import InMemoryBackend, ServeMetrics
        from deployments.router import CHOICES_METRIC, DECISIONS_METRIC
    except ImportError:
        return None
    backend = InMemoryBackend()
    ServeMetrics("catalog", backend)
    FleetMetrics(backend)  # the fleet controller's gauges
    backend.counter(DECISIONS_METRIC, "", ("decision",))  # the request router's
    backend.counter(CHOICES_METRIC, "", ("engine_replica",))
    return {name: metric.kind for name, metric in backend.metrics.items()}  # type: ignore[misc]


def project_metrics(repo_root: Path) -> dict[str, MetricKind]:
    """The code is the truth once deployments/metrics.py imports; until then, the doc."""
    from_code = project_metrics_from_code()
    if from_code:
        return from_code
    return project_metrics_from_doc(repo_root / "docs" / "ARCHITECTURE.md")


def exported_series(name: str, kind: MetricKind) -> set[str]:
    """The series names Ray's exporter produces for one project metric."""
    full = name if name.startswith(RAY_PREFIX) else RAY_PREFIX + name
    if kind == "counter":
        return {full if full.endswith("_total") else full + "_total"}
    if kind == "histogram":
        return {full + suffix for suffix in _HISTOGRAM_SUFFIXES}
    return {full}


def known_series(repo_root: Path) -> set[str]:
    """Every series name a dashboard or alert may reference."""
    names: set[str] = set()
    for name, kind in project_metrics(repo_root).items():
        names |= exported_series(name, kind)
    for name, kind in {**RAY_SERVE_METRICS, **RAY_NODE_METRICS}.items():
        names |= exported_series(name, kind)
    return names
