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
from typing import Any

from engine.errors import InvalidRequestError

INT64_MAX = 2**63 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
GREEDY_BELOW = 1e-5  # a smaller temperature would overflow fp32 logits / temperature


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
    def create(cls, *, stop: Any = None, stop_token_ids: Any = None, **kwargs: Any) -> "SamplingParams":
        """Build from loosely typed user input (e.g. an OpenAI request): `stop` may be a string or a list
        of strings; None fields take their defaults."""
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s) {sorted(unknown)}", param=sorted(unknown)[0])
        fields = {k: v for k, v in kwargs.items() if v is not None}
        return cls(stop=_normalize_stop(stop), stop_token_ids=_normalize_ids(stop_token_ids), **fields)


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
