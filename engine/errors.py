"""Error types at the engine's boundary. Callers map them to HTTP codes (deployments/) or messages."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.morph.actions import ActionResult


class MorphServeError(Exception):
    """Base class for errors MorphServe raises on purpose."""


class InvalidRequestError(MorphServeError, ValueError):
    """The request itself is wrong (-> HTTP 400). `param` names the offending field when known."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelLoadError(MorphServeError):
    """A model path, file, profile or checkpoint cannot be used; the message says what to change."""


class DataUnavailableError(ModelLoadError):
    """A data set (calibration text, evaluation text, a trace) cannot be found or fetched; the message
    names it and says how to provide it. `dataset` is its name (e.g. "wikitext2", "sharegpt")."""

    def __init__(self, message: str, dataset: str):
        super().__init__(message)
        self.dataset = dataset


class BudgetError(MorphServeError):
    """The memory budget cannot hold what is asked; the message gives the minimum in bytes."""


class EngineOverloadedError(MorphServeError):
    """The waiting queue is full (-> HTTP 503 with Retry-After)."""


class EngineDeadError(MorphServeError):
    """The step loop stopped after an internal fault; requests in flight are failed with this."""


class StepFailed(MorphServeError):
    """A request made the engine step raise: it was aborted alone (its blocks freed), the others in
    that step went on (engine/step_isolation.py). What the async engine raises to that request's
    consumer. `morph_results`: what the morph executor ran at that step's boundary, if reported."""

    def __init__(self, request_ids: tuple[str, ...], cause: BaseException,
                 morph_results: tuple[ActionResult, ...] = ()):
        super().__init__(f"engine step failed for requests {list(request_ids)}: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause
        self.morph_results = morph_results
