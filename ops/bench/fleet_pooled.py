"""Issue 14's goal over every published fleet run at once: each fleet system against Serve's router + local
policies, paired by repeat, counted run by run and pooled, with a two-sided sign test.

    python -m ops.bench.fleet_pooled [DIR ...] [--out FILE]

DIR: run folders (each with the results.json `run_all --fleet` wrote); default: every
`ops/bench/published/fleet-*` folder that has one. Why pool: one run has 3-10 pairs, and on a shared
2-core VM the spread between repeats of one system (SLO misses 35-71 on the same arrivals) is larger
than any difference between the systems, so no single run can tell them apart; 200 pairs can.

Each pooled line also counts the first burst window on its own (before any restore between bursts) and
how often the fleet stepped slower (TPOT P50), apart for the pairs where it held fewer and more quantized
layer-seconds: on a CPU a quantized layer changes a step's speed.

Pooled pairs come from different commits, workloads and machines. The count says which way the fleet
went in most of them, not by how much. The drift line checks what pairing assumes: the two runs of a pair
are close in time, so a slower or faster VM moves both alike. It pairs each baseline run with the next
baseline run of the same folder (A/A: same system, same arrivals, later in the schedule). If later runs
miss fewer more often than not, the machine sped up during a folder's runs. The interleaved schedule
(ABBA...) runs the fleet system second in repeats 0, 2, 4, ... and first in the others, so a steady drift
favours neither side by much. With an odd number of repeats the fleet runs later once more than the
baseline, so a machine that speeds up favours the fleet.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Iterable, Sequence

from ops.bench.goals import FleetPair, fleet_pairs_line, sign_test_p
from ops.bench.systems import FLEET_BASELINE

PUBLISHED = Path(__file__).resolve().parent / "published"
UNKNOWN_CAPABILITY = "unknown"


@dataclasses.dataclass(frozen=True)
class RunPairs:
    """One folder's pairs of one fleet system against the baseline, in repeat order."""
    folder: str
    capability: str  # torch's CPU capability (AVX2, AVX512, ...) as the run recorded it
    system: str
    pairs: tuple[FleetPair, ...]
    # SLO misses in the first burst window, (baseline, compared), for the pairs whose runs both split
    # them by window: before that burst no restore has happened and no grant has moved.
    first_window: tuple[tuple[int, int], ...] = ()
    # TPOT P50 (baseline, compared) of each pair, in the order of `pairs`: how fast the replicas
    # stepped, which quantized layers change on a CPU (faster at small batches with AVX-512 INT4
    # kernels, slower prefill with AVX2's), so fewer layer-seconds can mean slower steps.
    tpot: tuple[tuple[float | None, float | None], ...] = ()


@dataclasses.dataclass(frozen=True)
class Tally:
    fewer: int = 0
    more: int = 0
    equal: int = 0

    def add(self, compared: float, base: float) -> "Tally":
        return Tally(self.fewer + (compared < base), self.more + (compared > base), self.equal + (compared == base))

    def line(self) -> str:
        return (f"fewer {self.fewer}, more {self.more}, equal {self.equal} "
                f"(p = {sign_test_p(self.fewer, self.more):.2g})")


def read_folder(folder: Path, baseline: str = FLEET_BASELINE) -> tuple[list[RunPairs], list[tuple[int, int]]]:
    """The folder's pairs per compared system, and its A/A pairs: (earlier, later) SLO misses of
    consecutive baseline runs in the order they ran."""
    data = json.loads((folder / "results.json").read_text())
    runs = data.get("runs") or []
    capability = _capability(data.get("machine"))
    by_system: dict[str, dict[int, dict]] = collections.defaultdict(dict)
    for run in runs:
        by_system[run["system"]][run["repeat"]] = run
    base = by_system.get(baseline, {})
    pairs = []
    for system, repeats in by_system.items():
        if system == baseline:
            continue
        both = sorted(base.keys() & repeats.keys())
        found = tuple(FleetPair((_misses(base[i]), _misses(repeats[i])),
                                (base[i].get("quantized_layer_s"), repeats[i].get("quantized_layer_s")))
                      for i in both)
        first = tuple((base[i]["misses_by_window"][0], repeats[i]["misses_by_window"][0]) for i in both
                      if base[i].get("misses_by_window") and repeats[i].get("misses_by_window"))
        tpot = tuple((base[i]["metrics"].get("tpot_s.p50"), repeats[i]["metrics"].get("tpot_s.p50")) for i in both)
        if found:
            pairs.append(RunPairs(folder.name, capability, system, found, first, tpot))
    ordered = [_misses(run) for run in runs if run["system"] == baseline]
    drift = list(zip(ordered[0::2], ordered[1::2]))
    return pairs, drift


