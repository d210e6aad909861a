"""Latency and SLO numbers of one run from its request records, and the aggregation of repeats.

Definitions (all times from the request's actual send, so a lagging client cannot hide server delay
in its own lag; the lag itself is reported as send_lag_p99_s):
  TTFT = first_token - sent                  e2e = end - sent
  TPOT = (e2e - TTFT) / (output_tokens - 1)  (requests with >= 2 tokens)
  ITL  = every gap between consecutive output chunks, pooled over requests
  SLO violation: TTFT > slo_ttft_s, or the request failed (error, non-200, no token, never sent)
  goodput = requests meeting the SLO / duration;  throughput = output tokens of ok requests / duration
  duration = last end - first scheduled send
Percentiles interpolate linearly between closest ranks (numpy's default "linear" method).
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from typing import Iterable, Mapping, Sequence

from ops.bench import BenchmarkInputError
from ops.bench.loadgen import RequestRecord, ServerSample


def percentile(values: Iterable[float], p: float) -> float | None:
    """The p-th percentile (0..100) with linear interpolation; None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0 <= p <= 100:
        raise BenchmarkInputError(f"percentile {p}: use a value in [0, 100]")
    rank = p / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclasses.dataclass(frozen=True)
class Distribution:
    count: int
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> "Distribution":
        return cls(count=len(values), mean=statistics.fmean(values) if values else None,
                   p50=percentile(values, 50), p95=percentile(values, 95), p99=percentile(values, 99))


@dataclasses.dataclass(frozen=True)
class RunMetrics:
    num_requests: int
    num_ok: int
    duration_s: float
    ttft_s: Distribution
    tpot_s: Distribution
    itl_s: Distribution
    e2e_s: Distribution
    queue_s: Distribution  # server-reported queueing delay; count 0 when the server reports none
    slo_ttft_s: float
    slo_violations: int
    slo_violation_rate: float
    goodput_rps: float
    throughput_tok_s: float
    preemptions: int | None  # from the sampled server counter; None when not sampled
    send_lag_p99_s: float | None
    # Prompt tokens the server found in its prefix cache / prompt tokens it served (usage.prompt_tokens_
    # details.cached_tokens over usage.prompt_tokens, served requests); None when the server sends no such figure
    prefix_hit_share: float | None = None

    def flat(self) -> dict[str, float | None]:
        """Scalar metrics by name, e.g. "ttft_s.p95" (what repeats are aggregated over)."""
        out: dict[str, float | None] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Distribution):
                for part in ("mean", "p50", "p95", "p99"):
                    out[f"{field.name}.{part}"] = getattr(value, part)
            else:
                out[field.name] = None if value is None else float(value)
        return out


def request_ttft(r: RequestRecord) -> float | None:
    return r.first_token_s - r.sent_s if r.ok else None


def meets_slo(r: RequestRecord, slo_ttft_s: float) -> bool:
    ttft = request_ttft(r)
    return ttft is not None and ttft <= slo_ttft_s


def misses_by_window(records: Sequence[RequestRecord], slo_ttft_s: float,
                     window_starts_s: Sequence[float]) -> tuple[int, ...]:
    """SLO misses (failed requests included, as in slo_violations) per burst window: a request belongs to
    the last window that starts at or before its scheduled arrival. The windows' sum is slo_violations."""
    starts = sorted(window_starts_s)
    if not starts:
        return ()
    misses = [0] * len(starts)
    for r in records:
        if not meets_slo(r, slo_ttft_s):
            misses[max(0, bisect.bisect_right(starts, r.scheduled_s) - 1)] += 1
    return tuple(misses)


