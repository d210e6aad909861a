"""MemoryLedger: the only counter of resident bytes. Invariant: weights + kv + reserve <= budget,
checked after every change, so a morph step that would break it fails where it happens."""
from __future__ import annotations

import dataclasses

from engine.errors import BudgetError
from engine.pressure import LedgerFigures


class MemoryLedger:
    def __init__(self, budget: int, reserve: int):
        if budget <= 0 or reserve < 0:
            raise ValueError(f"need budget > 0 and reserve >= 0, got budget={budget}, reserve={reserve}")
        self.budget = budget
        self.reserve = reserve
        self._base_weights = 0  # embeddings, final norm, lm head
        self._layer_weights: dict[int, int] = {}
        self._kv = 0

    @property
    def weights(self) -> int:
        return self._base_weights + sum(self._layer_weights.values())

    @property
    def kv(self) -> int:
        return self._kv

    @property
    def free(self) -> int:
        return self.budget - self.weights - self._kv - self.reserve

    def layer_weights(self, layer: int) -> int:
        return self._layer_weights.get(layer, 0)

    def figures(self) -> LedgerFigures:
        return LedgerFigures(budget=self.budget, weights=self.weights, kv=self._kv, reserve=self.reserve)

    def can_fit(self, extra_bytes: int) -> bool:
        return extra_bytes <= self.free

    def set_base_weights(self, nbytes: int) -> None:
        self._set(lambda: setattr(self, "_base_weights", nbytes), nbytes, "base weights")

    def set_layer_weights(self, layer: int, nbytes: int) -> None:
        self._set(lambda: self._layer_weights.__setitem__(layer, nbytes), nbytes, f"layer {layer} weights")

    def set_kv(self, nbytes: int) -> None:
        self._set(lambda: setattr(self, "_kv", nbytes), nbytes, "kv")

    def _set(self, apply, nbytes: int, what: str) -> None:
        if nbytes < 0:
            raise ValueError(f"{what} cannot be negative ({nbytes})")
        before = (self._base_weights, dict(self._layer_weights), self._kv)
        apply()
        try:
            self.check_integrity()
        except RuntimeError:
            self._base_weights, self._layer_weights, self._kv = before  # refuse the change whole
            raise

    def check_integrity(self) -> None:
        used = self.weights + self._kv + self.reserve
        if used > self.budget:
            raise RuntimeError(
                f"memory ledger over budget: weights {self.weights} + kv {self._kv} + reserve "
                f"{self.reserve} = {used} > budget {self.budget}")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How a budget is split at start-up (all layers at full precision)."""
    budget: int
    weights: int
    reserve: int
    block_bytes: int
    capacity: int  # committed KV blocks now
    max_blocks: int  # KV blocks if every layer sat at the lowest rung (address space to reserve)
    min_blocks: int  # blocks one max_model_len request needs


def plan_memory(budget: int, weights: int, lowest_weights: int, reserve: int, block_bytes: int,
                min_blocks: int) -> MemoryPlan:
    """Split the budget; BudgetError (with the minimum budget) when one full-length request cannot fit."""
    capacity = max(0, (budget - weights - reserve) // block_bytes)
    if capacity < min_blocks:
        minimum = weights + reserve + min_blocks * block_bytes
        raise BudgetError(
            f"memory budget {budget} bytes ({budget / 2**20:.1f} MiB) is too small: weights {weights} + "
            f"reserve {reserve} + KV for one max_model_len request ({min_blocks} blocks x {block_bytes}) "
            f"need at least {minimum} bytes ({minimum / 2**20:.1f} MiB). Raise memory_budget to at least "
            f"{-(-minimum // 2**20)}MiB, or lower max_model_len / max_num_batched_tokens.")
    max_blocks = max(capacity, (budget - lowest_weights - reserve) // block_bytes)
    return MemoryPlan(budget, weights, reserve, block_bytes, capacity, max_blocks, min_blocks)
