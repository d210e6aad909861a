"""Start a throwaway Prometheus next to a local Ray cluster and query it (for tests and demos).

    with LocalPrometheus() as prom:            # scrapes what Ray's discovery file lists
        prom.wait_for("up == 1")
        print(prom.query("ray_morphserve_kv_cache_usage_perc"))

It uses ops/monitoring/prometheus.yml with the file-SD path swapped in, keeps its data in a temp
dir, binds 127.0.0.1 on a free port, and is stopped (and its data removed) on exit. Needs the
`prometheus` binary (Debian/Ubuntu: `apt-get install prometheus`).
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

CONFIG_TEMPLATE = Path(__file__).resolve().parent / "prometheus.yml"
RAY_DISCOVERY_FILE = Path("/tmp/ray/prom_metrics_service_discovery.json")


class PrometheusError(RuntimeError):
    """Prometheus could not be started, or answered a query with an error."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(directory: Path, discovery_file: Path, scrape_interval: str = "5s") -> Path:
    """prometheus.yml from the committed one, with this discovery file and scrape interval."""
    config = yaml.safe_load(CONFIG_TEMPLATE.read_text())
    config["global"]["scrape_interval"] = scrape_interval
    config["global"]["evaluation_interval"] = scrape_interval
    for job in config["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [str(discovery_file)]
            sd["refresh_interval"] = scrape_interval
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class LocalPrometheus:
    def __init__(self, discovery_file: Path = RAY_DISCOVERY_FILE, scrape_interval: str = "5s",
                 binary: str = "prometheus", start_timeout_s: float = 30.0):
        found = shutil.which(binary)
        if found is None:
            raise PrometheusError(f"no {binary!r} binary on PATH; install it "
                                  "(apt-get install prometheus) or pass binary=")
        self.binary = found
        self.discovery_file = Path(discovery_file)
        self.scrape_interval = scrape_interval
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self._dir: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._log_file: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "LocalPrometheus":
        self._dir = Path(tempfile.mkdtemp(prefix="morphserve-prometheus-"))
        config = write_config(self._dir, self.discovery_file, self.scrape_interval)
        self.port = free_port()
        self._log_file = open(self._dir / "prometheus.log", "wb")
        self._proc = subprocess.Popen(
            [self.binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{self.port}",
             f"--storage.tsdb.path={self._dir / 'data'}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=self._log_file)
        try:
            self._wait_ready()
        except PrometheusError:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self._proc.returncode}: "
                                      f"{self.log()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)  # poll interval while the process starts, not a synchronisation
        raise PrometheusError(f"prometheus not ready after {self.start_timeout_s} s")

    def log(self) -> str:
        path = self._dir / "prometheus.log" if self._dir else None
        return path.read_text(errors="replace") if path and path.exists() else ""

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query via /api/v1/query; returns the result vector (possibly empty)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as err:
            body = json.loads(err.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"query {expr!r} failed: {body.get('error', body)}")
        return body["data"]["result"]

    def wait_for(self, expr: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Poll until `expr` returns a non-empty vector (targets are scraped every interval)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result or time.monotonic() > deadline:
                if not result:
                    raise PrometheusError(f"{expr!r} still empty after {timeout_s} s")
                return result
            time.sleep(0.2)  # poll interval between queries

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "LocalPrometheus":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
