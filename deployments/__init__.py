"""The Ray Serve application: `serve run deployments:app` (defaults) or
`serve run deployments:build_app model=... memory_budget=...` / a serve config's `args:`.

    OpenAIIngress (HTTP, FastAPI)  --DeploymentHandle-->  LLMServer (AsyncLLMEngine + MorphLoop)
                                                              |  reports every report_interval_s
                                                              v
                                               FleetController (detached, named Ray actor)

Ray Serve is imported only when the application is built, so `import deployments.ingress` (tests with
a fake engine) stays light; `app` is built on first access.
"""
from __future__ import annotations

from typing import Any

INGRESS_NAME = "OpenAIIngress"
ENGINE_NAME = "LLMServer"


def build_app(args: dict[str, Any] | None = None):
    """The bound application for `args` (see deployments/app_args.py: AppArgs). Unknown or bad
    keys raise InvalidRequestError naming them, before anything is deployed."""
    from ray import serve
    from ray.serve.config import BackpressureConfig

    from deployments.app_args import parse_app_args
    from deployments.autoscaling import with_morph_policy
    from deployments.ingress_deployment import OpenAIIngress
    from deployments.replica import LLMServer

    parsed = parse_app_args(args)
    scaling: dict[str, Any] = ({"autoscaling_config": with_morph_policy(parsed.autoscaling_config)}
                               if parsed.autoscaling_config is not None
                               else {"num_replicas": parsed.num_replicas or 1})
    # Every queue is bounded: Serve's beyond max_ongoing_requests (max_queued_requests), the engine's
    # (max_waiting). A refusal anywhere is a 503 with Retry-After (README "Overload").
    backpressure = BackpressureConfig(status_code=503, retry_after_s=parsed.retry_after_s)
    router = parsed.request_router_config()
    if router is not None:
        scaling["request_router_config"] = router
    engine = serve.deployment(LLMServer).options(
        name=ENGINE_NAME, max_ongoing_requests=parsed.engine_max_ongoing_requests(),
        max_queued_requests=parsed.max_queued_requests, backpressure_config=backpressure,
        # The first start on a model may prepare its host store (minutes); do not give up on it.
        health_check_timeout_s=60, graceful_shutdown_timeout_s=30,
        ray_actor_options={"num_cpus": parsed.engine_num_cpus, "num_gpus": parsed.engine_num_gpus},
        **scaling)
    ingress = serve.deployment(OpenAIIngress).options(
        name=INGRESS_NAME, num_replicas=parsed.ingress_replicas,
        max_ongoing_requests=parsed.ingress_max_ongoing_requests,
        max_queued_requests=parsed.ingress_max_queued_requests, backpressure_config=backpressure,
        ray_actor_options={"num_cpus": 0})
    args_dump = parsed.model_dump()
    return ingress.bind(engine.bind(args_dump), args_dump)


def __getattr__(name: str):
    if name == "app":  # `serve run deployments:app`: the defaults (and MORPHSERVE_* secrets from env)
        value = build_app({})
        globals()["app"] = value
        return value
    raise AttributeError(f"module 'deployments' has no attribute {name!r}")
