"""Benchmark result records and the report: report.md (tables, settings, machine), results.json (every
number), PNG plots (per-system timeline, TTFT CDF, quality vs P95 TTFT).

Server timelines are `ServerSample`s whose values use these names when the server reports them:
  kv_usage (0..1), kv_capacity_blocks, quantized_layers, preemptions_total (counter).
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
from pathlib import Path
from typing import Mapping, Sequence

from deployments import directive_wait
from deployments.router_decisions import GENERATE_DECISIONS
from ops.bench import BenchmarkInputError
from ops.bench.loadgen import RequestRecord, ServerSample
from ops.bench.metrics import (RESTORE_UNDONE_WITHIN_S, LayerMoves, RunMetrics, Spread, aggregate, compute_run_metrics,
                               misses_by_window, spread)
from ops.bench.process_cpu import CPU_ROLES
from ops.bench.reaction import ReactionSummary

from ops.quality.rouge import agreement, quality_loss_reduction


@dataclasses.dataclass(frozen=True)
class QualityNumbers:
    rouge_l_vs_full: float | None  # mean ROUGE-L F1 vs the full-precision run's response, same request
    rouge_l_vs_reference: float | None  # mean ROUGE-L F1 vs the dataset's reference answer
    n_scored: int


@dataclasses.dataclass(frozen=True)
class SystemRun:
    system: str  # e.g. "morphserve-static-fp", "vllm-cpu"
    repeat: int
    records: tuple[RequestRecord, ...]
    timeline: tuple[ServerSample, ...] = ()
    quality: QualityNumbers | None = None
    reaction: ReactionSummary | None = None  # ops/bench/reaction.py
    tf_agreement: float | None = None  # teacher-forced top-1 agreement with full precision (served_quality.py)
    weighted_ppl: float | None = None  # WikiText-2 perplexity of its configurations, token-weighted
    quantized_layer_s: float | None = None  # integral of quantized layers over the run (sampled)
    engine_blocked_s: tuple[float, ...] = ()  # reaction.engine_blocked_waits: the engine's own head waits
    generate_calls: tuple[int, ...] = ()  # generate calls each engine replica received (a fleet's load spread)
    # Report rounds (every replica's, ~4 a second) at which requests waited, by cause: "memory" (the head
    # did not fit in KV: morphing relieves it) or "compute" (it would fit; the step's token budget holds it)
    waiting_rounds: Mapping[str, int] = dataclasses.field(default_factory=dict)
    cpu_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)  # role -> CPU s during the replay (process_cpu.py)
    layer_moves: LayerMoves | None = None  # a fleet's morphs and restores during the replay (metrics.layer_moves)
    # Every replica's morph-loop waits for a directive during the replay, merged (deployments/directive_wait.py)
    directive_wait: Mapping | None = None
    # The pressure-aware router's decisions during the replay, by kind ({}: Serve's router; None: not read)
    router_decisions: Mapping[str, int] | None = None

    @property
    def busiest_share(self) -> float | None:
        """The busiest replica's share of the generate calls (0.5 = even over 2 replicas); None for one."""
        total = sum(self.generate_calls)
        return max(self.generate_calls) / total if len(self.generate_calls) > 1 and total else None

    @property
    def memory_wait_share(self) -> float | None:
        """Of the rounds at which requests waited for memory or compute, the share for memory: what the
        morph (and a fleet's grants) can act on; None when nothing waited or the engines do not say."""
        memory, compute = self.waiting_rounds.get("memory", 0), self.waiting_rounds.get("compute", 0)
        return memory / (memory + compute) if memory + compute else None


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    title: str
    model: str
    memory_budget: str  # as the user wrote it, e.g. "1.2 GiB"
    workload: str  # Workload.describe()
    slo_ttft_s: float
    full_precision_system: str  # reference for "ROUGE-L vs full" and quality loss
    static_int4_system: str | None  # baseline of "quality loss reduction"
    commands: tuple[str, ...] = ()  # how it was run
    notes: tuple[str, ...] = ()
    calibration: str = ""  # Calibration.describe()
    crosscheck: tuple[str, ...] = ()  # crosscheck.describe()
    goals: tuple[str, ...] = ()  # goals.goal_lines()
    window_starts_s: tuple[float, ...] = ()  # replay time each burst window starts (Workload.window_starts_s)


