"""OverloadGate: the ingress refuses generation itself while the engine replicas are known to be full.

Without it every request of a 10x burst costs two Ray calls into engine replicas that are busy
decoding before the replica refuses it; on 2 cores that delayed the last refusals of a 40-request
burst past a second, and took that CPU from the requests being served.

Known full means: an engine refused one of this ingress's generations (max_num_seqs + max_waiting
reached there, or Serve's back-pressure), and since that refusal

  * none of this ingress's generations has ended (an end frees a slot: the next call probes), and
  * fewer than `hold_s` seconds passed (a generation another ingress replica sent may have ended,
    which this one cannot see; after hold_s the next call probes).

A probe that is refused again closes the gate again. With several engine replicas a refusal comes
from the one Serve's router picked as the least loaded (shortest queue, or the pressure router's
cheapest by queue length and KV fit), so the others are full too. The gate is policy without I/O: the caller reports
what happened and asks before it sends. hold_s = 0 turns it off.
"""
from __future__ import annotations

import time
from typing import Callable

from engine.errors import EngineOverloadedError


class OverloadGate:
    def __init__(self, hold_s: float, clock: Callable[[], float] = time.monotonic):
        if hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, got {hold_s}")
        self.hold_s, self._clock = hold_s, clock
        self._refused_at: float | None = None  # the latest engine refusal not yet followed by an end
        self.refused_here = 0  # generations this gate refused without calling an engine

    def is_closed(self) -> bool:
        return self._refused_at is not None and self._clock() - self._refused_at < self.hold_s

    def check(self) -> None:
        """Raise EngineOverloadedError (-> 503 + Retry-After) when the engines are known full."""
        if self.is_closed():
            self.refused_here += 1
            waited = self._clock() - self._refused_at
            raise EngineOverloadedError(f"the engine replicas are full (one refused a request {waited:.2f} s "
                                        "ago and none has finished one since); retry later")

    def refused(self) -> None:
        """An engine refused a generation: full until something ends or hold_s passes."""
        self._refused_at = self._clock()

    def ended(self) -> None:
        """A generation the engine had taken ended (finished, failed or was cancelled): a slot is free."""
        self._refused_at = None
