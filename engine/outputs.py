"""What the engine returns per request per step: a delta, so streaming is the natural case."""
from __future__ import annotations

import dataclasses
from typing import Literal

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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
