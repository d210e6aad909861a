"""Shared by the end-to-end Serve tests: one local Ray cluster per test module, the app deployed on
127.0.0.1, and small HTTP helpers. Every wait is a poll with a deadline."""
from __future__ import annotations

import contextlib
import socket
import time
from typing import Any, Callable, Iterator

from ops.local_ray import http, init_local_ray  # noqa: F401  (http: re-exported for the tests)

CHAT_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def auto_precision() -> str:
    """The full precision the app's default dtype=auto serves on this machine: bf16 on a CPU with
    native bf16, fp32 elsewhere (engine/capability.py)."""
    from engine.precision import full_precision_for, resolve_dtype

    return full_precision_for(resolve_dtype("auto")).value


def auto_budget(bf16_budget: str) -> int:
    """A serve test's memory budget, written for bf16 weights, in bytes for auto_precision(): doubled
    where that is fp32, since weights, activation reserve and KV all scale with the element size.
    Without it a 280 MiB budget holds half the fp32 model, and the engine starts with most layers
    quantized."""
    from engine.config import parse_bytes

    return parse_bytes(bf16_budget) * (2 if auto_precision() == "fp32" else 1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def until(predicate: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.1) -> Any:
    """Poll `predicate` until it returns something truthy (returned), or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(every_s)  # poll interval, not a synchronisation
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")


@contextlib.contextmanager
def ray_cluster(include_dashboard: bool = False) -> Iterator[Any]:
    """A local Ray cluster on 127.0.0.1 with a known metrics export port; shut down at the end
    (a cluster some other module left running is shared and left to its owner)."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    init_local_ray(num_cpus=2, include_dashboard=include_dashboard, _node_ip_address="127.0.0.1",
                   _metrics_export_port=free_port(), log_to_driver=False,
                   # Replicas push metrics to the agent every 2 s instead of 10 s: tests see them sooner.
                   _system_config={"metrics_report_interval_ms": 2000})
    try:
        yield ray
    finally:
        ray.shutdown()


def metrics_export_port(ray) -> int:
    node = next(n for n in ray.nodes() if n["Alive"])
    return int(node["MetricsExportPort"])


@contextlib.contextmanager
def deployed(args: dict[str, Any], name: str = "morphserve") -> Iterator[str]:
    """The application for `args` running behind Serve's proxy on 127.0.0.1; yields its base URL."""
    from ray import serve

    from deployments import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(args), name=name, route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        # Generous: on a loaded 2-core machine two replicas loading the model took 260 s (a healthy app
        # returns at once; only a broken one waits the whole deadline).
        until(lambda: http("GET", url + "/health")[0] == 200, 600, "the app to become healthy", every_s=0.5)
        yield url
    finally:
        serve.shutdown()


def kill_controller(ray, name: str, namespace: str) -> None:
    with contextlib.suppress(Exception):
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)


@contextlib.contextmanager
def serve_app(args: dict[str, Any], include_dashboard: bool = False) -> Iterator[tuple[Any, str]]:
    """A local cluster running the app for `args`; yields (ray, base URL). The detached controller
    named in `args` outlives Serve, so it is killed at the end (a later module starts its own)."""
    with ray_cluster(include_dashboard) as ray:
        try:
            with deployed(args) as url:
                yield ray, url
        finally:
            kill_controller(ray, args["controller_name"], args["controller_namespace"])


def admin_status(url: str, token: str) -> dict:
    status, body = http("GET", url + "/admin/morph", headers={"Authorization": f"Bearer {token}"})
    assert status == 200, body
    return body
