"""`make bench`: the side-by-side bursty-trace benchmark (static FP, static INT4, MorphServe in each
mode, vLLM's CPU build) on one machine, model, memory budget and workload.

    python -m ops.bench.run_all [--quick] [--fleet] [--repeats N] [--systems ...] [--out DIR]

1. Workload: the trace's burst windows (ops/bench/workload.py), with ShareGPT prompts.
2. Calibration: a closed-loop probe of the baseline (static FP) measures capacity for the workload's
   length mix; arrivals are scaled so the mean load is a set fraction of it (ops/bench/calibration.py).
   On the same servers, our load generator is cross-checked with `vllm bench serve` (crosscheck.py).
3. Replay: runs interleaved (repeat r runs the systems rotated by r), each on a fresh server; per run
   the reaction time to each burst (reaction.py).
4. Quality, offline after the load phase: teacher-forced agreement with full precision and
   token-weighted WikiText-2 perplexity of what each run served (served_quality.py).
The report (report.md, results.json, PNGs, logs/) goes to ops/bench/results/<timestamp>/ and is
rewritten after every round of repeats, so an interrupted run still leaves what it measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from engine import datasets
from ops.bench.bench_settings import CHAT_TEMPLATE_TOKENS, BenchConfig, workload_spec
from ops.bench.calibration import calibrate
from ops.bench.loadgen import load_requests, reference_answers
from ops.bench.probe import measure
from ops.bench.prompts import build_prompts, with_system_prompts
from ops.bench.reaction import engine_blocked_waits, reaction_times
from ops.bench.report import (BenchResults, BenchSettings, SystemRun, build_report, run_metrics, score_quality,
                              summarize)
from ops.bench.run_one import REPO, RunContext, run_system
from ops.bench.server_process import ServerStartError
from ops.bench.systems import (ALL_SYSTEMS, BUDGETED, FLEET_BASELINE, FLEET_REPLICAS, FLEET_SYSTEMS,
                               QUICK_SYSTEMS, STATIC_FP, STATIC_INT4, ModelFacts, fleet_note, fleet_systems,
                               interleaved_schedule, plan_budget, system_specs, vllm_block_size, vllm_kv_tokens)
from ops.bench.traces import load_trace
from ops.bench.workload import build_workload

def _seconds_or_off(text: str) -> float | str:
    """--fleet-restore-quiet-s: seconds >= 0, or `off` (its default, None, means not given)."""
    if text.strip().lower() == "off":
        return "off"
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds >= 0, or off") from None
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds >= 0, or off")
    return seconds


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, one short window, 4 systems (a few minutes)")
    ap.add_argument("--fleet", action="store_true", help="2 replicas per system: Serve's router + local policy vs "
                    "the fleet controller + pressure-aware router")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per system (default 2; --quick: 1)")
    ap.add_argument("--window-s", type=float, default=None, help="trace window length in seconds (default 12)")
    ap.add_argument("--systems", nargs="+", default=None, choices=ALL_SYSTEMS + FLEET_SYSTEMS, help="systems, in order")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default ops/bench/results/<timestamp>)")
    ap.add_argument("--trace", type=Path, default=None, help="Azure or BurstGPT CSV; default: the Azure "
                    "conversation trace (engine/datasets.py finds or downloads it)")
    ap.add_argument("--model", default="default", help="'default' or a Hugging Face folder / .gguf")
    ap.add_argument("--capacity-rps", type=float, default=None, help="skip the probe: capacity in requests/s")
    ap.add_argument("--no-crosscheck", action="store_true", help="skip the `vllm bench serve` cross-check")
    ap.add_argument("--fleet-budget-replicas", type=float, default=None, help="--fleet: the fleet controller's "
                    "accuracy budget, in one replica's balanced-mode cap (default 1)")
    ap.add_argument("--fleet-restore-quiet-s", type=_seconds_or_off, default=None, metavar="S|off",
                    help="--fleet: the controller systems' fleet_restore_quiet_s (default: the app's); off: a "
                    "replica's restores always wait the engine's restore_quiet_s")
    ap.add_argument("--fleet-restore-calm-s", type=float, default=None, metavar="S",
                    help="--fleet: the controller systems' fleet_restore_calm_s, how long every replica must have "
                    "been calm before the sooner restores apply (default: the app's)")
    ap.add_argument("--fleet-report-interval-s", type=float, default=None, metavar="S",
                    help="--fleet: the controller systems' report_interval_s, how often each replica reports to "
                    "the controller and applies its directive (default: the app's 0.25 s)")
    ap.add_argument("--fleet-router-affinity", action="store_true", help="--fleet: the pressure router's prefix "
                    "affinity on (AppArgs.router_prefix_affinity) in the controller systems")
    ap.add_argument("--fleet-router-slo", action="store_true", help="--fleet: the pressure router overflows requests "
                    "that can meet the run's TTFT SLO nowhere to the most backlogged replica "
                    "(AppArgs.router_slo_ttft_s = --slo-ttft-s) in the controller systems")
    ap.add_argument("--mean-load", type=float, default=None, help="the replay's mean arrival rate as a fraction of "
                    "the measured capacity (default 0.5; raised when the bursts would not exceed capacity)")
    ap.add_argument("--no-quality", action="store_true", help="skip teacher-forced agreement and perplexity")
    ap.add_argument("--kv-sequences", type=float, default=None, help="each replica's full-precision KV, in "
                    "max_model_len sequences (default 2): less makes the replay more memory-bound")
    ap.add_argument("--slo-ttft-s", type=float, default=None, help="the TTFT SLO in seconds, the same for every "
                    "system (default 2, the paper's)")
    ap.add_argument("--prompt-scale", type=float, default=None, help="the trace's prompt lengths times this "
                    "(default 1/8, for a 135M model's 512-token context)")
    ap.add_argument("--prompt-max", type=int, default=None, help="prompts longer than this many tokens are cut "
                    "(default 256); max_model_len grows to hold the longest prompt and output, and each replica's KV "
                    "with it (--kv-sequences of them)")
    ap.add_argument("--output-scale", type=float, default=None, help="the trace's output lengths times this "
                    "(default 1/8)")
    ap.add_argument("--output-max", type=int, default=None, help="outputs longer than this many tokens are cut "
                    "(default 32); max_model_len grows with it as with --prompt-max")
    ap.add_argument("--system-prompts", type=int, nargs=2, default=None, metavar=("COUNT", "TOKENS"),
                    help="give every request one of COUNT system prompts of TOKENS tokens (drawn at random): "
                    "shared prefixes, for prefix caching and the pressure router's prefix affinity")
    ap.add_argument("--dtype", choices=("bf16", "fp32", "auto"), default=None, help="MorphServe's full precision "
                    "(default bf16, as vLLM serves; auto: the engine's choice for this CPU, fp32 without native bf16)")
    return ap.parse_args(argv)


def bench_config(args: argparse.Namespace) -> BenchConfig:
    base = BenchConfig.quick() if args.quick else BenchConfig()
    changes = {k: v for k, v in (("repeats", args.repeats), ("window_s", args.window_s),
                                 ("capacity_rps", args.capacity_rps),
                                 ("fleet_budget_replicas", args.fleet_budget_replicas),
                                 ("fleet_report_interval_s", args.fleet_report_interval_s),
                                 ("fleet_restore_calm_s", args.fleet_restore_calm_s),
                                 ("kv_sequences", args.kv_sequences), ("slo_ttft_s", args.slo_ttft_s)) if v is not None}
    if args.fleet_router_affinity:
        changes["fleet_router_affinity"] = True
    if args.fleet_router_slo:
        changes["fleet_router_slo"] = True
    if args.fleet_restore_quiet_s is not None:  # `off` is AppArgs' None
        changes["fleet_restore_quiet_s"] = None if args.fleet_restore_quiet_s == "off" else args.fleet_restore_quiet_s
    if args.systems:
        changes["systems"] = tuple(args.systems)
    elif args.fleet:
        changes["systems"] = fleet_systems()
    elif args.quick:
        changes["systems"] = QUICK_SYSTEMS
    if set(changes.get("systems", base.systems)) <= set(FLEET_SYSTEMS):
        # Every replica must be kept saturated for the probe to measure the fleet's capacity: with one
        # replica's 8 in flight, 2 replicas held 4 each and the probe read 1.9 req/s, where a replica
        # alone takes 1.7, so the "calibrated" replay never loaded the fleet enough to miss an SLO.
        changes["probe"] = dataclasses.replace(base.probe, concurrency=base.probe.concurrency * FLEET_REPLICAS,
                                               num_requests=base.probe.num_requests * FLEET_REPLICAS)
    if args.mean_load is not None:
        changes["calibration"] = dataclasses.replace(base.calibration, mean_load_fraction=args.mean_load)
    if args.no_crosscheck:
        changes["crosscheck"] = None
    if args.no_quality:
        changes["quality"] = False
    if args.dtype is not None:
        changes["dtype"] = bench_dtype(args.dtype)
    for name in ("prompt_scale", "output_scale"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.system_prompts is not None:
        count, tokens = args.system_prompts
        changes |= {"system_prompts": count, "system_prompt_tokens": tokens}
    if args.prompt_max is not None or args.output_max is not None or args.system_prompts is not None:
        changes |= length_limits(base, args.prompt_max, args.output_max, changes.get("system_prompt_tokens", 0))
    return dataclasses.replace(base, **changes)


def length_limits(base: BenchConfig, prompt_max: int | None, output_max: int | None, system_tokens: int = 0) -> dict:
    """The config changes for prompts and outputs cut at other lengths (None: the default's): max_model_len
    holds the longest prompt, its system prompt, its chat template and the longest output, in whole KV
    blocks, and never shrinks below the default's."""
    prompt_max = base.prompt_range[1] if prompt_max is None else prompt_max
    output_max = base.output_range[1] if output_max is None else output_max
    blocks = -(-(prompt_max + system_tokens + CHAT_TEMPLATE_TOKENS + output_max) // base.block_size)
    return {"prompt_range": (min(base.prompt_range[0], prompt_max), prompt_max),
            "output_range": (min(base.output_range[0], output_max), output_max),
            "max_model_len": max(base.max_model_len, blocks * base.block_size)}


def bench_dtype(name: str) -> str:
    """'auto' -> what dtype=auto picks on this machine's CPU (engine/capability.py), as a benchmark dtype."""
    from engine.precision import full_precision_for, resolve_dtype

    return full_precision_for(resolve_dtype(name)).value


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = bench_config(args)
    out = args.out or REPO / "ops" / "bench" / "results" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    setup = model_setup(cfg, args.model, out)
    files, facts, ctx, plan = setup.files, setup.facts, setup.ctx, setup.ctx.plan
    specs = {s.name: s for s in system_specs(cfg.systems, facts.num_layers, cfg.fleet_budget_replicas,
                                             cfg.controller_overrides())}
    trace = load_trace(datasets.resolve("azure_conv", args.trace))
    unscaled = build_workload(trace, workload_spec(cfg))
    prompts = build_prompts(unscaled.requests, setup.encode, setup.decode, seed=cfg.seed)
    if cfg.system_prompts:
        prompts = with_system_prompts(prompts, cfg.system_prompts, cfg.system_prompt_tokens, setup.encode,
                                      setup.decode, seed=cfg.seed)
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "ops.bench.run_all", *(argv or sys.argv[1:])])
    (out / "command.txt").write_text(command + "\n", encoding="utf-8")
    _log(f"budget: {plan.describe()}\nout: {out}")
    started = time.monotonic()
    capacity, checks = measure(cfg, specs, load_requests(unscaled.requests, prompts), ctx, _log)
    calibration = calibrate(capacity, unscaled.trace_mean_rps, unscaled.trace_peak_rps, cfg.calibration)
    workload = build_workload(trace, workload_spec(cfg, calibration.time_scale))
    requests = load_requests(workload.requests, prompts)  # same windows, same order: the same prompts
    budget_note = None
    if args.repeats is None and not args.quick:
        fitting = cfg.fitting_repeats(workload.duration_s, time.monotonic() - started)
        if fitting < cfg.repeats:
            budget_note = (f"repeats reduced from {cfg.repeats} to {fitting}: {len(cfg.systems)} runs of "
                           f"{workload.duration_s:.0f} s replay + {cfg.run_overhead_s:g} s per repeat would pass the "
                           f"{cfg.time_budget_s / 60:.0f}-minute budget at this machine's calibrated load")
            cfg = dataclasses.replace(cfg, repeats=fitting)
    schedule = interleaved_schedule(cfg.systems, cfg.repeats)
    _log(f"calibration: {calibration.describe()}\nworkload: {workload.describe()}\n{len(schedule)} runs of about "
         f"{workload.duration_s + 45:.0f} s each (replay + server start)")
    info = _ReportInfo(cfg, plan, workload.describe(), command, prompts, files.name, calibration.describe(),
                       tuple(checks), "; ".join(filter(None, (fleet_note(cfg.systems, _fleet_budget(specs),
                                                                         cfg.controller_overrides()),
                                                              budget_note))) or None,
                       workload.window_starts_s)
    runs: list[SystemRun] = []
    failures: list[str] = []
    for i, (repeat, name) in enumerate(schedule):
        _log(f"[{i + 1}/{len(schedule)}] {name} repeat {repeat} ({time.monotonic() - started:.0f} s elapsed)")
        for attempt in range(1, cfg.start_attempts + 1):
            try:
                runs.append(_with_reaction(run_system(specs[name], repeat, requests, ctx), specs[name], plan, cfg))
                break
            except ServerStartError as e:  # a start that failed (an overloaded machine) is tried again
                _log(f"  FAILED (attempt {attempt} of {cfg.start_attempts}): {e}")
                if attempt == cfg.start_attempts:  # recorded and reported; the other systems still run
                    failures.append(f"{name} repeat {repeat}: {e}")
        if (i + 1) % len(cfg.systems) == 0 or i + 1 == len(schedule):
            _write(out, runs, failures, info)
    if cfg.quality and runs:
        runs = _with_quality(runs, prompts, requests, args.model, plan, cfg)
    paths = _write(out, runs, failures, info)
    _log(f"done in {time.monotonic() - started:.0f} s: {paths.report_md if paths else 'no runs succeeded'}")
    return 0 if paths and not failures else 1