@dataclasses.dataclass(frozen=True)
class BenchResults:
    settings: BenchSettings
    runs: tuple[SystemRun, ...]

    def systems(self) -> list[str]:
        return list(dict.fromkeys(r.system for r in self.runs))  # first-appearance order

    def runs_of(self, system: str) -> list[SystemRun]:
        return sorted((r for r in self.runs if r.system == system), key=lambda r: r.repeat)


@dataclasses.dataclass(frozen=True)
class ReportPaths:
    report_md: Path
    results_json: Path
    plots: tuple[Path, ...]


def score_quality(runs: Sequence[SystemRun], full_precision_system: str,
                  references: Mapping[str, str]) -> tuple[SystemRun, ...]:
    """Attach QualityNumbers to every run: agreement with the full-precision run of the same repeat
    (or its first repeat) and with the reference answers (request id -> text)."""
    full = {r.repeat: r for r in runs if r.system == full_precision_system}
    if not full:
        raise BenchmarkInputError(f"no run of the full-precision system {full_precision_system!r} to compare with")
    out = []
    for run in runs:
        base = full.get(run.repeat, full[min(full)])
        mine = {r.request_id: r.output_text for r in run.records if r.ok}
        vs_full = agreement(mine, {r.request_id: r.output_text for r in base.records if r.ok})
        ids = {r.request_id for r in run.records}
        vs_ref = agreement(mine, {k: v for k, v in references.items() if k in ids})
        out.append(dataclasses.replace(run, quality=QualityNumbers(vs_full.mean, vs_ref.mean, vs_full.n_scored)))
    return tuple(out)


def summarize(results: BenchResults) -> dict[str, dict[str, Spread]]:
    """Per system: every RunMetrics scalar and the quality numbers as median [min, max] over repeats,
    plus quality loss and its reduction vs static INT4 (computed on the medians)."""
    s = results.settings
    table: dict[str, dict[str, Spread]] = {}
    for system in results.systems():
        runs = results.runs_of(system)
        row = aggregate([run_metrics(r, s.slo_ttft_s) for r in runs])
        row["rouge_l_vs_full"] = spread(r.quality.rouge_l_vs_full for r in runs if r.quality)
        row["rouge_l_vs_reference"] = spread(r.quality.rouge_l_vs_reference for r in runs if r.quality)
        row["tf_agreement"] = spread(r.tf_agreement for r in runs)
        row["weighted_ppl"] = spread(r.weighted_ppl for r in runs)
        row["quantized_layer_s"] = spread(r.quantized_layer_s for r in runs)
        row["stall_episodes"] = spread(len(r.reaction.episodes) if r.reaction else None for r in runs)
        row["reaction_median_s"] = spread(r.reaction.median_s if r.reaction else None for r in runs)
        row["reaction_max_s"] = spread(r.reaction.max_s if r.reaction else None for r in runs)
        row["engine_blocked_median_s"] = spread(_median_or_none(r.engine_blocked_s) for r in runs)
        row["busiest_replica_share"] = spread(r.busiest_share for r in runs)
        row["waiting_rounds"] = spread(sum(r.waiting_rounds.values()) if r.waiting_rounds else None for r in runs)
        row["memory_wait_share"] = spread(r.memory_wait_share for r in runs)
        waits = [directive_wait.summary(r.directive_wait) for r in runs]
        for key in ("mean_s", "p95_s", "over_100ms_share"):
            row[f"directive_wait.{key}"] = spread(w[key] if w else None for w in waits)
        for key in ("morphs", "restores", "restores_undone"):
            row[f"layer_moves.{key}"] = spread(getattr(r.layer_moves, key) if r.layer_moves else None for r in runs)
        for decision in GENERATE_DECISIONS:  # None for a system without the pressure router
            row[f"router.{decision}"] = spread(r.router_decisions.get(decision, 0) if r.router_decisions else None
                                               for r in runs)
        by_window = [misses_by_window(r.records, s.slo_ttft_s, s.window_starts_s) for r in runs]
        for k in range(len(s.window_starts_s)):
            row[f"slo_violations.w{k + 1}"] = spread(misses[k] for misses in by_window)
        for role in CPU_ROLES:
            row[f"cpu_s.{role}"] = spread(r.cpu_seconds.get(role) for r in runs)
        table[system] = row
    fp_ref = _median(table.get(s.full_precision_system, {}), "rouge_l_vs_reference")
    for row in table.values():
        vs_full, vs_ref = _median(row, "rouge_l_vs_full"), _median(row, "rouge_l_vs_reference")
        row["loss_vs_full"] = spread([None if vs_full is None else 1 - vs_full])
        row["loss_vs_reference"] = spread([None if vs_ref is None or fp_ref is None else fp_ref - vs_ref])
    fp_tf = _median(table.get(s.full_precision_system, {}), "tf_agreement")
    for row in table.values():
        tf = _median(row, "tf_agreement")
        row["loss_vs_full_tf"] = spread([None if tf is None or fp_tf is None else fp_tf - tf])
    int4 = table.get(s.static_int4_system or "", {})
    for row in table.values():
        for kind in ("full", "reference", "full_tf"):
            reduction = quality_loss_reduction(_median(row, f"loss_vs_{kind}"), _median(int4, f"loss_vs_{kind}"))
            row[f"loss_reduction_vs_int4_{kind}"] = spread([reduction])
    return table


