"""PromQL building blocks of the dashboard: the label selectors of its variables, quantiles over
histogram buckets, rates and gauges, and a latency panel with the usual percentiles."""
from __future__ import annotations

from ops.monitoring.grafana_json import Panel, Query

CLUSTER = 'ray_io_cluster=~"$cluster"'  # set by the PodMonitors' relabeling; absent locally (matches .*)
SEL = f'{CLUSTER}, application=~"$application", deployment=~"$deployment", replica=~"$replica"'
APP_SEL = f'{CLUSTER}, application=~"$application"'  # Serve-level series without a replica
FLEET_SEL = f'{CLUSTER}, replica=~"$replica"'  # the fleet controller's per-replica gauges
CLUSTER_SEL = CLUSTER  # node and fleet-wide series
RATE = "[$__rate_interval]"
PERCENTILES = (0.5, 0.9, 0.95, 0.99)


def quantile(q: float, metric: str, by: str = "", sel: str = SEL) -> str:
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{sel}}}{RATE})))"


def rate(metric: str, by: str = "", sel: str = SEL) -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{{{sel}}}{RATE}))"


def gauge(metric: str, by: str, agg: str = "sum", sel: str = SEL) -> str:
    return f"{agg} by ({by}) ({metric}{{{sel}}})"


def buckets(metric: str, sel: str = SEL) -> str:
    """A histogram's bucket rates by boundary: what a heatmap panel draws."""
    return f"sum by (le) (rate({metric}_bucket{{{sel}}}{RATE}))"


def latency_panel(title: str, metric: str, by: str, unit: str = "s", description: str = "",
                  percentiles: tuple[float, ...] = PERCENTILES, sel: str = SEL) -> Panel:
    legend = "{{" + by + "}}" if by else "fleet"
    return Panel(title, tuple(Query(quantile(q, metric, by, sel), f"P{round(q * 100)} {legend}") for q in percentiles),
                 description=description or "histogram_quantile over _bucket rates; "
                 "linear interpolation inside a bucket, so an estimate.", unit=unit)
