"""MorphExecutor: runs morph actions between steps and keeps the morph state.

    policy / admin --apply()--> run now --> LayerSwapper / KVResizer
                                  | what is left (a waiting restore, a target needing more steps)
                                  v
                               pending --run_pending() at each step boundary--^

Everything runs on the engine's stepping thread (the async engine hands apply() to it), so there is
no lock. run_pending() returns what it did; the engine's step() passes that on (StepResult).

- SwapLayer / RestoreLayer move one layer; a restore whose KV blocks are held by live requests
  stays pending ("waiting") and is retried every step, never preempting anyone.
- SetQuantizedTarget(count, precision, k): the first `count` layers of the swap order at `precision`,
  the rest at full precision; each step moves at most k layers toward it, swap-downs first in swap
  order (they free memory), then restores in reverse swap order. A newer target replaces an older one.
- After every action the block pool and the ledger check their invariants (weights + kv + reserve
  <= budget): a violation raises where it happened instead of surfacing later as a wrong answer.
"""
from __future__ import annotations

import dataclasses
import logging

from engine.morph.actions import ActionResult, MorphAction, MorphState, RestoreLayer, SetQuantizedTarget, SwapLayer
from engine.morph.host_store import HostStore
from engine.morph.layer_swapper import LayerSwapper, SwapResult
from engine.morph.packed_store import PackedStore
from engine.morph.swap_order import SwapOrder
from engine.precision import Precision

logger = logging.getLogger(__name__)


