"""Continuous batching under a per-step token budget.

Each step: (1) running decodes, oldest first; (2) running requests still prefilling (chunked);
(3) waiting requests, strictly FCFS, while blocks for their first chunk and a running slot exist; with
prefix caching a request starts after the cached blocks its tokens begin with (KVCacheManager), and
only the rest is prefilled.
A running request that cannot get a block preempts, by recompute, the most recently arrived
running request not yet scheduled this step (possibly itself): its blocks are freed and it goes
back to the front of the waiting queue, to be re-prefilled (prompt + outputs so far) later.
"""
from __future__ import annotations

import bisect
import collections

from engine.batch import ScheduledChunk, SchedulerOutput
from engine.kv_cache_manager import KVCacheManager
from engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.kv = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # kept sorted by arrival_index
        self.num_preemptions = 0

    # -- queue management --------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a request out of the queues (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = _StepPlan(budget=self.max_num_batched_tokens)
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if step.budget == 0:
                break
            if seq.status is SequenceStatus.RUNNING:  # not preempted earlier in this loop
                self._schedule_running(seq, step)
        if not step.preempted:  # admitting right after preempting would only thrash
            self._admit_waiting(step)
        # step.chunks is already decodes, then continuing prefills, then admissions (FCFS).
        return SchedulerOutput(chunks=tuple(step.chunks), preempted=tuple(step.preempted))

    def _schedule_running(self, seq: Sequence, step: "_StepPlan") -> None:
        num_tokens = min(seq.num_uncomputed_tokens, step.budget)
        while not self.kv.allocate_slots(seq.request_id, seq.num_computed_tokens + num_tokens):
            victim = self._pick_victim(step)
            self._preempt(victim, step)
            if victim is seq:
                return
        step.add(seq, num_tokens, self.kv.block_table(seq.request_id))

    def _pick_victim(self, step: "_StepPlan") -> Sequence:
        """The most recently arrived running request not scheduled this step."""
        candidates = [s for s in self.running if s.request_id not in step.scheduled]
        return max(candidates, key=lambda s: s.arrival_index)

    def _preempt(self, seq: Sequence, step: "_StepPlan") -> None:
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        step.preempted.append(seq.request_id)

    def _admit_waiting(self, step: "_StepPlan") -> None:
        while self.waiting and step.budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self._take_cached_prefix(seq)
            num_tokens = min(seq.num_uncomputed_tokens, step.budget)
            if not self.kv.allocate_slots(seq.request_id, seq.num_computed_tokens + num_tokens):
                if cached:  # give the shared blocks back (to the cache) until it is admitted
                    self.kv.free(seq.request_id)
                    seq.num_computed_tokens = 0
                break  # FCFS: nobody overtakes the head of the queue
            if self.kv.enable_prefix_caching:
                self.kv.count_lookup(seq.num_tokens, cached)
                if seq.num_cached_tokens is None:  # the first admission's hit is the one usage reports
                    seq.num_cached_tokens = cached
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival_index)
            step.add(seq, num_tokens, self.kv.block_table(seq.request_id))

    def _take_cached_prefix(self, seq: Sequence) -> int:
        """Start a waiting request after the cached blocks its tokens begin with; returns their tokens."""
        if not seq.may_use_prefix_cache:
            return 0
        cached = self.kv.take_cached_prefix(seq.request_id, seq.token_slice(0, seq.num_tokens), seq.params.cache_salt)
        seq.num_computed_tokens = cached
        return cached

    def oldest_waiting_arrival(self) -> float | None:
        return min((s.arrival_time for s in self.waiting), default=None)


class _StepPlan:
    """The chunks chosen so far in one schedule() call and the budget left."""

    def __init__(self, budget: int):
        self.budget = budget
        self.chunks: list[ScheduledChunk] = []
        self.scheduled: set[str] = set()
        self.preempted: list[str] = []

    def add(self, seq: Sequence, num_tokens: int, block_table: tuple[int, ...]) -> None:
        start = seq.num_computed_tokens
        end = start + num_tokens
        self.chunks.append(ScheduledChunk(
            request_id=seq.request_id, token_ids=seq.token_slice(start, end), start_pos=start,
            block_table=block_table, needs_logits=end == seq.num_tokens))
        self.scheduled.add(seq.request_id)
        self.budget -= num_tokens
