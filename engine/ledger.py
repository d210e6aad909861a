"""MemoryLedger: the only counter of resident bytes. Invariant: weights + kv + reserve <= budget,
checked after every change, so a morph step that would break it fails where it happens.

Weights are the base (embeddings, norms, head), each layer at its current precision, and the staged
copies: variants loaded ahead of their switch (the swapper's prefetch), resident but not yet installed.
A stage is claimed before its bytes are allocated and released when the copy is installed (its bytes
then count as the layer's) or dropped."""
from __future__ import annotations

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
        self._staged: dict[object, int] = {}  # key (e.g. (layer, precision)) -> bytes loaded ahead of a switch

    @property
    def weights(self) -> int:
        return self._base_weights + sum(self._layer_weights.values()) + self.staged

    @property
    def staged(self) -> int:
        return sum(self._staged.values())

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

    def set_base_weights(self, nbytes: int) -> None:
        self._set(lambda: setattr(self, "_base_weights", nbytes), nbytes, "base weights")

    def set_layer_weights(self, layer: int, nbytes: int) -> None:
        self._set(lambda: self._layer_weights.__setitem__(layer, nbytes), nbytes, f"layer {layer} weights")

    def stage(self, key: object, nbytes: int) -> None:
        """Claim bytes for a copy loaded ahead of its switch; RuntimeError (nothing changed) when they do
        not fit the budget."""
        self._set(lambda: self._staged.__setitem__(key, nbytes), nbytes, f"staged copy {key}")

    def unstage(self, key: object) -> None:
        self._staged.pop(key, None)

    def set_kv(self, nbytes: int) -> None:
        self._set(lambda: setattr(self, "_kv", nbytes), nbytes, "kv")

    def _set(self, apply, nbytes: int, what: str) -> None:
        if nbytes < 0:
            raise ValueError(f"{what} cannot be negative ({nbytes})")
        before = (self._base_weights, dict(self._layer_weights), self._kv, dict(self._staged))
        apply()
        try:
            self.check_integrity()
        except RuntimeError:
            self._base_weights, self._layer_weights, self._kv, self._staged = before  # refuse the change whole
            raise

    def check_integrity(self) -> None:
        used = self.weights + self._kv + self.reserve
        if used > self.budget:
            raise RuntimeError(
                f"memory ledger over budget: weights {self.weights} + kv {self._kv} + reserve "
                f"{self.reserve} = {used} > budget {self.budget}")
