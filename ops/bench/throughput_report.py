"""Numbers of the offline throughput benchmark: per-run records -> medians -> a markdown table, the
ours/peer ratios, and the facts of the machine it ran on."""
from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from ops.bench.throughput_workload import Scenario

BACKEND_NAMES = {"ours": "MorphServe (ours)", "hf": "HF generate", "vllm": "vLLM CPU"}


@dataclasses.dataclass(frozen=True)
class RunRecord:
    backend: str
    scenario: str
    repeat: int
    elapsed_s: float
    cpu_s: float  # user + system CPU seconds the backend process spent on the run
    prompt_tokens: int
    generated_tokens: int
    vmhwm_kib: int

    @property
    def gen_tok_s(self) -> float:
        return self.generated_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.generated_tokens) / self.elapsed_s

    @property
    def gen_tok_per_cpu_s(self) -> float:
        return self.generated_tokens / self.cpu_s if self.cpu_s > 0 else float("nan")


@dataclasses.dataclass(frozen=True)
class Summary:
    backend: str
    scenario: str
    repeats: int
    median_s: float
    gen_tok_s: float  # median over repeats
    gen_tok_s_min: float
    gen_tok_s_max: float
    total_tok_s: float  # median, prompt + generated tokens
    gen_tok_per_cpu_s: float  # median generated tokens per CPU second: robust to other load on the machine
    peak_rss_mib: float  # the backend process's peak over its whole life up to its last run


def summarize(records: Sequence[RunRecord]) -> list[Summary]:
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for r in records:
        groups.setdefault((r.backend, r.scenario), []).append(r)
    out = []
    for (backend, scenario), runs in groups.items():
        gen = [r.gen_tok_s for r in runs]
        out.append(Summary(backend, scenario, len(runs), statistics.median(r.elapsed_s for r in runs),
                           statistics.median(gen), min(gen), max(gen),
                           statistics.median(r.total_tok_s for r in runs),
                           statistics.median(r.gen_tok_per_cpu_s for r in runs),
                           max(r.vmhwm_kib for r in runs) / 1024))
    return out


def ratios(summaries: Sequence[Summary]) -> dict[str, dict[str, float]]:
    """{"a": {"gen_ours/vllm": 0.9, "total_ours/vllm": ..., "gen_ours/hf": ...}, ...} for the peers that ran."""
    by = {(s.backend, s.scenario): s for s in summaries}
    out: dict[str, dict[str, float]] = {}
    for (backend, scenario), ours in by.items():
        if backend != "ours":
            continue
        for peer in ("vllm", "hf"):
            other = by.get((peer, scenario))
            if other is not None:
                out.setdefault(scenario, {})[f"gen_ours/{peer}"] = ours.gen_tok_s / other.gen_tok_s
                out.setdefault(scenario, {})[f"total_ours/{peer}"] = ours.total_tok_s / other.total_tok_s
                out.setdefault(scenario, {})[f"per_cpu_s_ours/{peer}"] = ours.gen_tok_per_cpu_s / other.gen_tok_per_cpu_s
    return out


def markdown_table(summaries: Sequence[Summary], scenarios: Sequence[Scenario]) -> str:
    order = {name: i for i, name in enumerate(BACKEND_NAMES)}
    rows = ["| scenario | backend | generated tok/s (median [min, max]) | total tok/s incl. prompt | "
            "generated tok per CPU-s | median s | repeats | peak RSS MiB |", "|---|---|---|---|---|---|---|---|"]
    titles = {s.name: f"({s.name}) {s.title}" for s in scenarios}
    for s in sorted(summaries, key=lambda s: (s.scenario, order.get(s.backend, 99))):
        rows.append(f"| {titles.get(s.scenario, s.scenario)} | {BACKEND_NAMES.get(s.backend, s.backend)} | "
                    f"{s.gen_tok_s:.1f} [{s.gen_tok_s_min:.1f}, {s.gen_tok_s_max:.1f}] | {s.total_tok_s:.1f} | "
                    f"{s.gen_tok_per_cpu_s:.1f} | "
                    f"{s.median_s:.2f} | {s.repeats} | {s.peak_rss_mib:.0f} |")
    return "\n".join(rows)


def ratio_lines(r: dict[str, dict[str, float]]) -> str:
    lines = []
    for scenario in sorted(r):
        parts = [f"{k} = {v:.2f}" for k, v in sorted(r[scenario].items())]
        lines.append(f"- ({scenario}) " + ", ".join(parts))
    return "\n".join(lines) if lines else "- (no peer ran: no ratios)"


def machine_facts() -> dict:
    """What a reader needs to judge the numbers: CPU, cores we may use, load, memory, versions."""
    facts = {"cpu": _cpu_model(), "logical_cpus": os.cpu_count(),
             "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
             "loadavg_1_5_15": [round(x, 1) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
             "mem_total_gib": _meminfo_gib("MemTotal"), "mem_available_gib": _meminfo_gib("MemAvailable"),
             "python": sys.version.split()[0], "platform": platform.platform(), "git_commit": _git_commit()}
    try:
        import torch

        from engine.capability import detect_capability

        facts["torch"] = torch.__version__
        facts["capability"] = detect_capability("cpu").as_dict()
    except ImportError:
        pass
    return facts


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _meminfo_gib(field: str) -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith(field + ":"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None
