"""LLMServer: the engine replica deployment. It owns one AsyncLLMEngine and runs its MorphLoop.

The ingress reaches it through a DeploymentHandle (HandleEngineClient); its public methods have the
EngineClient's names. `generate` is a streaming method: engine errors become a final chunk with
`error` set (they do not survive the Ray boundary as exceptions), and a cancelled stream (client
gone) aborts the engine request at once. `record_autoscaling_stats` feeds Ray Serve's autoscaler
(deployments/autoscaling.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import time
from typing import Any, AsyncIterator

from ray import serve

from controller.client import ControllerClient
from deployments.app_args import AppArgs
from deployments.autoscaling import KV_USAGE_METRIC, QUANTIZED_METRIC, SCALE_OUT_METRIC, WAITING_METRIC
from deployments.engine_client import (AdminUpdate, EngineErrorInfo, GenerateChunk, GenerateRequest, ModelInfo,
                                       chunk_from_output, error_info_from_exception, stream_with_error_chunks)
from deployments.metrics import ServeMetrics
from deployments.morph_loop import MorphLoop
from deployments.router import ReplicaLoad
from engine.async_engine import AsyncLLMEngine
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.tokenizer import TokenizerFiles

log = logging.getLogger("morphserve.replica")
STEP_METRICS_INTERVAL_S = 1.0


def resolve_device(wanted: str) -> str:
    if wanted != "auto":
        return wanted
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def demand_summary(s) -> dict[str, Any]:
    """The snapshot's KV demand and admission-morph figures (engine/demand.py, engine/morph/admission.py)."""
    return {"waiting_for": s.waiting_for, "waiting_demand_blocks": s.waiting_demand_blocks,
            "head_demand_blocks": s.head_demand_blocks, "running_reserved_blocks": s.running_reserved_blocks,
            "running_finish_blocks": s.running_finish_blocks, "available_blocks": s.available_blocks,
            "reservation_tokens": s.reservation_tokens, "rung_gain_blocks": dict(s.rung_gain_blocks),
            "ttft_recent_p95_s": s.ttft_recent_p95_s, "head_blocked_since": s.head_blocked_since,
            "admission_swaps_total": s.admission_swaps_total, "admission_layers_total": s.admission_layers_total,
            "admission_restores_total": s.admission_restores_total, "admission_capped_total": s.admission_capped_total}


def resident_set() -> dict[str, int | None]:
    """This process's resident set (Linux /proc/self/statm), for the admin status and the soak: the
    total, and its anonymous part (heap, tensors). The rest is file-backed: pages of mapped files such
    as the host store's layers (engine/morph/mapped_file.py), which the kernel may drop at any time and
    which cannot grow beyond the files' size, so a leak shows in the anonymous part."""
    try:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        page = os.sysconf("SC_PAGE_SIZE")
        resident, shared = int(fields[1]) * page, int(fields[2]) * page
        return {"rss_bytes": resident, "rss_anon_bytes": resident - shared}
    except (OSError, ValueError, IndexError):
        return {"rss_bytes": None, "rss_anon_bytes": None}


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (tests constructing the class directly)
        return f"local-{secrets.token_hex(4)}"


