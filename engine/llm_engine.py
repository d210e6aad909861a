"""LLMEngine: the synchronous step loop. add_request -> step() ... -> outputs; morph actions run
between steps (`_at_step_boundary`), never inside one.

One step: schedule (decodes first, chunked prefills, preemption by recompute) -> run the model ->
sample one token for each chunk that ends at its request's last token -> stop checks -> deltas.
"""
from __future__ import annotations

import logging
import time

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.errors import EngineOverloadedError, InvalidRequestError, ModelLoadError, StepFailed
from engine.kv_cache_manager import KVCacheManager
from engine.kv_storage import KVStorage
from engine.ledger import MemoryLedger, MemoryPlan, plan_memory
from engine.loader import load_config, load_weights, resolve_model
from engine.model import Transformer, build_model, layer_bias_names, linear_shapes
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.monitor import PressureMonitor
from engine.morph.actions import ActionResult, MorphAction, MorphState
from engine.morph.kv_resizer import KVResizer
from engine.morph.executor import MorphExecutor, prepare_morphing
from engine.outputs import RequestOutput, StepResult
from engine.precision import full_precision_for
from engine.pressure import PressureSnapshot
from engine.quant import quantized_nbytes
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus, StopChecker
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN_CAP = 8192


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        files = resolve_model(config.model, config.cache_path)
        self.model_name = config.served_model_name or files.name
        self.model_config: ModelConfig = load_config(files.hf_dir)
        self.max_model_len = _max_model_len(config, self.model_config)
        self.tokenizer = _load_tokenizer(files.hf_dir)
        self.model: Transformer = build_model(self.model_config, load_weights(files.hf_dir, config.torch_dtype),
                                              config.torch_dtype, self.device)
        self.full_precision = full_precision_for(config.torch_dtype)
        # Host store + swap order, validated before memory is planned (may start with layers swapped down).
        self.morph_setup = prepare_morphing(self, files) if config.enable_morphing else None
        self.memory_plan = self._plan_memory()
        self._build_memory(self.memory_plan)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.runner = ModelRunner(self.model, self.storage, self.device)
        self.monitor = PressureMonitor(self.scheduler, self.pool, self.ledger)
        self.kv_resizer = KVResizer(self.pool, self.storage, self.kv_manager, self.ledger,
                                    min_blocks=self.memory_plan.min_blocks)
        # None = morphing disabled
        self.morph_executor = MorphExecutor.for_engine(self, self.morph_setup) if self.morph_setup else None
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | frozenset(
            self.tokenizer.eos_token_ids if self.tokenizer is not None else ())
        self._requests: dict[str, Sequence] = {}
        self._seed_source = torch.Generator().manual_seed(config.seed)

    # -- memory ------------------------------------------------------------------------------
    def _plan_memory(self) -> MemoryPlan:
        cfg, mc = self.config, self.model_config
        elem = torch.empty((), dtype=cfg.torch_dtype).element_size()
        reserve = cfg.reserve if cfg.reserve is not None else (
            cfg.max_num_batched_tokens * (mc.hidden_size + mc.intermediate_size + mc.vocab_size) * elem)
        base = self.model.base_weight_bytes()
        weights = base + sum(self.model.layer_weight_bytes(i) for i in range(mc.num_layers))
        lowest = base + mc.num_layers * self._lowest_layer_bytes() if cfg.enable_morphing else weights
        block_bytes = mc.num_layers * 2 * cfg.block_size * mc.num_kv_heads * mc.head_dim * elem
        return plan_memory(cfg.memory_budget_bytes, weights, lowest, int(reserve), block_bytes,
                           min_blocks=-(-self.max_model_len // cfg.block_size))

    def _lowest_layer_bytes(self) -> int:
        """One layer's linears at the ladder's lowest rung (sizes known before quantizing)."""
        lowest = self.config.ladder[-1]
        biased = layer_bias_names(self.model_config, 0)
        return sum(quantized_nbytes(lowest, out_f, in_f, self.config.int4_group_size,
                                    bias_dtype=self.config.torch_dtype if name in biased else None)
                   for name, (out_f, in_f) in linear_shapes(self.model_config).items())

    def _build_memory(self, plan: MemoryPlan) -> None:
        mc = self.model_config
        self.ledger = MemoryLedger(plan.budget, plan.reserve)
        self.ledger.set_base_weights(self.model.base_weight_bytes())
        for i in range(mc.num_layers):
            self.ledger.set_layer_weights(i, self.model.layer_weight_bytes(i))
        self.ledger.set_kv(plan.capacity * plan.block_bytes)
        self.pool = BlockPool(plan.capacity, plan.max_blocks)
        self.storage = KVStorage(mc.num_layers, self.config.block_size, mc.num_kv_heads, mc.head_dim,
                                 self.config.torch_dtype, self.device, plan.max_blocks, plan.capacity)
        self.kv_manager = KVCacheManager(self.pool, self.config.block_size)

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        params = params if params is not None else SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        token_ids = self._prompt_tokens(prompt)
        self._check_lengths(len(token_ids), params)
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise EngineOverloadedError(
                f"{self.scheduler.num_waiting} requests are waiting (max_waiting={self.config.max_waiting}); retry later")
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_source).item())
        generator = torch.Generator(device=self.device).manual_seed(seed)
        seq = Sequence(request_id, token_ids, params, time.monotonic(), generator,
                       stop_checker=StopChecker(self.tokenizer, params, self.eos_token_ids, tuple(token_ids)))
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def _prompt_tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model folder has no tokenizer; send the prompt as token ids", param="prompt")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
            vocab = self.model_config.vocab_size
            if any(not 0 <= t < vocab for t in token_ids):
                raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab})", param="prompt")
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        if not token_ids:
            raise InvalidRequestError("prompt is empty; send at least one token", param="prompt")
        return token_ids

    def _check_lengths(self, num_prompt: int, params: SamplingParams) -> None:
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {num_prompt} tokens; this model's context (max_model_len) is {self.max_model_len}, "
                f"so the prompt must be shorter than that", param="prompt")
        if num_prompt + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"{self.max_model_len}; lower max_tokens to at most {self.max_model_len - num_prompt}", param="max_tokens")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; None when it is unknown or already finished."""
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "abort", time.monotonic())
        return self._output(seq, seq.stop_checker.flush(finished=True))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_pending_morph(self) -> bool:
        """Morph work accepted but not finished (a target needing more steps, a waiting restore):
        a step continues it even when no request is running."""
        return self.morph_executor is not None and self.morph_executor.has_pending()

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> StepResult:
        morph_results = self._at_step_boundary()
        out = self.scheduler.schedule()
        if out.is_empty:
            return StepResult((), morph_results)
        try:
            logits = self.runner.execute(out)
            outputs = self._process(out, logits)
        except Exception as e:
            ids = tuple(dict.fromkeys(c.request_id for c in out.chunks))
            logger.exception("engine step failed for requests %s; aborting them", list(ids))
            for rid in ids:
                if rid in self._requests:
                    self._finish(self._requests[rid], "abort", time.monotonic())
            raise StepFailed(ids, e, morph_results) from e
        finally:
            self.monitor.on_step()
        return StepResult(tuple(outputs), morph_results)

    def _at_step_boundary(self) -> tuple[ActionResult, ...]:
        """Where pending morph actions run: no model step is reading weights or KV now."""
        if self.morph_executor is None:
            return ()
        return tuple(self.morph_executor.run_pending())

    def _process(self, out, logits: torch.Tensor) -> list[RequestOutput]:
        for c in out.chunks:
            self._requests[c.request_id].num_computed_tokens = c.end_pos
        seqs = [self._requests[c.request_id] for c in out.chunks if c.needs_logits]
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        now = time.monotonic()
        self.monitor.record_tokens(now, len(tokens))
        return [self._append_token(seq, token, now) for seq, token in zip(seqs, tokens)]

    def _append_token(self, seq: Sequence, token: int, now: float) -> RequestOutput:
        seq.output_token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.monitor.record_first_token(now, now - seq.arrival_time)
        else:
            self.monitor.record_decode_gap(now, now - seq.last_token_time)
        seq.last_token_time = now
        reason = seq.stop_checker.push(token)
        if reason is None and seq.num_output_tokens >= seq.params.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(seq, reason, now)
        return self._output(seq, seq.stop_checker.flush(finished=reason is not None))

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.finish_time = reason, now
        self.scheduler.remove(seq)
        self._requests.pop(seq.request_id, None)

    def _output(self, seq: Sequence, text: str) -> RequestOutput:
        new_ids = tuple(seq.output_token_ids[seq.emitted_token_len:])
        seq.emitted_token_len = seq.num_output_tokens
        return RequestOutput(
            request_id=seq.request_id, text=text, token_ids=new_ids, num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens, finish_reason=seq.finish_reason,
            arrival_time=seq.arrival_time, first_token_time=seq.first_token_time, finish_time=seq.finish_time)

    # -- pressure and morphing ---------------------------------------------------------------
    def pressure(self) -> PressureSnapshot:
        return self.monitor.snapshot()

    def morph_state(self) -> MorphState:
        if self.morph_executor is not None:
            return self.morph_executor.morph_state()
        n = self.model_config.num_layers
        return MorphState(layer_precisions=(self.full_precision,) * n, full_precision=self.full_precision,
                          swap_order=tuple(range(n)), swap_order_source="front-to-back",
                          kv_capacity_blocks=self.pool.capacity, kv_max_blocks=self.pool.max_blocks,
                          morphing_enabled=False)

    def apply(self, action: MorphAction) -> ActionResult:
        """Run a morph action now (the caller guarantees a step boundary: it is not inside step())."""
        if self.morph_executor is None:
            return ActionResult(action=action, status="rejected",
                                message="morphing is disabled (no morph executor on this engine)")
        return self.morph_executor.apply(action)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.kv_manager.check_integrity()
        self.ledger.check_integrity()


def _max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    if config.max_model_len is None:
        return min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)
    if config.max_model_len > mc.max_position_embeddings:
        raise ModelLoadError(f"max_model_len={config.max_model_len} exceeds the model's context of "
                             f"{mc.max_position_embeddings} tokens; lower max_model_len")
    return config.max_model_len


def _load_tokenizer(hf_dir) -> Tokenizer | None:
    try:
        return Tokenizer.from_dir(hf_dir)
    except ModelLoadError as e:
        logger.warning("no usable tokenizer in %s (%s); only token-id prompts will work", hf_dir, e)
        return None