@dataclasses.dataclass(frozen=True)
class _ReportInfo:
    cfg: BenchConfig
    plan: object
    workload: str
    command: str
    prompts: list
    model_name: str
    calibration: str
    crosscheck: tuple[str, ...]
    extra_note: str | None
    window_starts_s: tuple[float, ...] = ()  # replay time each burst window starts


def _with_reaction(run: SystemRun, spec, plan, cfg: BenchConfig) -> SystemRun:
    from ops.bench.metrics import integral

    vllm = spec.kind == "vllm"
    block = vllm_block_size(plan) if vllm else plan.block_size
    fixed = vllm_kv_tokens(plan) // block if vllm else plan.kv_blocks
    reservation = max((int(s.values["reservation_tokens"]) for s in run.timeline if "reservation_tokens" in s.values),
                      default=0)
    reaction = reaction_times(run.records, run.timeline, block, fixed, cfg.stall_threshold_s, reservation)
    return dataclasses.replace(run, reaction=reaction, quantized_layer_s=integral(run.timeline, "quantized_layers"),
                               engine_blocked_s=engine_blocked_waits(run.timeline))


def _with_quality(runs: list[SystemRun], prompts, requests, model: str, plan, cfg: BenchConfig) -> list[SystemRun]:
    from ops.bench.served_quality import RunServed, evaluate_runs

    _log(f"quality: teacher forcing every served response, perplexity of every served configuration...")
    texts = {r.request_id: p.prompt for r, p in zip(requests, prompts)}
    served = [RunServed(key=f"{r.system}/r{r.repeat}", prompts=texts,
                        outputs={x.request_id: x.output_text for x in r.records if x.ok},
                        token_times=[t for x in r.records if x.ok for t in x.token_times_s], timeline=r.timeline)
              for r in runs]
    knobs = {"block_size": cfg.block_size, "max_model_len": cfg.max_model_len,
             "max_num_batched_tokens": cfg.max_num_batched_tokens}
    try:
        quality = evaluate_runs(served, model, plan.budget_bytes, knobs, cfg.threads, cfg.ppl_tokens, cfg.ppl_window)
    except Exception as e:  # noqa: BLE001 - the latency results must still be reported
        _log(f"  quality phase failed: {type(e).__name__}: {e}")
        return runs
    return [dataclasses.replace(r, tf_agreement=quality[f"{r.system}/r{r.repeat}"].agreement,
                                weighted_ppl=quality[f"{r.system}/r{r.repeat}"].weighted_perplexity) for r in runs]


