"""From a whole trace to the requests one benchmark run replays: pick a window, then scale it.

Window rule (when no offset is given): cut the trace into 1 s bins of arrival counts; for every start
second s, the window [s, s + window_s) has peak = its largest bin and mean = its average bin. Among the
windows whose mean is at least `min_mean_fraction` x the trace's overall mean rate (so a lone spike in
a dead minute does not win), take the one with the highest peak / mean; ties go to the earliest.

Scaling, in this order: arrivals are made relative to the window start and multiplied by `time_scale`
(< 1 compresses: 0.5 replays a 72 s window in 36 s at twice the rate); prompt and output lengths are
multiplied by their scale, rounded, and clipped to [min, max]; `max_requests` keeps the first N.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ops.bench import BenchmarkInputError
from ops.bench.traces import Trace, TraceRequest


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    window_s: float = 72.0  # the paper's window length
    offset_s: float | None = None  # explicit window start in trace seconds; None = the rule above
    min_mean_fraction: float = 0.5
    time_scale: float = 1.0  # multiplies arrival times (< 1 compresses)
    prompt_scale: float = 1.0
    prompt_min: int = 1
    prompt_max: int = 1_000_000
    output_scale: float = 1.0
    output_min: int = 1
    output_max: int = 1_000_000
    max_requests: int | None = None

    def __post_init__(self):
        if not self.window_s >= 1:
            raise BenchmarkInputError(f"window_s={self.window_s}: use at least 1 second")
        if self.offset_s is not None and self.offset_s < 0:
            raise BenchmarkInputError(f"offset_s={self.offset_s}: use a start >= 0 or None for the rule")
        if not 0 <= self.min_mean_fraction <= 1:
            raise BenchmarkInputError(f"min_mean_fraction={self.min_mean_fraction}: use a value in [0, 1]")
        for name in ("time_scale", "prompt_scale", "output_scale"):
            if not getattr(self, name) > 0:
                raise BenchmarkInputError(f"{name}={getattr(self, name)}: use a positive factor")
        for lo, hi in (("prompt_min", "prompt_max"), ("output_min", "output_max")):
            if not 1 <= getattr(self, lo) <= getattr(self, hi):
                raise BenchmarkInputError(
                    f"{lo}={getattr(self, lo)}, {hi}={getattr(self, hi)}: need 1 <= {lo} <= {hi}")
        if self.max_requests is not None and self.max_requests < 1:
            raise BenchmarkInputError(f"max_requests={self.max_requests}: use >= 1 or None")

    def describe(self) -> str:
        where = (f"at offset {self.offset_s:g} s" if self.offset_s is not None else
                 f"chosen as the one with the highest peak-to-mean arrival rate (1 s bins; mean >= "
                 f"{self.min_mean_fraction:g} x the trace mean)")
        cap = f"; first {self.max_requests} requests" if self.max_requests else ""
        return (f"{self.window_s:g} s window {where}; arrival times x {self.time_scale:g}; "
                f"prompt tokens x {self.prompt_scale:g} clipped to [{self.prompt_min}, {self.prompt_max}]; "
                f"output tokens x {self.output_scale:g} clipped to [{self.output_min}, {self.output_max}]{cap}")


@dataclasses.dataclass(frozen=True)
class WindowChoice:
    offset_s: float
    peak_rps: float  # in trace time (before time scaling)
    mean_rps: float
    rule: str  # "max-peak-to-mean" or "explicit offset"

    @property
    def peak_to_mean(self) -> float:
        return self.peak_rps / self.mean_rps if self.mean_rps else 0.0


@dataclasses.dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    trace_name: str
    trace_source: str
    window: WindowChoice
    requests: tuple[TraceRequest, ...]  # scaled; arrivals relative to the window start

    @property
    def duration_s(self) -> float:
        return self.spec.window_s * self.spec.time_scale

    def describe(self) -> str:
        w = self.window
        prompts = [r.prompt_tokens for r in self.requests] or [0]
        outputs = [r.output_tokens for r in self.requests] or [0]
        return (f"{self.trace_name} trace ({self.trace_source}): {self.spec.describe()}.\n"
                f"Chosen window: [{w.offset_s:g} s, {w.offset_s + self.spec.window_s:g} s) by {w.rule}; "
                f"peak {w.peak_rps:g} req/s, mean {w.mean_rps:.2f} req/s, peak/mean {w.peak_to_mean:.2f} "
                f"(trace time).\nReplayed: {len(self.requests)} requests over {self.duration_s:g} s; "
                f"prompt tokens median {int(np.median(prompts))} (max {max(prompts)}), "
                f"output tokens median {int(np.median(outputs))} (max {max(outputs)}).")


def arrival_counts(arrivals_s: list[float] | np.ndarray, bin_s: float = 1.0, span_s: float | None = None) -> np.ndarray:
    """Requests per bin; bin i covers [i * bin_s, (i + 1) * bin_s). `span_s` fixes the number of bins."""
    arrivals = np.asarray(arrivals_s, dtype=float)
    if span_s is not None:
        n_bins = max(1, math.ceil(span_s / bin_s))
    else:
        n_bins = int(arrivals.max() // bin_s) + 1 if arrivals.size else 1
    idx = np.clip(np.floor(arrivals / bin_s).astype(int), 0, n_bins - 1)
    return np.bincount(idx, minlength=n_bins)[:n_bins]


def select_window(trace: Trace, window_s: float, min_mean_fraction: float = 0.5) -> WindowChoice:
    counts = arrival_counts([r.arrival_s for r in trace.requests])
    width = int(math.ceil(window_s))
    if len(counts) <= width:  # the whole trace fits in one window
        return WindowChoice(0.0, float(counts.max()), len(trace.requests) / width, "max-peak-to-mean")
    sums = np.convolve(counts, np.ones(width, dtype=int), mode="valid")
    peaks = np.lib.stride_tricks.sliding_window_view(counts, width).max(axis=1)
    means = sums / width
    eligible = means >= min_mean_fraction * counts.mean()
    ratio = np.where(eligible & (means > 0), peaks / np.maximum(means, 1e-12), -1.0)
    start = int(np.argmax(ratio))  # argmax returns the first maximum: ties go to the earliest
    return WindowChoice(float(start), float(peaks[start]), float(means[start]), "max-peak-to-mean")


def build_workload(trace: Trace, spec: WorkloadSpec) -> Workload:
    if not trace.requests:
        raise BenchmarkInputError(f"trace {trace.source} has no requests")
    if spec.offset_s is None:
        window = select_window(trace, spec.window_s, spec.min_mean_fraction)
    else:
        window = _explicit_window(trace, spec)
    lo, hi = window.offset_s, window.offset_s + spec.window_s
    chosen = [r for r in trace.requests if lo <= r.arrival_s < hi]
    if not chosen:
        raise BenchmarkInputError(
            f"window [{lo:g} s, {hi:g} s) of {trace.source} holds no requests (trace length "
            f"{trace.duration_s:g} s); pick another offset_s")
    scaled = tuple(
        TraceRequest(arrival_s=(r.arrival_s - lo) * spec.time_scale,
                     prompt_tokens=_scale(r.prompt_tokens, spec.prompt_scale, spec.prompt_min, spec.prompt_max),
                     output_tokens=_scale(r.output_tokens, spec.output_scale, spec.output_min, spec.output_max))
        for r in chosen)
    if spec.max_requests is not None:
        scaled = scaled[: spec.max_requests]
    return Workload(spec=spec, trace_name=trace.name, trace_source=trace.source, window=window, requests=scaled)


def _explicit_window(trace: Trace, spec: WorkloadSpec) -> WindowChoice:
    arrivals = [r.arrival_s - spec.offset_s for r in trace.requests
                if spec.offset_s <= r.arrival_s < spec.offset_s + spec.window_s]
    counts = arrival_counts(arrivals, span_s=math.ceil(spec.window_s)) if arrivals else np.zeros(1)
    return WindowChoice(spec.offset_s, float(counts.max()), len(arrivals) / math.ceil(spec.window_s),
                        "explicit offset")


def _scale(tokens: int, factor: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(tokens * factor))))
