"""KV demand: what the queued and running requests need, in blocks, as opposed to what they hold.

Usage (used / capacity) says how full the cache is; demand says whether the next request fits. A
request is *reserved* its prompt (plus any outputs it already has, after a preemption) and an output
reservation of `reservation_tokens`, capped by its max_tokens:

    reserved tokens = min(prompt + max_tokens, max(num_tokens + 1, prompt + reservation_tokens))

    waiting request: needs blocks_for(reserved) - shared    (it holds none; shared: the blocks of its
                                                             prefix in the cache that other requests hold)
    running request: needs blocks_for(reserved) - held      (its growth inside the reservation)
    to finish:       blocks_for(prompt + max_tokens) - held (the upper bound, reported only)

`available = free - running reserved growth` is what the head of the queue may take without
squeezing a running request into preemption. The prefill backlog (tokens not yet in the cache, a waiting
request's cached prefix excluded) is what a new request's first token waits behind. Pure functions of
the sequences, the block tables and the prefix cache's index.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from engine.kv_cache_manager import KVCacheManager
from engine.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class Demand:
    waiting_blocks: tuple[int, ...]  # per waiting request, FCFS order: blocks to be admitted
    running_reserved_blocks: int  # blocks running requests still need inside their reservation
    running_finish_blocks: int  # blocks running requests still need to reach max_tokens
    free_blocks: int  # committed and unused
    admissible_now: int = 1  # waiting requests (FCFS prefix) the next step's token budget and seat count could take
    prefill_backlog_tokens: int = 0  # prompt tokens not yet in the cache, waiting and running requests (a new request's TTFT queues behind them)

    @property
    def waiting_total_blocks(self) -> int:
        return sum(self.waiting_blocks)

    @property
    def available_blocks(self) -> int:
        """Free blocks not promised to running requests (may be negative: they are owed more)."""
        return self.free_blocks - self.running_reserved_blocks

    @property
    def head_fits(self) -> bool:
        return not self.waiting_blocks or self.waiting_blocks[0] <= self.available_blocks

    @property
    def step_fits(self) -> bool:
        """Running requests get what they are owed, and every request the next step could admit (at
        least the head) fits the available blocks."""
        return sum(self.waiting_blocks[:max(1, self.admissible_now)]) <= self.available_blocks


def reserved_tokens(seq: Sequence, reservation_tokens: int) -> int:
    full = seq.num_prompt_tokens + seq.params.max_tokens
    return min(full, max(seq.num_tokens + 1, seq.num_prompt_tokens + reservation_tokens))


def admissible_now(waiting: list[Sequence], running: list[Sequence], token_budget: int, max_seqs: int) -> int:
    """How many queued requests the next step could start by compute alone: running requests take
    their tokens first; a queued one starts while any budget is left (chunked prefill)."""
    budget = token_budget - sum(s.num_uncomputed_tokens for s in running)
    count = 0
    for s in waiting[:max(0, max_seqs - len(running))]:
        if budget <= 0:
            break
        count += 1
        budget -= s.num_uncomputed_tokens
    return count


def measure_demand(waiting: Iterable[Sequence], running: Iterable[Sequence], kv: KVCacheManager,
                   reservation_tokens: int, token_budget: int, max_seqs: int) -> Demand:
    if reservation_tokens < 0:
        raise ValueError(f"reservation_tokens must be >= 0, got {reservation_tokens}")
    waiting, running = list(waiting), list(running)
    # A waiting request's prefix already in the cache: blocks other requests hold are shared, not taken from
    # the free ones, and no cached block is prefilled again (KVCacheManager.cached_prefix_blocks).
    cached = [_cached_prefix(kv, s) for s in waiting]
    queue = tuple(kv.blocks_for(reserved_tokens(s, reservation_tokens)) - len(kv.block_table(s.request_id)) - held
                  for s, (_, held) in zip(waiting, cached))
    reserved = finish = 0
    for s in running:
        held = len(kv.block_table(s.request_id))
        reserved += max(0, kv.blocks_for(reserved_tokens(s, reservation_tokens)) - held)
        finish += max(0, kv.blocks_for(s.num_prompt_tokens + s.params.max_tokens) - held)
    return Demand(waiting_blocks=tuple(max(0, b) for b in queue), running_reserved_blocks=reserved,
                  running_finish_blocks=finish, free_blocks=kv.num_free_blocks,
                  admissible_now=admissible_now(waiting, running, token_budget, max_seqs),
                  prefill_backlog_tokens=prefill_backlog(waiting, running, [n * kv.block_size for n, _ in cached]))


def _cached_prefix(kv: KVCacheManager, seq: Sequence) -> tuple[int, int]:
    if not seq.may_use_prefix_cache:
        return 0, 0
    return kv.cached_prefix_blocks(seq.request_id, seq.token_slice(0, seq.num_tokens), seq.params.cache_salt)


def prefill_backlog(waiting: list[Sequence], running: list[Sequence], waiting_cached: list[int]) -> int:
    """Tokens the engine must prefill before it reaches a request arriving now: everything queued (less
    the tokens each waiting request finds in the prefix cache, `waiting_cached`, one per waiting request),
    and what running requests have left of their prompts (a decoding request's one uncomputed token is
    its next step, not backlog)."""
    return (sum(s.num_uncomputed_tokens - c for s, c in zip(waiting, waiting_cached, strict=True))
            + sum(max(0, s.num_uncomputed_tokens - 1) for s in running))
