"""`make bench`: the side-by-side bursty-trace benchmark (static FP, static INT4, MorphServe in each
mode, vLLM's CPU build) on one machine, model, memory budget and workload.

    python -m ops.bench.run_all [--quick] [--repeats N] [--window-s S] [--systems ...] [--out DIR]

Runs are interleaved (repeat r runs the systems rotated by r) and each starts its server fresh. The
report (report.md, results.json, PNGs, logs/) goes to ops/bench/results/<timestamp>/ and is rewritten
after every round of repeats, so an interrupted run still leaves what it measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

from engine import datasets
from ops.bench.bench_settings import BenchConfig, goal_lines, workload_spec
from ops.bench.loadgen import load_requests, reference_answers
from ops.bench.prompts import build_prompts
from ops.bench.report import BenchResults, BenchSettings, SystemRun, build_report, score_quality, summarize
from ops.bench.run_one import REPO, RunContext, run_system
from ops.bench.server_process import ServerStartError
from ops.bench.systems import (ALL_SYSTEMS, QUICK_SYSTEMS, STATIC_FP, STATIC_INT4, ModelFacts, interleaved_schedule,
                               plan_budget, system_specs, vllm_block_size, vllm_kv_tokens)
from ops.bench.traces import load_trace
from ops.bench.workload import build_workload



def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, short window, 4 systems (a few minutes)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per system (default 3; --quick: 1)")
    ap.add_argument("--window-s", type=float, default=None, help="trace window in seconds (default 8)")
    ap.add_argument("--systems", nargs="+", default=None, choices=ALL_SYSTEMS, help="systems to run, in order")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default ops/bench/results/<timestamp>)")
    ap.add_argument("--trace", type=Path, default=None,
                    help="trace CSV; default: the Azure conversation trace (engine/datasets.py finds or downloads it)")
    ap.add_argument("--model", default="default", help="'default' or a Hugging Face folder / .gguf")
    ap.add_argument("--no-perplexity", action="store_true", help="skip WikiText-2 perplexity of the static modes "
                    "(--quick always skips it)")
    return ap.parse_args(argv)


def bench_config(args: argparse.Namespace) -> BenchConfig:
    base = BenchConfig.quick() if args.quick else BenchConfig()
    changes = {k: v for k, v in (("repeats", args.repeats), ("window_s", args.window_s)) if v is not None}
    if args.systems:
        changes["systems"] = tuple(args.systems)
    elif args.quick:
        changes["systems"] = QUICK_SYSTEMS
    return dataclasses.replace(base, **changes)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = bench_config(args)
    out = args.out or REPO / "ops" / "bench" / "results" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    from engine.config import default_cache_dir
    from engine.loader import resolve_model

    files = resolve_model(args.model, default_cache_dir())
    facts = ModelFacts.from_hf_dir(files.hf_dir)
    plan = plan_budget(facts, cfg.max_model_len, cfg.kv_sequences, cfg.block_size, cfg.max_num_batched_tokens,
                       weight_bytes=_engine_weight_bytes(files.hf_dir))
    specs = {s.name: s for s in system_specs(cfg.systems, facts.num_layers)}
    workload = build_workload(load_trace(datasets.resolve("azure_conv", args.trace)), workload_spec(cfg))
    encode, decode = _tokenizer(files.hf_dir)
    prompts = build_prompts(workload.requests, encode, decode, seed=cfg.seed)
    requests = load_requests(workload.requests, prompts)
    ctx = RunContext(hf_dir=str(files.hf_dir), served_name=files.name, plan=plan, out_dir=out,
                     start_deadline_s=cfg.start_deadline_s, drain_s=cfg.drain_s, threads=cfg.threads,
                     vllm_python=str(REPO / ".venv-vllm" / "bin" / "python"))
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "ops.bench.run_all", *(argv or sys.argv[1:])])
    (out / "command.txt").write_text(command + "\n", encoding="utf-8")
    _log(f"budget: {plan.describe()}\nworkload: {workload.describe()}\nout: {out}")
    runs: list[SystemRun] = []
    failures: list[str] = []
    schedule = interleaved_schedule(cfg.systems, cfg.repeats)
    started = time.monotonic()
    for i, (repeat, name) in enumerate(schedule):
        _log(f"[{i + 1}/{len(schedule)}] {name} repeat {repeat} ({time.monotonic() - started:.0f} s elapsed)")
        try:
            runs.append(run_system(specs[name], repeat, requests, ctx))
        except ServerStartError as e:  # recorded and reported; the other systems still run
            failures.append(f"{name} repeat {repeat}: {e}")
            _log(f"  FAILED: {e}")
        if (i + 1) % len(cfg.systems) == 0 or i + 1 == len(schedule):
            _write(out, runs, failures, cfg, plan, workload.describe(), command, prompts, files.name, {})
    ppl = _perplexity(args.model, cfg) if cfg.perplexity and not args.no_perplexity else {}
    paths = _write(out, runs, failures, cfg, plan, workload.describe(), command, prompts, files.name, ppl)
    _log(f"done in {time.monotonic() - started:.0f} s: {paths.report_md if paths else 'no runs succeeded'}")
    return 0 if paths and not failures else 1


def _write(out, runs, failures, cfg, plan, workload_text, command, prompts, model_name, ppl):
    if not any(r.system == STATIC_FP for r in runs):
        _log("  (no full-precision run yet: report not written)")
        return None
    scored = score_quality(runs, STATIC_FP, reference_answers(prompts))
    settings = BenchSettings(
        title=f"MorphServe bursty-trace benchmark ({model_name}, {len(cfg.systems)} systems, {cfg.repeats} repeats)",
        model=model_name,
        memory_budget=f"{plan.describe()}; {plan.describe_vllm(vllm_block_size(plan), vllm_kv_tokens(plan))}", workload=workload_text, slo_ttft_s=cfg.slo_ttft_s,
        full_precision_system=STATIC_FP, static_int4_system=STATIC_INT4 if STATIC_INT4 in cfg.systems else None,
        commands=(command,), notes=())
    results = BenchResults(settings=settings, runs=scored)
    notes = (*cfg.notes(), *goal_lines(summarize(results), ppl), *[f"failed run: {f}" for f in failures])
    return build_report(dataclasses.replace(results, settings=dataclasses.replace(settings, notes=notes)), out)


def _tokenizer(hf_dir: Path):
    """The served model's tokenizer, plain (no special tokens), to fit prompts to trace lengths."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(hf_dir) / "tokenizer.json"))
    return (lambda text: tok.encode(text, add_special_tokens=False).ids), (lambda ids: tok.decode(list(ids)))


def _engine_weight_bytes(hf_dir: Path) -> int:
    """Resident bf16 weights as MorphServe's ledger counts them (stored tensors + RoPE tables), so the
    full-precision KV we hand vLLM is exactly what MorphServe static FP gets."""
    import torch

    from engine.loader import load_config, load_weights
    from engine.model import build_model

    model = build_model(load_config(hf_dir), load_weights(hf_dir, torch.bfloat16), torch.bfloat16, "cpu")
    return model.base_weight_bytes() + sum(model.layer_weight_bytes(i) for i in range(len(model.layers)))


def _perplexity(model: str, cfg: BenchConfig) -> dict[str, float]:
    from ops.bench.static_perplexity import static_perplexities

    _log(f"WikiText-2 perplexity of the static modes ({cfg.ppl_tokens} tokens)...")
    try:
        return static_perplexities(model, cfg.ppl_tokens, cfg.ppl_window, cfg.threads)
    except Exception as e:  # noqa: BLE001 - the latency results must still be reported
        _log(f"  perplexity failed: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}"}


def _log(msg: str) -> None:
    print(msg, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
