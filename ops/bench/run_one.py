"""One (system, repeat) of the benchmark: start the server fresh, warm it up, configure it, replay the
workload while sampling its status, stop it. Returns the SystemRun the report needs."""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import secrets
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from deployments import directive_wait
from ops.bench.loadgen import LoadGenConfig, LoadRequest, ServerSample, replay
from ops.bench.metrics import LayerMoves, fleet_total_at, layer_moves
from ops.bench.process_cpu import CpuAccount
from ops.bench.report import SystemRun
from ops.bench.server_process import ServerProcess, ServerStartError, free_port, http_get, http_post_json
from ops.bench.systems import (BudgetPlan, SystemSpec, morphserve_app_args, morphserve_command, morphserve_labels,
                               morphserve_status, serve_config, vllm_command, vllm_env, vllm_status_parser)

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What every run shares (settings chosen once in run_all)."""
    hf_dir: str
    served_name: str
    plan: BudgetPlan
    out_dir: Path
    start_deadline_s: float
    drain_s: float  # how long after the last arrival requests may still finish
    threads: int
    vllm_python: str
    status_interval_s: float = 0.25


@dataclasses.dataclass(frozen=True)
class LiveServer:
    spec: SystemSpec
    base_url: str
    admin_token: str
    session_id: int  # the server's process session: every process it started (process_cpu.CpuAccount)
    warm_up_calls: Mapping[str, int] = dataclasses.field(default_factory=dict)  # engine replica -> its warm-ups


@contextlib.contextmanager
def started_server(spec: SystemSpec, tag: str, ctx: RunContext) -> Iterator[LiveServer]:
    """A fresh server for `spec`, ready, warmed up and configured; stopped (with every process it
    started) when the block ends. Its log is logs/<system>.<tag>.log."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = ctx.out_dir / "logs" / f"{spec.name}.{tag}.log"
    token = secrets.token_hex(16)
    command, env = _launch(spec, port, token, ctx, log.with_suffix(".config.json"))
    started = time.monotonic()
    with ServerProcess(command, log, env=env, cwd=REPO) as server:
        server.wait_ready(f"{base}/v1/models", ctx.start_deadline_s)
        warm_up_calls: Mapping[str, int] = {}
        if spec.kind == "morphserve":
            warm_up_calls = _warm_up_replicas(base, token, ctx.served_name, spec.replicas, ctx.start_deadline_s)
            _configure(base, token, spec, ctx.served_name, ctx.start_deadline_s)
        else:
            _warm_up(base, ctx.served_name)
        _log(f"  {spec.name} {tag}: ready and configured in {time.monotonic() - started:.0f} s")
        yield LiveServer(spec, base, token, server.proc.pid, warm_up_calls)


def run_system(spec: SystemSpec, repeat: int, requests: Sequence[LoadRequest], ctx: RunContext) -> SystemRun:
    started = time.monotonic()
    with started_server(spec, f"r{repeat}", ctx) as server:
        _log(f"  {spec.name} r{repeat}: replaying {len(requests)} requests")
        account = CpuAccount(server.session_id)
        account.start()
        result, samples, replicas = _replay(spec, server.base_url, server.admin_token, requests, ctx,
                                            server.warm_up_calls)
        cpu = account.stop()
    _log(f"  {spec.name} r{repeat}: CPU seconds during the replay {cpu}")
    ok = sum(r.ok for r in result.records)
    _log(f"  {spec.name} r{repeat}: {ok}/{len(result.records)} ok in {result.duration_s:.0f} s; "
         f"total {time.monotonic() - started:.0f} s")
    return SystemRun(system=spec.name, repeat=repeat, records=result.records, timeline=tuple(samples),
                     generate_calls=replicas.generate_calls, waiting_rounds=replicas.waiting_rounds, cpu_seconds=cpu,
                     layer_moves=replicas.layer_moves, directive_wait=replicas.directive_wait,
                     router_decisions=replicas.router_decisions)


