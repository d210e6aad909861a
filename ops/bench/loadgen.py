"""Open-loop load generator: send each request at its scheduled time to an OpenAI-compatible server
(streaming /v1/completions or /v1/chat/completions) and record what came back, chunk by chunk.

Open loop means a slow server never slows the arrivals: a dispatcher sleeps until each request's time
and starts it as its own task; the connection pool is unbounded. The generator must not be the
bottleneck, so it records the send lag (actual - scheduled send time) of every request; its P99 is
reported next to the results. Every time is in seconds on one clock (time.perf_counter) relative to
the run's start, shared with the optional server-status sampler, so the report can line them up.

Bounded: at most len(requests) requests, and a hard deadline after which everything in flight is
cancelled (recorded as an error) and the run returns by itself. Loopback servers only.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, Callable, Literal, Mapping, Sequence
from urllib.parse import urlparse

import aiohttp

from ops.bench import BenchmarkInputError
from ops.bench.prompts import BenchPrompt
from ops.bench.traces import TraceRequest

_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
StatusParser = Callable[[str], Mapping[str, float]]


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    request_id: str
    scheduled_s: float  # when to send, seconds after the run's start
    prompt: str | tuple[int, ...]
    max_tokens: int  # the trace's output length; sent with ignore_eos so exactly this many come back
    prompt_tokens: int = 0  # informational (the trace's prompt length)
    system: str | None = None  # chat: a system message sent before the prompt (a prefix shared by many requests)


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    request_id: str
    scheduled_s: float
    sent_s: float | None  # None: never sent (deadline passed first)
    first_token_s: float | None
    token_times_s: tuple[float, ...]  # arrival time of every chunk that carried output
    end_s: float | None
    status: int | None  # HTTP status; None when no response arrived
    output_text: str
    output_tokens: int  # the server's usage.completion_tokens when given, else the chunk count
    prompt_tokens: int
    error: str | None
    queue_s: float | None = None  # server-reported queueing delay, when the server sends one
    served_prompt_tokens: int | None = None  # the server's usage.prompt_tokens (chat template included)
    cached_prompt_tokens: int | None = None  # the server's usage.prompt_tokens_details.cached_tokens, when sent

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.first_token_s is not None

    @property
    def send_lag_s(self) -> float | None:
        return None if self.sent_s is None else self.sent_s - self.scheduled_s


@dataclasses.dataclass(frozen=True)
class ServerSample:
    """One poll of the server's status endpoint: numeric values by name (e.g. "kv_usage")."""
    t_s: float
    values: Mapping[str, float]
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)  # e.g. "config": layer precisions


@dataclasses.dataclass(frozen=True)
class LoadGenConfig:
    base_url: str  # e.g. "http://127.0.0.1:8000"
    model: str
    api: Literal["completions", "chat"] = "completions"
    deadline_s: float = 3600.0  # hard stop, seconds after the run's start
    start_delay_s: float = 0.2  # scheduled time 0 is this long after setup, so setup never shows as lag
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    status_url: str | None = None  # polled every status_interval_s while the run lasts
    status_interval_s: float = 0.25
    status_parser: StatusParser | None = None  # body text -> values; default: numbers in a JSON object

    def __post_init__(self):
        for url in filter(None, (self.base_url, self.status_url)):
            host = urlparse(url).hostname
            if host not in _LOOPBACK_HOSTS:
                raise BenchmarkInputError(
                    f"{url}: the load generator only talks to loopback servers (127.0.0.1, localhost, ::1)")
        if self.api not in ("completions", "chat"):
            raise BenchmarkInputError(f"api={self.api!r}: use 'completions' or 'chat'")
        if not self.deadline_s > 0 or not self.status_interval_s > 0:
            raise BenchmarkInputError("deadline_s and status_interval_s must be positive")


