"""Typed morph actions, their results, and the morph state an engine reports. The policy produces
actions; the engine executes them between steps; nobody mutates MorphState, it is re-read."""
from __future__ import annotations

import dataclasses
from typing import Literal, Union

from engine.precision import Precision


@dataclasses.dataclass(frozen=True)
class SwapLayer:
    """Move one layer to `precision` (lower rung = swap down; its full precision = restore)."""
    layer: int
    precision: Precision


@dataclasses.dataclass(frozen=True)
class RestoreLayer:
    """Bring one layer back to full precision (shrinks KV first; waits if live blocks are in the way)."""
    layer: int


@dataclasses.dataclass(frozen=True)
class SetQuantizedTarget:
    """Have exactly `count` layers below full precision, at `precision`, chosen by the swap order
    (first `count` layers of the order); the executor moves at most `max_layers_per_step` per step."""
    count: int
    precision: Precision
    max_layers_per_step: int = 1


MorphAction = Union[SwapLayer, RestoreLayer, SetQuantizedTarget]

ActionStatus = Literal["done", "waiting", "noop", "rejected"]


@dataclasses.dataclass(frozen=True)
class ActionResult:
    action: MorphAction
    status: ActionStatus  # waiting: a restore that needs blocks live requests hold; retried each step
    layers_changed: tuple[int, ...] = ()
    weight_bytes_delta: int = 0  # negative when weights were freed
    kv_blocks_delta: int = 0  # positive when KV grew
    swap_seconds: float = 0.0
    resize_seconds: float = 0.0
    message: str = ""


@dataclasses.dataclass(frozen=True)
class MorphState:
    layer_precisions: tuple[Precision, ...]  # index = layer id
    full_precision: Precision
    swap_order: tuple[int, ...]  # layers in the order they are quantized (LIS or front-to-back)
    swap_order_source: str  # "lis:<profile path>" or "front-to-back"
    kv_capacity_blocks: int
    kv_max_blocks: int
    pending: tuple[MorphAction, ...] = ()  # accepted actions not finished (e.g. waiting restores)
    morphing_enabled: bool = True
    forced_quantized: int = 0  # layers the memory budget forces below full precision (a floor for every cap)

    @property
    def num_quantized(self) -> int:
        return sum(1 for p in self.layer_precisions if not p.is_full)

    def count(self, precision: Precision) -> int:
        return sum(1 for p in self.layer_precisions if p == precision)