def compute_run_metrics(records: Sequence[RequestRecord], slo_ttft_s: float,
                        samples: Sequence[ServerSample] = ()) -> RunMetrics:
    if not slo_ttft_s > 0:
        raise BenchmarkInputError(f"slo_ttft_s={slo_ttft_s}: use a positive TTFT SLO in seconds")
    ok = [r for r in records if r.ok]
    ttft = [request_ttft(r) for r in ok]
    e2e = [r.end_s - r.sent_s for r in ok]
    tpot = [(r.end_s - r.first_token_s) / (r.output_tokens - 1) for r in ok if r.output_tokens >= 2]
    itl = [b - a for r in ok for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    queue = [r.queue_s for r in ok if r.queue_s is not None]
    ends = [r.end_s for r in records if r.end_s is not None]
    starts = [r.scheduled_s for r in records]
    duration = max(ends) - min(starts) if ends and starts else 0.0
    good = sum(1 for r in records if meets_slo(r, slo_ttft_s))
    violations = len(records) - good
    tokens = sum(r.output_tokens for r in ok)
    lags = [r.send_lag_s for r in records if r.send_lag_s is not None]
    return RunMetrics(
        num_requests=len(records), num_ok=len(ok), duration_s=duration,
        ttft_s=Distribution.of(ttft), tpot_s=Distribution.of(tpot), itl_s=Distribution.of(itl),
        e2e_s=Distribution.of(e2e), queue_s=Distribution.of(queue),
        slo_ttft_s=slo_ttft_s, slo_violations=violations,
        slo_violation_rate=violations / len(records) if records else 0.0,
        goodput_rps=good / duration if duration > 0 else 0.0,
        throughput_tok_s=tokens / duration if duration > 0 else 0.0,
        preemptions=counter_increase(samples, "preemptions_total"),
        send_lag_p99_s=percentile(lags, 99), prefix_hit_share=prefix_hit_share(ok))


def prefix_hit_share(records: Sequence[RequestRecord]) -> float | None:
    """Cached prompt tokens over served prompt tokens, over the records that report both."""
    both = [r for r in records if r.cached_prompt_tokens is not None and r.served_prompt_tokens]
    served = sum(r.served_prompt_tokens for r in both)
    return sum(r.cached_prompt_tokens for r in both) / served if served else None


def counter_increase(samples: Sequence[ServerSample], name: str) -> int | None:
    """How much a monotonic server counter grew between the first and the last sample carrying it."""
    values = [s.values[name] for s in sorted(samples, key=lambda s: s.t_s) if name in s.values]
    return int(values[-1] - values[0]) if len(values) >= 2 else None


def integral(samples: Sequence[ServerSample], name: str) -> float | None:
    """Step integral (value held until the next sample) of a sampled value over the run, e.g.
    quantized layers -> quantized layer-seconds; None when the server does not report it."""
    points = sorted((s.t_s, s.values[name]) for s in samples if name in s.values)
    if len(points) < 2:
        return None
    return sum(v * (t2 - t1) for (t1, v), (t2, _) in zip(points, points[1:]))


def fleet_total_at(histories: Mapping[str, Sequence[Sequence[float]]], t: float) -> int:
    """The quantized layers of a fleet at time `t`: each replica's value at `t` from its own history
    of changes [(time, layers), ...] (deployments/morph_loop.py; 0 before its first entry), summed."""
    total = 0
    for history in histories.values():
        value = 0
        for at, layers in sorted(history):
            if at > t:
                break
            value = int(layers)
        total += value
    return total


# A restore the same replica undoes (morphs again) within this long came in a lull of a burst, not
# after it: the engine's own restore hysteresis (EngineConfig.restore_quiet_s) is 2 s, and the bench's
# bursts are at least 4 s apart.
RESTORE_UNDONE_WITHIN_S = 2.0


@dataclasses.dataclass(frozen=True)
class LayerMoves:
    """How often a fleet's replicas changed their quantized layers during a replay, from each replica's
    history of changes (deployments/morph_loop.py records the count at each report, so a restore and a
    morph within one report interval cancel out unseen)."""
    morphs: int  # changes to more quantized layers
    restores: int  # changes to fewer
    restores_undone: int  # restores the same replica followed with a morph within RESTORE_UNDONE_WITHIN_S

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def layer_moves(histories: Mapping[str, Sequence[Sequence[float]]], start: float, end: float,
                undone_within_s: float = RESTORE_UNDONE_WITHIN_S) -> LayerMoves:
    """The changes with a time in [start, end] over every replica's history [(time, layers), ...]."""
    morphs = restores = undone = 0
    for history in histories.values():
        changes = []  # (time, +1 morph / -1 restore)
        points = sorted((float(t), int(n)) for t, n in history)
        for (_, before), (at, after) in zip(points, points[1:]):
            if start <= at <= end and after != before:
                changes.append((at, 1 if after > before else -1))
        morphs += sum(1 for _, d in changes if d > 0)
        restores += sum(1 for _, d in changes if d < 0)
        undone += sum(1 for (t0, d0), (t1, d1) in zip(changes, changes[1:])
                      if d0 < 0 and d1 > 0 and t1 - t0 <= undone_within_s)
    return LayerMoves(morphs, restores, undone)


@dataclasses.dataclass(frozen=True)
class Spread:
    """One metric over repeats: median with the min-max range (n = repeats that had a value)."""
    median: float | None
    min: float | None
    max: float | None
    n: int

    def format(self, scale: float = 1.0, digits: int = 3) -> str:
        if self.median is None:
            return "n/a"
        m, lo, hi = (round(v * scale, digits) for v in (self.median, self.min, self.max))
        return f"{m:g}" if self.n == 1 or lo == hi else f"{m:g} [{lo:g}–{hi:g}]"


def spread(values: Iterable[float | None]) -> Spread:
    xs = [v for v in values if v is not None]
    if not xs:
        return Spread(None, None, None, 0)
    return Spread(statistics.median(xs), min(xs), max(xs), len(xs))


def aggregate(runs: Sequence[RunMetrics]) -> dict[str, Spread]:
    """Median [min, max] per scalar metric over repeats of one system."""
    flats = [r.flat() for r in runs]
    names = list(flats[0]) if flats else []
    return {name: spread(f[name] for f in flats) for name in names}
