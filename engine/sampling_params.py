"""Per-request sampling parameters, validated once at the boundary so the engine never sees bad ones."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = -1  # -1 = disabled
    seed: int | None = None  # per-request generator: same seed -> same tokens, alone or batched
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}", param="temperature")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        _check_int("top_k", self.top_k, minimum=-1)
        if self.top_k == 0:
            raise InvalidRequestError("top_k must be -1 (disabled) or >= 1, got 0", param="top_k")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=None)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop must be a non-empty string or a list of non-empty strings", param="stop")
        if not isinstance(self.stop_token_ids, tuple):
            raise InvalidRequestError("stop_token_ids must be a list of token ids", param="stop_token_ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

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


def _check_int(name: str, value: Any, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    if minimum is not None and value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}, got {value}", param=name)


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", param=name)