@dataclasses.dataclass(frozen=True)
class LoadResult:
    records: tuple[RequestRecord, ...]  # in the order of the input requests
    samples: tuple[ServerSample, ...]
    duration_s: float  # from the run's start to the last record's end
    deadline_hit: bool

    @property
    def send_lag_p99_s(self) -> float | None:
        from ops.bench.metrics import percentile  # metrics imports this module's records

        return percentile([r.send_lag_s for r in self.records if r.send_lag_s is not None], 99)


def load_requests(requests: Sequence[TraceRequest], prompts: Sequence[BenchPrompt]) -> list[LoadRequest]:
    """Pair a workload's requests with their prompts; ids are request_id(i): "req-00000", ..."""
    if len(prompts) != len(requests):
        raise BenchmarkInputError(f"{len(requests)} requests but {len(prompts)} prompts; build one prompt per request")
    return [LoadRequest(request_id=request_id(i), scheduled_s=r.arrival_s, prompt=p.prompt,
                        max_tokens=r.output_tokens, prompt_tokens=p.prompt_tokens, system=p.system)
            for i, (r, p) in enumerate(zip(requests, prompts))]


def request_id(index: int) -> str:
    return f"req-{index:05d}"


def reference_answers(prompts: Sequence[BenchPrompt]) -> dict[str, str]:
    """request id -> the dataset's reference answer, with the ids load_requests gives."""
    return {request_id(p.request_index): p.reference for p in prompts}


def replay(requests: Sequence[LoadRequest], config: LoadGenConfig) -> LoadResult:
    """Synchronous entry point (runs its own event loop)."""
    return asyncio.run(run_load(requests, config))


async def run_load(requests: Sequence[LoadRequest], config: LoadGenConfig) -> LoadResult:
    _check_requests(requests, config)
    order = sorted(range(len(requests)), key=lambda i: requests[i].scheduled_s)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)  # limit=0: no client-side queue
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter() + config.start_delay_s
        clock = lambda: time.perf_counter() - t0  # noqa: E731
        samples: list[ServerSample] = []
        sampler = (asyncio.create_task(_sample_status(session, config, clock, samples))
                   if config.status_url else None)
        tasks: dict[int, asyncio.Task] = {}
        progress = [_Progress() for _ in requests]
        deadline_hit = False
        try:
            await asyncio.wait_for(_dispatch(session, requests, order, config, clock, tasks, progress),
                                   timeout=max(0.0, config.deadline_s - clock()))
        except asyncio.TimeoutError:
            deadline_hit = True
        finally:
            # Past the deadline (or on any error) nothing may keep running: closing a stream makes
            # the server abort that request.
            leftovers = [t for t in (*tasks.values(), sampler) if t is not None and not t.done()]
            for task in leftovers:
                task.cancel()
            await asyncio.gather(*leftovers, return_exceptions=True)
        records = tuple(_collect(requests[i], tasks.get(i), progress[i], config.deadline_s)
                        for i in range(len(requests)))
    ends = [r.end_s for r in records if r.end_s is not None]
    return LoadResult(records=records, samples=tuple(samples), duration_s=max(ends, default=0.0),
                      deadline_hit=deadline_hit)


def closed_loop(requests: Sequence[LoadRequest], config: LoadGenConfig, concurrency: int) -> LoadResult:
    """Synchronous entry point of `run_closed_loop`."""
    return asyncio.run(run_closed_loop(requests, config, concurrency))


