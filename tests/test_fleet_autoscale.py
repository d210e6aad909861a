"""Scale-out that really happens, on a local Ray cluster with the real default model: one engine
replica under sustained pressure at its morph cap (a fleet budget of 2 layers) asks for a peer only
after `scale_out_after_s`, Ray Serve adds it through deployments/autoscaling.py (the queue policy
alone would not: target_ongoing_requests is out of reach), and when the traffic stops every layer
is restored before the fleet shrinks back to one replica. Bounded and self-stopping."""
from __future__ import annotations

import threading
import time

import pytest

from tests.test_fleet_serve import BURST_DEADLINE_S, COMMON, Sampler, brief, held, wait
from tests.test_serve_morph import Traffic

SCALE_AFTER_S = 3.0
SCALE_CONTROLLER = {"controller_name": "test-autoscale-controller", "controller_namespace": "morphserve-test-scale"}
SCALE_ARGS = {
    **COMMON, **SCALE_CONTROLLER, "fleet_max_quantized_layers": 2, "scale_out_after_s": SCALE_AFTER_S,
    "replica_timeout_s": 5.0,
    "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
                           "target_ongoing_requests": 1000, "upscale_delay_s": 0.0, "downscale_delay_s": 3.0,
                           "metrics_interval_s": 0.5, "look_back_period_s": 1.0},
}


class ReplicaCounter:
    """Polls Serve's status of the engine deployment every 0.2 s: (time, replicas not stopping)."""

    def __init__(self, app: str = "morphserve", deployment: str = "LLMServer"):
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(app, deployment), daemon=True)
        self._thread.start()

    def _run(self, app: str, deployment: str) -> None:
        from ray import serve

        while not self._stop.is_set():
            states = serve.status().applications[app].deployments[deployment].replica_states
            count = sum(n for state, n in states.items() if str(state).split(".")[-1] in ("STARTING", "RUNNING", "UPDATING"))
            self.samples.append((time.monotonic(), count))
            self._stop.wait(0.2)  # sampling period

    def latest(self) -> int:
        return self.samples[-1][1] if self.samples else 0

    def first_time(self, predicate) -> float | None:
        return next((t for t, n in self.samples if predicate(n)), None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


@pytest.fixture(scope="module")
def scaling_app():
    from tests.serve_helpers import serve_app

    with serve_app(SCALE_ARGS) as (ray, url):
        yield ray, url


@pytest.mark.slow
def test_sustained_pressure_at_the_cap_adds_a_replica_and_quiet_removes_it_after_restoring(scaling_app):
    ray, url = scaling_app
    counter, sampler = ReplicaCounter(), Sampler(ray, SCALE_CONTROLLER)
    try:
        last = lambda: sampler.views[-1] if sampler.views else None  # noqa: E731
        wait(lambda: counter.latest() == 1 and sampler.views and len(sampler.views[-1]["replicas"]) == 1, 120,
             "one replica reporting", last)
        traffic = Traffic(url, workers=12, max_tokens=24)
        try:
            wait(lambda: counter.latest() == 2, BURST_DEADLINE_S, "Serve to add a replica", last)
            wait(lambda: len(sampler.views[-1]["replicas"]) == 2, BURST_DEADLINE_S, "the new replica reporting", last)
        finally:
            results = traffic.stop()
        stopped = time.monotonic()
        wait(lambda: counter.latest() == 1, BURST_DEADLINE_S, "Serve to remove the extra replica", last)
    finally:
        counter.stop()
        views = sampler.stop()
    assert all(status == 200 for status, _ in results), [r for r in results if r[0] != 200][:3]
    # Out: not before the replica had been at its cap under pressure for scale_out_after_s.
    # (The controller's own measure, on the replica's snapshot clock: the test's view of the controller is
    # sampled, and on a loaded machine a sample can come a second or more after the clock started.)
    asked = next(v for v in views if v["scale_out"]["desired_extra_replicas"] > 0)
    assert max(r["at_cap_for_s"] for r in asked["replicas"].values()) >= SCALE_AFTER_S, brief(asked)
    added = counter.first_time(lambda n: n >= 2)
    assert added >= asked["_t"] - 0.5  # Serve added it because the controller asked (the queue rule would not)
    # In: every layer restored first, then one replica removed.
    removed = next(t for t, n in counter.samples if t > stopped and n == 1)
    restored = next(v["_t"] for v in views if v["_t"] > stopped and held(v) == 0)
    assert restored <= removed, (restored - stopped, removed - stopped)
    assert max(held(v) for v in views) <= 2  # the fleet budget held throughout