def _median_or_none(values: Sequence[float]) -> float | None:
    import statistics

    return statistics.median(values) if values else None


def _median(row: Mapping[str, Spread], key: str) -> float | None:
    return row[key].median if key in row else None


def run_metrics(run: SystemRun, slo_ttft_s: float) -> RunMetrics:
    return compute_run_metrics(run.records, slo_ttft_s, run.timeline)


def build_report(results: BenchResults, out_dir: str | Path) -> ReportPaths:
    if not results.runs:
        raise BenchmarkInputError("no runs to report; run at least one system")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = summarize(results)
    from ops.bench.report_plots import plots as draw_plots

    plots = draw_plots(results, table, out)
    md = out / "report.md"
    md.write_text(_markdown(results, table, [p.name for p in plots]), encoding="utf-8")
    js = out / "results.json"
    js.write_text(json.dumps(_json(results, table), indent=1), encoding="utf-8")
    return ReportPaths(report_md=md, results_json=js, plots=tuple(plots))


# --- report.md -------------------------------------------------------------------------------------

_TABLES = (
    ("Latency (seconds)", (("TTFT P50", "ttft_s.p50"), ("TTFT P95", "ttft_s.p95"), ("TTFT P99", "ttft_s.p99"),
                           ("TPOT P50", "tpot_s.p50"), ("TPOT P95", "tpot_s.p95"), ("TPOT P99", "tpot_s.p99"))),
    ("Latency (seconds), continued", (("ITL P50", "itl_s.p50"), ("ITL P95", "itl_s.p95"), ("ITL P99", "itl_s.p99"),
                                      ("E2E P50", "e2e_s.p50"), ("E2E P95", "e2e_s.p95"), ("E2E P99", "e2e_s.p99"))),
    ("SLO, goodput, throughput", (("SLO violation rate", "slo_violation_rate"), ("goodput (req/s)", "goodput_rps"),
                                  ("throughput (tok/s)", "throughput_tok_s"), ("queue P95 (s)", "queue_s.p95"),
                                  ("preemptions", "preemptions"), ("ok / sent", "num_ok"),
                                  ("client send lag P99 (s)", "send_lag_p99_s"),
                                  ("prefix cache hit share", "prefix_hit_share"))),
    ("Reaction to bursts (from the first arrival that did not fit in KV to the capacity that admits it)",
     (("episodes", "stall_episodes"), ("reaction median (s)", "reaction_median_s"), ("reaction max (s)", "reaction_max_s"),
      ("engine-reported head wait median (s)", "engine_blocked_median_s"),
      ("quantized layer-seconds", "quantized_layer_s"),
      ("busiest replica's share of requests", "busiest_replica_share"),
      ("report rounds with a queue", "waiting_rounds"), ("of those, waiting for memory", "memory_wait_share"),
      ("a round's wait for its directive, mean (s)", "directive_wait.mean_s"),
      ("... P95 (s, bucket bound)", "directive_wait.p95_s"),
      ("... share of rounds over 0.1 s", "directive_wait.over_100ms_share"))),
    ("Layer moves of a fleet (each replica's quantized-layer changes during the replay, at report granularity)",
     (("morphs", "layer_moves.morphs"), ("restores", "layer_moves.restores"),
      (f"restores undone within {RESTORE_UNDONE_WITHIN_S:g} s (in a lull of a burst)", "layer_moves.restores_undone"))),
    ("Decisions of the pressure-aware router during the replay (deployments/router.py; stale and no_queue_len "
     "fell back to Serve's power of two choices)", tuple((d, f"router.{d}") for d in GENERATE_DECISIONS)),
    ("CPU seconds during the replay, by process (every second outside the engines is taken from them on a small machine)",
     tuple((role, f"cpu_s.{role}") for role in CPU_ROLES)),
    ("Quality of what was served", (("teacher-forced top-1 agreement with full precision", "tf_agreement"),
                                    ("quality loss reduction vs static INT4 (teacher-forced)", "loss_reduction_vs_int4_full_tf"),
                                    ("WikiText-2 perplexity, token-weighted over configurations", "weighted_ppl"))),
    ("Quality, secondary (ROUGE-L F1)", (("vs full precision", "rouge_l_vs_full"), ("vs reference answer", "rouge_l_vs_reference"),
                              ("loss reduction vs static INT4 (vs full)", "loss_reduction_vs_int4_full"),
                              ("loss reduction vs static INT4 (vs reference)", "loss_reduction_vs_int4_reference"))),
)