async def run_closed_loop(requests: Sequence[LoadRequest], config: LoadGenConfig, concurrency: int) -> LoadResult:
    """Closed loop: `concurrency` requests in flight, the next (in input order) sent as soon as one
    ends; scheduled times are ignored (each record's scheduled_s is its send time). Bounded by
    config.deadline_s like the open loop; requests not done by then are failed records."""
    _check_requests(requests, config)
    if concurrency < 1:
        raise BenchmarkInputError(f"concurrency={concurrency}: use at least 1")
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    records: list[RequestRecord | None] = [None] * len(requests)
    progress = [_Progress() for _ in requests]
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter() + config.start_delay_s
        clock = lambda: time.perf_counter() - t0  # noqa: E731
        pending = iter(range(len(requests)))  # shared by the workers: each index is taken once

        async def worker() -> None:
            for i in pending:
                if clock() < 0:
                    await asyncio.sleep(-clock())
                record = await _send_one(session, requests[i], config, clock, progress[i])
                records[i] = dataclasses.replace(record, scheduled_s=record.sent_s)

        workers = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(requests)))]
        deadline_hit = False
        try:
            await asyncio.wait_for(asyncio.gather(*workers), timeout=config.deadline_s + config.start_delay_s)
        except asyncio.TimeoutError:
            deadline_hit = True
    out = tuple(r if r is not None else dataclasses.replace(
        _failed(requests[i], progress[i], "deadline exceeded", end_s=config.deadline_s),
        scheduled_s=progress[i].sent_s or 0.0) for i, r in enumerate(records))
    ends = [r.end_s for r in out if r.end_s is not None]
    return LoadResult(records=out, samples=(), duration_s=max(ends, default=0.0), deadline_hit=deadline_hit)


def _check_requests(requests: Sequence[LoadRequest], config: LoadGenConfig) -> None:
    if len({r.request_id for r in requests}) != len(requests):
        raise BenchmarkInputError("request ids repeat; give every request its own id")
    for r in requests:
        if r.max_tokens < 1 or r.scheduled_s < 0:
            raise BenchmarkInputError(f"request {r.request_id}: need max_tokens >= 1 and scheduled_s >= 0")
        if config.api == "chat" and not isinstance(r.prompt, str):
            raise BenchmarkInputError(f"request {r.request_id}: chat needs a text prompt, not token ids")


async def _dispatch(session, requests, order, config, clock, tasks: dict[int, asyncio.Task], progress) -> None:
    for i in order:
        delay = requests[i].scheduled_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks[i] = asyncio.create_task(_send_one(session, requests[i], config, clock, progress[i]))
    if tasks:
        await asyncio.wait(list(tasks.values()))


def _collect(request: LoadRequest, task: asyncio.Task | None, state: "_Progress", deadline_s: float) -> RequestRecord:
    if task is not None and not task.cancelled():
        return task.result()
    error = "deadline exceeded" if task is not None else "not sent before the deadline"
    return _failed(request, state, error, end_s=deadline_s if task is not None else None)


def _failed(request: LoadRequest, state: "_Progress | None", error: str, end_s: float | None) -> RequestRecord:
    state = state or _Progress()
    return RequestRecord(request_id=request.request_id, scheduled_s=request.scheduled_s, sent_s=state.sent_s,
                         first_token_s=state.times[0] if state.times else None, token_times_s=tuple(state.times),
                         end_s=end_s, status=state.status, output_text="".join(state.text),
                         output_tokens=len(state.times), prompt_tokens=request.prompt_tokens, error=error)


@dataclasses.dataclass
class _Progress:
    """What a request has received so far (mutable; only its own task writes it)."""
    sent_s: float | None = None
    status: int | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    usage_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    usage_cached_tokens: int | None = None
    queue_s: float | None = None


