"""Small builders for Grafana 10+ dashboard JSON (schemaVersion 39): panels, rows, variables, layout.

Every panel and every query points at the `${datasource}` template variable, so the same JSON works
against whichever Prometheus a Grafana has (local provisioning, the Kubernetes sidecar, an upload).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 39
GRID_WIDTH = 24
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    description: str = ""
    unit: str = "short"
    kind: str = "timeseries"  # or "stat", "heatmap" (queries: `sum by (le) (rate(x_bucket...))`)
    width: int = 8
    height: int = 8
    stacked: bool = False
    value_mappings: tuple[tuple[int, str, str], ...] = ()  # (value, text, color)


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def _target(query: Query, ref_id: str, kind: str = "timeseries") -> dict[str, Any]:
    target = {"refId": ref_id, "datasource": dict(DATASOURCE), "expr": query.expr,
              "legendFormat": query.legend or "__auto", "range": True, "editorMode": "code"}
    if kind == "heatmap":  # one series per bucket boundary, de-cumulated by Grafana
        target.update(format="heatmap", legendFormat=query.legend or "{{le}}")
    return target


def _field_config(panel: Panel) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit, "color": {"mode": "palette-classic"},
                                "thresholds": {"mode": "absolute",
                                               "steps": [{"color": "green", "value": None}]}}
    if panel.kind == "heatmap":
        defaults["custom"] = {"scaleDistribution": {"type": "linear"},
                              "hideFrom": {"legend": False, "tooltip": False, "viz": False}}
    if panel.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                              "showPoints": "never", "spanNulls": False,
                              "stacking": {"mode": "normal" if panel.stacked else "none",
                                           "group": "A"}}
    if panel.value_mappings:
        defaults["color"] = {"mode": "thresholds"}
        defaults["mappings"] = [{"type": "value", "options": {
            str(value): {"text": text, "color": color, "index": i}}}
            for i, (value, text, color) in enumerate(panel.value_mappings)]
    return {"defaults": defaults, "overrides": []}


def _options(panel: Panel) -> dict[str, Any]:
    if panel.kind == "heatmap":
        return {"calculate": False, "cellGap": 1, "yAxis": {"axisPlacement": "left", "unit": panel.unit},
                "color": {"mode": "scheme", "scheme": "Oranges", "exponent": 0.5, "steps": 64, "fill": "dark-orange",
                          "reverse": False},
                "rowsFrame": {"layout": "le"}, "tooltip": {"mode": "single", "yHistogram": True},
                "legend": {"show": True}, "showValue": "never", "filterValues": {"le": 1e-9}}
    if panel.kind == "stat":
        return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "background", "graphMode": "none", "textMode": "auto",
                "orientation": "auto", "justifyMode": "auto"}
    return {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"}}


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    ref_ids = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    if len(panel.queries) > len(ref_ids):
        raise ValueError(f"panel {panel.title!r} has more than {len(ref_ids)} queries")
    return {"id": panel_id, "type": panel.kind, "title": panel.title,
            "description": panel.description, "datasource": dict(DATASOURCE),
            "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
            "fieldConfig": _field_config(panel), "options": _options(panel),
            "targets": [_target(q, ref_ids[i], panel.kind) for i, q in enumerate(panel.queries)]}


def layout(rows: list[Row]) -> list[dict[str, Any]]:
    """Rows top to bottom; inside a row, panels left to right, wrapping at the grid's width.
    Ids are 1, 2, 3, ... in reading order, so they are unique by construction."""
    out: list[dict[str, Any]] = []
    y = 0
    for row in rows:
        out.append({"id": len(out) + 1, "type": "row", "title": row.title, "collapsed": False,
                    "datasource": dict(DATASOURCE), "panels": [],
                    "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}})
        y += 1
        x, line_height = 0, 0
        for panel in row.panels:
            if panel.width > GRID_WIDTH:
                raise ValueError(f"panel {panel.title!r} is wider than {GRID_WIDTH}")
            if x + panel.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            out.append(panel_json(panel, len(out) + 1, x, y))
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return out


def datasource_variable() -> dict[str, Any]:
    return {"name": "datasource", "label": "Data source", "type": "datasource",
            "query": "prometheus", "regex": "", "current": {}, "options": [], "hide": 0,
            "refresh": 1, "includeAll": False, "multi": False}


def query_variable(name: str, label: str, query: str, description: str = "") -> dict[str, Any]:
    """A multi-value label variable; "All" means the regex `.*`, so `=~"$name"` matches everything
    (a series without the label too)."""
    return {"name": name, "label": label, "description": description, "type": "query", "datasource": dict(DATASOURCE),
            "definition": query, "query": {"query": query, "refId": f"{name}-values"},
            "refresh": 2, "regex": "", "sort": 1, "current": {}, "options": [], "hide": 0,
            "includeAll": True, "allValue": ".*", "multi": True}


def custom_variable(name: str, label: str, values: list[str], default: str,
                    description: str) -> dict[str, Any]:
    if default not in values:
        raise ValueError(f"default {default!r} of variable {name!r} is not one of {values}")
    options = [{"text": v, "value": v, "selected": v == default} for v in values]
    return {"name": name, "label": label, "type": "custom", "description": description,
            "query": ",".join(values), "current": {"text": default, "value": default,
                                                   "selected": True},
            "options": options, "hide": 0, "includeAll": False, "multi": False}


def dashboard(uid: str, title: str, rows: list[Row], variables: list[dict[str, Any]],
              description: str) -> dict[str, Any]:
    return {"uid": uid, "title": title, "description": description, "tags": ["morphserve", "ray"],
            "schemaVersion": SCHEMA_VERSION, "version": 1, "editable": True,
            "graphTooltip": 1, "timezone": "browser", "fiscalYearStartMonth": 0, "liveNow": False,
            "refresh": "10s", "time": {"from": "now-30m", "to": "now"}, "timepicker": {},
            "links": [], "annotations": {"list": []}, "templating": {"list": variables},
            "panels": layout(rows)}