def _launch(spec: SystemSpec, port: int, token: str, ctx: RunContext, config_path: Path) -> tuple[list[str], dict]:
    threads = {"OMP_NUM_THREADS": str(ctx.threads)}
    if spec.kind == "vllm":
        return (vllm_command(ctx.vllm_python, ctx.hf_dir, port, ctx.plan, ctx.served_name),
                {**vllm_env(ctx.threads), "PYTHONPATH": ""})
    args = morphserve_app_args(spec, ctx.plan, ctx.hf_dir, token)
    args["served_model_name"] = ctx.served_name
    args["engine"]["num_threads"] = max(1, ctx.threads // spec.replicas)  # replicas share the cores
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(json.dumps(serve_config(args, port), indent=1), encoding="utf-8")
    serve_bin = shutil.which("serve", path=str(Path(sys.executable).parent)) or "serve"
    # The token is in the config file (logs/ of this run's folder), never on a command line.
    return morphserve_command(serve_bin, str(config_path)), {**threads, "PYTHONPATH": str(REPO)}


def _warm_up(base: str, model: str) -> None:
    """One tiny request, so a first-call cost (lazy init, kernel selection) is not in the first TTFT. Its
    own system message opens the prompt, so no two warm-ups share a prefix: the pressure router's prefix
    affinity would send every warm-up to the replica that served the first (seen: 1278 warm-ups on one
    replica, none on the other)."""
    system = f"Warm-up {uuid.uuid4().hex}."
    body = json.dumps({"model": model, "messages": [{"role": "system", "content": system},
                                                    {"role": "user", "content": "Hi"}],
                       "max_tokens": 4, "temperature": 0.0})
    status, text = http_post_json(f"{base}/v1/chat/completions", body, timeout_s=300)
    if status != 200:
        raise ServerStartError(f"warm-up request failed: HTTP {status}: {text[:300]}")


def _warm_up_replicas(base: str, token: str, model: str, replicas: int, deadline_s: float) -> dict[str, int]:
    """Wait until every engine replica is routable and has served a warm-up request; the generate calls
    each served by then (the warm-ups, so the replay's own count can be told apart). The app answers
    as soon as one replica is up; a fleet replica still starting (its controller connection included)
    would otherwise miss the replay's first seconds, and Serve's router would put the first burst on
    the other one (seen in the fleet benchmark: 91 of 141 requests on one replica, 33 misses)."""
    auth = {"Authorization": f"Bearer {token}"}
    end = time.monotonic() + deadline_s
    calls: dict[str, int] = {}
    while True:
        with concurrent.futures.ThreadPoolExecutor(replicas) as pool:  # at once, so the router spreads them
            list(pool.map(lambda _: _warm_up(base, model), range(replicas)))
        for _ in range(4 * replicas):  # Serve routes each call to one replica: ask until each answered
            try:
                status, text = http_get(f"{base}/admin/morph", auth)
                counted = _generate_calls(json.loads(text)) if status == 200 else None
            except (OSError, ValueError):
                continue  # a slow answer while replicas start; the deadline bounds the wait
            if counted is not None:
                calls[counted[0]] = counted[1]
        if len(calls) >= replicas and all(n > 0 for n in calls.values()):
            return calls
        if time.monotonic() > end:
            raise ServerStartError(f"{replicas} engine replicas not all up and warmed in {deadline_s:g} s "
                                   f"(generate calls seen per replica: {calls})")
        time.sleep(0.2)  # a replica still loading: do not flood the one that is up with warm-ups


def _generate_calls(status: dict) -> tuple[str, int] | None:
    """(replica id, generate calls it has received) from one replica's /admin/morph body; None without them."""
    replica_id, calls = status.get("replica_id"), (status.get("queue") or {}).get("generate_calls")
    return (str(replica_id), calls) if replica_id and isinstance(calls, int) else None


def _configure(base: str, token: str, spec: SystemSpec, model: str, deadline_s: float) -> None:
    """Send the spec's admin updates, then wait until the pinned layer count is reached (swaps happen
    at step boundaries, so tiny requests keep the engine stepping meanwhile)."""
    auth = {"Authorization": f"Bearer {token}"}
    for update in spec.admin_updates():
        status, text = http_post_json(f"{base}/admin/morph", json.dumps(update), auth)
        if status != 200:
            raise ServerStartError(f"POST /admin/morph {update} -> HTTP {status}: {text[:300]}")
    if spec.pin_int4_layers is None:
        return
    end = time.monotonic() + deadline_s
    while True:
        status, text = http_get(f"{base}/admin/morph", auth)
        if status == 200 and morphserve_status(text).get("quantized_layers") == spec.pin_int4_layers:
            return
        if time.monotonic() > end:
            raise ServerStartError(f"{spec.name}: {spec.pin_int4_layers} INT4 layers not reached in {deadline_s:g} s "
                                   f"(last status {text[:300]})")
        _warm_up(base, model)  # keeps the engine stepping so pending swaps are applied


def _replay(spec: SystemSpec, base: str, token: str, requests: Sequence[LoadRequest], ctx: RunContext,
            warm_up_calls: Mapping[str, int]):
    last = max((r.scheduled_s for r in requests), default=0.0)
    config = LoadGenConfig(base_url=base, model=ctx.served_name, api="chat", deadline_s=last + ctx.drain_s,
                           status_url=f"{base}/metrics" if spec.kind == "vllm" else None,
                           status_interval_s=ctx.status_interval_s,
                           status_parser=vllm_status_parser() if spec.kind == "vllm" else None)
    if spec.kind == "vllm":
        result = replay(requests, config)
        return result, list(result.samples), ReplicaTotals()
    # /admin/morph needs the bearer token, which the load generator's sampler does not send: sample it
    # here, on the same clock (the load generator's zero = its call time + start_delay_s, to within
    # the ms its session setup takes).
    sampler = _AdminSampler(f"{base}/admin/morph", token, ctx.status_interval_s, spec.replicas)
    decisions_before = _router_decisions(base, token)
    sampler.start(time.perf_counter() + config.start_delay_s)
    try:
        result = replay(requests, config)
    finally:
        samples = sampler.stop()
    decisions = routed_during(decisions_before, _router_decisions(base, token))
    return result, samples, dataclasses.replace(sampler.totals(warm_up_calls), router_decisions=decisions)


def _router_decisions(base: str, token: str) -> dict[str, int] | None:
    """The pressure-aware router's decisions so far (GET /admin/router; the ingress's one replica);
    None when the server has no such route or does not answer."""
    try:
        status, text = http_get(f"{base}/admin/router", {"Authorization": f"Bearer {token}"})
        decisions = json.loads(text).get("decisions") if status == 200 else None
    except (OSError, ValueError, AttributeError):
        return None
    return {str(k): int(v) for k, v in decisions.items()} if isinstance(decisions, dict) else None


def routed_during(before: Mapping[str, int] | None, after: Mapping[str, int] | None) -> dict[str, int] | None:
    """The decisions made between two readings (the replay's, without the warm-ups'); None without both,
    or when a count went down (the ingress restarted between them: the difference would mislead)."""
    if before is None or after is None or any(after.get(k, 0) < n for k, n in before.items()):
        return None
    return {k: n - before.get(k, 0) for k, n in after.items() if n - before.get(k, 0) > 0}


@dataclasses.dataclass(frozen=True)
class ReplicaTotals:
    """Counts each engine replica keeps over its life, read after the replay from every replica."""
    generate_calls: tuple[int, ...] = ()  # per replica, the replay's (how the router spread the load)
    waiting_rounds: Mapping[str, int] = dataclasses.field(default_factory=dict)  # cause -> rounds, all replicas
    layer_moves: LayerMoves | None = None  # a fleet's morphs and restores during the replay (None: one replica)
    # Every replica's morph-loop waits for a directive (deployments/directive_wait.py), merged, from each
    # one's first reading in the replay to its last; None when the engines do not report them.
    directive_wait: Mapping | None = None
    # The pressure-aware router's decisions during the replay, by kind (router.DECISIONS), read from the
    # ingress (GET /admin/router); {} with Serve's default router, None when not read.
    router_decisions: Mapping[str, int] | None = None


class _AdminSampler:
    """Polls /admin/morph, which one replica answers per call. With several replicas, each answer also
    carries that replica's own history of quantized-layer changes; at the end every sample's
    `quantized_layers` becomes the fleet's total at that instant (metrics.fleet_total_at), so the
    quantized layer-seconds count every replica, not whichever one Serve routed the poll to."""

    def __init__(self, url: str, token: str, interval_s: float, replicas: int = 1):
        self.url, self.headers, self.interval_s = url, {"Authorization": f"Bearer {token}"}, interval_s
        self.replicas = replicas
        self.samples: list[ServerSample] = []
        self.histories: dict[str, list] = {}  # replica id -> its latest quantized_history
        self.generate_calls: dict[str, int] = {}  # replica id -> generate calls it received (how load spread)
        self.waiting_rounds: dict[str, dict[str, int]] = {}  # replica id -> its MorphLoop.waiting_rounds
        # replica id -> (first, latest) reading of its directive waits during the replay
        self.directive_waits: dict[str, tuple[dict, dict]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._wall_minus_perf = time.time() - time.perf_counter()
        self._moves: LayerMoves | None = None  # set by stop(): the replay's morphs and restores

    def start(self, t0: float) -> None:
        self._t0 = t0
        self._thread = threading.Thread(target=self._run, args=(t0,), daemon=True)
        self._thread.start()

    def _poll(self, t0: float) -> None:
        started = time.perf_counter()
        try:
            status, body = http_get(self.url, self.headers, timeout_s=5.0)
            if status == 200:
                self.samples.append(ServerSample(t_s=started - t0, values=morphserve_status(body),
                                                 labels=morphserve_labels(body)))
                parsed = json.loads(body)
                if isinstance(parsed.get("quantized_history"), list):
                    self.histories[str(parsed.get("replica_id"))] = parsed["quantized_history"]
                counted = _generate_calls(parsed)
                if counted is not None:
                    self.generate_calls[counted[0]] = counted[1]
                if isinstance(parsed.get("waiting_rounds"), dict):
                    self.waiting_rounds[str(parsed.get("replica_id"))] = parsed["waiting_rounds"]
                reading = parsed.get("directive_wait")
                if isinstance(reading, dict):
                    rid = str(parsed.get("replica_id"))
                    first = self.directive_waits[rid][0] if rid in self.directive_waits else reading
                    self.directive_waits[rid] = (first, reading)
        except (OSError, ValueError):
            pass  # a missed sample is a gap in the plot, not a failed run

    def _run(self, t0: float) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            self._poll(t0)
            self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - started)))

    def totals(self, warm_up_calls: Mapping[str, int] | None = None) -> ReplicaTotals:
        """The counts summed over replicas; generate calls less the warm-ups each replica served."""
        waits: dict[str, int] = {}
        for counts in self.waiting_rounds.values():
            for cause, n in counts.items():
                waits[cause] = waits.get(cause, 0) + int(n)
        warm = warm_up_calls or {}
        calls = tuple(n - warm.get(rid, 0) for rid, n in sorted(self.generate_calls.items()))
        return ReplicaTotals(calls, waits, self._moves, directive_wait.merged(self._directive_waits()))

    def _directive_waits(self) -> list[dict]:
        """Each replica's directive waits between its first and last reading; a replica whose counts went
        down (restarted during the replay) is left out, with a line in the log, not a failed run."""
        waited = []
        for rid, (first, last) in sorted(self.directive_waits.items()):
            try:
                waited.append(directive_wait.since(first, last))
            except ValueError as e:
                _log(f"    replica {rid}: directive waits left out ({e})")
        return waited

    def stop(self, final_polls: int = 40) -> list[ServerSample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.replicas <= 1:
            return list(self.samples)
        during_run = len(self.samples)  # the polls below only fetch histories; their samples are not kept
        # Every replica's history, as of after the run (Serve picks the replica per call: poll until each answered).
        seen_after = set()
        for _ in range(final_polls):
            if len(seen_after) >= self.replicas:
                break
            before = dict(self.histories)
            self._poll(self._t0)
            seen_after |= {rid for rid, h in self.histories.items() if h is not before.get(rid)}
        if self.generate_calls:  # shows how the router spread the load (totals() takes the warm-ups off)
            _log(f"    generate calls per replica (warm-ups included): {dict(sorted(self.generate_calls.items()))}")
        offset = self._t0 + self._wall_minus_perf  # sampler time t_s -> wall clock
        samples = list(self.samples)[:during_run]
        if samples:
            self._moves = layer_moves(self.histories, offset, samples[-1].t_s + offset)
        return [dataclasses.replace(s, values={**s.values, "quantized_layers": float(fleet_total_at(self.histories, s.t_s + offset)),
                                               "replicas_seen": float(len(self.histories))})
                for s in samples]


def _log(msg: str) -> None:
    print(msg, flush=True)
