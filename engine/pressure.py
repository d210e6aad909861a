"""The pressure snapshot an engine publishes after every step. The policy (controller/) and the
metrics (deployments/) read it; only the engine's PressureMonitor writes it."""
from __future__ import annotations

import dataclasses
from typing import Literal

WaitingFor = Literal["none", "memory", "compute", "unknown"]


@dataclasses.dataclass(frozen=True)
class LedgerFigures:
    """Bytes by owner at one instant. Invariant: weights + kv + reserve <= budget."""
    budget: int
    weights: int  # resident weights: all layers at their current precisions + embeddings + norms + staged copies
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
    # -- demand (engine/demand.py): what requests need, not what they hold --------------------
    waiting_demand_blocks: int = 0  # blocks the whole waiting queue needs to be admitted (prompts + reservation)
    head_demand_blocks: int = 0  # blocks the head of the queue needs; 0 when nothing waits
    running_reserved_blocks: int = 0  # blocks running requests still need inside their output reservation
    running_finish_blocks: int = 0  # blocks running requests still need to reach their max_tokens
    reservation_tokens: int = 0  # the output reservation these figures used
    prefill_backlog_tokens: int = 0  # prompt tokens waiting and running requests have not prefilled yet
    rung_gain_blocks: tuple[tuple[str, int], ...] = ()  # (rung, KV blocks one more layer at that rung frees)
    ttft_recent_p95_s: float | None = None  # 95th percentile TTFT over the window
    # -- admission-time morphing (engine/morph/admission.py) ----------------------------------
    head_blocked_since: float | None = None  # engine clock when the current head first did not fit
    admission_swaps_total: int = 0  # admission morphs so far (each moves one or more layers down)
    admission_layers_total: int = 0  # layers those moved
    admission_restores_total: int = 0  # demand restores so far
    admission_capped_total: int = 0  # boundaries where the queue wanted more layers than the grant allows
    # -- prefix caching (engine/kv_cache_manager.py) ------------------------------------------
    prefix_cache_queries_total: int = 0  # prompt tokens of admitted requests that looked in the prefix cache
    prefix_cache_hits_total: int = 0  # of those, tokens found there
    kv_cached_blocks: int = 0  # free blocks still holding a cached prefix block (counted free)

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_capacity_blocks if self.kv_capacity_blocks else 1.0

    @property
    def free_blocks(self) -> int:
        return self.kv_capacity_blocks - self.kv_used_blocks

    @property
    def available_blocks(self) -> int:
        """Free blocks not owed to running requests (negative when they are owed more than is free)."""
        return self.free_blocks - self.running_reserved_blocks

    @property
    def waiting_for(self) -> WaitingFor:
        """Why requests wait: "memory" when the head's demand exceeds the available blocks, "compute"
        when it would fit (the step's token budget or max_num_seqs holds it back), "none" when none waits,
        "unknown" when the snapshot has no demand figures."""
        if self.num_waiting == 0:
            return "none"
        if self.head_demand_blocks == 0:  # a snapshot without demand figures (an older engine, a test double)
            return "unknown"
        return "memory" if self.head_demand_blocks > self.available_blocks else "compute"
