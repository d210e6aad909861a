"""The Grafana dashboard: valid for Grafana 10+, self-consistent, and querying only real metrics."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ops.monitoring import build_dashboard
from ops.monitoring.metric_catalog import (exported_series, known_series,
                                           project_metrics, project_metrics_from_code,
                                           project_metrics_from_doc)

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "ops" / "monitoring" / "grafana" / "dashboards" / "morphserve.json"
PROVISIONING = REPO / "ops" / "monitoring" / "grafana" / "provisioning"
DS = {"type": "prometheus", "uid": "${datasource}"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                "or", "unless", "offset", "inf", "nan"}


@pytest.fixture(scope="module")
def dash() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dash: dict) -> list[dict]:
    return [p for top in dash["panels"] for p in [top, *top.get("panels", [])]]


def all_targets(dash: dict) -> list[dict]:
    return [t for p in all_panels(dash) for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """Series names in a PromQL expression: identifiers left after removing label matchers,
    range selectors, grouping clauses, function calls and keywords."""
    stripped = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\b(by|without|on|ignoring)\s*\([^)]*\)", " ", expr)
    stripped = re.sub(r'"[^"]*"', " ", stripped)
    names = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", stripped))
    return {n for n in names if n.lower() not in PROMQL_WORDS}


def test_generated_files_are_up_to_date():
    assert build_dashboard.main(["--check"]) == 0


def test_schema_fields_for_grafana_10(dash):
    for key in ("uid", "title", "panels", "templating", "time", "schemaVersion", "refresh"):
        assert key in dash, key
    assert dash["schemaVersion"] >= 38
    assert isinstance(dash["templating"]["list"], list)
    assert dash["uid"] == "morphserve" and len(dash["uid"]) <= 40


def test_panel_ids_unique_and_grid_positions_do_not_overlap(dash):
    panels = all_panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], int] = {}
    for p in panels:
        g = p["gridPos"]
        assert {"h", "w", "x", "y"} <= set(g) and all(isinstance(g[k], int) for k in "hwxy")
        assert g["h"] > 0 and 0 < g["w"] and g["x"] >= 0 and g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['id']} overlaps panel {cells[(x, y)]}"
                cells[(x, y)] = p["id"]


def test_every_panel_and_target_uses_the_datasource_variable(dash):
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for p in all_panels(dash):
        assert p["datasource"] == DS, p["title"]
    targets = all_targets(dash)
    assert targets and all(t["datasource"] == DS and t["expr"] for t in targets)
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == DS


def test_every_referenced_variable_is_defined(dash):
    defined = {v["name"] for v in dash["templating"]["list"]}
    text = json.dumps(dash)
    refs = {a or b for a, b in re.findall(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", text)}
    builtins = {r for r in refs if r.startswith("__")}
    assert refs - builtins - defined == set()
    assert {"cluster", "application", "deployment", "replica", "slo_ttft"} <= defined


def test_metric_extractor_sees_metric_names():
    expr = ('histogram_quantile(0.95, sum by (le, replica) (rate(ray_x_bucket{a=~"$b", le="2.0"}'
            '[$__rate_interval]))) / ignoring(le) ray_y_total offset 5m')
    assert metric_names(expr) == {"ray_x_bucket", "ray_y_total"}


def test_every_expression_references_known_metrics_only(dash):
    known = known_series(REPO)
    exprs = [t["expr"] for t in all_targets(dash)]
    used = set().union(*(metric_names(e) for e in exprs))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":  # label_values(<metric>{...}, <label>)
            used.add(re.fullmatch(r"label_values\((\w+).*", v["definition"]).group(1))
    assert used and used - known == set()


def test_dashboard_covers_every_project_metric_and_ray_serve_panels(dash):
    used = set().union(*(metric_names(t["expr"]) for t in all_targets(dash)))
    for name, kind in project_metrics(REPO).items():
        assert used & exported_series(name, kind), f"no panel shows {name}"
    for name in ("ray_serve_num_http_requests_total", "ray_serve_num_ongoing_http_requests",
                 "ray_serve_deployment_processing_latency_ms_bucket"):
        assert name in used


def test_code_and_doc_name_the_same_metrics():
    from_code = project_metrics_from_code()
    if from_code is None:
        pytest.skip("deployments.metrics is not importable yet; the doc's list is used")
    assert from_code == project_metrics_from_doc(REPO / "docs" / "ARCHITECTURE.md")


def test_quantiles_group_by_le_over_bucket_rates(dash):
    for t in all_targets(dash):
        if "histogram_quantile" in t["expr"]:
            assert re.search(r"sum by \(le\b", t["expr"]) and "_bucket{" in t["expr"], t["expr"]


def test_slo_choices_are_ttft_bucket_boundaries(dash):
    slo = next(v for v in dash["templating"]["list"] if v["name"] == "slo_ttft")
    assert slo["type"] in ("custom", "textbox")
    choices = [float(o["value"]) for o in slo["options"]]
    assert float(slo["current"]["value"]) in choices
    slo_exprs = [t["expr"] for t in all_targets(dash) if "$slo_ttft" in t["expr"]
                 or "${slo_ttft}" in t["expr"]]
    assert len(slo_exprs) >= 2 and all("time_to_first_token_seconds_bucket" in e for e in slo_exprs)
    try:
        from deployments.metrics import TTFT_BUCKETS
    except ImportError:
        pytest.skip("deployments.metrics.TTFT_BUCKETS not importable; boundaries unchecked")
    assert set(choices) <= {float(b) for b in TTFT_BUCKETS}


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian: apt-get install prometheus)")
def test_every_expression_parses_with_promtool(dash, tmp_path):
    values = {"${datasource}": "x", "$__rate_interval": "1m", "${slo_ttft}": "2",
              "$slo_ttft": "2", "$cluster": ".*", "$application": ".*", "$deployment": ".*", "$replica": ".*"}
    rules = []
    for i, t in enumerate(all_targets(dash)):
        expr = t["expr"]
        for var, value in values.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, expr
        rules.append({"record": f"morphserve:check_{i}", "expr": expr})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_provisioning_files():
    ds = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yaml").read_text())
    assert ds["apiVersion"] == 1 and ds["datasources"][0]["type"] == "prometheus"
    dashboards = yaml.safe_load((PROVISIONING / "dashboards" / "morphserve.yaml").read_text())
    provider = dashboards["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    assert provider["folder"] == "MorphServe"


# --- upload_dashboard.py against a fake Grafana HTTP API on 127.0.0.1 ---------------------------

class FakeGrafana:
    """Answers the three calls the uploader makes and records every request."""

    def __init__(self, folder_exists: bool = False, status_for_post: int = 200):
        import http.server
        import threading

        self.requests: list[dict] = []
        self.folder_exists = folder_exists
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self) -> dict:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                req = {"method": self.command, "path": self.path, "body": body,
                       "auth": self.headers.get("Authorization")}
                fake.requests.append(req)
                return req

            def do_GET(self):
                self._record()
                if self.path == "/api/folders/morphserve" and fake.folder_exists:
                    self._answer(200, {"uid": "morphserve", "title": "MorphServe"})
                else:
                    self._answer(404, {"message": "folder not found"})

            def do_POST(self):
                req = self._record()
                if self.path == "/api/folders":
                    self._answer(200, {"uid": req["body"]["uid"], "title": req["body"]["title"]})
                elif self.path == "/api/dashboards/db" and status_for_post != 200:
                    self._answer(status_for_post, {"message": "denied"})
                elif self.path == "/api/dashboards/db":
                    uid = req["body"]["dashboard"]["uid"]
                    self._answer(200, {"status": "success", "uid": uid, "version": 1,
                                       "url": f"/d/{uid}/morphserve"})
                else:
                    self._answer(404, {"message": "not found"})

            def log_message(self, *args):  # keep pytest output clean
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeGrafana":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def test_upload_creates_folder_and_posts_dashboard_with_token(dash, capsys):
    from ops.monitoring import upload_dashboard

    with FakeGrafana() as grafana:
        rc = upload_dashboard.main(["--url", grafana.url, "--token", "tok-123"])
    assert rc == 0
    calls = [(r["method"], r["path"]) for r in grafana.requests]
    assert calls == [("GET", "/api/folders/morphserve"), ("POST", "/api/folders"),
                     ("POST", "/api/dashboards/db")]
    assert all(r["auth"] == "Bearer tok-123" for r in grafana.requests)
    posted = grafana.requests[-1]["body"]
    assert posted["overwrite"] is True and posted["folderUid"] == "morphserve"
    assert posted["dashboard"]["id"] is None
    assert posted["dashboard"]["panels"] == dash["panels"]
    assert posted["dashboard"]["uid"] == dash["uid"]
    assert "status=success" in capsys.readouterr().out


def test_upload_with_basic_auth_reuses_an_existing_folder(monkeypatch):
    import base64

    from ops.monitoring import upload_dashboard

    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    monkeypatch.setenv("GRAFANA_USER", "admin")
    monkeypatch.setenv("GRAFANA_PASSWORD", "secret")
    with FakeGrafana(folder_exists=True) as grafana:
        assert upload_dashboard.main(["--url", grafana.url]) == 0
    assert [r["path"] for r in grafana.requests] == ["/api/folders/morphserve", "/api/dashboards/db"]
    expected = "Basic " + base64.b64encode(b"admin:secret").decode()
    assert all(r["auth"] == expected for r in grafana.requests)


def test_upload_failure_raises_a_grafana_error(monkeypatch):
    from grafana_client.client import GrafanaClientError

    from ops.monitoring import upload_dashboard

    with FakeGrafana(status_for_post=403) as grafana:
        with pytest.raises(GrafanaClientError, match="denied"):
            upload_dashboard.main(["--url", grafana.url, "--token", "t"])


def test_upload_rejects_half_basic_auth_and_bad_files(tmp_path, monkeypatch):
    from ops.monitoring import upload_dashboard

    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    monkeypatch.delenv("GRAFANA_PASSWORD", raising=False)
    with pytest.raises(ValueError, match="--password"):
        upload_dashboard.main(["--url", "http://127.0.0.1:9", "--user", "admin"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"panels": []}))
    with pytest.raises(ValueError, match="uid"):
        upload_dashboard.main(["--dry-run", "--file", str(bad)])


def test_dry_run_prints_the_payload_and_contacts_nothing(dash, capsys):
    from ops.monitoring import upload_dashboard

    assert upload_dashboard.main(["--dry-run", "--url", "http://127.0.0.1:9"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["overwrite"] is True and payload["folderUid"] == "morphserve"
    assert payload["dashboard"]["title"] == dash["title"]


def test_rows_for_the_fleet_serve_deployments_resources_and_lengths(dash):
    titles = {p["title"] for p in dash["panels"] if p["type"] == "row"}
    assert {"Fleet controller and routing", "Serve deployments", "Cluster resources",
            "Request lengths and engine steps"} <= titles
    heatmaps = [p for p in all_panels(dash) if p["type"] == "heatmap"]
    assert {"ray_morphserve_request_prompt_tokens_bucket", "ray_morphserve_request_generation_tokens_bucket"} <= \
        set().union(*(metric_names(t["expr"]) for p in heatmaps for t in p["targets"]))
    assert all(t["format"] == "heatmap" and t["expr"].startswith("sum by (le)") for p in heatmaps for t in p["targets"])
    ttft = next(p for p in all_panels(dash) if p["title"] == "TTFT P50 / P90 / P95 / P99 (fleet)")
    assert [t["legendFormat"].split()[0] for t in ttft["targets"]] == ["P50", "P90", "P95", "P99"]
    cluster = next(v for v in dash["templating"]["list"] if v["name"] == "cluster")
    assert "ray_io_cluster" in cluster["definition"]
    assert all('ray_io_cluster=~"$cluster"' in t["expr"] for t in all_targets(dash)), \
        [t["expr"] for t in all_targets(dash) if "$cluster" not in t["expr"]]
