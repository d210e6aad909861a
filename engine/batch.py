"""What the scheduler hands the model runner for one step: a typed record, no hidden context."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one request to run through the model this step.

    A prefill may be split over several steps (chunked prefill); a decode is a chunk of one token.
    The runner writes K/V for positions [start_pos, start_pos + len(token_ids)) into the slots that
    `block_table` maps them to, and attends over positions [0, start_pos + len(token_ids)).
    """
    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int  # tokens of this request already in the KV cache
    block_table: tuple[int, ...]  # block ids covering at least start_pos + len(token_ids) positions
    needs_logits: bool  # True when this chunk ends at the request's last known token (sample next)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]  # decodes first, then prefill chunks, in FCFS order
    preempted: tuple[str, ...] = ()  # requests preempted (by recompute) while scheduling this step

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