def _markdown(results: BenchResults, table: dict[str, dict[str, Spread]], plots: list[str]) -> str:
    s = results.settings
    repeats = {name: len(results.runs_of(name)) for name in table}
    lines = [f"# {s.title}", "", "Every cell: median over repeats, [min–max] when they differ.", "",
             "## Settings", "", f"- model: {s.model}", f"- memory budget: {s.memory_budget}",
             f"- TTFT SLO: {s.slo_ttft_s:g} s (failed requests count as violations)",
             f"- workload: {s.workload}", "- repeats: " + ", ".join(f"{k} x{v}" for k, v in repeats.items()),
             f"- quality reference: {s.full_precision_system}; loss-reduction baseline: {s.static_int4_system}",
             "- quality loss: teacher-forced = agreement(static FP) - agreement(system); ROUGE-L vs full = 1 - "
             "ROUGE-L(system, full); vs reference = ROUGE-L(full, ref) - ROUGE-L(system, ref); reduction = 1 - "
             "loss(system) / loss(static INT4)"]
    if s.calibration:
        lines.append(f"- load calibration: {s.calibration}")
    lines += [f"- note: {n}" for n in s.notes]
    lines += ["", "## Goals (issue 10; with --fleet, issue 14)", ""] + ([f"- {g}" for g in s.goals] or ["- (not checked)"])
    lines += ["", "## Cross-check: our load generator vs `vllm bench serve`", ""] + (
        [f"- {c}" for c in s.crosscheck] or ["- (not run)"])
    for title, columns in _TABLES:
        lines += ["", f"## {title}", "", "| system | " + " | ".join(c for c, _ in columns) + " |",
                  "|---" * (len(columns) + 1) + "|"]
        for system, row in table.items():
            cells = [_cell(row, key, row["num_requests"]) for _, key in columns]
            lines.append(f"| {system} | " + " | ".join(cells) + " |")
    lines += _window_table(s.window_starts_s, table)
    lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plots]
    lines += ["", "## How it was run", ""] + ([f"    {c}" for c in s.commands] or ["    (not recorded)"])
    lines += ["", "## Machine", ""] + [f"- {k}: {v}" for k, v in machine_facts().items()]
    return "\n".join(lines) + "\n"


