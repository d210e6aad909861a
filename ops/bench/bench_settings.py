"""The benchmark's fixed choices (one record, printed into the report).

Workload rule: the trace's `num_windows` (or more, until `min_requests`) non-overlapping windows of
`window_s` seconds with the highest peak-to-mean arrival rate (ops/bench/workload.py), replayed one
after the other; prompt and output lengths scaled down by 8 and clipped (a 135M model with a 512-token
context; run_all's --prompt-scale/--prompt-max/--output-scale/--output-max change them); arrival
times scaled by the calibration (ops/bench/calibration.py), measured on this machine before the replay. The goals the report checks live in ops/bench/goals.py.
"""
from __future__ import annotations

import dataclasses

from ops.bench import BenchmarkInputError
from ops.bench.calibration import CalibrationRule, ProbePlan
from ops.bench.crosscheck import CrossCheckPlan
from ops.bench.workload import WorkloadSpec

APP_DEFAULT = "app"  # a fleet setting the benchmark leaves to the app (AppArgs' own default)
# Prompts are fitted to the trace's lengths as plain text; the chat template then adds the roles and the
# default system prompt (about 30 tokens with SmolLM2), which max_model_len must hold too.
CHAT_TEMPLATE_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    systems: tuple[str, ...] = ("morphserve-static-fp", "morphserve-static-int4", "morphserve-accuracy",
                                "morphserve-balanced", "morphserve-performance", "vllm-cpu")
    repeats: int = 2  # 6 systems x 2 repeats of ~150 requests stay under an hour on 2 cores
    window_s: float = 12.0
    num_windows: int = 3  # separate bursts, replayed one after the other ...
    min_requests: int = 120  # ... and more windows until they hold this many requests
    gap_s: float = 4.0  # replay seconds of silence between two windows
    prompt_scale: float = 1 / 8
    prompt_range: tuple[int, int] = (16, 256)
    output_scale: float = 1 / 8
    output_range: tuple[int, int] = (4, 32)
    calibration: CalibrationRule = CalibrationRule()
    capacity_rps: float | None = None  # skip the probe and use this capacity (req/s)
    probe: ProbePlan = ProbePlan(concurrency=8, num_requests=32)
    crosscheck: CrossCheckPlan | None = CrossCheckPlan(concurrency=4, num_requests=24)
    slo_ttft_s: float = 2.0  # the paper's TTFT SLO, the same for every system
    max_model_len: int = 512
    kv_sequences: float = 2.0  # full-precision KV = this many max_model_len sequences
    block_size: int = 16
    max_num_batched_tokens: int = 512
    threads: int = 2
    dtype: str = "bf16"  # MorphServe's full precision (ops/bench/systems.py: DTYPE_BYTES); vLLM keeps bf16
    start_deadline_s: float = 600.0  # a first start may build the host store
    start_attempts: int = 2  # a server that fails to start (Ray's node timeout on a busy machine) gets one more try
    drain_s: float = 90.0  # after the last arrival, then unfinished requests count as failed
    stall_threshold_s: float = 0.0  # a request that did not fit counts once it waited longer than this
    seed: int = 0
    time_budget_s: float = 3300.0  # make bench under an hour: fewer repeats when a slow machine needs it
    run_overhead_s: float = 60.0  # server start, warm-up and stop per run (estimate for the budget)
    fleet_budget_replicas: float = 1.0  # --fleet: the fleet's accuracy budget, in one replica's balanced cap
    # --fleet: AppArgs.fleet_restore_quiet_s of the controller systems; None: off (a replica's restores
    # always wait the engine's restore_quiet_s)
    fleet_restore_quiet_s: float | str | None = APP_DEFAULT
    # --fleet: AppArgs.fleet_restore_calm_s of the controller systems (how long the fleet must be calm
    # before the sooner restores apply); None: the app's
    fleet_restore_calm_s: float | None = None
    # --fleet: AppArgs.report_interval_s of the controller systems (how often a replica reports to the
    # controller); None: the app's
    fleet_report_interval_s: float | None = None
    # --fleet: the pressure router's prefix affinity (AppArgs.router_prefix_affinity) for the controller systems
    fleet_router_affinity: bool = False
    # --fleet: the pressure router's overflow at this run's SLO (AppArgs.router_slo_ttft_s) for the controller systems
    fleet_router_slo: bool = False
    # Shared prefixes (what prefix caching and the router's prefix affinity are for): every request gets
    # one of `system_prompts` system prompts of `system_prompt_tokens` tokens (0: none, the model's default)
    system_prompts: int = 0
    system_prompt_tokens: int = 0
    quality: bool = True  # teacher-forced agreement and token-weighted perplexity after the load phase
    ppl_tokens: int = 2048
    ppl_window: int = 512

    def __post_init__(self):
        if self.repeats < 1:
            raise BenchmarkInputError(f"repeats={self.repeats}: use at least 1")
        if not self.slo_ttft_s > 0 or not self.drain_s > 0:
            raise BenchmarkInputError("slo_ttft_s and drain_s must be positive")
        if self.fleet_report_interval_s is not None and not self.fleet_report_interval_s > 0:
            raise BenchmarkInputError(f"fleet_report_interval_s={self.fleet_report_interval_s}: give a positive "
                                      "interval in seconds or leave it to the app")
        if self.fleet_restore_calm_s is not None and not self.fleet_restore_calm_s >= 0:
            raise BenchmarkInputError(f"fleet_restore_calm_s={self.fleet_restore_calm_s}: give seconds >= 0 or "
                                      "leave it to the app")
        if self.capacity_rps is not None and not self.capacity_rps > 0:
            raise BenchmarkInputError(f"capacity_rps={self.capacity_rps}: give a positive rate or leave it unset")
        for kind, scale, (low, high) in (("prompt", self.prompt_scale, self.prompt_range),
                                         ("output", self.output_scale, self.output_range)):
            if not (scale > 0 and 1 <= low <= high):
                raise BenchmarkInputError(f"{kind}_scale={scale}, {kind}_range={(low, high)}: need a positive "
                                          f"scale and 1 <= shortest <= longest {kind}")
        if (self.system_prompts > 0) != (self.system_prompt_tokens > 0) or min(self.system_prompts,
                                                                               self.system_prompt_tokens) < 0:
            raise BenchmarkInputError(f"system_prompts={self.system_prompts}, system_prompt_tokens="
                                      f"{self.system_prompt_tokens}: give both (a count and a length) or neither")
        if self.system_prompts and self.crosscheck is not None:
            raise BenchmarkInputError("system prompts: the cross-check's `vllm bench serve` dataset has no system "
                                      "messages, so it would replay other requests; add --no-crosscheck")
        longest = self.prompt_range[1] + self.system_prompt_tokens
        if longest + CHAT_TEMPLATE_TOKENS + self.output_range[1] > self.max_model_len:
            raise BenchmarkInputError(f"the longest prompt ({longest}, system prompt included), its chat template "
                                      f"(up to {CHAT_TEMPLATE_TOKENS}) and the longest output ({self.output_range[1]}) "
                                      f"exceed max_model_len={self.max_model_len}")

    def controller_overrides(self) -> dict:
        """The AppArgs the controller systems get beyond the app's defaults (the --fleet-* settings)."""
        overrides = {}
        if self.fleet_restore_quiet_s != APP_DEFAULT:  # None is a setting too: off
            overrides["fleet_restore_quiet_s"] = self.fleet_restore_quiet_s
        if self.fleet_restore_calm_s is not None:
            overrides["fleet_restore_calm_s"] = self.fleet_restore_calm_s
        if self.fleet_report_interval_s is not None:
            overrides["report_interval_s"] = self.fleet_report_interval_s
        if self.fleet_router_affinity:
            overrides["router_prefix_affinity"] = True
        if self.fleet_router_slo:
            overrides["router_slo_ttft_s"] = self.slo_ttft_s
        return overrides

    def fitting_repeats(self, replay_s: float, elapsed_s: float) -> int:
        """Repeats (at most `repeats`, at least 1) whose runs fit what is left of the time budget."""
        per_round = len(self.systems) * (replay_s + self.run_overhead_s)
        return max(1, min(self.repeats, int((self.time_budget_s - elapsed_s) // per_round)))

    @classmethod
    def quick(cls) -> "BenchConfig":
        return cls(repeats=1, window_s=8.0, num_windows=1, min_requests=0, drain_s=60.0, ppl_tokens=1024,
                   probe=ProbePlan(concurrency=6, num_requests=16), crosscheck=CrossCheckPlan(concurrency=4, num_requests=12))

    def notes(self) -> tuple[str, ...]:
        return (f"systems: {', '.join(self.systems)}; {self.repeats} repeat(s), interleaved (order rotated per "
                f"repeat), each run on a freshly started server once every engine replica is up and has served a warm-up request",
                f"engine: {self.dtype}, block_size {self.block_size}, max_model_len {self.max_model_len}, "
                f"max_num_batched_tokens {self.max_num_batched_tokens}, {self.threads} threads; vLLM gets the "
                f"same KV bytes via --kv-cache-memory-bytes (VLLM_CPU_KVCACHE_SPACE is whole GiB only)",
                f"requests: streaming /v1/chat/completions, temperature 0, ignore_eos; unfinished {self.drain_s:g} s "
                f"after the last arrival = failed" + (
                    f"; each with one of {self.system_prompts} system prompts of {self.system_prompt_tokens} tokens "
                    "(drawn at random, seeded), instead of the model's default" if self.system_prompts else ""))


def workload_spec(cfg: BenchConfig, time_scale: float = 1.0) -> WorkloadSpec:
    return WorkloadSpec(window_s=cfg.window_s, time_scale=time_scale, num_windows=cfg.num_windows,
                        min_requests=cfg.min_requests, gap_s=cfg.gap_s,
                        prompt_scale=cfg.prompt_scale, prompt_min=cfg.prompt_range[0], prompt_max=cfg.prompt_range[1],
                        output_scale=cfg.output_scale, output_min=cfg.output_range[0], output_max=cfg.output_range[1])


