"""What one engine step returns: a delta per request (so streaming is the natural case) and the morph
actions the executor ran at that step's boundary."""
from __future__ import annotations

import dataclasses
from typing import Literal

from engine.logprobs import PositionLogprobs
from engine.morph.actions import ActionResult
from engine.step_stats import StepStats

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    request_id: str
    text: str  # new text since the previous output of this request
    token_ids: tuple[int, ...]  # new token ids since the previous output
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    finish_reason: FinishReason | None
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    first_scheduled_time: float | None = None  # when a step first ran any of its tokens (queue time ends)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (not prefilled) at first admission
    # Set when the engine failed this request alone (a step raised for it): finish_reason is "abort".
    error: Exception | None = None
    # When the request asked for them: one per new token id (aligned with token_ids) ...
    logprobs: tuple[PositionLogprobs, ...] | None = None
    # ... and, on the first output only, one per prompt token (the first is None: nothing precedes it).
    prompt_logprobs: tuple[PositionLogprobs | None, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def queue_time_s(self) -> float | None:
        """Arrival to first schedule (None until scheduled)."""
        return None if self.first_scheduled_time is None else max(0.0, self.first_scheduled_time - self.arrival_time)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What `LLMEngine.step()` did: the requests' deltas, and what the morph executor ran at the step
    boundary before the model step (a pending target's next layers, a waiting restore that went
    through). An action that stays waiting without changing anything is not repeated here."""
    outputs: tuple[RequestOutput, ...] = ()
    morph_results: tuple[ActionResult, ...] = ()
    stats: StepStats | None = None  # tokens by phase and time of the model step (None: no model step)
