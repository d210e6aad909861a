"""ops/monitoring/prometheus.yml and the local Prometheus helper, checked with the real promtool
and prometheus binaries when installed (Debian/Ubuntu: `apt-get install prometheus`)."""
from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import yaml

from ops.monitoring.local_prometheus import (RAY_DISCOVERY_FILE, LocalPrometheus, PrometheusError,
                                             write_config)

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "ops" / "monitoring" / "prometheus.yml"
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not installed (apt-get install prometheus)")
needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None,
                                      reason="prometheus not installed (apt-get install prometheus)")


def promtool_check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", "check", "config", str(path)], capture_output=True,
                          text=True, timeout=60)


def test_config_scrapes_rays_discovery_file_every_5s():
    from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE

    config = yaml.safe_load(CONFIG.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    (job,) = config["scrape_configs"]
    (sd,) = job["file_sd_configs"]
    assert sd["files"] == [str(RAY_DISCOVERY_FILE)]
    assert RAY_DISCOVERY_FILE.name == PROMETHEUS_SERVICE_DISCOVERY_FILE


@needs_promtool
def test_promtool_accepts_the_config():
    done = promtool_check(CONFIG)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_promtool_rejects_a_broken_config(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(CONFIG.read_text().replace("scrape_interval: 5s", "scrape_interval: often"))
    assert promtool_check(broken).returncode != 0


@needs_promtool
def test_written_config_is_valid_and_points_at_the_given_file(tmp_path):
    sd = tmp_path / "sd.json"
    path = write_config(tmp_path, sd, scrape_interval="1s")
    config = yaml.safe_load(path.read_text())
    assert config["scrape_configs"][0]["file_sd_configs"][0]["files"] == [str(sd)]
    done = promtool_check(path)
    assert done.returncode == 0, done.stdout + done.stderr


class FakeMetricsAgent:
    """A /metrics endpoint shaped like Ray's agent, serving one MorphServe gauge."""

    BODY = (b"# TYPE ray_morphserve_kv_cache_usage_perc gauge\n"
            b'ray_morphserve_kv_cache_usage_perc{application="morphserve",deployment="LLMServer",'
            b'replica="r1",model_name="m"} 0.25\n')

    def __init__(self):
        body = self.BODY

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@needs_prometheus
def test_local_prometheus_discovers_scrapes_and_answers_queries(tmp_path):
    agent = FakeMetricsAgent()
    sd = tmp_path / "prom_metrics_service_discovery.json"
    # The same shape Ray writes: one group, job label "ray", host:port targets.
    sd.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": [agent.address]}]))
    try:
        with LocalPrometheus(discovery_file=sd, scrape_interval="1s") as prom:
            up = prom.wait_for('up{job="ray"} == 1', timeout_s=60)
            assert [s["metric"]["instance"] for s in up] == [agent.address]
            (sample,) = prom.wait_for("ray_morphserve_kv_cache_usage_perc", timeout_s=30)
            assert sample["metric"]["replica"] == "r1" and float(sample["value"][1]) == 0.25
            with pytest.raises(PrometheusError, match="failed"):
                prom.query("sum(")
        assert prom._proc is None and prom._dir is None
    finally:
        agent.close()


def test_missing_binary_is_a_clear_error():
    with pytest.raises(PrometheusError, match="install"):
        LocalPrometheus(binary="no-such-prometheus-binary")
