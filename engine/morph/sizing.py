"""How many layers to move for a given KV demand: pure functions of block counts and byte sizes.

Swapping layers down frees bytes; the KV cache grows by whole blocks, within its reserved address
space (`room_blocks`). Restoring layers takes bytes back; the cache shrinks by whole blocks. Both are
cumulative over the next layers in the swap order (down: the order; restore: its reverse), so a
model whose layers differ in size is sized exactly:

    growth[k] = min(room, (free_bytes + gain_1 + ... + gain_k) // block_bytes)     k = 0..K
    loss[k]   = max(0, ceil((need_1 + ... + need_k - free_bytes) / block_bytes))   k = 0..K

Admission (`plan_admission`): when a request the next step could start does not fit (at least the
head), size the swap for the longest FCFS prefix of the whole queue that fits under the cap, with the
fewest layers that free its deficit.
Restore (`plan_restore`): the most layers whose loss still leaves the demand below a usage bound.
No clocks, no engine: the engine feeds figures in and executes the answer.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence


def growth_blocks(free_bytes: int, block_bytes: int, room_blocks: int, gains_bytes: Sequence[int]) -> tuple[int, ...]:
    """Blocks the KV cache can grow by after swapping 0, 1, ..., K more layers (K = len(gains))."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    totals = itertools.accumulate(gains_bytes, initial=max(0, free_bytes))
    return tuple(min(max(0, room_blocks), t // block_bytes) for t in totals)


def loss_blocks(free_bytes: int, block_bytes: int, needs_bytes: Sequence[int]) -> tuple[int, ...]:
    """Blocks the KV cache must shrink by to restore 0, 1, ..., K layers (K = len(needs))."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    totals = itertools.accumulate(needs_bytes, initial=0)
    return tuple(max(0, -(-(t - max(0, free_bytes)) // block_bytes)) for t in totals)


@dataclasses.dataclass(frozen=True)
class AdmissionPlan:
    layers: int  # layers to swap down now (0: none)
    admits: int  # waiting requests (FCFS prefix) whose demand fits once they are swapped
    deficit_blocks: int  # blocks that prefix lacks now
    queue_deficit_blocks: int  # blocks the whole queue lacks now
    capped: bool  # the whole queue needs more than the allowed layers can free

    @property
    def head_blocked(self) -> bool:
        return self.queue_deficit_blocks > 0 and self.admits == 0 and self.layers == 0


def plan_admission(queue_blocks: Sequence[int], available_blocks: int, growth: Sequence[int],
                   admissible_now: int = 1) -> AdmissionPlan:
    """`queue_blocks`: each waiting request's demand, FCFS; `available_blocks`: free blocks not owed
    to running requests (negative when running requests are owed more than is free: they would
    preempt); `growth`: growth_blocks(...) over the layers the cap still allows; `admissible_now`:
    how many of the queue the next step could start by compute alone.

    Swaps when the running requests are owed more than is free, or a request the next step could
    start (at least the head: the authors' trigger) does not fit; then sizes for the longest FCFS
    prefix of the whole queue that fits under the cap, not for that one request."""
    if not growth:
        raise ValueError("growth needs at least the entry for 0 layers")
    cum = tuple(itertools.accumulate(queue_blocks, initial=0))
    queue_deficit = max(0, cum[-1] - available_blocks)
    fit_now = sum(1 for c in cum[1:] if c <= available_blocks)
    if cum[min(len(queue_blocks), max(1, admissible_now))] <= available_blocks:
        return AdmissionPlan(0, fit_now, 0, queue_deficit, capped=False)
    best = growth[-1]
    feasible = [n for n, c in enumerate(cum) if c - available_blocks <= best]
    if not feasible:  # running requests are owed more than every allowed layer frees: free what we may
        return AdmissionPlan(len(growth) - 1 if best > growth[0] else 0, 0, -available_blocks, queue_deficit, True)
    admits = feasible[-1]
    deficit = cum[admits] - available_blocks
    layers = next(k for k, g in enumerate(growth) if g >= deficit) if deficit > 0 else 0
    return AdmissionPlan(layers, admits, max(0, deficit), queue_deficit, capped=admits < len(queue_blocks))


def plan_restore(needed_blocks: int, capacity_blocks: int, loss: Sequence[int], max_usage: float) -> int:
    """The most layers (a prefix of the restore order) whose KV loss leaves `needed_blocks` (used +
    owed + queued) at most `max_usage` of the smaller capacity; 0 when none does."""
    if not 0.0 < max_usage <= 1.0:
        raise ValueError(f"max_usage must be in (0, 1], got {max_usage}")
    fits = [k for k, lost in enumerate(loss) if needed_blocks <= max_usage * (capacity_blocks - lost)]
    return max(fits, default=0)