def _window_table(starts: Sequence[float], table: dict[str, dict[str, Spread]]) -> list[str]:
    """SLO misses by the burst window the request arrived in: where in the replay a system misses (the
    fleet's levers act after a burst's start, so a miss in the first burst is beyond them)."""
    if len(starts) < 2:
        return []
    heads = [f"window {k + 1} (from {t:.1f} s)" for k, t in enumerate(starts)]
    lines = ["", "## SLO misses by burst window (by scheduled arrival)", "", "| system | " + " | ".join(heads) + " |",
             "|---" * (len(heads) + 1) + "|"]
    for system, row in table.items():
        lines.append(f"| {system} | " + " | ".join(row[f"slo_violations.w{k + 1}"].format(digits=0)
                                                  for k in range(len(starts))) + " |")
    return lines


def _cell(row: dict[str, Spread], key: str, total: Spread) -> str:
    if key == "num_ok":
        return f"{row[key].format(digits=0)} / {total.format(digits=0)}"
    counts = key in ("preemptions", "waiting_rounds") or key.startswith(("layer_moves.", "router."))
    return row[key].format(digits=0 if counts else 3)


_FLAGS = re.compile(r"^(avx2|avx512\w*|amx\w*|fma|f16c)$")


def machine_facts() -> dict[str, str]:
    facts = {"platform": platform.platform(), "python": platform.python_version(),
             "logical CPUs": str(os.cpu_count())}
    try:
        import torch

        facts["torch CPU capability"] = str(torch.backends.cpu.get_cpu_capability())
    except (ImportError, AttributeError):
        pass
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
        facts["CPU"] = model.group(1).strip() if model else "unknown"
        flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
        if flags:
            facts["CPU flags (vector/matrix)"] = " ".join(sorted(f for f in flags.group(1).split() if _FLAGS.match(f)))
        meminfo = Path("/proc/meminfo").read_text()
        for key, label in (("MemTotal", "memory total"), ("MemAvailable", "memory available at report time")):
            kb = re.search(rf"^{key}:\s*(\d+) kB", meminfo, re.M)
            if kb:
                facts[label] = f"{int(kb.group(1)) / 2**20:.1f} GiB"
    except OSError:  # not Linux: platform facts only
        pass
    return facts


# --- results.json ----------------------------------------------------------------------------------

def _json(results: BenchResults, table: dict[str, dict[str, Spread]]) -> dict:
    s = results.settings
    return {
        "settings": dataclasses.asdict(s), "machine": machine_facts(),
        "summary": {system: {k: dataclasses.asdict(v) for k, v in row.items()} for system, row in table.items()},
        "runs": [{"system": r.system, "repeat": r.repeat,
                  "metrics": run_metrics(r, s.slo_ttft_s).flat(),
                  "quality": dataclasses.asdict(r.quality) if r.quality else None,
                  "tf_agreement": r.tf_agreement, "weighted_ppl": r.weighted_ppl,
                  "quantized_layer_s": r.quantized_layer_s, "generate_calls": list(r.generate_calls),
                  "waiting_rounds": dict(r.waiting_rounds),
                  "misses_by_window": list(misses_by_window(r.records, s.slo_ttft_s, s.window_starts_s)),
                  "cpu_seconds": dict(r.cpu_seconds),
                  "layer_moves": r.layer_moves.as_dict() if r.layer_moves else None,
                  "directive_wait": dict(r.directive_wait) if r.directive_wait else None,
                  "router_decisions": None if r.router_decisions is None else dict(r.router_decisions),
                  "reaction": dataclasses.asdict(r.reaction) if r.reaction else None,
                  "timeline": [{"t_s": x.t_s, **x.values, **x.labels} for x in r.timeline],
                  "requests": [dataclasses.asdict(x) for x in r.records]} for r in results.runs],
    }
