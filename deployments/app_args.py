"""AppArgs: the arguments of the Serve application (`serve run deployments:app key=value ...`, the
`args:` of a serve config / RayService), validated up front with messages that say what to change.

Everything a replica needs is derived here once (EngineConfig, FleetConfig, IngressSettings), so a
bad value fails `build_app` on the driver instead of crashing replicas one by one.
"""
from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from controller.fleet import DEFAULT_NAME, DEFAULT_NAMESPACE
from controller.policy_config import FleetConfig, ModeName, PolicyConfig
from deployments.ingress import IngressSettings
from engine.config import EngineConfig
from engine.errors import InvalidRequestError

API_KEY_ENV = "MORPHSERVE_API_KEY"
ADMIN_TOKEN_ENV = "MORPHSERVE_ADMIN_TOKEN"
# EngineConfig fields AppArgs sets itself; `engine` may carry any other EngineConfig field.
_ENGINE_FIELDS_AT_TOP = ("model", "served_model_name", "dtype", "device", "memory_budget", "max_waiting")


class AppArgs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # -- the engine --
    model: str = Field("default", description="'default' (embedded SmolLM2-135M-Instruct), a Hugging Face folder or a .gguf file")
    served_model_name: str | None = Field(None, description="name in /v1/models; default: the model folder's name")
    memory_budget: int | str = Field("1GiB", description="bytes one engine replica may hold: weights + KV + reserve")
    dtype: str = Field("auto", description="full precision: auto (native bf16 where the device has it), bf16, fp16 or fp32")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when the replica sees a GPU")
    max_waiting: int = Field(32, ge=1, description="requests one engine replica queues beyond its running batch (max_num_seqs); more -> 503 + Retry-After at once")
    engine: dict[str, Any] = Field(default_factory=dict, description="other EngineConfig knobs (block_size, max_num_seqs, max_model_len, ...)")
    # -- the morph policy and the fleet controller --
    mode: ModeName = Field("balanced", description="accuracy | balanced | performance")
    policy: dict[str, Any] = Field(default_factory=dict, description="PolicyConfig overrides (enter_after, relax_after, thresholds, ...)")
    fleet_max_quantized_layers: int | None = Field(None, ge=0, description="fleet accuracy budget: most quantized layers over all replicas")
    scale_out_after_s: float = Field(30.0, ge=0.0, description="a replica at its morph cap under pressure this long asks for a peer")
    scale_out_reset_after_s: float = Field(5.0, ge=0.0, description="a scale-out request is withdrawn only after saturation has been absent this long (hysteresis)")
    replica_timeout_s: float = Field(10.0, gt=0.0, description="the controller forgets a replica silent this long and returns its grant")
    max_extra_replicas: int = Field(4, ge=0, description="most extra replicas the controller asks for at once")
    fleet_restore_quiet_s: float | None = Field(0.5, ge=0.0, description="the quiet period a replica's restores need once the fleet has been calm for fleet_restore_calm_s (None: always the engine's restore_quiet_s)")
    fleet_restore_calm_s: float = Field(1.0, ge=0.0, description="how long every replica must have been relaxed with nothing waiting before fleet_restore_quiet_s applies (longer than a lull inside a burst)")
    fleet_controller: bool = Field(True, description="false: no fleet controller; every replica runs its own policy (no fleet budget)")
    controller_name: str = Field(DEFAULT_NAME, min_length=1)
    controller_namespace: str = Field(DEFAULT_NAMESPACE, min_length=1)
    report_interval_s: float = Field(0.25, gt=0.0, le=60.0, description="how often a replica reports pressure and applies its directive")
    controller_timeout_s: float = Field(0.5, gt=0.0, description="a report not answered within this falls back to the local policy")
    controller_start_timeout_s: float = Field(30.0, ge=0.0, description="how long a starting replica waits for the fleet controller's first answer before it is ready (it then serves on its local policy and keeps reporting); 0: do not wait")
    max_layers_per_step: int = Field(2, ge=1, description="most layers the engine swaps between two steps")
    # -- Ray Serve --
    num_replicas: int | None = Field(None, ge=1, description="engine replicas (fixed); exclusive with autoscaling_config")
    autoscaling_config: dict[str, Any] | None = Field(None, description="Ray Serve autoscaling of the engine replicas")
    max_ongoing_requests: int | None = Field(None, ge=1, description="Serve calls one engine replica takes at once; default: engine_max_ongoing_requests()")
    max_queued_requests: int = Field(32, ge=-1, description="calls Serve queues for the engine replicas while all are at max_ongoing_requests or restarting (-1: no limit); beyond -> 503")
    control_slots: int = Field(8, ge=1, description="Serve calls per engine replica kept free of generation for health and admin calls")
    engine_stall_s: float = Field(60.0, gt=0.0, description="a replica whose engine has work but finishes no step for this long fails its health check")
    # Off by default since wave 18: with the fleet controller and its budget, Serve's router missed fewer SLOs
    # than the pressure router (README, Benchmarks, wave 18: the halves of the fleet measured apart).
    pressure_router: bool = Field(False, description="route engine requests by prefill backlog, queue length and KV fit (deployments/router.py); false: Serve's default power of two choices")
    router_stale_after_s: float = Field(2.0, gt=0.0, description="older routing stats than this: the pressure router falls back to Serve's default")
    router_stats_period_s: float = Field(0.5, gt=0.0, description="how often Serve pulls each replica's routing stats")
    router_morphed_penalty: float = Field(0.0, ge=0.0, description="pressure router: queued requests' worth added to a replica where the request fits only in the KV its morph added")
    router_no_fit_penalty: float = Field(0.0, ge=0.0, description="pressure router: queued requests' worth added to a replica where the request does not fit now (it waits or morphs there)")
    router_transit_s: float = Field(0.05, ge=0.0, description="pressure router: a request sent this long before a replica's stats' cutoff may still have been on its way there, so it is counted as sent after them")
    router_prefix_affinity: bool = Field(False, description="pressure router: prefer the replica likely holding a quarter or more of a request's prompt in its prefix cache (off by default: in the wave-28 benchmark it raised the prefix-cache hit share but not the SLO attainment)")
    router_affinity_queue_gap: int = Field(2, ge=0, description="pressure router with router_prefix_affinity: that replica is preferred while its queue is at most this many requests longer than the shortest")
    router_slo_ttft_s: float | None = Field(None, gt=0.0, description="pressure router: a TTFT SLO in seconds; a request that can meet it on no replica now (though it could on an idle one) goes to the most backlogged replica, keeping the others within it for requests that still can (goodput over tail latency); None: off")
    ingress_replicas: int = Field(1, ge=1)
    ingress_max_ongoing_requests: int = Field(256, ge=1, description="HTTP requests one ingress replica handles at once")
    ingress_max_queued_requests: int = Field(64, ge=-1, description="HTTP requests Serve's proxy queues for the ingress beyond that (-1: no limit); beyond -> 503")
    ingress_refusal_hold_s: float = Field(0.5, ge=0.0, description="after an engine refuses a generation (full), the ingress refuses new ones itself (503) until one of its generations ends or this long passes; 0: off (deployments/overload_gate.py)")
    engine_num_cpus: float = Field(1.0, ge=0.0, description="Ray CPUs reserved per engine replica")
    engine_num_gpus: float = Field(0.0, ge=0.0, description="Ray GPUs reserved per engine replica (1 on a GPU cluster)")
    # -- HTTP --
    api_key: str | None = Field(None, description=f"when set, /v1/* needs it as a bearer token (default: ${API_KEY_ENV})")
    admin_token: str | None = Field(None, description=f"when set, /admin/* is on with this bearer token (default: ${ADMIN_TOKEN_ENV})")
    retry_after_s: int = Field(1, ge=0)
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest HTTP request body; larger -> 413")

    @model_validator(mode="before")
    @classmethod
    def _secrets_from_env(cls, data: Any) -> Any:
        # Secrets do not belong in a committed serve config: an unset key is read from the environment.
        if isinstance(data, dict):
            data = dict(data)
            for key, env in (("api_key", API_KEY_ENV), ("admin_token", ADMIN_TOKEN_ENV)):
                if data.get(key) is None and os.environ.get(env):
                    data[key] = os.environ[env]
        return data

    @field_validator("engine")
    @classmethod
    def _engine_knobs(cls, v: dict[str, Any]) -> dict[str, Any]:
        doubled = [k for k in v if k in _ENGINE_FIELDS_AT_TOP]
        if doubled:
            raise ValueError(f"set {doubled} at the top level of the args, not inside 'engine'")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "AppArgs":
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("give num_replicas or autoscaling_config, not both")
        if self.router_stale_after_s <= self.router_stats_period_s:
            raise ValueError(f"router_stale_after_s ({self.router_stale_after_s}) must exceed router_stats_period_s "
                             f"({self.router_stats_period_s}), or the router would always fall back")
        from deployments.router import Penalties

        Penalties(morphed=self.router_morphed_penalty, no_fit=self.router_no_fit_penalty)  # its own checks, up front
        if "mode" in self.policy:
            raise ValueError("set the mode with the top-level 'mode' arg, not inside 'policy'")
        if self.autoscaling_config is not None:
            from ray.serve.config import AutoscalingConfig

            AutoscalingConfig.model_validate(self.autoscaling_config)  # Ray's own checks, up front
        # Build every derived config now: its validation errors surface here, named by field.
        self.engine_config()
        fleet = self.fleet_config()
        span = fleet.policy.history_len * self.report_interval_s
        if fleet.fleet_restore_quiet_s is not None and self.fleet_restore_calm_s >= span:
            raise ValueError(f"fleet_restore_calm_s ({self.fleet_restore_calm_s}) must be shorter than the history the "
                             f"controller keeps per replica (policy.history_len x report_interval_s = {span:g} s), "
                             "or the fleet's sooner restores never apply; shorten it or raise policy.history_len")
        self.ingress_settings()
        return self

    def engine_config(self, device: str | None = None) -> EngineConfig:
        """`device`: what "auto" resolved to on the replica (the driver may have no GPU)."""
        resolved = device or (self.device if self.device != "auto" else "cpu")
        return EngineConfig(model=self.model, served_model_name=self.served_model_name, dtype=self.dtype,
                            device=resolved, memory_budget=self.memory_budget, max_waiting=self.max_waiting,
                            **self.engine)

    def engine_max_ongoing_requests(self) -> int:
        """Serve's max_ongoing_requests for an engine replica. Large enough that generation alone never
        fills it: the engine refuses generation beyond max_num_seqs + max_waiting at once (503), every
        ingress replica makes at most ingress_max_ongoing_requests calls (tokenize, generate) at a time,
        and control_slots stay free, so health and admin calls are never queued behind generation."""
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        engine = self.engine_config()
        return (engine.max_num_seqs + engine.max_waiting + self.ingress_replicas * self.ingress_max_ongoing_requests
                + self.control_slots)

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig.model_validate({**self.policy, "mode": self.mode})

    def fleet_config(self) -> FleetConfig:
        return FleetConfig(policy=self.policy_config(), fleet_max_quantized_layers=self.fleet_max_quantized_layers,
                           scale_out_after_s=self.scale_out_after_s,
                           scale_out_reset_after_s=self.scale_out_reset_after_s, replica_timeout_s=self.replica_timeout_s,
                           max_extra_replicas=self.max_extra_replicas, fleet_restore_quiet_s=self.fleet_restore_quiet_s,
                           fleet_restore_calm_s=self.fleet_restore_calm_s)

    def request_router_config(self) -> dict[str, Any] | None:
        """The engine deployment's `request_router_config` (None: Serve's default router)."""
        if not self.pressure_router:
            return None
        from deployments.router import ROUTER_IMPORT_PATH

        return {"request_router_class": ROUTER_IMPORT_PATH,
                "request_router_kwargs": {"stale_after_s": self.router_stale_after_s,
                                          "morphed_penalty": self.router_morphed_penalty,
                                          "no_fit_penalty": self.router_no_fit_penalty,
                                          "transit_s": self.router_transit_s,
                                          "prefix_affinity": self.router_prefix_affinity,
                                          "affinity_queue_gap": self.router_affinity_queue_gap,
                                          "slo_ttft_s": self.router_slo_ttft_s},
                "request_routing_stats_period_s": self.router_stats_period_s,
                "request_routing_stats_timeout_s": max(1.0, 2 * self.router_stats_period_s)}

    def ingress_settings(self) -> IngressSettings:
        # Ray Serve's proxy already returns x-request-id; the app must not add a second one.
        return IngressSettings(api_key=self.api_key, admin_token=self.admin_token,
                               retry_after_s=self.retry_after_s, max_body_bytes=self.max_body_bytes,
                               echo_request_id=False)


def parse_app_args(args: dict[str, Any] | None) -> AppArgs:
    """Validate `args`; a bad value raises InvalidRequestError naming every offending key."""
    if args is not None and not isinstance(args, dict):
        raise InvalidRequestError(f"application args must be a mapping, got {type(args).__name__}")
    try:
        return AppArgs.model_validate(args or {})
    except ValidationError as e:
        problems = []
        for err in e.errors():
            where = ".".join(str(x) for x in err.get("loc", ())) or "args"
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            if err.get("type") == "extra_forbidden":
                msg = f"unknown argument; known: {', '.join(sorted(AppArgs.model_fields))}"
            problems.append(f"{where}: {msg}")
        param = next((str(err["loc"][0]) for err in e.errors() if err.get("loc")), None)
        raise InvalidRequestError("invalid MorphServe application args: " + "; ".join(problems), param=param) from None