def _write(out: Path, runs, failures, info: _ReportInfo):
    cfg, plan = info.cfg, info.plan
    reference = STATIC_FP if any(r.system == STATIC_FP for r in runs) else (runs[0].system if runs else None)
    if reference is None:
        _log("  (no run yet: report not written)")
        return None
    from ops.bench.goals import goal_lines

    scored = score_quality(runs, reference, reference_answers(info.prompts))
    settings = BenchSettings(
        title=f"MorphServe bursty-trace benchmark ({info.model_name}, {len(cfg.systems)} systems, {cfg.repeats} repeats)",
        model=info.model_name,
        memory_budget=f"{plan.describe()}; {plan.describe_vllm(vllm_block_size(plan), vllm_kv_tokens(plan))}",
        workload=info.workload, slo_ttft_s=cfg.slo_ttft_s, full_precision_system=reference,
        static_int4_system=STATIC_INT4 if STATIC_INT4 in cfg.systems else None, commands=(info.command,),
        calibration=info.calibration, crosscheck=info.crosscheck, window_starts_s=info.window_starts_s)
    results = BenchResults(settings=settings, runs=scored)
    notes = (*cfg.notes(), *([info.extra_note] if info.extra_note else []),
             *[f"failed run: {f}" for f in failures])
    goals = goal_lines(summarize(results)) + _fleet_pairs_lines(results)
    settings = dataclasses.replace(settings, notes=notes, goals=tuple(goals))
    return build_report(dataclasses.replace(results, settings=settings), out)


