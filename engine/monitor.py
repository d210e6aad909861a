"""PressureMonitor: windowed latency and throughput signals, and the PressureSnapshot taken after
every step. Times are the engine clock (time.monotonic); the window defaults to 5 s of it."""
from __future__ import annotations

import collections
import time
from typing import Callable

from engine.block_pool import BlockPool
from engine.ledger import MemoryLedger
from engine.pressure import PressureSnapshot
from engine.scheduler import Scheduler


class PressureMonitor:
    def __init__(self, scheduler: Scheduler, pool: BlockPool, ledger: MemoryLedger,
                 window_s: float = 5.0, clock: Callable[[], float] | None = None):
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.scheduler, self.pool, self.ledger = scheduler, pool, ledger
        self.window_s = window_s
        self.clock = clock or time.monotonic
        self.start_time = self.clock()
        self._ttfts: collections.deque[tuple[float, float]] = collections.deque()  # (time, ttft)
        self._tpots: collections.deque[tuple[float, float]] = collections.deque()  # (time, gap)
        self._tokens: collections.deque[tuple[float, int]] = collections.deque()  # (time, count)
        self.step_count = 0

    def record_first_token(self, now: float, ttft_s: float) -> None:
        self._ttfts.append((now, ttft_s))

    def record_decode_gap(self, now: float, gap_s: float) -> None:
        self._tpots.append((now, gap_s))

    def record_tokens(self, now: float, count: int) -> None:
        if count:
            self._tokens.append((now, count))

    def on_step(self) -> PressureSnapshot:
        self.step_count += 1
        return self.snapshot()

    def snapshot(self, now: float | None = None) -> PressureSnapshot:
        now = self.clock() if now is None else now
        self._expire(now)
        oldest = self.scheduler.oldest_waiting_arrival()
        span = max(min(self.window_s, now - self.start_time), 1e-3)
        return PressureSnapshot(
            time=now, step=self.step_count,
            kv_used_blocks=self.pool.num_used, kv_capacity_blocks=self.pool.capacity,
            kv_max_blocks=self.pool.max_blocks,
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            queue_delay_s=max(0.0, now - oldest) if oldest is not None else 0.0,
            ttft_recent_s=_mean(v for _, v in self._ttfts),
            tpot_recent_s=_mean(v for _, v in self._tpots),
            throughput_tok_s=sum(c for _, c in self._tokens) / span,
            preemptions_total=self.scheduler.num_preemptions,
            ledger=self.ledger.figures())

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        for q in (self._ttfts, self._tpots, self._tokens):
            while q and q[0][0] < horizon:
                q.popleft()


def _mean(values) -> float | None:
    vals = list(values)
    return sum(vals) / len(vals) if vals else None
