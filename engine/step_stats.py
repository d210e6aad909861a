"""StepStats: what one engine step ran (tokens by phase, model time), for the iteration metrics.

`LLMEngine.step()` returns one in its StepResult; the AsyncLLMEngine keeps the recent ones in a
bounded StepLog that the serving layer drains now and then into histograms (`iteration_tokens_total`,
step time by phase). Bounded, so a replica nobody drains never grows; the oldest records go first.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Literal

StepPhase = Literal["prefill", "decode", "mixed"]


@dataclasses.dataclass(frozen=True)
class StepStats:
    num_prefill_tokens: int  # prompt tokens (chunks of prefills, recomputes included) in this step
    num_decode_tokens: int  # one per decoding request
    seconds: float  # model execution and sampling of this step

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def phase(self) -> StepPhase:
        if self.num_prefill_tokens and self.num_decode_tokens:
            return "mixed"
        return "prefill" if self.num_prefill_tokens else "decode"


class StepLog:
    def __init__(self, maxlen: int = 4096):
        self._records: collections.deque[StepStats] = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()  # written by the stepping thread, drained from elsewhere

    def record(self, stats: StepStats) -> None:
        with self._lock:
            self._records.append(stats)

    def drain(self) -> list[StepStats]:
        with self._lock:
            out = list(self._records)
            self._records.clear()
        return out


class PrefillRate:
    """Prompt tokens one replica prefills per second of wall time, smoothed over its recent rounds
    that prefilled (mixed steps included: decoding beside a prefill slows it, and that is the rate a
    queued prompt sees). A round is the stepping thread's whole turn (commands, step, publishing);
    back to back rounds count from the previous round's end, so the gaps between steps (morph swaps
    at a boundary, the event loop taking the GIL) slow the rate as they slow the backlog. Model time
    alone made the router's aged backlogs optimistic. The pressure-aware router uses it to age a
    replica's reported prefill backlog: a report can be a whole step old, and over that time the
    backlog has shrunk by about this rate times its age. 0 until the first prefill: nothing is known yet."""

    def __init__(self, smoothing: float = 0.3):
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        self.tokens_per_s = 0.0  # written by the stepping thread; a float read is atomic

    def record(self, prefill_tokens: int, seconds: float) -> None:
        """One round: the prompt tokens its step prefilled, and the wall seconds the round took."""
        if prefill_tokens <= 0 or seconds <= 0:
            return
        rate = prefill_tokens / seconds
        self.tokens_per_s = rate if self.tokens_per_s == 0 else (
            self.smoothing * rate + (1 - self.smoothing) * self.tokens_per_s)