class MorphExecutor:
    def __init__(self, model, ledger, kv_resizer, pool, host_store: HostStore, swap_order: SwapOrder,
                 ladder: tuple[Precision, ...], forced_quantized: int = 0, packed_store: PackedStore | None = None):
        """`ladder` starts at the full precision, e.g. (BF16, INT8, INT4). `forced_quantized`: layers
        the budget made the engine start with at the lowest rung (no policy may restore below it).
        `packed_store`: the full precision as the model runs it pre-packed (restores copy, not pack)."""
        swap_order.check_integrity(len(model.layers))
        missing = [p.value for p in ladder if p not in host_store.precisions]
        if missing:
            raise ValueError(f"the host store lacks precisions {missing} of the ladder")
        self.model, self.ledger, self.kv_resizer, self.pool = model, ledger, kv_resizer, pool
        self.swap_order, self.ladder = swap_order, tuple(ladder)
        self.forced_quantized = forced_quantized
        self.swapper = LayerSwapper(model, host_store, ledger, kv_resizer, packed_store)
        self._pending: list[MorphAction] = []

    @property
    def full_precision(self) -> Precision:
        return self.ladder[0]

    # -- accepting actions -------------------------------------------------------------------
    def validate(self, action: MorphAction) -> str | None:
        """Why the action cannot be run on this model, or None."""
        n, rungs = len(self.model.layers), self.ladder[1:]
        if isinstance(action, (SwapLayer, RestoreLayer)) and not 0 <= action.layer < n:
            return f"layer {action.layer} does not exist; this model has layers 0..{n - 1}"
        if isinstance(action, SwapLayer) and action.precision not in self.ladder:
            return f"precision {action.precision.value} is not on the ladder {[p.value for p in self.ladder]}"
        if isinstance(action, SetQuantizedTarget):
            if not 0 <= action.count <= n:
                return f"count must be in 0..{n}, got {action.count}"
            if action.precision not in rungs:
                return f"target precision must be one of {[p.value for p in rungs]}, got {action.precision.value}"
            if action.max_layers_per_step < 1:
                return f"max_layers_per_step must be at least 1, got {action.max_layers_per_step}"
        if not isinstance(action, (SwapLayer, RestoreLayer, SetQuantizedTarget)):
            return f"unknown morph action {action!r}"
        return None

    def _enqueue(self, action: MorphAction) -> None:
        if isinstance(action, SetQuantizedTarget):
            self._pending = [a for a in self._pending if not isinstance(a, SetQuantizedTarget)]
        self._pending.append(action)

    # -- running actions ---------------------------------------------------------------------
    def has_pending(self) -> bool:
        return bool(self._pending)

    def run_pending(self) -> list[ActionResult]:
        """Called by the engine at each step boundary; returns what it did. Unfinished actions stay
        pending; one that is still waiting and changed nothing this time is not reported again."""
        pending, self._pending = self._pending, []
        results = []
        for action in pending:
            result = self._run(action)
            if result.status == "waiting":
                self._enqueue(action)
                if not (result.layers_changed or result.kv_blocks_delta):
                    continue
            results.append(result)
        return results

    def apply(self, action: MorphAction) -> ActionResult:
        """Run an action now (the caller guarantees a step boundary). What is left of it (a waiting
        restore, a target needing more steps) stays pending and continues at the next steps; a newer
        target replaces a pending one."""
        problem = self.validate(action)
        if problem:
            return ActionResult(action, "rejected", message=problem)
        if isinstance(action, SetQuantizedTarget):
            self._pending = [a for a in self._pending if not isinstance(a, SetQuantizedTarget)]
        result = self._run(action)
        if result.status == "waiting":
            self._enqueue(action)
        return result

    def _run(self, action: MorphAction) -> ActionResult:
        if isinstance(action, SetQuantizedTarget):
            result = self._step_target(action)
        else:
            target = self.full_precision if isinstance(action, RestoreLayer) else action.precision
            result = _as_action_result(action, [self.swapper.move(action.layer, target)])
        self.pool.check_integrity()
        self.ledger.check_integrity()
        self.swapper.check_integrity()
        if result.status == "rejected":
            logger.warning("morph action %s rejected: %s", action, result.message)
        return result

    def target_moves(self, target: SetQuantizedTarget) -> list[tuple[int, Precision]]:
        """(layer, precision) moves still needed: downs in swap order, then ups in reverse swap order."""
        chosen = set(self.swap_order.order[: target.count])
        now = self.swapper.precisions()
        downs, ups = [], []
        for layer in self.swap_order.order:
            want = target.precision if layer in chosen else self.full_precision
            if want != now[layer]:
                (downs if want.bits < now[layer].bits else ups).append((layer, want))
        return downs + ups[::-1]

    def _step_target(self, target: SetQuantizedTarget) -> ActionResult:
        moves = self.target_moves(target)
        if not moves:
            return ActionResult(target, "noop", message="already at the target")
        done: list[SwapResult] = []
        for layer, precision in moves[: target.max_layers_per_step]:
            done.append(self.swapper.move(layer, precision, grow_kv=False))
            if done[-1].status != "done":
                break
        left = self.target_moves(target)
        for layer, precision in left[: target.max_layers_per_step]:
            if precision.bits < self.swapper.precision_of(layer).bits:
                self.swapper.prefetch(layer, precision)  # so the next step's switch does not wait on disk
        # The KV cache takes what the moves freed only now: grown first, it held every free byte and no
        # prefetch had room to stage (each next layer then loaded on the engine thread, ~1 ms of a swap).
        grown = self.kv_resizer.grow(self.kv_resizer.growable_blocks())
        result = _as_action_result(target, done)
        result = dataclasses.replace(result, kv_blocks_delta=result.kv_blocks_delta + grown.blocks_delta,
                                     resize_seconds=result.resize_seconds + grown.seconds)
        if result.status == "rejected":
            return result
        status = "done" if not left else "waiting"
        note = f"{len(left)} layer moves left" if left else "target reached"
        return dataclasses.replace(result, status=status, message=f"{note}; {result.message}".rstrip("; "))

    # -- state -------------------------------------------------------------------------------
    def morph_state(self) -> MorphState:
        return MorphState(layer_precisions=self.swapper.precisions(), full_precision=self.full_precision,
                          swap_order=self.swap_order.order, swap_order_source=self.swap_order.source,
                          kv_capacity_blocks=self.pool.capacity, kv_max_blocks=self.pool.max_blocks,
                          pending=tuple(self._pending), morphing_enabled=True,
                          forced_quantized=self.forced_quantized)

    def close(self) -> None:
        """Stop the prefetch worker (the engine's close())."""
        self.swapper.close()


def _as_action_result(action: MorphAction, results: list[SwapResult]) -> ActionResult:
    """Fold one or more layer moves into the action's result; the last move decides a failure."""
    changed = tuple(r.layer for r in results if r.status == "done")
    last = results[-1] if results else None
    if last is None or (last.status == "noop" and not changed):
        status = "noop"
    elif last.status in ("waiting", "rejected"):
        status = last.status
    else:
        status = "done"
    messages = [f"layer {r.layer} {r.before.value}->{r.after.value}" for r in results if r.status == "done"]
    messages += [r.message for r in results if r.status != "done" and r.message]
    return ActionResult(action=action, status=status, layers_changed=changed,
                        weight_bytes_delta=sum(r.weight_bytes_delta for r in results),
                        kv_blocks_delta=sum(r.kv_blocks_delta for r in results),
                        swap_seconds=sum(r.swap_seconds for r in results),
                        resize_seconds=sum(r.resize_seconds for r in results), message="; ".join(messages))