def _body(request: LoadRequest, config: LoadGenConfig) -> dict:
    body: dict[str, Any] = {"model": config.model, "max_tokens": request.max_tokens, "stream": True,
                            "temperature": config.temperature, "ignore_eos": config.ignore_eos,
                            "stream_options": {"include_usage": True}}
    if config.api == "chat":
        system = [{"role": "system", "content": request.system}] if request.system is not None else []
        body["messages"] = system + [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = list(request.prompt) if isinstance(request.prompt, tuple) else request.prompt
    body.update(config.extra_body)
    return body


async def _send_one(session: aiohttp.ClientSession, request: LoadRequest, config: LoadGenConfig, clock,
                    state: _Progress) -> RequestRecord:
    path = "/v1/chat/completions" if config.api == "chat" else "/v1/completions"
    payload = json.dumps(_body(request, config))
    state.sent_s = clock()
    try:
        async with session.post(config.base_url.rstrip("/") + path, data=payload,
                                headers={"Content-Type": "application/json"}) as resp:
            state.status = resp.status
            if resp.status != 200:
                detail = (await resp.text())[:300]
                return _failed(request, state, f"HTTP {resp.status}: {detail}", end_s=clock())
            async for raw in resp.content:
                if _on_line(raw, state, clock, config.api):
                    break
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
        return _failed(request, state, f"{type(e).__name__}: {e}", end_s=clock())
    end = clock()
    error = None if state.times else "no output tokens"
    return RequestRecord(request_id=request.request_id, scheduled_s=request.scheduled_s, sent_s=state.sent_s,
                         first_token_s=state.times[0] if state.times else None, token_times_s=tuple(state.times),
                         end_s=end, status=state.status, output_text="".join(state.text),
                         output_tokens=state.usage_tokens if state.usage_tokens is not None else len(state.times),
                         prompt_tokens=request.prompt_tokens, error=error, queue_s=state.queue_s,
                         served_prompt_tokens=state.usage_prompt_tokens, cached_prompt_tokens=state.usage_cached_tokens)


def _on_line(raw: bytes, state: _Progress, clock, api: str) -> bool:
    """Handle one SSE line; True at the end of the stream. Raises ValueError on a server error event."""
    now = clock()
    line = raw.strip()
    if not line.startswith(b"data:"):
        return False
    data = line[5:].strip()
    if data == b"[DONE]":
        return True
    event = json.loads(data)
    if not isinstance(event, dict):
        raise ValueError(f"stream event is not a JSON object: {data[:100]!r}")
    if "error" in event:
        raise ValueError(f"server error event: {json.dumps(event['error'])[:300]}")
    usage = event.get("usage") or {}
    if usage.get("completion_tokens") is not None:
        state.usage_tokens = int(usage["completion_tokens"])
    if usage.get("prompt_tokens") is not None:
        state.usage_prompt_tokens = int(usage["prompt_tokens"])
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        state.usage_cached_tokens = int(cached)
    queue = event.get("queue_time_s", usage.get("queue_time_s"))
    if queue is not None:
        state.queue_s = float(queue)
    for choice in event.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") if api == "chat" else choice.get("text")
        # An empty chunk that only closes the stream is not a token; an empty one mid-stream is
        # (a detokenizer holding back half a UTF-8 character still produced a token).
        if text or choice.get("finish_reason") is None:
            state.times.append(now)
            state.text.append(text or "")
    return False


async def _sample_status(session: aiohttp.ClientSession, config: LoadGenConfig, clock, out: list[ServerSample]) -> None:
    parse = config.status_parser or parse_json_status
    while True:
        started = clock()
        try:
            async with session.get(config.status_url) as resp:
                body = await resp.text()
            if resp.status == 200:
                out.append(ServerSample(t_s=started, values=dict(parse(body))))
        except (aiohttp.ClientError, OSError, ValueError):
            pass  # a missed sample is a gap in the plot, not a failed run
        await asyncio.sleep(max(0.0, config.status_interval_s - (clock() - started)))


def parse_json_status(body: str) -> dict[str, float]:
    """Numbers of a JSON object, nested objects flattened with '.' (bools and strings skipped)."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix] = float(value)

    walk("", json.loads(body))
    return out


def prometheus_status_parser(names: Mapping[str, str]) -> StatusParser:
    """A parser for a Prometheus /metrics page: {value name: metric name}; samples of one metric
    (all label sets) are summed, e.g. {"kv_usage": "vllm:kv_cache_usage_perc"}."""
    from prometheus_client.parser import text_string_to_metric_families

    def parse(body: str) -> dict[str, float]:
        wanted = {metric: key for key, metric in names.items()}
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                key = wanted.get(sample.name)
                if key is not None:
                    out[key] = out.get(key, 0.0) + float(sample.value)
        return out

    return parse
