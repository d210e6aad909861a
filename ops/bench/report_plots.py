"""The report's PNG plots (matplotlib's Figure API: no pyplot state, no display needed): per system a
timeline (arrivals, KV usage and capacity with the reaction episodes shaded, quantized layers, TTFT),
the TTFT CDF over all repeats, and quality (teacher-forced agreement) vs P95 TTFT."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from ops.bench.loadgen import ServerSample
from ops.bench.metrics import Spread, request_ttft



def plots(results, table: dict[str, dict[str, Spread]], out: Path) -> list[Path]:
    slo = results.settings.slo_ttft_s
    paths = [_timeline(system, results.runs_of(system)[0], slo, out / f"timeline_{_slug(system)}.png")
             for system in results.systems()]
    paths.append(_ttft_cdf(results, slo, out / "ttft_cdf.png"))
    paths.append(_quality_vs_ttft(table, out / "quality_vs_p95_ttft.png"))
    return paths


def _timeline(system: str, run, slo: float, path: Path) -> Path:
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
    for e in (run.reaction.episodes if run.reaction else ()):  # from a request that did not fit to room for it
        for a in (ax[1], ax[3]):
            a.axvspan(e.first_arrival_s, e.reacted_s, color="tab:red", alpha=0.15, lw=0)
        ax[1].annotate(f"{e.reaction_s * 1e3:.0f} ms", (e.first_arrival_s, 95), fontsize="x-small", color="tab:red")
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
    title = f"{system} (repeat {run.repeat})"
    if run.reaction and run.reaction.episodes:
        title += (f"; reaction median {run.reaction.median_s * 1e3:.0f} ms, max {run.reaction.max_s * 1e3:.0f} ms "
                  f"over {len(run.reaction.episodes)} episodes (shaded)")
    fig.suptitle(title)
    fig.savefig(path, dpi=90)
    return path


def _series(ax, samples: Sequence[ServerSample], key: str, label: str, scale: float = 1.0, **style) -> None:
    points = [(s.t_s, s.values[key] * scale) for s in samples if key in s.values]
    if not points:
        ax.text(0.5, 0.5, f"{label}: not reported by this server", transform=ax.transAxes, ha="center")
        return
    ax.plot([t for t, _ in points], [v for _, v in points], label=label, **style)
    ax.set_ylabel(label)


def _ttft_cdf(results, slo: float, path: Path) -> Path:
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
        x, y = row["ttft_s.p95"], row["tf_agreement"]
        if y.median is None:
            y = row["rouge_l_vs_full"]
        if x.median is None or y.median is None:
            continue
        ax.errorbar([x.median], [y.median], xerr=[[x.median - x.min], [x.max - x.median]],
                    yerr=[[y.median - y.min], [y.max - y.median]], fmt="o", capsize=3, label=system)
        ax.annotate(system, (x.median, y.median), textcoords="offset points", xytext=(5, 5), fontsize="small")
    ax.set(xlabel="P95 TTFT (s), lower is better", ylabel="teacher-forced agreement with full precision (ROUGE-L where absent)",
           title="Quality vs latency (median, min-max bars)")
    fig.savefig(path, dpi=90)
    return path


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
