"""The pressure snapshot an engine publishes after every step. The policy (controller/) and the
metrics (deployments/) read it; only the engine's PressureMonitor writes it."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LedgerFigures:
    """Bytes by owner at one instant. Invariant: weights + kv + reserve <= budget."""
    budget: int
    weights: int  # resident weights at their current precisions (all layers + embeddings + norms)
    kv: int  # committed KV blocks x bytes per block
    reserve: int  # fixed activation reserve

    @property
    def free(self) -> int:
        return self.budget - self.weights - self.kv - self.reserve


@dataclasses.dataclass(frozen=True)
class PressureSnapshot:
    time: float  # engine clock (time.monotonic) when taken
    step: int  # number of engine steps so far
    kv_used_blocks: int
    kv_capacity_blocks: int  # committed blocks (what the budget backs now)
    kv_max_blocks: int  # reserved address space (all layers at the lowest precision)
    num_running: int
    num_waiting: int
    queue_delay_s: float  # how long the oldest waiting request has waited; 0 when none waits
    ttft_recent_s: float | None  # mean TTFT of requests that got their first token in the window
    tpot_recent_s: float | None  # mean time per output token (decode) over the window
    throughput_tok_s: float  # generated tokens per second over the window
    preemptions_total: int
    ledger: LedgerFigures

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_capacity_blocks if self.kv_capacity_blocks else 1.0
