"""Per-request sampling parameters: the one place a request's sampling *meaning* is validated.

The HTTP layer checks only shapes (types, required fields); every range lives here, so the API,
the CLI and the engine agree. Conventions (vLLM's): top_k -1 or 0 = disabled, and a top_k larger
than the vocabulary keeps every token; temperature below GREEDY_BELOW is greedy. Integer ranges
are what the sampler can hold: top_k and stop token ids in int64, seed in torch's generator range.
Limits that are deployment choices (number and length of stop strings) are EngineConfig's and are
checked by the engine when it admits a request.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from engine.errors import InvalidRequestError

INT64_MAX = 2**63 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
GREEDY_BELOW = 1e-5  # a smaller temperature would overflow fp32 logits / temperature
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (vLLM's default max_logprobs is 20 too)


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """What the output must parse as: any JSON object (`json_object`) or JSON that validates against
    `json_schema` (a JSON string). Compiled by engine/structured_output.py."""
    kind: Literal["json_object", "json_schema"]
    json_schema: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("json_object", "json_schema"):
            raise InvalidRequestError(f"unknown structured output kind {self.kind!r}", param="response_format")
        if (self.kind == "json_schema") != isinstance(self.json_schema, str):
            raise InvalidRequestError("a json_schema response_format needs its schema (and only it has one)",
                                      param="response_format")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = -1  # -1 or 0 = disabled (0 is stored as -1)
    seed: int | None = None  # per-request generator: same seed -> same tokens, alone or batched
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # vLLM's logits processors (see engine/logits_processors.py for their order and meaning)
    presence_penalty: float = 0.0  # [-2, 2], on tokens already generated
    frequency_penalty: float = 0.0  # [-2, 2], times each generated token's count
    repetition_penalty: float = 1.0  # > 0, on tokens in the prompt or generated; 1 = off
    min_p: float = 0.0  # [0, 1]: drop tokens below min_p * the top token's probability
    min_tokens: int = 0  # eos and stop token ids are masked until this many tokens are out
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    logprobs: int | None = None  # return the sampled token's logprob and this many top ones
    prompt_logprobs: int | None = None  # the same for every prompt token (for echo)
    structured_output: "StructuredOutput | None" = None  # grammar the output must follow
    cache_salt: str | None = None  # prefix caching: only requests with the same salt share cached blocks

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, INT64_MAX)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}", param="temperature")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        _check_int("top_k", self.top_k, -1, INT64_MAX, "-1 or 0 (disabled) or a positive count")
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        if self.seed is not None:
            _check_int("seed", self.seed, SEED_MIN, SEED_MAX)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop must be a non-empty string or a list of non-empty strings", param="stop")
        if not isinstance(self.stop_token_ids, tuple):
            raise InvalidRequestError("stop_token_ids must be a list of token ids", param="stop_token_ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, INT64_MAX)
        self._check_processors()

    def _check_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}", param=name)
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}",
                                      param="repetition_penalty")
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens, "at most max_tokens")
        for token, bias in self.logit_bias:
            _check_int("logit_bias", token, 0, INT64_MAX, "token ids")
            _check_number("logit_bias", bias)
            if not -100 <= bias <= 100:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias}", param="logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS, "how many top tokens to return")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise InvalidRequestError("structured_output must be a StructuredOutput", param="response_format")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def check_stop_limits(self, max_count: int, max_chars: int) -> None:
        """The deployment's limits on stop strings (EngineConfig); checked when a request is admitted."""
        if len(self.stop) > max_count:
            raise InvalidRequestError(f"at most {max_count} stop strings are allowed, got {len(self.stop)}", param="stop")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > max_chars:
            raise InvalidRequestError(f"a stop string may have at most {max_chars} characters, got {longest}", param="stop")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @classmethod
    def create(cls, *, stop: Any = None, stop_token_ids: Any = None, logit_bias: Any = None,
               **kwargs: Any) -> "SamplingParams":
        """Build from loosely typed user input (e.g. an OpenAI request): `stop` may be a string or a list
        of strings; None fields take their defaults."""
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s) {sorted(unknown)}", param=sorted(unknown)[0])
        fields = {k: v for k, v in kwargs.items() if v is not None}
        return cls(stop=_normalize_stop(stop), stop_token_ids=_normalize_ids(stop_token_ids),
                   logit_bias=_normalize_bias(logit_bias), **fields)


def _normalize_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise InvalidRequestError(
        f"stop must be a string or a list of strings, got {type(stop).__name__}", param="stop")


def _normalize_ids(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, (list, tuple)):
        return tuple(ids)
    raise InvalidRequestError(f"stop_token_ids must be a list of ints, got {type(ids).__name__}", param="stop_token_ids")


def _normalize_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI sends {"token id as a string": bias}; pairs are kept sorted so equal maps compare equal."""
    if bias is None:
        return ()
    if isinstance(bias, (list, tuple)):
        bias = dict(bias)
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias")
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        out.append((token, value))
    return tuple(sorted(out))


def _check_int(name: str, value: Any, minimum: int, maximum: int, meaning: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    if not minimum <= value <= maximum:
        shown = f"{value}" if len(str(value)) <= 40 else f"a {len(str(abs(value)))}-digit number"
        what = f" ({meaning})" if meaning else ""
        raise InvalidRequestError(f"{name} must be in [{minimum}, {maximum}]{what}, got {shown}", param=name)


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", param=name)
