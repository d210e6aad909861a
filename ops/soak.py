"""Soak: `python -m ops.soak --minutes N` (the published run: 30).

Starts a local Ray cluster and the real app on 127.0.0.1 with a small memory budget, then repeats
cycles of a traffic burst (the morph policy swaps layers down) and a quiet phase (it restores
them). A cycle whose burst did not morph (a noisy machine) is driven by an operator pin instead, so
that every cycle swaps down and up; the record says which did. At 40% of the run the fleet
controller is killed, at 60% the engine replica (SIGKILL; Serve starts a new one). It prints and
saves sent / ok / refused / failed requests (a failure is allowed only in flight at the replica
kill), morph cycles, integrity (ledger + block pool) checks, and the replica's RSS: start, peak,
first idle plateau, end. Output: ops/soak_results/soak-<time>.json (--out to change).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from ops.soak_record import (Sample, classify_requests, count_morph_cycles, integrity_totals,
                             memory_by_replica, rss_series, verdict)
from ops.local_ray import http, init_local_ray
from ops.soak_traffic import Traffic

ADMIN = "soak-admin-token"
CONTROLLER = {"controller_name": "soak-controller", "controller_namespace": "morphserve-soak"}
APP_ARGS = {
    "admin_token": ADMIN, "memory_budget": "300MiB", "mode": "performance", "report_interval_s": 0.1,
    "controller_timeout_s": 0.3, "max_layers_per_step": 4, "max_waiting": 8, "max_queued_requests": 16,
    "policy": {"enter_after": 2, "relax_after": 4, "history_len": 16},
    "engine": {"max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 128}, **CONTROLLER,
}
AUTH = {"Authorization": f"Bearer {ADMIN}"}
ROOT = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    minutes: float
    workers: int = 8
    burst_s: float = 25.0
    quiet_s: float = 20.0
    min_cycles_per_30_min: int = 20
    rss_tolerance: float = 0.05
    max_tokens: int = 24
    prompt_words: int = 80  # ~250 prompt tokens with the chat template: 8 such requests need more KV than 300 MiB leaves

    @property
    def min_cycles(self) -> int:  # the 30-minute target, scaled to the run
        return max(1, int(self.min_cycles_per_30_min * self.minutes / 30))


class Observer:
    """Samples GET /admin/morph every 0.5 s on its own thread."""

    def __init__(self, url: str):
        self.url, self.samples, self.idle_now = url, [], threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def status(self) -> dict | None:
        status, body = http("GET", self.url + "/admin/morph", headers=AUTH, timeout_s=10)
        return body if status == 200 else None

    def _run(self) -> None:
        while not self._stop.wait(0.5):  # sampling interval
            s = self.status()
            if s is not None and s.get("process", {}).get("rss_bytes"):
                self.samples.append(Sample(time.monotonic(), s["process"]["pid"], s["process"]["rss_bytes"],
                                           s["morph_state"]["num_quantized"], s["integrity"]["checks"],
                                           s["integrity"]["failures"], s["controller"]["reachable"],
                                           self.idle_now.is_set(), s["process"].get("rss_anon_bytes")))

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join(30)
        return self.samples


def _pin(url: str, body: dict) -> None:
    http("POST", url + "/admin/morph", body, headers=AUTH, timeout_s=30)


def _restored_and_idle(status: dict | None) -> bool:
    """One admin status (one HTTP call per poll): every layer back and nothing running."""
    status = status or {}
    return (status.get("morph_state", {}).get("num_quantized", 1) == 0
            and status.get("pressure", {}).get("num_running", 1) == 0)


def _wait(predicate, timeout_s: float, every_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)  # poll interval
    return False


def run_cycles(url: str, config: SoakConfig, traffic: Traffic, observer: Observer, events: list[dict],
               kills: dict[float, Any]) -> None:
    t0, end = time.monotonic(), time.monotonic() + config.minutes * 60
    pending = sorted(kills)
    while time.monotonic() < end:
        observer.idle_now.clear()
        traffic.set_active(True)
        morphed = _wait(lambda: (observer.status() or {}).get("morph_state", {}).get("num_quantized", 0) > 0,
                        config.burst_s)
        driver = "policy"
        if not morphed:  # the burst did not morph on this machine: the operator pins 8 layers low
            _pin(url, {"quantized_layers": 8, "precision": "int4"})
            driver = "pin"
            _wait(lambda: (observer.status() or {}).get("morph_state", {}).get("num_quantized", 0) > 0, 30)
        while pending and (time.monotonic() - t0) >= pending[0] * config.minutes * 60:
            fraction = pending.pop(0)
            events.append({"t": round(time.monotonic() - t0, 1), **kills[fraction]()})
        traffic.set_active(False)
        if driver == "pin":
            _pin(url, {"morphing_enabled": True})
        restored = _wait(lambda: _restored_and_idle(observer.status()), max(config.quiet_s, 60))
        observer.idle_now.set()
        time.sleep(min(config.quiet_s, 3.0))  # let an idle sample or two land; the plateau is what we read
        events.append({"t": round(time.monotonic() - t0, 1), "cycle_driver": driver, "restored": restored})


def kill_controller(ray) -> dict:
    try:
        ray.kill(ray.get_actor(CONTROLLER["controller_name"], namespace=CONTROLLER["controller_namespace"]))
        return {"event": "controller killed"}
    except Exception as e:  # noqa: BLE001 - recorded, the soak goes on
        return {"event": "controller kill failed", "error": repr(e)}


def kill_replica(url: str, traffic: Traffic) -> dict:
    status, body = http("GET", url + "/admin/morph", headers=AUTH, timeout_s=10)
    if status != 200:
        return {"event": "replica kill skipped", "error": f"admin status {status}"}
    pid = body["process"]["pid"]
    traffic.mark_replica_kill(time.monotonic())
    os.kill(pid, signal.SIGKILL)
    back = _wait(lambda: (lambda s: s[0] == 200 and s[1]["process"]["pid"] != pid)(
        http("GET", url + "/admin/morph", headers=AUTH, timeout_s=10)), 600, every_s=1.0)
    return {"event": "replica killed", "pid": pid, "replacement_serving": back}


@contextlib.contextmanager
def local_app(args: dict):
    """Ray on 127.0.0.1 (see ops/serve_local.py) and the app on a free loopback port."""
    import socket

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray import serve

    from deployments import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_local_ray(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name="soak", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        if not _wait(lambda: http("GET", url + "/health", timeout_s=10)[0] == 200, 600):
            raise RuntimeError("the app did not become healthy within 600 s")
        yield ray, url
    finally:
        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(CONTROLLER["controller_name"], namespace=CONTROLLER["controller_namespace"]))
        serve.shutdown()
        ray.shutdown()


def soak(config: SoakConfig) -> dict[str, Any]:
    with local_app(APP_ARGS) as (ray, url):
        traffic = Traffic(url, config.workers, config.max_tokens, config.prompt_words)
        observer = Observer(url)
        events: list[dict] = []
        started = time.monotonic()
        try:
            run_cycles(url, config, traffic, observer, events,
                       {0.4: lambda: kill_controller(ray), 0.6: lambda: kill_replica(url, traffic)})
        finally:
            records = traffic.stop()
            samples = observer.stop()
    requests = classify_requests(records, traffic.replica_kills)
    cycles = count_morph_cycles(samples)
    integrity = integrity_totals(samples)
    memory = memory_by_replica(samples, config.rss_tolerance)
    return {"config": dataclasses.asdict(config), "wall_s": round(time.monotonic() - started, 1),
            "requests": requests, "morph_cycles": cycles, "min_cycles": config.min_cycles,
            "cycle_drivers": {d: sum(1 for e in events if e.get("cycle_driver") == d) for d in ("policy", "pin")},
            "integrity": integrity, "memory": memory, "events": events,
            "rss_series": rss_series(samples, every_s=10.0),
            "verdict": verdict(requests, cycles, config.min_cycles, integrity, memory),
            "app_args": {k: v for k, v in APP_ARGS.items() if k != "admin_token"}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=SoakConfig.prompt_words,
                        help="length of the preamble every request carries (KV pressure per request)")
    parser.add_argument("--out", type=Path, default=ROOT / "soak_results")
    opts = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # several processes share few cores
    report = soak(SoakConfig(minutes=opts.minutes, workers=opts.workers, prompt_words=opts.prompt_words))
    opts.out.mkdir(parents=True, exist_ok=True)
    path = opts.out / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("requests", "morph_cycles", "min_cycles", "cycle_drivers", "integrity",
                                             "memory", "verdict")}, indent=2))
    print(f"saved {path}")
    return 0 if all(report["verdict"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
