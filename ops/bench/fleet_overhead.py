"""What the fleet machinery costs when nothing is pressed: TTFT and inter-token latency of each
--fleet system (the fleet controller and the pressure-aware router, each on or off) under a light,
steady load that never makes a replica morph, side by side, interleaved, medians of repeats.

    python -m ops.bench.fleet_overhead [--systems ...] [--repeats 3] [--rate-rps 3] [--duration-s 25] [--out DIR]

Why: in the fleet benchmark (run_all --fleet) the systems with the controller or the router showed a
higher inter-token latency already in the trace's first seconds, before any burst or morph. A fixed
cost of the reports, the grants or the routing stats would weigh on every request of a quiet day; this
benchmark isolates it: the same replicas, model and budget as run_all --fleet (ops/bench/run_one.py
starts them), Poisson arrivals at `rate_rps` (seeded, the same for every run), prompts of 64-192
tokens from ShareGPT and 20 output tokens each. The report gives each system's medians over repeats
and its ratio to the baseline (Serve's router + local policies); results.json has every run.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import random
import shlex
import statistics
import sys
from pathlib import Path
from typing import Mapping, Sequence

from engine.capability import detect_capability
from ops.bench import BenchmarkInputError
from ops.bench.bench_settings import BenchConfig
from ops.bench.loadgen import LoadGenConfig, LoadRequest, load_requests, replay
from ops.bench.metrics import compute_run_metrics
from ops.bench.prompts import build_prompts
from ops.bench.run_all import bench_dtype, model_setup
from ops.bench.run_one import REPO, started_server
from ops.bench.systems import FLEET_BASELINE, FLEET_SYSTEMS, interleaved_schedule, system_specs
from ops.bench.traces import TraceRequest

METRICS = ("ttft_p50_ms", "itl_p50_ms", "tpot_p50_ms")


def light_load(rate_rps: float, duration_s: float, seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals at `rate_rps` for `duration_s`, prompts of 64-192 tokens, 20 output tokens."""
    if not rate_rps > 0 or not duration_s > 0:
        raise BenchmarkInputError(f"rate_rps={rate_rps}, duration_s={duration_s}: both must be positive")
    rng, t, out = random.Random(seed), 0.0, []
    while t < duration_s:
        out.append(TraceRequest(arrival_s=t, prompt_tokens=rng.randint(64, 192), output_tokens=20))
        t += rng.expovariate(rate_rps)
    return out


def run_figures(records) -> dict[str, float]:
    """One run's medians in ms, and how many requests failed (a quiet load should fail none)."""
    m = compute_run_metrics(records, slo_ttft_s=2.0)
    ms = lambda d: round(d.p50 * 1e3, 2) if d.p50 is not None else float("nan")  # noqa: E731
    return {"ttft_p50_ms": ms(m.ttft_s), "itl_p50_ms": ms(m.itl_s), "tpot_p50_ms": ms(m.tpot_s),
            "failed": m.num_requests - m.num_ok}


def summarize(runs: Sequence[Mapping], baseline: str) -> dict[str, dict[str, float]]:
    """Per system: the median of each metric over its repeats, and its ratio to the baseline's median."""
    by: dict[str, list[Mapping]] = {}
    for run in runs:
        by.setdefault(run["system"], []).append(run["figures"])
    medians = {s: {k: statistics.median(f[k] for f in figs) for k in METRICS} for s, figs in by.items()}
    base = medians.get(baseline)
    out = {}
    for s, med in medians.items():
        row = dict(med, repeats=len(by[s]))
        if base is not None:
            row.update({f"{k}_vs_baseline": round(med[k] / base[k], 3) for k in METRICS if base[k]})
        out[s] = row
    return out


def report(summary: Mapping[str, Mapping[str, float]], runs: Sequence[Mapping], command: str, machine: str) -> str:
    lines = ["# Fleet overhead at light load", "", f"`{command}`", "", f"Machine: {machine}", "",
             "| system | repeats | TTFT P50 ms | ITL P50 ms | TPOT P50 ms | TTFT vs baseline | ITL vs baseline |",
             "|---|---|---|---|---|---|---|"]
    for s, row in summary.items():
        lines.append(f"| {s} | {row['repeats']} | {row['ttft_p50_ms']:.1f} | {row['itl_p50_ms']:.2f} | "
                     f"{row['tpot_p50_ms']:.2f} | {row.get('ttft_p50_ms_vs_baseline', float('nan')):.3f} | "
                     f"{row.get('itl_p50_ms_vs_baseline', float('nan')):.3f} |")
    lines += ["", "Every run, in run order:", ""]
    lines += [f"- r{r['repeat']} {r['system']}: {json.dumps(r['figures'])}" for r in runs]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", choices=FLEET_SYSTEMS, default=list(FLEET_SYSTEMS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rate-rps", type=float, default=3.0)
    p.add_argument("--duration-s", type=float, default=25.0)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = dataclasses.replace(BenchConfig(), dtype=bench_dtype("auto"))  # as the published fleet runs
    out = args.out or REPO / "ops" / "bench" / "results" / ("overhead-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    setup = model_setup(cfg, "default", out)
    ctx = setup.ctx
    specs = {s.name: s for s in system_specs(args.systems, setup.facts.num_layers)}
    trace = light_load(args.rate_rps, args.duration_s)
    requests: list[LoadRequest] = load_requests(trace, build_prompts(trace, setup.encode, setup.decode, seed=cfg.seed))
    command = shlex.join([sys.executable, "-m", "ops.bench.fleet_overhead", *(sys.argv[1:] if argv is None else argv)])
    machine = detect_capability("cpu").describe()
    runs = []
    for repeat, name in interleaved_schedule(args.systems, args.repeats):
        with started_server(specs[name], f"r{repeat}", ctx) as server:
            config = LoadGenConfig(base_url=server.base_url, model=ctx.served_name, api="chat",
                                   deadline_s=args.duration_s + ctx.drain_s)
            result = replay(requests, config)
        runs.append({"system": name, "repeat": repeat, "figures": run_figures(result.records)})
        print(f"r{repeat} {name}: {runs[-1]['figures']}", flush=True)
        summary = summarize(runs, FLEET_BASELINE)  # rewritten after every run: an interrupted run keeps its data
        (out / "results.json").write_text(json.dumps({"command": command, "machine": machine, "summary": summary,
                                                      "runs": runs}, indent=1), encoding="utf-8")
        (out / "report.md").write_text(report(summary, runs, command, machine), encoding="utf-8")
    print((out / "report.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
