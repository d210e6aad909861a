"""Load calibrated to the machine: measure the server's capacity for the workload's length mix, then
scale the trace's arrivals so that the replay's mean load is a set fraction of that capacity and its
bursts exceed it.

Capacity (`capacity_from_records`): a closed-loop probe keeps `concurrency` requests in flight (a new
one is sent as soon as one finishes) over requests drawn from the workload, against the baseline
system (static full precision). While the pool is full the server is saturated; capacity = requests
completed by the time the pool stops being full (the (N - concurrency + 1)-th completion) / that time.

Rule (`calibrate`): with the chosen windows' mean arrival rate m and peak rate p (trace time, 1 s
bins) and capacity C (requests/s on this machine):
    f = clip(max(mean_load_fraction, min_burst_load / (p / m)), <= max_mean_load_fraction)
    time_scale = m / (f x C)
so the replay's mean rate is f x C and its peak second f x C x p / m >= min_burst_load x C (as long
as f did not hit its ceiling; the report then says the bursts are weaker than asked). The same rule
holds on any trace in this format and on a fast or a slow machine: only C changes.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from ops.bench import BenchmarkInputError
from ops.bench.loadgen import RequestRecord


@dataclasses.dataclass(frozen=True)
class CalibrationRule:
    mean_load_fraction: float = 0.5  # the replay's mean arrival rate / capacity
    min_burst_load: float = 1.5  # the busiest second must bring at least this x capacity
    max_mean_load_fraction: float = 0.9  # never more than this on average, even for flat traces

    def __post_init__(self):
        if not 0 < self.mean_load_fraction <= self.max_mean_load_fraction < 1:
            raise BenchmarkInputError(
                f"mean_load_fraction={self.mean_load_fraction}, max_mean_load_fraction={self.max_mean_load_fraction}: "
                f"need 0 < mean_load_fraction <= max_mean_load_fraction < 1")
        if not self.min_burst_load > 1:
            raise BenchmarkInputError(f"min_burst_load={self.min_burst_load}: bursts must exceed capacity (> 1)")


@dataclasses.dataclass(frozen=True)
class ProbePlan:
    concurrency: int  # requests in flight: more than the baseline's KV holds, so it saturates
    num_requests: int
    deadline_s: float = 600.0

    def __post_init__(self):
        if not 1 <= self.concurrency < self.num_requests:
            raise BenchmarkInputError(f"probe concurrency {self.concurrency}, {self.num_requests} requests: need "
                                      f"1 <= concurrency < requests")


@dataclasses.dataclass(frozen=True)
class Capacity:
    requests_per_s: float
    output_tokens_per_s: float
    concurrency: int
    num_requests: int  # sent by the probe
    saturated_s: float  # how long the pool stayed full
    system: str

    def describe(self) -> str:
        return (f"{self.requests_per_s:.3f} req/s ({self.output_tokens_per_s:.1f} output tok/s) for the workload's "
                f"length mix: {self.system}, closed loop, {self.concurrency} in flight, {self.num_requests} requests, "
                f"saturated for {self.saturated_s:.1f} s")


@dataclasses.dataclass(frozen=True)
class Calibration:
    capacity: Capacity
    rule: CalibrationRule
    trace_mean_rps: float
    trace_peak_rps: float
    mean_load_fraction: float  # f actually used
    time_scale: float

    @property
    def replay_mean_rps(self) -> float:
        return self.trace_mean_rps / self.time_scale

    @property
    def peak_load(self) -> float:
        """The busiest second's arrival rate / capacity."""
        return self.trace_peak_rps / self.time_scale / self.capacity.requests_per_s

    def describe(self) -> str:
        weak = "" if self.peak_load >= self.rule.min_burst_load else (
            f" (below the asked {self.rule.min_burst_load:g}x: the trace's bursts are too flat for "
            f"max_mean_load_fraction {self.rule.max_mean_load_fraction:g})")
        return (f"capacity {self.capacity.describe()}. Trace windows: mean {self.trace_mean_rps:.2f} req/s, peak "
                f"{self.trace_peak_rps:g} req/s (peak/mean {self.trace_peak_rps / self.trace_mean_rps:.2f}). Rule: mean "
                f"load {self.rule.mean_load_fraction:g} x capacity, raised so that the peak second brings >= "
                f"{self.rule.min_burst_load:g} x capacity, at most {self.rule.max_mean_load_fraction:g}. Used: mean load "
                f"{self.mean_load_fraction:.3f} x capacity = {self.replay_mean_rps:.3f} req/s, arrival times x "
                f"{self.time_scale:.3f}, peak second {self.peak_load:.2f} x capacity{weak}")


def calibrate(capacity: Capacity, trace_mean_rps: float, trace_peak_rps: float,
              rule: CalibrationRule = CalibrationRule()) -> Calibration:
    if not capacity.requests_per_s > 0:
        raise BenchmarkInputError(f"measured capacity {capacity.requests_per_s} req/s: the probe completed nothing; "
                                  f"see the probe server's log")
    if not 0 < trace_mean_rps <= trace_peak_rps:
        raise BenchmarkInputError(f"trace mean {trace_mean_rps} req/s, peak {trace_peak_rps}: need 0 < mean <= peak")
    burstiness = trace_peak_rps / trace_mean_rps
    fraction = min(max(rule.mean_load_fraction, rule.min_burst_load / burstiness), rule.max_mean_load_fraction)
    return Calibration(capacity=capacity, rule=rule, trace_mean_rps=trace_mean_rps, trace_peak_rps=trace_peak_rps,
                       mean_load_fraction=fraction, time_scale=trace_mean_rps / (fraction * capacity.requests_per_s))


def capacity_from_records(records: Sequence[RequestRecord], concurrency: int, system: str) -> Capacity:
    """Saturated throughput of a closed-loop probe (see the module doc); failed requests do not count."""
    if concurrency < 1 or len(records) <= concurrency:
        raise BenchmarkInputError(f"{len(records)} probe requests at concurrency {concurrency}: send more requests "
                                  f"than are in flight, or the pool is never full")
    ok = sorted((r for r in records if r.ok), key=lambda r: r.end_s)
    start = min(r.sent_s for r in records if r.sent_s is not None)
    full_until = len(records) - concurrency + 1  # completions while the pool was still full
    if len(ok) < full_until:
        raise BenchmarkInputError(f"only {len(ok)} of {len(records)} probe requests succeeded; see the server log")
    counted = ok[:full_until]
    elapsed = counted[-1].end_s - start
    return Capacity(requests_per_s=full_until / elapsed,
                    output_tokens_per_s=sum(r.output_tokens for r in counted) / elapsed,
                    concurrency=concurrency, num_requests=len(records), saturated_s=elapsed, system=system)
