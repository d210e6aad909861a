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

from ops.bench import BenchmarkInputError
from ops.bench.loadgen import RequestRecord, ServerSample
from ops.bench.metrics import RunMetrics, Spread, aggregate, compute_run_metrics, request_ttft, spread
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
        table[system] = row
    fp_ref = _median(table.get(s.full_precision_system, {}), "rouge_l_vs_reference")
    for row in table.values():
        vs_full, vs_ref = _median(row, "rouge_l_vs_full"), _median(row, "rouge_l_vs_reference")
        row["loss_vs_full"] = spread([None if vs_full is None else 1 - vs_full])
        row["loss_vs_reference"] = spread([None if vs_ref is None or fp_ref is None else fp_ref - vs_ref])
    int4 = table.get(s.static_int4_system or "", {})
    for row in table.values():
        for kind in ("full", "reference"):
            reduction = quality_loss_reduction(_median(row, f"loss_vs_{kind}"), _median(int4, f"loss_vs_{kind}"))
            row[f"loss_reduction_vs_int4_{kind}"] = spread([reduction])
    return table


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
    plots = _plots(results, table, out)
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
                                  ("client send lag P99 (s)", "send_lag_p99_s"))),
    ("Quality (ROUGE-L F1)", (("vs full precision", "rouge_l_vs_full"), ("vs reference answer", "rouge_l_vs_reference"),
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
             "- quality loss: vs full = 1 - ROUGE-L(system, full); vs reference = ROUGE-L(full, ref) - "
             "ROUGE-L(system, ref); reduction = 1 - loss(system) / loss(static INT4)"]
    lines += [f"- note: {n}" for n in s.notes]
    for title, columns in _TABLES:
        lines += ["", f"## {title}", "", "| system | " + " | ".join(c for c, _ in columns) + " |",
                  "|---" * (len(columns) + 1) + "|"]
        for system, row in table.items():
            cells = [_cell(row, key, row["num_requests"]) for _, key in columns]
            lines.append(f"| {system} | " + " | ".join(cells) + " |")
    lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plots]
    lines += ["", "## How it was run", ""] + ([f"    {c}" for c in s.commands] or ["    (not recorded)"])
    lines += ["", "## Machine", ""] + [f"- {k}: {v}" for k, v in machine_facts().items()]
    return "\n".join(lines) + "\n"


def _cell(row: dict[str, Spread], key: str, total: Spread) -> str:
    if key == "num_ok":
        return f"{row[key].format(digits=0)} / {total.format(digits=0)}"
    return row[key].format(digits=0 if key == "preemptions" else 3)


def machine_facts() -> dict[str, str]:
    facts = {"platform": platform.platform(), "python": platform.python_version(),
             "logical CPUs": str(os.cpu_count())}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
        facts["CPU"] = model.group(1).strip() if model else "unknown"
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
                  "timeline": [{"t_s": x.t_s, **x.values} for x in r.timeline],
                  "requests": [dataclasses.asdict(x) for x in r.records]} for r in results.runs],
    }


# --- plots (matplotlib's Figure API: no pyplot state, no display needed) ---------------------------

def _plots(results: BenchResults, table: dict[str, dict[str, Spread]], out: Path) -> list[Path]:
    slo = results.settings.slo_ttft_s
    paths = [_timeline(system, results.runs_of(system)[0], slo, out / f"timeline_{_slug(system)}.png")
             for system in results.systems()]
    paths.append(_ttft_cdf(results, slo, out / "ttft_cdf.png"))
    paths.append(_quality_vs_ttft(table, out / "quality_vs_p95_ttft.png"))
    return paths


def _timeline(system: str, run: SystemRun, slo: float, path: Path) -> Path:
    """Arrival rate, KV usage and capacity, quantized layers, and TTFT per request on one time axis
    (the run's first repeat)."""
    from matplotlib.figure import Figure
    from ops.bench.workload import arrival_counts

    fig = Figure(figsize=(10, 9), layout="constrained")
    ax = fig.subplots(4, 1, sharex=True)
    arrivals = [r.scheduled_s for r in run.records]
    bin_s = min(1.0, max(arrivals, default=0.0) / 30) or 1.0  # ~30+ bins even for compressed replays
    counts = arrival_counts(arrivals, bin_s=bin_s)
    ax[0].stairs(counts / bin_s, [i * bin_s for i in range(len(counts) + 1)])
    ax[0].set_ylabel(f"arrivals / s ({bin_s:.2g} s bins)")
    _series(ax[1], run.timeline, "kv_usage", "KV usage", scale=100.0, color="tab:blue")
    ax[1].set_ylabel("KV usage (%)")
    _series(ax[1].twinx(), run.timeline, "kv_capacity_blocks", "KV capacity (blocks)", color="tab:orange")
    _series(ax[2], run.timeline, "quantized_layers", "quantized layers", drawstyle="steps-post")
    ax[2].set_ylabel("quantized layers")
    ok = [(r.scheduled_s, request_ttft(r)) for r in run.records if r.ok]
    failed = [r.scheduled_s for r in run.records if not r.ok]
    ax[3].scatter([t for t, _ in ok], [v for _, v in ok], s=6, label="TTFT")
    top = max([v for _, v in ok] + [slo]) * 1.05
    ax[3].scatter(failed, [top] * len(failed), marker="x", color="red", s=12, label="failed")
    ax[3].axhline(slo, color="gray", linestyle="--", label=f"SLO {slo:g} s")
    ax[3].set_ylabel("TTFT (s)")
    ax[3].set_xlabel("time since start (s)")
    ax[3].legend(loc="upper left", fontsize="small")
    fig.suptitle(f"{system} (repeat {run.repeat})")
    fig.savefig(path, dpi=90)
    return path


def _series(ax, samples: Sequence[ServerSample], key: str, label: str, scale: float = 1.0, **style) -> None:
    points = [(s.t_s, s.values[key] * scale) for s in samples if key in s.values]
    if not points:
        ax.text(0.5, 0.5, f"{label}: not reported by this server", transform=ax.transAxes, ha="center")
        return
    ax.plot([t for t, _ in points], [v for _, v in points], label=label, **style)
    ax.set_ylabel(label)


def _ttft_cdf(results: BenchResults, slo: float, path: Path) -> Path:
    """All repeats pooled; failed requests count as never served, so a curve tops out at the ok share."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for system in results.systems():
        records = [r for run in results.runs_of(system) for r in run.records]
        ttfts = sorted(request_ttft(r) for r in records if r.ok)
        if not ttfts:
            continue
        ax.step(ttfts, [(i + 1) / len(records) for i in range(len(ttfts))], where="post", label=system)
    ax.axvline(slo, color="gray", linestyle="--", label=f"SLO {slo:g} s")
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF", ylim=(0, 1.02))
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=90)
    return path


def _quality_vs_ttft(table: dict[str, dict[str, Spread]], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.5), layout="constrained")
    ax = fig.subplots()
    for system, row in table.items():
        x, y = row["ttft_s.p95"], row["rouge_l_vs_full"]
        if x.median is None or y.median is None:
            continue
        ax.errorbar([x.median], [y.median], xerr=[[x.median - x.min], [x.max - x.median]],
                    yerr=[[y.median - y.min], [y.max - y.median]], fmt="o", capsize=3, label=system)
        ax.annotate(system, (x.median, y.median), textcoords="offset points", xytext=(5, 5), fontsize="small")
    ax.set(xlabel="P95 TTFT (s), lower is better", ylabel="ROUGE-L vs full precision, higher is better",
           title="Quality vs latency (median, min-max bars)")
    fig.savefig(path, dpi=90)
    return path


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