class LLMServer:
    async def __init__(self, args: AppArgs | dict):
        self.args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
        self.replica_id = _replica_id()
        self.config = config = self.args.engine_config(resolve_device(self.args.device))
        self.block_size = config.block_size
        self._last_admission: dict[str, Any] | None = None  # served when a status cannot wait for a boundary
        self.generate_calls = 0  # generate calls this replica received (how a router spread the load)
        started = time.monotonic()
        client = ControllerClient(self.replica_id, self.args.policy_config(), name=self.args.controller_name,
                                  namespace=self.args.controller_namespace, timeout_s=self.args.controller_timeout_s,
                                  create_with=self.args.fleet_config(), use_controller=self.args.fleet_controller)
        # The fleet controller starts (or is found) while the model loads, and the replica is ready only
        # once it answered: else it came up as the first requests did, taking CPU from them, and a
        # budgeted fleet's replicas could not morph until it answered (their share is 0 before).
        connecting = asyncio.get_running_loop().create_task(client.connect(self.args.controller_start_timeout_s))
        # Loading (and, the first time, preparing the host store) blocks: keep it off the event loop.
        try:
            self.engine = await asyncio.to_thread(AsyncLLMEngine, config)
        except BaseException:
            connecting.cancel()  # the replica fails its start; nothing is left waiting on the controller
            raise
        self.load_seconds = time.monotonic() - started
        self.created = int(time.time())
        self.metrics = ServeMetrics(self.engine.model_name, max_model_len=self.engine.max_model_len)
        self.morph_loop = MorphLoop(self.engine, client, self.metrics, interval_s=self.args.report_interval_s,
                                    max_layers_per_step=self.args.max_layers_per_step, ladder=config.ladder)
        if await connecting:
            try:
                await self.morph_loop.run_once()  # its first directive (a budgeted fleet's grant) before any request
            except Exception:  # the loop's own rounds retry; a start is not worth failing for it
                log.exception("first morph-loop round failed; the loop tries again")
        self.morph_loop.start()
        self._step_metrics = asyncio.get_running_loop().create_task(self._export_step_stats())
        log.info("replica %s serves %s (loaded in %.1f s)", self.replica_id, self.engine.model_name, self.load_seconds)

    # -- EngineClient methods (called through the DeploymentHandle) --------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.generate_calls += 1
        async for chunk in stream_with_error_chunks(request, self._generate(request)):
            yield chunk

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        params = SamplingParams.create(**request.sampling_kwargs())
        # A client may reuse an x-request-id for two requests at once; the engine must never see both.
        engine_id = f"{request.request_id}-{secrets.token_hex(4)}"
        stream = self.engine.generate(engine_id, list(request.prompt_token_ids), params)
        try:
            async for output in stream:
                chunk = dataclasses.replace(chunk_from_output(output), request_id=request.request_id)
                if output.finished:
                    waited = output.queue_time_s
                    if waited is not None:
                        self.metrics.observe_queue_time(waited)
                        chunk = dataclasses.replace(chunk, queue_time_s=round(waited, 6))
                yield chunk
        finally:
            await stream.aclose()  # aborts the engine request when we stop early

    async def model_info(self) -> ModelInfo:
        tokenizer = self.engine.tokenizer
        eos = tuple(sorted(set(self.engine.model_config.eos_token_ids) |
                           set(tokenizer.eos_token_ids if tokenizer is not None else ())))
        return ModelInfo(self.engine.model_name, self.engine.max_model_len, self.engine.model_config.vocab_size,
                         eos, self.created, (self.config.max_stop_strings, self.config.max_stop_string_chars))

    async def tokenizer_files(self) -> TokenizerFiles | None:
        """The tokenizer as plain values: the ingress tokenizes with its own copy (None: no tokenizer)."""
        tokenizer = self.engine.tokenizer
        return None if tokenizer is None else tokenizer.files()

    def _tokenizer(self):
        if self.engine.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; send /v1/completions prompts as token ids",
                                      param="prompt")
        return self.engine.tokenizer

    # Tokenizing a long prompt takes a while: on a worker thread, so the replica's event loop keeps
    # streaming other requests and answering health checks meanwhile.
    async def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        tokenizer = self._tokenizer()
        return await asyncio.to_thread(lambda: list(tokenizer.encode(text, add_special_tokens=add_special_tokens)))

    async def detokenize(self, token_ids: list[int]) -> str:
        tokenizer = self._tokenizer()
        vocab = self.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="tokens")
        return await asyncio.to_thread(lambda: tokenizer.decode(token_ids, skip_special_tokens=False))

    async def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        tokenizer = self._tokenizer()
        return await asyncio.to_thread(lambda: list(tokenizer.encode(tokenizer.apply_chat_template(messages))))

    async def check_health(self) -> None:
        """Also Ray Serve's health check. It reads the stepping thread's heartbeat and never waits
        for a step boundary, so a burst of queued work cannot make a busy, healthy replica fail it."""
        self.engine.check_alive(self.args.engine_stall_s)

    async def admin_status(self) -> dict[str, Any]:
        # The snapshot and state the stepping thread published after its latest round: an operator's
        # look does not queue behind generation (the morph loop takes fresh ones every round).
        snapshot, state = self.engine.pressure(), self.engine.morph_state()
        admission = await self._admission_status()
        return {
            "replica_id": self.replica_id, "model": self.engine.model_name,
            "mode": self._mode(), "morphing_enabled": self.morph_loop.pins.morphing_enabled,
            "morph_state": {"num_layers": len(state.layer_precisions), "num_quantized": state.num_quantized,
                            "precisions": [p.value for p in state.layer_precisions],
                            "swap_order": list(state.swap_order), "swap_order_source": state.swap_order_source,
                            "kv_capacity_blocks": state.kv_capacity_blocks, "kv_max_blocks": state.kv_max_blocks,
                            "pending": len(state.pending), "engine_morphing_enabled": state.morphing_enabled,
                            "forced_quantized": state.forced_quantized,
                            "capability": None if state.capability is None else state.capability.as_dict()},
            "pressure": {"kv_usage": round(snapshot.kv_usage, 4), "kv_used_blocks": snapshot.kv_used_blocks,
                         "num_running": snapshot.num_running, "num_waiting": snapshot.num_waiting,
                         "queue_delay_s": snapshot.queue_delay_s, "preemptions_total": snapshot.preemptions_total,
                         "memory": dataclasses.asdict(snapshot.ledger), **demand_summary(snapshot)},
            "admission": admission,
            "load_seconds": round(self.load_seconds, 3),
            "queue": {"live_requests": self.engine.num_live, "capacity": self.engine.capacity,
                      "generate_calls": self.generate_calls},
            "process": {"pid": os.getpid(), **resident_set()},
            **self.morph_loop.status(),
        }

    async def _admission_status(self) -> dict[str, Any] | None:
        """The admission morph's status, read at a step boundary. When no boundary comes within 0.2 s
        (a long step), the last one read, marked `"stale": true`, so an admin call never waits behind
        generation for longer; None only before the first read."""
        try:
            status = await asyncio.wait_for(self.engine.run_at_step_boundary(
                lambda e: e.admission.status() if getattr(e, "admission", None) is not None else None), 0.2)
        except asyncio.TimeoutError:
            last = self._last_admission
            return None if last is None else {**last, "stale": True}
        self._last_admission = status
        return status

    async def admin_set(self, update: AdminUpdate) -> dict[str, Any] | EngineErrorInfo:
        """The new status, or why the update is impossible (as a value: see engine_client)."""
        try:
            await self.morph_loop.update(update)
        except InvalidRequestError as e:
            return error_info_from_exception(e)
        return await self.admin_status()

    def _mode(self) -> str:
        last = self.morph_loop.last
        return self.morph_loop.pins.mode or (last.directive.mode if last else self.args.mode)

    async def _export_step_stats(self) -> None:
        """Per-step records into the iteration histograms, once a second (the log is bounded)."""
        while True:
            await asyncio.sleep(STEP_METRICS_INTERVAL_S)
            try:
                self.metrics.observe_steps(self.engine.drain_step_stats())
            except Exception:  # metrics never take the replica down
                log.exception("could not export step metrics")

    # -- Ray Serve hooks ---------------------------------------------------------------------
    def record_autoscaling_stats(self) -> dict[str, float]:
        last = self.morph_loop.last
        snapshot = self.engine.pressure()
        return {SCALE_OUT_METRIC: 1.0 if last is not None and last.directive.scale_out else 0.0,
                QUANTIZED_METRIC: float(self.engine.morph_state().num_quantized),
                WAITING_METRIC: float(snapshot.num_waiting), KV_USAGE_METRIC: float(snapshot.kv_usage)}

    def record_routing_stats(self) -> dict[str, Any]:
        """What the pressure-aware router (deployments/router.py) reads: the KV blocks a new request
        may take now (free, less what running requests are owed and what the queue needs) and the prompt
        tokens a new request's first token waits behind. `taken_at` is the wall-clock cutoff of
        the snapshot (`AsyncLLMEngine.pressure_with_cutoff`): every request that reached the engine before
        it is in these figures, none after it, so the router counts every request it sent after it as
        not yet in them. The cutoff lies before the snapshot's step (it can be a long step old): counting
        from the step's end instead hid every request sent during a prefill step from the router."""
        snapshot, cutoff = self.engine.pressure_with_cutoff()
        wall, mono = time.time(), time.monotonic()
        taken_at = wall - max(0.0, mono - cutoff)
        # The figures are the step's end (the snapshot's own time, the engine clock): the router ages
        # the prefill backlog from there, as the step's prefill is already off it.
        measured_at = wall - max(0.0, mono - snapshot.time)
        if self.engine.num_live == 0:  # idle: the thread published its last round and nothing changed
            taken_at = measured_at = wall  # since (an idle engine does not step, so its snapshot would look stale)
        return ReplicaLoad(free_blocks=snapshot.available_blocks - snapshot.waiting_demand_blocks,
                           num_waiting=snapshot.num_waiting, block_size=self.block_size, taken_at=taken_at,
                           reservation_tokens=snapshot.reservation_tokens,
                           num_quantized=self.engine.morph_state().num_quantized,
                           morph_blocks=max(0, snapshot.kv_capacity_blocks - self.engine.base_kv_blocks),
                           prefill_tokens=snapshot.prefill_backlog_tokens,
                           prefill_tps=self.engine.prefill_tokens_per_s(),
                           capacity_blocks=snapshot.kv_capacity_blocks,
                           prefix_caching=self.config.enable_prefix_caching, measured_at=measured_at).to_stats()

    def __del__(self) -> None:
        # Ray Serve calls this when the replica stops; a half-built replica may lack both.
        if getattr(self, "morph_loop", None) is not None:
            self.morph_loop.cancel()
        if getattr(self, "_step_metrics", None) is not None:
            self._step_metrics.cancel()
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown(timeout_s=10.0)
