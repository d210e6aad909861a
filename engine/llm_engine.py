"""LLMEngine: the synchronous step loop. add_request -> step() ... -> outputs; morph actions run
between steps (`_at_step_boundary`), never inside one.

One step: schedule (decodes first, chunked prefills, preemption by recompute) -> run the model ->
sample one token for each chunk that ends at its request's last token -> stop checks -> deltas.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch

from engine.batch import SchedulerOutput
from engine.config import EngineConfig
from engine.engine_builder import EngineParts, build_engine_parts
from engine.errors import EngineOverloadedError, InvalidRequestError
from engine.morph.actions import ActionResult, MorphAction, MorphState
from engine.morph.admission import AdmissionGrant, AdmissionMorpher
from engine.outputs import RequestOutput, StepResult
from engine.prefix_hash import precision_tag
from engine.pressure import PressureSnapshot
from engine.request_extras import (ChunkResult, chunks_needing_every_row, commit_extras, compute_prompt_logprobs,
                                   compute_sampled_logprobs, row_context)
from engine.sampler import sample
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.sequence import Sequence, SequenceStatus, StopChecker
from engine.step_isolation import forward_isolating
from engine.step_stats import StepStats
from engine.structured_output import GrammarCompiler, GrammarState

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, parts: EngineParts | None = None):
        """`parts`: built by engine/engine_builder.py from `config` unless given."""
        parts = parts if parts is not None else build_engine_parts(config)
        if parts.config != config:
            raise ValueError("the engine parts were built from another config")
        self.config, self.device = config, torch.device(config.device)
        self.model_name, self.model_config, self.max_model_len = parts.model_name, parts.model_config, parts.max_model_len
        self.tokenizer, self.model, self.full_precision = parts.tokenizer, parts.model, parts.full_precision
        self.eos_token_ids, self.memory_plan, self.ledger = parts.eos_token_ids, parts.memory_plan, parts.ledger
        self.storage, self.pool, self.kv_manager = parts.storage, parts.pool, parts.kv_manager
        self.scheduler, self.runner, self.monitor = parts.scheduler, parts.runner, parts.monitor
        self.kv_resizer, self.morph_executor = parts.kv_resizer, parts.morph_executor
        # Morph at admission and restore by demand (engine/morph/admission.py), within the policy's grant.
        self.admission = AdmissionMorpher.for_engine(self) if self.morph_executor is not None else None
        self.monitor.admission = self.admission
        self._requests: dict[str, Sequence] = {}
        self._grammar: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._tag_prefix_cache()  # an engine may start with layers quantized

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    grammar: GrammarState | None = None) -> None:
        """`grammar`: params.structured_output already compiled (`compile_grammar`, off the step loop);
        compiled here when None."""
        params = params if params is not None else SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        params.check_stop_limits(self.config.max_stop_strings, self.config.max_stop_string_chars)
        token_ids = self._prompt_tokens(prompt)
        self._check_lengths(len(token_ids), params)
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise EngineOverloadedError(
                f"{self.scheduler.num_waiting} requests are waiting (max_waiting={self.config.max_waiting}); retry later")
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_source).item())
        generator = torch.Generator(device=self.device).manual_seed(seed)
        if grammar is None and params.structured_output is not None:
            grammar = self.compile_grammar(params.structured_output)
        seq = Sequence(request_id, token_ids, params, time.monotonic(), generator,
                       stop_checker=StopChecker(self.tokenizer, params, self.eos_token_ids, tuple(token_ids)))
        seq.grammar = grammar
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def compile_grammar(self, spec: StructuredOutput) -> GrammarState:
        """A request's grammar state; thread-safe, so the async engine compiles off the step loop."""
        return self._grammar_compiler().compile(spec)

    def _grammar_compiler(self) -> GrammarCompiler:
        """Built on first use: xgrammar's vocabulary view takes seconds and most engines never need it."""
        with self._grammar_lock:
            return self._build_grammar_compiler()

    def _build_grammar_compiler(self) -> GrammarCompiler:
        if self._grammar is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs the model's tokenizer", param="response_format")
            self._grammar = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                            tuple(sorted(self.eos_token_ids)))
        return self._grammar

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
        self._mark_scheduled(out, time.monotonic())
        num_decode, started = self._num_decode_tokens(out), time.perf_counter()
        try:
            generators = [s.generator for s in self._sampled_seqs(out) if not s.params.greedy]
            sampled, failed = forward_isolating(out, self._forward, generators)
            outputs = tuple(self._commit(sampled, failed))
            stats = StepStats(out.num_tokens - num_decode, num_decode, time.perf_counter() - started)
            return StepResult(outputs, morph_results, stats)
        finally:
            self.monitor.on_step()

    def _num_decode_tokens(self, out: SchedulerOutput) -> int:
        """Decode chunks: one token with the whole prompt already in the KV cache (the rest is prefill)."""
        return sum(1 for c in out.chunks if len(c.token_ids) == 1 and
                   c.start_pos >= self._requests[c.request_id].num_prompt_tokens)

    def _at_step_boundary(self) -> tuple[ActionResult, ...]:
        """Where pending morph actions run: no model step is reading weights or KV now."""
        if self.morph_executor is None:
            return ()
        results = list(self.morph_executor.run_pending())
        if self.admission is not None:  # a request the step could start does not fit: swap for it first
            admitted = self.admission.at_boundary(time.monotonic())
            if admitted is not None:
                results.append(admitted)
        if results:
            self._tag_prefix_cache()
        return tuple(results)

    def _tag_prefix_cache(self) -> None:
        """Blocks computed from now on are cached as exact or morphed, by the layer precisions in force
        (engine/prefix_hash.py)."""
        if self.morph_executor is not None:
            self.kv_manager.precision_tag = precision_tag(self.morph_executor.morph_state().layer_precisions,
                                                          self.full_precision)

    def _mark_scheduled(self, out: SchedulerOutput, now: float) -> None:
        for c in out.chunks:
            seq = self._requests[c.request_id]
            if seq.first_scheduled_time is None:  # kept across preemptions: queue time is the first wait
                seq.first_scheduled_time = now

    def _sampled_seqs(self, out: SchedulerOutput) -> list[Sequence]:
        return [self._requests[c.request_id] for c in out.chunks if c.needs_logits]

    def _forward(self, out: SchedulerOutput) -> list[ChunkResult]:
        """Model + sampler for `out`: one result per chunk (token None when the chunk needs no logits),
        with the logprobs its request asked for. Reads request state only (see request_extras)."""
        every_row_of = chunks_needing_every_row(out.chunks, self._requests)
        if every_row_of:  # some request wants prompt logprobs: the logits of every row of its chunk too
            logits, every = self.runner.execute_with_chunk_logits(out, every_row_of)
        else:
            logits, every = self.runner.execute(out), {}
        seqs = self._sampled_seqs(out)
        sampled = sample(logits, [s.params for s in seqs], [s.generator for s in seqs],
                         [row_context(s) for s in seqs])
        sampled_lps = compute_sampled_logprobs(logits, seqs, sampled, self._decode_token)
        tokens, lps = iter(sampled), iter(sampled_lps)
        return [ChunkResult(c, next(tokens) if c.needs_logits else None, next(lps) if c.needs_logits else None,
                            compute_prompt_logprobs(self._requests[c.request_id], c, every[i], self._decode_token)
                            if i in every else ())
                for i, c in enumerate(out.chunks)]

    def _decode_token(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer is not None else ""

    def _commit(self, sampled: list[ChunkResult], failed: list[tuple[str, Exception]]) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = [self._fail(self._requests[rid], e, now) for rid, e in failed]
        for r in sampled:
            seq = self._requests[r.chunk.request_id]
            seq.num_computed_tokens = r.chunk.end_pos
            self.kv_manager.cache_computed(seq.request_id, seq.num_computed_tokens, seq.token_slice, seq.params.cache_salt)
        kept = [(self._requests[r.chunk.request_id], r) for r in sampled]
        self.monitor.record_tokens(now, sum(1 for _, r in kept if r.token is not None))
        for seq, r in kept:
            try:
                commit_extras(seq, r)
                if r.token is not None:
                    outputs.append(self._append_token(seq, r.token, now))
            except Exception as e:  # noqa: BLE001 - e.g. its detokenizer: this request alone fails
                logger.exception("request %s failed after its token was sampled; aborting it", seq.request_id)
                outputs.append(self._fail(seq, e, now))
        return outputs

    def _fail(self, seq: Sequence, error: Exception, now: float) -> RequestOutput:
        self._finish(seq, "abort", now)
        return dataclasses.replace(self._output(seq, ""), error=error)

    def _append_token(self, seq: Sequence, token: int, now: float) -> RequestOutput:
        seq.output_token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.monitor.record_first_token(now, now - seq.arrival_time)
        else:
            self.monitor.record_decode_gap(now, now - seq.last_token_time)
        seq.last_token_time = now
        reason = seq.stop_checker.push(token)
        if reason is None and seq.grammar is not None and seq.grammar.terminated:
            reason = "stop"  # the structured output is complete (reached without a stop token: ignore_eos)
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
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs, seq.pending_logprobs = tuple(seq.pending_logprobs), []
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            seq.prompt_logprobs_sent = True
            prompt_logprobs = tuple(seq.prompt_logprobs) or (None,)
        return RequestOutput(
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            request_id=seq.request_id, text=text, token_ids=new_ids, num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens, finish_reason=seq.finish_reason,
            arrival_time=seq.arrival_time, first_token_time=seq.first_token_time, finish_time=seq.finish_time,
            first_scheduled_time=seq.first_scheduled_time, num_cached_tokens=seq.num_cached_tokens or 0)

    # -- pressure and morphing ---------------------------------------------------------------
    def pressure(self) -> PressureSnapshot:
        return self.monitor.snapshot()

    def morph_state(self) -> MorphState:
        return dataclasses.replace(self._morph_state(), capability=self.runner.capability)

    def _morph_state(self) -> MorphState:
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
        result = self.morph_executor.apply(action)
        self._tag_prefix_cache()
        return result

    def set_admission_grant(self, grant: AdmissionGrant | None) -> None:
        """What admission-time morphing may do until the next directive (None: nothing)."""
        if self.admission is not None:
            self.admission.set_grant(grant)

    def close(self) -> None:
        """Stop the morph executor's prefetch worker; the engine takes no more steps."""
        if self.morph_executor is not None:
            self.morph_executor.close()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.kv_manager.check_integrity()
        self.ledger.check_integrity()

