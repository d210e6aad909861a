"""From a whole trace to the requests one benchmark run replays: pick a window, then scale it.

Window rule (when no offset is given): cut the trace into 1 s bins of arrival counts; for every start
second s, the window [s, s + window_s) has peak = its largest bin and mean = its average bin. Among the
windows whose mean is at least `min_mean_fraction` x the trace's overall mean rate (so a lone spike in
a dead minute does not win), take the one with the highest peak / mean; ties go to the earliest.

Several windows (`num_windows` > 1, or `min_requests` more than one window holds): the same rule,
repeatedly, over windows that do not overlap the ones already taken, until there are `num_windows`
and together they hold `min_requests` (at most `max_windows`). They are replayed in trace order, one
after the other, with `gap_s` replay seconds of silence between them (the server drains in between,
so every window is a separate burst).

Scaling, in this order: arrivals are made relative to their window's start and multiplied by
`time_scale` (< 1 compresses: 0.5 replays a 72 s window in 36 s at twice the rate); prompt and output
lengths are multiplied by their scale, rounded, and clipped to [min, max]; `max_requests` keeps the
first N.
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
    num_windows: int = 1  # separate burst windows, replayed one after the other
    min_requests: int = 0  # take more windows (up to max_windows) until they hold this many requests
    max_windows: int = 8
    gap_s: float = 0.0  # replay seconds of silence between two windows

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
        if not 1 <= self.num_windows <= self.max_windows or self.min_requests < 0 or self.gap_s < 0:
            raise BenchmarkInputError(f"num_windows={self.num_windows}, max_windows={self.max_windows}, "
                                      f"min_requests={self.min_requests}, gap_s={self.gap_s}: need "
                                      f"1 <= num_windows <= max_windows, min_requests >= 0, gap_s >= 0")
        if self.offset_s is not None and (self.num_windows > 1 or self.min_requests):
            raise BenchmarkInputError("offset_s picks one window; leave num_windows=1 and min_requests=0 with it")

    @property
    def multi_window(self) -> bool:
        return self.offset_s is None and (self.num_windows > 1 or self.min_requests > 0)

    def describe(self) -> str:
        where = (f"at offset {self.offset_s:g} s" if self.offset_s is not None else
                 f"chosen as the one with the highest peak-to-mean arrival rate (1 s bins; mean >= "
                 f"{self.min_mean_fraction:g} x the trace mean)")
        cap = f"; first {self.max_requests} requests" if self.max_requests else ""
        if self.multi_window:
            where = (f"({self.num_windows} or more until they hold >= {self.min_requests} requests, at most "
                     f"{self.max_windows}; none overlapping), each {where.replace('the one', 'the next')}; "
                     f"replayed in trace order with {self.gap_s:g} s of silence between them")
        kind = "windows" if self.multi_window else "window"
        return (f"{self.window_s:g} s {kind} {where}; arrival times x {self.time_scale:g}; "
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
    windows: tuple[WindowChoice, ...]  # in trace order
    requests: tuple[TraceRequest, ...]  # scaled; arrivals relative to the replay's start
    window_of: tuple[int, ...] = ()  # request i came from windows[window_of[i]]

    @property
    def window(self) -> WindowChoice:
        return self.windows[0]

    @property
    def window_starts_s(self) -> tuple[float, ...]:
        """Replay time at which each window starts."""
        span = self.spec.window_s * self.spec.time_scale
        return tuple(k * (span + self.spec.gap_s) for k in range(len(self.windows)))

    @property
    def duration_s(self) -> float:
        return len(self.windows) * self.spec.window_s * self.spec.time_scale + (len(self.windows) - 1) * self.spec.gap_s

    @property
    def trace_mean_rps(self) -> float:
        """Arrivals per trace second over the chosen windows (before time scaling)."""
        return sum(w.mean_rps for w in self.windows) / len(self.windows)

    @property
    def trace_peak_rps(self) -> float:
        return max(w.peak_rps for w in self.windows)

    def describe(self) -> str:
        prompts = [r.prompt_tokens for r in self.requests] or [0]
        outputs = [r.output_tokens for r in self.requests] or [0]
        chosen = "; ".join(f"[{w.offset_s:g} s, {w.offset_s + self.spec.window_s:g} s) by {w.rule}, peak "
                           f"{w.peak_rps:g} req/s, mean {w.mean_rps:.2f} req/s, peak/mean {w.peak_to_mean:.2f}"
                           for w in self.windows)
        return (f"{self.trace_name} trace ({self.trace_source}): {self.spec.describe()}.\n"
                f"Chosen window(s) (trace time): {chosen}."
                f"\nReplayed: {len(self.requests)} requests over {self.duration_s:g} s; "
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


def select_windows(trace: Trace, spec: WorkloadSpec) -> list[WindowChoice]:
    """The rule above, repeated over windows that overlap none already taken; in trace order."""
    counts = arrival_counts([r.arrival_s for r in trace.requests])
    width = int(math.ceil(spec.window_s))
    if len(counts) <= width:
        return [select_window(trace, spec.window_s, spec.min_mean_fraction)]
    sums = np.convolve(counts, np.ones(width, dtype=int), mode="valid")
    peaks = np.lib.stride_tricks.sliding_window_view(counts, width).max(axis=1)
    means = sums / width
    eligible = (means >= spec.min_mean_fraction * counts.mean()) & (means > 0)
    ratio = np.where(eligible, peaks / np.maximum(means, 1e-12), -1.0)
    taken: list[int] = []
    while len(taken) < spec.max_windows and (len(taken) < spec.num_windows
                                              or sum(int(sums[s]) for s in taken) < spec.min_requests):
        start = int(np.argmax(ratio))
        if ratio[start] < 0:
            break  # no eligible window left
        taken.append(start)
        ratio[max(0, start - width + 1):start + width] = -1.0  # windows overlapping this one
    return [WindowChoice(float(s), float(peaks[s]), float(means[s]), "max-peak-to-mean") for s in sorted(taken)]


def build_workload(trace: Trace, spec: WorkloadSpec) -> Workload:
    if not trace.requests:
        raise BenchmarkInputError(f"trace {trace.source} has no requests")
    if spec.multi_window:
        windows = select_windows(trace, spec)
    elif spec.offset_s is None:
        windows = [select_window(trace, spec.window_s, spec.min_mean_fraction)]
    else:
        windows = [_explicit_window(trace, spec)]
    span = spec.window_s * spec.time_scale
    scaled, window_of = [], []
    for k, window in enumerate(windows):
        lo, hi = window.offset_s, window.offset_s + spec.window_s
        chosen = [r for r in trace.requests if lo <= r.arrival_s < hi]
        if not chosen:
            raise BenchmarkInputError(
                f"window [{lo:g} s, {hi:g} s) of {trace.source} holds no requests (trace length "
                f"{trace.duration_s:g} s); pick another offset_s")
        start = k * (span + spec.gap_s)
        scaled += [TraceRequest(arrival_s=start + (r.arrival_s - lo) * spec.time_scale,
                                prompt_tokens=_scale(r.prompt_tokens, spec.prompt_scale, spec.prompt_min, spec.prompt_max),
                                output_tokens=_scale(r.output_tokens, spec.output_scale, spec.output_min, spec.output_max))
                   for r in chosen]
        window_of += [k] * len(chosen)
    if spec.max_requests is not None:
        scaled, window_of = scaled[: spec.max_requests], window_of[: spec.max_requests]
    return Workload(spec=spec, trace_name=trace.name, trace_source=trace.source, windows=tuple(windows),
                    requests=tuple(scaled), window_of=tuple(window_of))


def _explicit_window(trace: Trace, spec: WorkloadSpec) -> WindowChoice:
    arrivals = [r.arrival_s - spec.offset_s for r in trace.requests
                if spec.offset_s <= r.arrival_s < spec.offset_s + spec.window_s]
    counts = arrival_counts(arrivals, span_s=math.ceil(spec.window_s)) if arrivals else np.zeros(1)
    return WindowChoice(spec.offset_s, float(counts.max()), len(arrivals) / math.ceil(spec.window_s),
                        "explicit offset")


def _scale(tokens: int, factor: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(tokens * factor))))
