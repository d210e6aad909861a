"""The benchmark's fixed choices (one record, printed into the report) and the goal checks.

Workload rule: the Azure conversation trace's window of `window_s` seconds with the highest
peak-to-mean arrival rate (the toolkit's rule, ops/bench/workload.py), arrivals stretched by
`time_scale`, prompt and output lengths scaled down by 8 and clipped, so that a 135M model on 2 CPU
cores saturates during the bursts and idles between them.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from ops.bench import BenchmarkInputError
from ops.bench.metrics import Spread
from ops.bench.systems import STATIC_FP, STATIC_INT4, VLLM
from ops.bench.workload import WorkloadSpec


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    systems: tuple[str, ...] = ("morphserve-static-fp", "morphserve-static-int4", "morphserve-accuracy",
                                "morphserve-balanced", "morphserve-performance", "vllm-cpu")
    repeats: int = 3
    window_s: float = 8.0  # 18 runs took 30 min here (server starts included): `make bench` stays under an hour
    time_scale: float = 2.0
    prompt_scale: float = 1 / 8
    prompt_range: tuple[int, int] = (16, 256)
    output_scale: float = 1 / 8
    output_range: tuple[int, int] = (4, 32)
    slo_ttft_s: float = 2.0  # the paper's TTFT SLO, the same for every system
    max_model_len: int = 512
    kv_sequences: float = 2.0  # full-precision KV = this many max_model_len sequences
    block_size: int = 16
    max_num_batched_tokens: int = 512
    threads: int = 2
    start_deadline_s: float = 600.0  # a first start may build the host store
    drain_s: float = 90.0  # after the last arrival, then unfinished requests count as failed
    seed: int = 0
    perplexity: bool = True  # AWQ-calibrates every layer first: minutes on 2 cores, so --quick skips it
    ppl_tokens: int = 2048
    ppl_window: int = 512

    def __post_init__(self):
        if self.repeats < 1:
            raise BenchmarkInputError(f"repeats={self.repeats}: use at least 1")
        if not self.slo_ttft_s > 0 or not self.drain_s > 0:
            raise BenchmarkInputError("slo_ttft_s and drain_s must be positive")

    @classmethod
    def quick(cls) -> "BenchConfig":
        return cls(repeats=1, window_s=8.0, drain_s=60.0, perplexity=False)

    def notes(self) -> tuple[str, ...]:
        return (f"systems: {', '.join(self.systems)}; {self.repeats} repeat(s), interleaved (order rotated per "
                f"repeat), each run on a freshly started server after one warm-up request",
                f"engine: bf16, block_size {self.block_size}, max_model_len {self.max_model_len}, "
                f"max_num_batched_tokens {self.max_num_batched_tokens}, {self.threads} threads; vLLM gets the "
                f"same KV bytes via --kv-cache-memory-bytes (VLLM_CPU_KVCACHE_SPACE is whole GiB only)",
                f"requests: streaming /v1/chat/completions, temperature 0, ignore_eos; unfinished {self.drain_s:g} s "
                f"after the last arrival = failed")


def workload_spec(cfg: BenchConfig) -> WorkloadSpec:
    return WorkloadSpec(window_s=cfg.window_s, time_scale=cfg.time_scale,
                        prompt_scale=cfg.prompt_scale, prompt_min=cfg.prompt_range[0], prompt_max=cfg.prompt_range[1],
                        output_scale=cfg.output_scale, output_min=cfg.output_range[0], output_max=cfg.output_range[1])


def _m(table: Mapping[str, Mapping[str, Spread]], system: str, key: str) -> float | None:
    row = table.get(system)
    return row[key].median if row and key in row else None


def _ratio_check(ok: bool | None) -> str:
    return "n/a" if ok is None else ("REACHED" if ok else "not reached")


def goal_lines(table: Mapping[str, Mapping[str, Spread]], ppl: Mapping[str, float]) -> list[str]:
    """One line per (dynamic system, goal) on the medians: the number and whether the goal was met."""
    lines = []
    for system in [s for s in table if s.startswith("morphserve-") and s not in (STATIC_FP, STATIC_INT4)]:
        p95, viol = _m(table, system, "ttft_s.p95"), _m(table, system, "slo_violations")
        lines += _vs_fp(system, p95, viol, _m(table, STATIC_FP, "ttft_s.p95"), _m(table, STATIC_FP, "slo_violations"))
        lines += _vs_int4(system, p95, _m(table, STATIC_INT4, "ttft_s.p95"),
                          _m(table, system, "loss_reduction_vs_int4_full"))
        lines += _vs_vllm(system, p95, viol, _m(table, VLLM, "ttft_s.p95"), _m(table, VLLM, "slo_violations"))
    if ppl:
        lines.append("WikiText-2 perplexity (static modes, direct model eval): " +
                     ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in ppl.items()))
    return lines


def _vs_fp(system, p95, viol, fp_p95, fp_viol) -> list[str]:
    if None in (p95, viol, fp_p95, fp_viol):
        return [f"goal {system} vs static FP: n/a (missing runs)"]
    speedup = fp_p95 / p95 if p95 > 0 else float("inf")
    fewer = 1 - viol / fp_viol if fp_viol > 0 else None
    ok = speedup >= 2.2 and fewer is not None and fewer >= 0.8
    fewer_text = ("n/a (static FP had no violations)" if fewer is None else
                  f"{fewer:.0%} fewer" if fewer >= 0 else f"{-fewer:.0%} more")
    return [f"goal {system} vs static FP (P95 TTFT >= 2.2x lower, >= 80% fewer SLO violations): "
            f"P95 TTFT {speedup:.2f}x lower, {fewer_text} violations -> {_ratio_check(ok)}"]


def _vs_int4(system, p95, int4_p95, reduction) -> list[str]:
    if None in (p95, int4_p95) or reduction is None:
        return [f"goal {system} vs static INT4 (>= 70% less quality loss, P95 TTFT within 1.5x): n/a "
                f"(missing runs or static INT4 lost no quality)"]
    ok = reduction >= 0.7 and p95 <= 1.5 * int4_p95
    return [f"goal {system} vs static INT4 (>= 70% less quality loss, P95 TTFT within 1.5x): quality loss "
            f"{reduction:.0%} lower, P95 TTFT {p95 / int4_p95 if int4_p95 else float('inf'):.2f}x of INT4's -> "
            f"{_ratio_check(ok)}"]


def _vs_vllm(system, p95, viol, v_p95, v_viol) -> list[str]:
    if None in (p95, viol, v_p95, v_viol):
        return [f"goal {system} vs vLLM: n/a (missing runs)"]
    ok = p95 < v_p95 and viol < v_viol
    return [f"goal {system} vs vLLM (lower P95 TTFT and fewer SLO violations): P95 TTFT {p95:.3g} s vs "
            f"{v_p95:.3g} s, violations {viol:g} vs {v_viol:g} -> {_ratio_check(ok)}"]
