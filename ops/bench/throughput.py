"""Offline generation throughput: MorphServe vs Hugging Face `generate` vs vLLM's CPU build.

    python -m ops.bench.throughput [--quick] [--skip-vllm] [--skip-hf] [--threads 2] [--repeats 3]

Workloads (ops/bench/throughput_workload.py): (a) 32 requests x 32-token prompts x 64 new tokens,
(b) 8 requests x 1,024-token prompts x 64 new tokens; greedy, ignore_eos, bf16, the default model.

How it is fair:
- each backend lives in its own process (ops/bench/*_offline.py), loaded once, with the same threads;
  peak RSS is that process's VmHWM (the largest resident set it ever had, loading included);
- before any timing, each backend runs every scenario once with 4 new tokens (warm-up: lazy init,
  allocator, kernel selection), which is not timed;
- repeats are interleaved: round r runs every scenario on every backend, the backend order rotating
  each round, so load drifting on a shared machine spreads over all backends instead of one;
- a run is timed inside the worker from submitting all requests to the last token, so process start
  and command transfer are excluded. Reported: medians over repeats.
Prints a markdown table, the ours/vLLM and ours/HF ratios, the machine facts and the exact command;
saves everything as JSON under ops/bench/results/ (git-ignored).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys
from pathlib import Path

from ops.bench import BenchmarkInputError
from ops.bench.throughput_report import (RunRecord, machine_facts, markdown_table, ratio_lines, ratios, summarize)
from ops.bench.throughput_workers import REPO_ROOT, WorkerFailed, WorkerProcess, WorkerSpec, python_for
from ops.bench.throughput_workload import FULL, QUICK, Workload, build_workloads

RESULTS_DIR = REPO_ROOT / "ops" / "bench" / "results"
WARMUP_TOKENS = 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="'default', a Hugging Face folder or a .gguf file")
    ap.add_argument("--quick", action="store_true", help="smoke run: small scenarios, one repeat each")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="CPU threads per backend")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats for ours and HF (>= 1)")
    ap.add_argument("--vllm-repeats", type=int, default=2, help="timed repeats for vLLM (>= 1)")
    ap.add_argument("--kv-gib", type=float, default=1.0, help="KV space for ours (in its budget) and vLLM")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="per-step token budget for ours and vLLM; default: vLLM's own default, "
                         "and the same for ours (ops/bench/ours_offline.py)")
    ap.add_argument("--vllm-python", type=Path, default=REPO_ROOT / ".venv-vllm" / "bin" / "python")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one load or one run may take")
    ap.add_argument("--seed", type=int, default=0, help="which ShareGPT conversations become prompts")
    ap.add_argument("--out", type=Path, default=None, help="JSON path; default ops/bench/results/throughput-<time>.json")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.vllm_repeats < 1:
        raise BenchmarkInputError("--repeats and --vllm-repeats must be >= 1")
    if args.threads < 1:
        raise BenchmarkInputError("--threads must be >= 1")
    return args


def plan_repeats(args: argparse.Namespace) -> dict[str, int]:
    """backend -> timed repeats, in the order the backends start."""
    backends = {"ours": args.repeats}
    if not args.skip_hf:
        backends["hf"] = args.repeats
    if not args.skip_vllm:
        backends["vllm"] = args.vllm_repeats
    if args.quick:
        backends = dict.fromkeys(backends, 1)
    return backends


def interleaved_order(repeats: dict[str, int], scenarios: list[str]) -> list[tuple[int, str, str]]:
    """(repeat, scenario, backend) in run order: round by round, the backend order rotating each round."""
    names = list(repeats)
    order = []
    for r in range(max(repeats.values())):
        rotated = names[r % len(names):] + names[:r % len(names)]
        for scenario in scenarios:
            order.extend((r, scenario, b) for b in rotated if r < repeats[b])
    return order


def start_workers(args, hf_dir: Path, repeats: dict[str, int], max_len: int, stamp: str) -> dict[str, WorkerProcess]:
    common = ("--model-dir", str(hf_dir), "--threads", str(args.threads), "--max-model-len", str(max_len),
              "--kv-gib", str(args.kv_gib))
    if args.max_num_batched_tokens:
        common += ("--max-num-batched-tokens", str(args.max_num_batched_tokens))
    specs = [WorkerSpec(backend, python_for(backend, args.vllm_python, Path(sys.executable)), common,
                        RESULTS_DIR / "logs" / f"throughput-{stamp}-{backend}.log") for backend in repeats]
    # All load at once (every interpreter was checked above): loading is not timed, and vLLM's is slow.
    return {spec.backend: WorkerProcess(spec) for spec in specs}


def run_all(args, workers: dict[str, WorkerProcess], workloads: list[Workload],
            repeats: dict[str, int]) -> tuple[list[RunRecord], dict[str, str], dict[str, dict]]:
    failed: dict[str, str] = {}
    info: dict[str, dict] = {}
    for backend, worker in workers.items():
        try:
            ready = worker.wait_ready(args.timeout)
            info[backend] = dict(ready["info"], load_s=round(ready["load_s"], 1))
            print(f"[{backend}] loaded in {ready['load_s']:.1f}s; warming up", flush=True)
            for w in workloads:
                worker.run(f"warmup-{w.scenario.name}", w.prompts, min(WARMUP_TOKENS, w.scenario.max_tokens),
                           args.timeout)
        except WorkerFailed as e:
            failed[backend] = str(e)
            print(f"[{backend}] FAILED: {e}", file=sys.stderr, flush=True)
    by_name = {w.scenario.name: w for w in workloads}
    records = []
    for r, scenario, backend in interleaved_order(repeats, list(by_name)):
        if backend in failed:
            continue
        w = by_name[scenario]
        try:
            reply = workers[backend].run(f"{scenario}-{r}", w.prompts, w.scenario.max_tokens, args.timeout)
        except WorkerFailed as e:
            failed[backend] = str(e)
            print(f"[{backend}] FAILED: {e}", file=sys.stderr, flush=True)
            continue
        rec = RunRecord(backend, scenario, r, reply["elapsed_s"], reply["cpu_s"], reply["prompt_tokens"],
                        reply["generated_tokens"], reply["vmhwm_kib"])
        records.append(rec)
        print(f"[{backend}] ({scenario}) repeat {r}: {rec.elapsed_s:.2f}s ({rec.cpu_s:.1f} CPU-s), "
              f"{rec.gen_tok_s:.1f} generated tok/s, {rec.total_tok_s:.1f} total tok/s", flush=True)
    return records, failed, info


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from engine.config import default_cache_dir
    from engine.loader import resolve_model

    command = shlex.join([_shown_python(), "-m", "ops.bench.throughput", *(sys.argv[1:] if argv is None else argv)])
    hf_dir = resolve_model(args.model, default_cache_dir()).hf_dir
    scenarios = QUICK if args.quick else FULL
    workloads = build_workloads(hf_dir, scenarios, seed=args.seed)
    repeats = plan_repeats(args)
    facts_before = machine_facts()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    workers = start_workers(args, hf_dir, repeats, max(s.max_len for s in scenarios), stamp)
    try:
        records, failed, info = run_all(args, workers, workloads, repeats)
    finally:
        for worker in workers.values():
            worker.close()
    summaries = summarize(records)
    result = {"command": command, "model_dir": str(hf_dir), "threads": args.threads, "repeats": repeats,
              "scenarios": [dataclasses.asdict(w.scenario) | {"prompt_source": w.source} for w in workloads],
              "machine": facts_before, "loadavg_after": [round(x, 1) for x in os.getloadavg()], "backends": info,
              "failed": failed, "summaries": [dataclasses.asdict(s) for s in summaries],
              "ratios": ratios(summaries), "runs": [dataclasses.asdict(r) for r in records]}
    print_report(result, summaries, scenarios)
    out = args.out or RESULTS_DIR / f"throughput-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nsaved {out}")
    return result


def _shown_python() -> str:
    exe = Path(sys.executable)
    try:
        return str(exe.relative_to(REPO_ROOT))  # e.g. .venv/bin/python (not resolved: keep the venv's name)
    except ValueError:
        return str(exe)


def print_report(result: dict, summaries, scenarios) -> None:
    m = result["machine"]
    print("\n## Offline throughput\n")
    print(markdown_table(summaries, scenarios))
    print("\nRatios (ours / peer; > 1 means ours is faster):")
    print(ratio_lines(result["ratios"]))
    print(f"\nMachine: {m['cpu']}, {m['usable_cpus']} usable of {m['logical_cpus']} logical CPUs, "
          f"threads per backend: {result['threads']}, {m['mem_total_gib']} GiB RAM; load average "
          f"{m['loadavg_1_5_15']} before, {result['loadavg_after']} after (shared machine: other work "
          f"competes for the same cores); torch {m.get('torch')}, commit {m['git_commit']}")
    print(f"Command: {result['command']}")
    for backend, message in result["failed"].items():
        print(f"\n{backend} FAILED (left out): {message.splitlines()[0]}")


if __name__ == "__main__":
    try:
        main()
    except BenchmarkInputError as e:
        sys.exit(f"error: {e}")
