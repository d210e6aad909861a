"""Every Prometheus metric MorphServe exports (names: docs/ARCHITECTURE.md "Metric names").

Inside a Ray Serve replica the metrics are `ray.serve.metrics` objects (Ray exports them with the
`ray_` prefix and adds application/deployment/replica tags). Outside Ray (unit tests, the CLI, a
demo without a cluster) `InMemoryBackend` keeps counts and sums instead, so the same calls work
and tests can read what was recorded.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Protocol

from deployments.directive_wait import BOUNDS_S as DIRECTIVE_WAIT_BOUNDS_S
from engine.morph.actions import ActionResult, MorphState
from engine.pressure import PressureSnapshot

# Seconds. Where a metric has vLLM's name, it has vLLM's boundaries (so dashboards and queries
# written for vLLM read ours alike), with one addition: TTFT also has 2.0 s, the benchmark's TTFT
# SLO, so "fraction of requests over the SLO" is exact (ops/monitoring/build_dashboard.py).
_VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
              20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TTFT_BUCKETS = sorted({*_VLLM_TTFT, 2.0})
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
# vLLM's request-latency boundaries: e2e latency and queue time.
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
E2E_BUCKETS = QUEUE_BUCKETS = REQUEST_LATENCY_BUCKETS
MORPH_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]

# vLLM's boundaries for the metrics it has and we add (vllm/v1/metrics/loggers.py): token counts
# in 1-2-5 steps up to the model's context, tokens per engine step in powers of two from 8.
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
STEP_TIME_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
DEFAULT_MAX_MODEL_LEN = 32768


def token_count_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_model_len:
                return out
            out.append(value)
        scale *= 10


PREFIX = "morphserve_"


class Metric(Protocol):
    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None: ...
    def set(self, value: float, tags: dict[str, str] | None = None) -> None: ...
    def observe(self, value: float, tags: dict[str, str] | None = None) -> None: ...


class MetricsBackend(Protocol):
    def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any: ...
    def gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any: ...
    def histogram(self, name: str, description: str, boundaries: list[float], tag_keys: tuple[str, ...]) -> Any: ...


class RayBackend:
    """ray.serve.metrics; only meaningful inside a Ray actor (a Serve replica)."""

    def counter(self, name, description, tag_keys):
        from ray.serve.metrics import Counter
        return Counter(name, description=description, tag_keys=tag_keys)

    def gauge(self, name, description, tag_keys):
        from ray.serve.metrics import Gauge
        return Gauge(name, description=description, tag_keys=tag_keys)

    def histogram(self, name, description, boundaries, tag_keys):
        from ray.serve.metrics import Histogram
        return Histogram(name, description=description, boundaries=boundaries, tag_keys=tag_keys)


@dataclasses.dataclass
class InMemoryMetric:
    """Counter / gauge / histogram without Ray: value per tag set (histograms: count and sum)."""
    name: str
    kind: str
    tag_keys: tuple[str, ...] = ()
    values: dict[tuple, float] = dataclasses.field(default_factory=dict)
    counts: dict[tuple, int] = dataclasses.field(default_factory=dict)

    def _key(self, tags: dict[str, str] | None) -> tuple:
        # Stricter than Ray (which ignores undeclared tags): a tag set must match the declared keys.
        if set(tags or {}) != set(self.tag_keys):
            raise ValueError(f"metric {self.name} takes tags {self.tag_keys}, got {sorted(tags or {})}")
        return tuple(sorted((tags or {}).items()))

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        if value < 0:
            raise ValueError(f"counter {self.name} cannot decrease (inc by {value})")
        key = self._key(tags)
        self.values[key] = self.values.get(key, 0.0) + value

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values[self._key(tags)] = float(value)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        key = self._key(tags)
        self.values[key] = self.values.get(key, 0.0) + value
        self.counts[key] = self.counts.get(key, 0) + 1

    def value(self, **tags: str) -> float:
        """Counter/gauge value (histogram: sum of observations) for exactly these tags."""
        return self.values.get(self._key(tags), 0.0)

    def count(self, **tags: str) -> int:
        return self.counts.get(self._key(tags), 0)


class InMemoryBackend:
    def __init__(self) -> None:
        self.metrics: dict[str, InMemoryMetric] = {}

    def _make(self, name: str, kind: str, tag_keys: tuple[str, ...]) -> InMemoryMetric:
        self.metrics[name] = InMemoryMetric(name, kind, tuple(tag_keys))
        return self.metrics[name]

    def counter(self, name, description, tag_keys):
        return self._make(name, "counter", tag_keys)

    def gauge(self, name, description, tag_keys):
        return self._make(name, "gauge", tag_keys)

    def histogram(self, name, description, boundaries, tag_keys):
        return self._make(name, "histogram", tag_keys)


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """What the ingress measured for one finished request."""
    finish_reason: str  # stop | length | abort | error
    num_prompt_tokens: int
    num_output_tokens: int
    e2e_s: float
    ttft_s: float | None  # None when no token came back
    itl_s: tuple[float, ...] = ()  # one per streamed delta after the first (per token)


def default_backend() -> MetricsBackend:
    try:
        from ray.serve import context
        in_replica = context._get_internal_replica_context() is not None
    except ImportError:
        in_replica = False
    return RayBackend() if in_replica else InMemoryBackend()


class ServeMetrics:
    """All MorphServe metrics for one model; every metric carries `model_name`."""

    def __init__(self, model_name: str, backend: MetricsBackend | None = None,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN):
        self.model_name = model_name
        self.backend = backend if backend is not None else default_backend()
        self._tags = {"model_name": model_name}
        self._counted: dict[str, int] = {}  # per counter fed from a snapshot's running total: the total counted so far
        b, m = self.backend, ("model_name",)
        self.ttft = b.histogram(PREFIX + "time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS, m)
        self.itl = b.histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens", ITL_BUCKETS, m)
        self.e2e = b.histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token", E2E_BUCKETS, m)
        self.queue_time = b.histogram(PREFIX + "request_queue_time_seconds", "Arrival in the engine to first schedule", QUEUE_BUCKETS, m)
        self.running = b.gauge(PREFIX + "num_requests_running", "Requests being processed", m)
        self.waiting = b.gauge(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled", m)
        self.queue_delay = b.gauge(PREFIX + "queue_delay_seconds", "Wait of the oldest waiting request", m)
        self.prefill_backlog = b.gauge(PREFIX + "prefill_backlog_tokens",
                                       "Prompt tokens waiting and running requests have not prefilled yet", m)
        self.kv_usage = b.gauge(PREFIX + "kv_cache_usage_perc", "Used / committed KV blocks (0..1)", m)
        self.kv_capacity = b.gauge(PREFIX + "kv_cache_capacity_blocks", "Committed KV blocks", m)
        self.quantized = b.gauge(PREFIX + "quantized_layers", "Layers held at a lower precision", m + ("precision",))
        self.reachable = b.gauge(PREFIX + "controller_reachable", "1 when the fleet controller answers", m)
        self.directive_wait = b.histogram(PREFIX + "directive_wait_seconds",
                                          "Wait of a morph-loop round for its directive (the controller's round trip, "
                                          "or the local policy)", list(DIRECTIVE_WAIT_BOUNDS_S), m + ("source",))
        self.memory = b.gauge(PREFIX + "memory_bytes", "Ledger bytes by owner", m + ("kind",))
        self.preemptions = b.counter(PREFIX + "num_preemptions", "Requests preempted (recompute)", m)
        self.prefix_queries = b.counter(PREFIX + "prefix_cache_queries",
                                        "Prompt tokens of admitted requests looked up in the prefix cache", m)
        self.prefix_hits = b.counter(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache", m)
        self.kv_cached = b.gauge(PREFIX + "kv_cache_cached_blocks",
                                 "Free KV blocks still holding a cached prefix block", m)
        self.prompt_tokens = b.counter(PREFIX + "prompt_tokens", "Prompt tokens processed", m)
        self.generation_tokens = b.counter(PREFIX + "generation_tokens", "Tokens generated", m)
        self.success = b.counter(PREFIX + "request_success", "Finished requests", m + ("finished_reason",))
        self.actions = b.counter(PREFIX + "morph_actions", "Layer swaps (per layer) and KV resizes", m + ("kind",))
        self.swap_latency = b.histogram(PREFIX + "layer_swap_latency_seconds", "Layer swap time", MORPH_BUCKETS, m + ("direction",))
        self.resize_latency = b.histogram(PREFIX + "kv_resize_latency_seconds", "KV resize time", MORPH_BUCKETS, m + ("direction",))
        lengths = token_count_buckets(max_model_len)
        self.prompt_lengths = b.histogram(PREFIX + "request_prompt_tokens", "Prompt tokens per request", lengths, m)
        self.generation_lengths = b.histogram(PREFIX + "request_generation_tokens", "Generated tokens per request", lengths, m)
        self.iteration_tokens = b.histogram(PREFIX + "iteration_tokens_total", "Tokens per engine step", ITERATION_TOKEN_BUCKETS, m)
        self.step_time = b.histogram(PREFIX + "step_time_seconds", "Engine step time by phase (prefill, decode, mixed)",
                                     STEP_TIME_BUCKETS, m + ("phase",))
        self.burst = BurstMetrics(b, model_name)  # admission-time morphing, KV demand, SLO feedback

    def _t(self, **extra: str) -> dict[str, str]:
        return {**self._tags, **extra}

    def observe_request(self, record: RequestRecord) -> None:
        if record.ttft_s is not None:
            self.ttft.observe(record.ttft_s, self._t())
        for gap in record.itl_s:
            self.itl.observe(gap, self._t())
        self.e2e.observe(record.e2e_s, self._t())
        self.success.inc(1, self._t(finished_reason=record.finish_reason))
        if record.num_prompt_tokens:
            self.prompt_tokens.inc(record.num_prompt_tokens, self._t())
        if record.num_output_tokens:
            self.generation_tokens.inc(record.num_output_tokens, self._t())
        self.prompt_lengths.observe(record.num_prompt_tokens, self._t())
        self.generation_lengths.observe(record.num_output_tokens, self._t())

    def observe_steps(self, steps: list) -> None:
        """Engine StepStats records (engine/step_stats.py): tokens per step, step time by phase."""
        for step in steps:
            self.iteration_tokens.observe(step.num_tokens, self._t())
            self.step_time.observe(step.seconds, self._t(phase=step.phase))

    def observe_queue_time(self, seconds: float) -> None:
        self.queue_time.observe(seconds, self._t())

    def set_pressure(self, snapshot: PressureSnapshot) -> None:
        self.running.set(snapshot.num_running, self._t())
        self.waiting.set(snapshot.num_waiting, self._t())
        self.queue_delay.set(snapshot.queue_delay_s, self._t())
        self.prefill_backlog.set(snapshot.prefill_backlog_tokens, self._t())
        self.kv_usage.set(snapshot.kv_usage, self._t())
        self.kv_capacity.set(snapshot.kv_capacity_blocks, self._t())
        ledger = snapshot.ledger
        for kind in ("budget", "weights", "kv", "reserve"):
            self.memory.set(getattr(ledger, kind), self._t(kind=kind))
        self._count_total("preemptions", self.preemptions, snapshot.preemptions_total)
        self._count_total("prefix_queries", self.prefix_queries, snapshot.prefix_cache_queries_total)
        self._count_total("prefix_hits", self.prefix_hits, snapshot.prefix_cache_hits_total)
        self.kv_cached.set(snapshot.kv_cached_blocks, self._t())

    def _count_total(self, name: str, counter, total: int) -> None:
        """The snapshot carries a running total; the counter gets the increase since the last one."""
        increase = total - self._counted.get(name, 0)
        if increase > 0:
            counter.inc(increase, self._t())
        self._counted[name] = total

    def set_morph_state(self, state: MorphState) -> None:
        for precision in ("int8", "int4"):
            self.quantized.set(sum(1 for p in state.layer_precisions if p.value == precision),
                               self._t(precision=precision))
        self.kv_capacity.set(state.kv_capacity_blocks, self._t())

    def count_action(self, result: ActionResult) -> None:
        """Count what an action did, whatever its status (a target still "waiting" may have moved layers
        this step): one swap per layer changed, one resize per KV change."""
        if result.layers_changed and result.weight_bytes_delta != 0:
            down = result.weight_bytes_delta < 0
            self.actions.inc(len(result.layers_changed), self._t(kind="swap_down" if down else "restore"))
            self.swap_latency.observe(result.swap_seconds, self._t(direction="down" if down else "up"))
        if result.kv_blocks_delta != 0:
            grow = result.kv_blocks_delta > 0
            self.actions.inc(1, self._t(kind="kv_grow" if grow else "kv_shrink"))
            self.resize_latency.observe(result.resize_seconds, self._t(direction="grow" if grow else "shrink"))

    def observe_directive_wait(self, seconds: float, source: str) -> None:
        self.directive_wait.observe(seconds, self._t(source=source))

    def set_controller_reachable(self, reachable: bool) -> None:
        self.reachable.set(1.0 if reachable else 0.0, self._t())


class RequestTimer:
    """Measures one request as its chunks arrive (monotonic clock) and yields its RequestRecord."""

    def __init__(self, clock=None):
        self._clock = clock or time.monotonic
        self.start = self._clock()
        self._first: float | None = None
        self._last: float | None = None
        self._itl: list[float] = []

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = self._clock()
        if self._first is None:
            self._first = now
        else:  # a delta of several tokens counts as that many equal gaps' mean
            self._itl.append((now - self._last) / num_tokens)
        self._last = now

    def record(self, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int) -> RequestRecord:
        ttft = None if self._first is None else self._first - self.start
        return RequestRecord(finish_reason, num_prompt_tokens, num_output_tokens, self._clock() - self.start,
                             ttft, tuple(self._itl))


class BurstMetrics:
    """Admission-time morphing (engine/morph/admission.py), KV demand and SLO feedback, per replica."""

    def __init__(self, b: MetricsBackend, model_name: str):
        m, self._tags = ("model_name",), {"model_name": model_name}
        self._last = {"swap": 0, "restore": 0}
        self.admission_morphs = b.counter(PREFIX + "admission_morphs",
                                          "Morphs the engine made at admission (swap) or by demand (restore)",
                                          m + ("kind",))
        self.queue_waits = b.counter(PREFIX + "queue_wait_rounds",
                                     "Report rounds at which requests waited, by cause: memory (the head of the "
                                     "queue did not fit in KV) or compute (it fit; the step's token budget held it)",
                                     m + ("cause",))
        self.demand = b.gauge(PREFIX + "kv_demand_blocks", "KV demand in blocks: waiting, running_reserved, "
                              "running_finish; available = free - running_reserved", m + ("kind",))
        self.reservation = b.gauge(PREFIX + "output_reservation_tokens",
                                   "Output tokens reserved per request in the KV demand", m)
        self.allowed = b.gauge(PREFIX + "morph_allowed_layers",
                               "Most quantized layers the last directive allows (bounds admission morphs)", m)
        self.slo_level = b.gauge(PREFIX + "slo_feedback_level",
                                 "SLO feedback level (0: configured thresholds, 1: most eager)", m)
        self.threshold = b.gauge(PREFIX + "policy_entry_threshold",
                                 "Entry thresholds in use (kv_usage; queue_delay_seconds)", m + ("signal",))

    def count_queue_wait(self, cause: str) -> None:
        """One report round at which requests waited for `cause` (PressureSnapshot.waiting_for)."""
        self.queue_waits.inc(1, {**self._tags, "cause": cause})

    def set(self, snapshot: PressureSnapshot, directive) -> None:
        t = self._tags
        for kind, total in (("swap", snapshot.admission_swaps_total), ("restore", snapshot.admission_restores_total)):
            if total > self._last[kind]:
                self.admission_morphs.inc(total - self._last[kind], {**t, "kind": kind})
            self._last[kind] = total
        demand = {"waiting": snapshot.waiting_demand_blocks, "running_reserved": snapshot.running_reserved_blocks,
                  "running_finish": snapshot.running_finish_blocks, "available": snapshot.available_blocks}
        for kind, blocks in demand.items():
            self.demand.set(blocks, {**t, "kind": kind})
        self.reservation.set(snapshot.reservation_tokens, t)
        if directive.max_quantized is not None:
            self.allowed.set(directive.max_quantized, t)
        self.slo_level.set(directive.slo_level or 0.0, t)
        thresholds = {"kv_usage": directive.enter_kv_usage, "queue_delay_seconds": directive.enter_queue_delay_s}
        for signal, value in thresholds.items():
            if value is not None:
                self.threshold.set(value, {**t, "signal": signal})
