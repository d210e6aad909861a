"""One request's life in the engine: its tokens, status, timings and streaming-text state.

Block tables are not here: KVCacheManager is their only owner (looked up by request_id).
StopChecker turns sampled tokens into streamed text and decides when a request stops.
"""
from __future__ import annotations

import enum
import itertools
import torch

from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, generator: torch.Generator | None = None,
                 stop_checker: "StopChecker | None" = None):
        self.request_id = request_id
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.arrival_time = arrival_time
        # Tie-breaker and preemption order: a strictly increasing number per admitted request.
        self.arrival_index = next(_arrival_counter)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_preemptions = 0
        self.num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
        self.generator = generator
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.stop_checker = stop_checker
        self.emitted_token_len = 0  # output tokens already returned in a RequestOutput
        # Asked-for extras (see SamplingParams.logprobs / prompt_logprobs / structured_output):
        self.grammar = None  # engine.structured_output.GrammarState, advanced once per sampled token
        self.pending_logprobs: list = []  # PositionLogprobs of output tokens not yet returned
        # PositionLogprobs of prompt positions 1.. (position 0 has none); computed once, kept across
        # preemptions (a re-prefill does not recompute them) and returned with the first output.
        self.prompt_logprobs: list = []
        self.prompt_logprobs_sent = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + tuple(self.output_token_ids))[start:end]

    @property
    def may_use_prefix_cache(self) -> bool:
        """Whether admission may start it after a cached prefix: it holds no computed tokens yet, and it
        does not want prompt logprobs (they come from the prefill's own logits)."""
        return self.num_computed_tokens == 0 and self.params.prompt_logprobs is None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")


class StopChecker:
    """Streams a request's text and applies its stop rules.

    Stop token ids (and eos, unless ignore_eos) end the request without adding their text. Stop
    strings end it with the text cut just before the match; while running, the last
    (longest stop string - 1) characters are held back so a stop string split over several tokens
    is never half-sent.
    """

    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: frozenset[int] = frozenset(),
                 prompt_ids: tuple[int, ...] = ()):
        self.params = params
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters of self.text already returned

    def push(self, token: int) -> str | None:
        """Take one sampled token; returns "stop" when the request must stop, else None."""
        if token in self.stop_ids:
            return "stop"
        if self.detokenizer is None:
            return None
        searched_from = max(0, len(self.text) - self.holdback)
        self.text += self.detokenizer.push([token])
        hits = [i for i in (self.text.find(s, searched_from) for s in self.params.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return "stop"
        return None

    def flush(self, finished: bool) -> str:
        """Text not yet returned that is safe to return now."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