def _fleet_pairs_lines(results: BenchResults) -> list[str]:
    """goals.fleet_pairs_line for each fleet system with the controller, over the repeats it and the
    baseline both completed; none for a system without such a repeat."""
    from ops.bench.goals import FleetPair, fleet_pairs_line

    slo = results.settings.slo_ttft_s
    base = {r.repeat: r for r in results.runs_of(FLEET_BASELINE)}
    lines = []
    for system in BUDGETED:
        fleet = {r.repeat: r for r in results.runs_of(system)}
        pairs = [FleetPair((run_metrics(base[i], slo).slo_violations, run_metrics(fleet[i], slo).slo_violations),
                           (base[i].quantized_layer_s, fleet[i].quantized_layer_s))
                 for i in sorted(base.keys() & fleet.keys())]
        lines += [fleet_pairs_line(pairs, system)] if pairs else []
    return lines


@dataclasses.dataclass(frozen=True)
class ModelSetup:
    """What every benchmark run of a model shares: its files, facts, run context (budget plan included)
    and tokenizer (plain, to fit prompts to trace lengths)."""
    files: Any
    facts: ModelFacts
    ctx: RunContext
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]


def model_setup(cfg: BenchConfig, model: str, out: Path) -> ModelSetup:
    """Resolve `model`, plan its memory budget for `cfg` and build the context servers start from."""
    from engine.config import default_cache_dir
    from engine.loader import resolve_model

    files = resolve_model(model, default_cache_dir())
    facts = ModelFacts.from_hf_dir(files.hf_dir)
    plan = plan_budget(facts, cfg.max_model_len, cfg.kv_sequences, cfg.block_size, cfg.max_num_batched_tokens,
                       weight_bytes=_engine_weight_bytes(files.hf_dir, cfg.dtype), dtype=cfg.dtype)
    ctx = RunContext(hf_dir=str(files.hf_dir), served_name=files.name, plan=plan, out_dir=out,
                     start_deadline_s=cfg.start_deadline_s, drain_s=cfg.drain_s, threads=cfg.threads,
                     vllm_python=str(REPO / ".venv-vllm" / "bin" / "python"))
    encode, decode = _tokenizer(files.hf_dir)
    return ModelSetup(files, facts, ctx, encode, decode)


