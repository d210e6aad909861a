"""A real Prometheus scrapes the running application (Ray's metrics agent on this node): after a burst
(with preemptions), one morph down and back, every PromQL expression of the Grafana dashboard, with
its variables substituted, returns at least one series."""
from __future__ import annotations

import concurrent.futures
import json
import shutil
from pathlib import Path

import pytest

from tests.serve_helpers import admin_status, auto_budget, http, serve_app, until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None,
                       reason="no `prometheus` binary on PATH (Debian/Ubuntu: apt-get install prometheus)"),
]
DASHBOARD = Path(__file__).resolve().parents[1] / "ops" / "monitoring" / "grafana" / "dashboards" / "morphserve.json"
ADMIN = "admin-prometheus-test"
CONTROLLER = {"controller_name": "test-serve-prom-controller", "controller_namespace": "morphserve-test-prom"}
# Few KV blocks and many sequences at once: a burst of long answers runs out of blocks (preemptions).
ARGS = {"admin_token": ADMIN, "memory_budget": auto_budget("300MiB"), "mode": "performance", "report_interval_s": 0.1,
        "max_layers_per_step": 4, "policy": {"enter_after": 2, "relax_after": 4, "history_len": 16},
        "engine": {"max_model_len": 512, "max_num_seqs": 16, "max_num_batched_tokens": 128},
        "fleet_max_quantized_layers": 30, "pressure_router": True, **CONTROLLER}  # the router's panels need it
# Series this test cannot make exist, each with why (every other dashboard query must return data).
CANNOT_EXIST_HERE = {
    "ray_node_gpus_utilization": "no GPU on this machine",
    "ray_node_gram_used": "no GPU on this machine",
    "ray_serve_deployment_error_counter_total": "nothing raises inside a deployment in this test",
    # A Ray counter has no series before its first increment; this test's burst runs with morphing
    # off (to force preemptions) and its morphs are operator pins, so no admission morph happens here.
    # tests/test_serve_morph.py checks the exported admission counter under a burst that causes them.
    "ray_morphserve_admission_morphs_total": "no admission-time morph in this test (see the comment)",
}


def dashboard_queries(variables: dict[str, str]) -> list[tuple[str, str]]:
    """(panel title, expression) for every target, with Grafana variables substituted; targets of the
    series in CANNOT_EXIST_HERE are left out."""
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):  # $__rate_interval first
                expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
            assert "$" not in expr, f"unsubstituted variable in {expr}"
            if not any(name in expr for name in CANNOT_EXIST_HERE):
                out.append((panel.get("title", ""), expr))
    return out


def _stream(url: str, i: int) -> int:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 120, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": f"Write a long story about the number {i}."}]}
    status, text = http("POST", url + "/v1/chat/completions", body)
    assert status != 200 or text.rstrip().endswith("data: [DONE]")
    return status


def _admin(url: str, change: dict) -> dict:
    status, body = http("POST", url + "/admin/morph", change, {"Authorization": f"Bearer {ADMIN}"})
    assert status == 200, body
    return body


@pytest.fixture(scope="module")
def app():
    with serve_app(ARGS) as (ray, url):
        yield ray, url


def test_every_dashboard_query_returns_series(app, tmp_path):
    from ops.monitoring.local_prometheus import LocalPrometheus
    from tests.serve_helpers import metrics_export_port

    ray, url = app
    _admin(url, {"morphing_enabled": False})  # no KV growth during the burst: it must preempt
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert set(pool.map(lambda i: _stream(url, i), range(16))) == {200}
    assert admin_status(url, ADMIN)["pressure"]["preemptions_total"] > 0  # the burst overflowed the KV cache
    # One morph down and back, pinned by the operator so that it happens whatever the policy saw.
    _admin(url, {"quantized_layers": 2, "precision": "int4"})
    until(lambda: admin_status(url, ADMIN)["morph_state"]["num_quantized"] == 2, 60, "two layers swapped down")
    _admin(url, {"morphing_enabled": False})
    until(lambda: admin_status(url, ADMIN)["morph_state"]["num_quantized"] == 0, 60, "every layer restored")
    _admin(url, {"morphing_enabled": True})
    assert _stream(url, 99) == 200
    assert http("POST", url + "/v1/chat/completions", {"messages": "not a list"})[0] == 400  # an HTTP error

    # Ray's dashboard (off here) would write the discovery file; point Prometheus at the agent directly.
    discovery = tmp_path / "ray_targets.json"
    discovery.write_text(json.dumps([{"targets": [f"127.0.0.1:{metrics_export_port(ray)}"], "labels": {}}]))
    queries = dashboard_queries({"cluster": ".*", "application": ".*", "deployment": ".*", "replica": ".*",
                                 "__rate_interval": "5m", "slo_ttft": "2"})
    assert len(queries) >= 20
    with LocalPrometheus(discovery_file=discovery, scrape_interval="1s") as prom:
        prom.wait_for("up == 1", timeout_s=60)

        def empty() -> list[str]:
            return [f"{title}: {expr}" for title, expr in queries if not prom.query(expr)]

        missing: list[str] = []

        def all_present() -> bool:
            missing[:] = empty()
            return not missing

        try:
            until(all_present, 120, "every dashboard query to return a series", every_s=1.0)
        except AssertionError:
            raise AssertionError("dashboard queries without series:\n" + "\n".join(missing)) from None
        reachable = prom.query("ray_morphserve_controller_reachable")
        assert {s["metric"]["deployment"] for s in reachable} == {"LLMServer"}
        swaps = prom.query('ray_morphserve_morph_actions_total{kind="swap_down"}')
        assert sum(float(s["value"][1]) for s in swaps) >= 2
        labels = {k for s in prom.query("ray_morphserve_time_to_first_token_seconds_count") for k in s["metric"]}
        assert {"application", "deployment", "replica", "model_name"} <= labels
