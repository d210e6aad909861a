"""Before the replay: measure capacity on the baseline system (ops/bench/calibration.py), and, on
the same running servers, cross-check our load generator against vLLM's own `vllm bench serve`
(ops/bench/crosscheck.py) with the same prompts, output lengths and concurrency."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from ops.bench.calibration import Capacity, ProbePlan, capacity_from_records
from ops.bench.crosscheck import CrossCheck, CrossCheckPlan, describe, run_crosscheck
from ops.bench.loadgen import LoadGenConfig, LoadRequest, closed_loop
from ops.bench.run_one import RunContext, started_server
from ops.bench.systems import STATIC_FP, VLLM, SystemSpec


def probe_requests(requests: Sequence[LoadRequest], n: int) -> list[LoadRequest]:
    """n requests spread evenly over the workload (its length mix), with fresh ids."""
    if not requests:
        return []
    step = len(requests) / n
    return [dataclasses.replace(requests[int(i * step) % len(requests)], request_id=f"probe-{i:04d}", scheduled_s=0.0)
            for i in range(n)]


def measure_capacity(spec: SystemSpec, requests: Sequence[LoadRequest], plan: ProbePlan, ctx: RunContext,
                     crosscheck: CrossCheckPlan | None = None) -> tuple[Capacity, CrossCheck | None]:
    with started_server(spec, "probe", ctx) as server:
        config = LoadGenConfig(base_url=server.base_url, model=ctx.served_name, api="chat", deadline_s=plan.deadline_s)
        result = closed_loop(probe_requests(requests, plan.num_requests), config, plan.concurrency)
        capacity = capacity_from_records(result.records, plan.concurrency, spec.name)
        check = run_crosscheck(server.base_url, spec.name, requests, crosscheck, ctx) if crosscheck else None
    return capacity, check


def crosscheck_only(spec: SystemSpec, requests: Sequence[LoadRequest], plan: CrossCheckPlan,
                    ctx: RunContext) -> CrossCheck:
    with started_server(spec, "crosscheck", ctx) as server:
        return run_crosscheck(server.base_url, spec.name, requests, plan, ctx)


def measure(cfg, specs: dict[str, SystemSpec], requests: Sequence[LoadRequest], ctx: RunContext,
            log) -> tuple[Capacity, list[str]]:
    """Capacity of the baseline (static FP when it runs, else the first system), unless the config
    gives it; the cross-check on the baseline and on vLLM when both the plan and vLLM's venv exist."""
    if cfg.capacity_rps is not None:
        return Capacity(cfg.capacity_rps, 0.0, 0, 0, 0.0, "given (--capacity-rps)"), []
    baseline = specs.get(STATIC_FP) or next(iter(specs.values()))
    plan = cfg.crosscheck if cfg.crosscheck and Path(ctx.vllm_python).exists() else None
    log(f"probe: {baseline.name}, closed loop, {cfg.probe.concurrency} in flight, {cfg.probe.num_requests} requests"
        + (f"; then the cross-check with vllm bench serve ({plan.num_requests} requests, {plan.concurrency} in flight)"
           if plan else ""))
    capacity, check = measure_capacity(baseline, requests, cfg.probe, ctx, plan if baseline.kind == "morphserve" else None)
    log(f"  capacity: {capacity.describe()}")
    checks = [check] if check else []
    if plan and VLLM in specs:
        try:
            checks.append(crosscheck_only(specs[VLLM], requests, plan, ctx))
        except Exception as e:  # noqa: BLE001 - a failed cross-check must not stop the benchmark
            log(f"  vLLM cross-check failed: {type(e).__name__}: {e}")
    lines = describe(checks)
    for line in lines:
        log(f"  cross-check {line}")
    if cfg.crosscheck and not plan:
        lines.append(f"not run: {ctx.vllm_python} does not exist (bash ops/bench/setup_vllm.sh builds it)")
    return capacity, lines