def _tokenizer(hf_dir: Path):
    """The served model's tokenizer, plain (no special tokens), to fit prompts to trace lengths."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(hf_dir) / "tokenizer.json"))
    return (lambda text: tok.encode(text, add_special_tokens=False).ids), (lambda ids: tok.decode(list(ids)))


def _engine_weight_bytes(hf_dir: Path, dtype: str) -> int:
    """Resident weights in `dtype` as MorphServe's ledger counts them (stored tensors + RoPE tables), so
    the full-precision KV we hand vLLM is exactly what MorphServe static FP gets."""
    from engine.loader import load_config, load_weights
    from engine.model import build_model
    from engine.precision import Precision, torch_dtype

    torch_type = torch_dtype(Precision(dtype))
    model = build_model(load_config(hf_dir), load_weights(hf_dir, torch_type), torch_type, "cpu")
    return model.base_weight_bytes() + sum(model.layer_weight_bytes(i) for i in range(len(model.layers)))


def _fleet_budget(specs) -> int | None:
    """The fleet accuracy budget the pressure-aware fleet system runs with (None: not in this run)."""
    spec = next((specs[n] for n in BUDGETED if n in specs), None)
    return spec.app_args.get("fleet_max_quantized_layers") if spec is not None else None


def _log(msg: str) -> None:
    print(msg, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