def _capability(machine: dict | str | None) -> str:
    """Reports record the machine as a dict of facts; a few early ones as one line of text."""
    if isinstance(machine, dict):
        return machine.get("torch CPU capability") or UNKNOWN_CAPABILITY
    found = re.search(r"cpu capability (\w+)", machine or "")
    return found.group(1) if found else UNKNOWN_CAPABILITY


def _misses(run: dict) -> int:
    return int(run["metrics"]["slo_violations"])


def goal_met(pair: FleetPair) -> bool:
    """The issue's goal within one pair: fewer SLO misses and fewer quantized layer-seconds."""
    (base_miss, miss), (base_ls, ls) = pair.misses, pair.layer_s
    return miss < base_miss and None not in (base_ls, ls) and ls < base_ls


def pooled_lines(found: Sequence[RunPairs], drift: Sequence[tuple[int, int]]) -> list[str]:
    lines = ["| run | capability | system | pairs | SLO misses | layer-seconds fewer | both fewer |",
             "|---|---|---|---|---|---|---|"]
    for run in found:
        misses = _tally(p.misses for p in run.pairs)
        scored = [p.layer_s for p in run.pairs if None not in p.layer_s]
        lines.append(f"| {run.folder} | {run.capability} | {run.system} | {len(run.pairs)} | "
                     f"{misses.fewer} fewer / {misses.more} more / {misses.equal} equal | "
                     f"{sum(f < b for b, f in scored)} of {len(scored)} | {sum(map(goal_met, run.pairs))} |")
    lines.append("")
    groups: dict[tuple[str, str], list[RunPairs]] = collections.defaultdict(list)
    for run in found:
        groups[(run.system, "all machines")].append(run)
        groups[(run.system, run.capability)].append(run)
    for (system, machines), runs in sorted(groups.items()):
        pairs = [p for run in runs for p in run.pairs]
        first = [p for run in runs for p in run.first_window]
        lines.append(f"- {machines}: {fleet_pairs_line(pairs, system)}; both fewer in "
                     f"{sum(map(goal_met, pairs))} of {len(pairs)}; SLO misses in the first burst window "
                     f"({len(first)} pairs): {_tally(first).line()}; {_speed(runs)}")
    later = _tally(drift)
    lines.append(f"- drift (A/A: a baseline run against the next one of the same folder, {len(drift)} pairs): "
                 f"the later run missed {later.line()}")
    return lines


def _speed(runs: Sequence[RunPairs]) -> str:
    """How often the compared system stepped slower (higher TPOT P50) than the baseline: in all pairs,
    and apart in those where it held fewer and more quantized layer-seconds."""
    # (layer-seconds (baseline, compared), stepped slower) per pair; a run that served no second
    # token of any request has no TPOT and is left out.
    rows = [(pair.layer_s, tpot > base_tpot) for run in runs
            for pair, (base_tpot, tpot) in zip(run.pairs, run.tpot) if None not in (base_tpot, tpot)]

    def slower_where(keep) -> str:
        kept = [slow for layer_s, slow in rows if None not in layer_s and keep(*layer_s)]
        return f"{sum(kept)} of the {len(kept)}"

    return (f"TPOT P50 higher in {sum(slow for _, slow in rows)} of {len(rows)} pairs "
            f"({slower_where(lambda base, ls: ls < base)} with fewer layer-seconds, "
            f"{slower_where(lambda base, ls: ls > base)} with more)")


def _tally(pairs: Iterable[tuple[float, float]]) -> Tally:
    tally = Tally()
    for base, compared in pairs:
        tally = tally.add(compared, base)
    return tally


def published_folders(root: Path = PUBLISHED) -> list[Path]:
    """The published `run_all --fleet` runs (fleet_overhead's folders hold another benchmark)."""
    return sorted(p for p in root.glob("fleet-*")
                  if not p.name.startswith("fleet-overhead-") and (p / "results.json").is_file())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="*", type=Path, help="run folders (default: the published fleet runs)")
    parser.add_argument("--out", type=Path, help="also write the lines to this markdown file")
    args = parser.parse_args(argv)
    folders = args.dirs or published_folders()
    missing = [str(f) for f in folders if not (f / "results.json").is_file()]
    if missing:
        parser.error(f"no results.json in {', '.join(missing)}: pass folders that run_all --fleet wrote")
    found, drift = [], []
    for folder in folders:
        pairs, aa = read_folder(folder)
        found += pairs
        drift += aa
    if not found:
        parser.error("no fleet system was paired with the baseline in these folders: were they run with --fleet?")
    lines = pooled_lines(found, drift)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
