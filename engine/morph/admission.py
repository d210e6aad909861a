"""AdmissionMorpher: morph at admission, restore by demand. Runs at every step boundary.

    step boundary:  demand (engine/demand.py) --plan_admission--> swap k layers now, then schedule
                                               --plan_restore----> after a quiet period, give k back

- Trigger: a request the next step could start (at least the head of the queue) does not fit: its
  prompt + output reservation exceeds the free blocks not owed to running requests (or running ones
  are owed more than is free). Size: the fewest layers that free the deficit of the longest FCFS
  prefix of the queue that fits under the cap (engine/morph/sizing.py), all moved at this boundary,
  before the scheduler runs. The next layers' quantized copies are read ahead while the step runs,
  and already while the queue as a whole does not fit, before its head is blocked.
- Bounds: the grant (`AdmissionGrant`, from the replica's last directive): the most layers allowed
  (mode cap and fleet share, never below what the budget forces) and the floor a restore keeps.
  Without a grant nothing morphs here (the engine has not heard from a policy yet).
- Restore: nothing waits and the demand (used + owed) stays below `restore_max_usage` of the smaller
  cache for `restore_quiet_s` in a row (the grant may shorten it: the fleet does while the other
  replicas are relaxed); then the most layers that keep it so, in reverse swap order.
  The resizer migrates live blocks and never preempts; the usage bound (at or below the policy's relax
  usage, so the sampled path does not see pressure right after) and the quiet period are the hysteresis.
- Every decision is logged (`AdmissionEvent`) and counted; the replica reports the counters with its
  next pressure snapshot, and the controller answers with a new grant (re-grant or veto).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Literal

from engine.demand import Demand
from engine.morph.actions import ActionResult, SetQuantizedTarget
from engine.morph.sizing import growth_blocks, loss_blocks, plan_admission, plan_restore
from engine.precision import Precision

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AdmissionSettings:
    restore_quiet_s: float  # demand must fit the smaller cache this long before a restore
    restore_max_usage: float  # a restore keeps the demand at most this fraction of the smaller cache
    prefetch_layers: int  # quantized copies read ahead while a step runs when the queue does not fit
    log_len: int  # admission events kept for status / benchmarks


@dataclasses.dataclass(frozen=True)
class AdmissionGrant:
    """What the replica's policy allows the engine to do on its own, until the next directive."""
    max_quantized: int  # most layers below full precision (mode cap, fleet share; >= forced)
    min_quantized: int  # a demand restore stops here (the layers the budget forces, or an operator pin)
    precision: Precision  # the rung admission swaps go to
    reservation_factor: float = 1.0  # output reservation multiplier (SLO feedback)
    # The quiet period a demand restore needs under this grant (None: the engine's restore_quiet_s). The
    # fleet shortens it while the other replicas are relaxed: they take what this one gives back.
    restore_quiet_s: float | None = None


@dataclasses.dataclass(frozen=True)
class AdmissionEvent:
    time: float  # engine clock when the layers were moved
    step: int
    kind: Literal["swap", "restore"]
    quantized_before: int
    quantized_after: int
    kv_capacity_before: int
    kv_capacity_after: int
    deficit_blocks: int  # swap: blocks the admitted prefix lacked; restore: 0
    admits: int  # swap: waiting requests the new capacity fits
    waiting: int
    blocked_since: float | None  # when the head first did not fit (None for restores)
    capped: bool  # the queue wanted more layers than the grant allows
    seconds: float  # swap + resize time
    status: str

    def summary(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class MemoryWait:
    """One episode of "a request the next step could start did not fit": from the boundary that first
    saw it to the boundary where everything the step could start fitted again (by a swap here, by
    requests finishing, or after the grant was raised). `end - start` is the reaction time."""
    start: float  # engine clock (time.monotonic)
    end: float
    swaps: int  # admission swaps made during it
    capped: bool  # the grant stopped a swap during it

    def summary(self) -> dict:
        return {**dataclasses.asdict(self), "seconds": self.end - self.start}


class AdmissionMorpher:
    def __init__(self, executor, settings: AdmissionSettings, reservation_tokens: int,
                 demand: Callable[[int], Demand], step_count: Callable[[], int]):
        """`executor`: the engine's MorphExecutor; `demand(reservation_tokens)`: the engine's current
        Demand; `step_count()`: steps so far."""
        self.executor, self.settings = MorphFigures(executor), settings
        self.default_reservation = reservation_tokens
        self._demand, self._step_count = demand, step_count
        self.grant: AdmissionGrant | None = None
        self.events: collections.deque[AdmissionEvent] = collections.deque(maxlen=settings.log_len)
        self.swaps_total = self.layers_swapped_total = self.restores_total = self.layers_restored_total = 0
        self.capped_total = 0
        self.blocked_since: float | None = None  # the current "does not fit" episode
        self.waits: collections.deque[MemoryWait] = collections.deque(maxlen=settings.log_len)
        self._episode = (0, 0)  # swaps_total, capped_total when the current episode began
        self._quiet_since: float | None = None

    @classmethod
    def for_engine(cls, engine) -> "AdmissionMorpher":
        c = engine.config
        settings = AdmissionSettings(restore_quiet_s=c.restore_quiet_s, restore_max_usage=c.restore_max_usage,
                                     prefetch_layers=c.admission_prefetch_layers, log_len=c.admission_log_len)
        return cls(engine.morph_executor, settings, c.output_reservation_tokens, engine.monitor.demand,
                   lambda: engine.monitor.step_count)

    @property
    def reservation_tokens(self) -> int:
        factor = self.grant.reservation_factor if self.grant is not None else 1.0
        return round(self.default_reservation * factor)

    def moves_total(self) -> int:
        """Admission swaps + demand restores so far: a directive computed before the latest is stale."""
        return self.swaps_total + self.restores_total

    def set_grant(self, grant: AdmissionGrant | None) -> None:
        if grant is not None and (grant.min_quantized < 0 or grant.max_quantized < 0 or grant.reservation_factor <= 0
                                  or (grant.restore_quiet_s is not None and grant.restore_quiet_s < 0)):
            raise ValueError(f"a grant needs non-negative layer counts and quiet period and a positive reservation "
                             f"factor, got {grant}")
        self.grant = grant

    def demand(self) -> Demand:
        return self._demand(self.reservation_tokens)

    # -- the boundary ------------------------------------------------------------------------
    def at_boundary(self, now: float) -> ActionResult | None:
        demand = self.demand()
        self._track_blocked(demand, now)
        grant = self.grant
        if grant is None:
            return None
        if not demand.step_fits:
            self._quiet_since = None
            result = self._swap(demand, grant, now)
            if result is not None and result.layers_changed:  # the episode may end with this swap
                self._track_blocked(self.demand(), time.monotonic())
            return result
        if demand.waiting_total_blocks > demand.available_blocks:  # the queue will not fit: read ahead now
            current = self.executor.num_quantized()
            self._prefetch(current, max(0, grant.max_quantized - current), grant)
        return self._maybe_restore(demand, grant, now)

    def _track_blocked(self, demand: Demand, now: float) -> None:
        if demand.step_fits:
            if self.blocked_since is not None:
                swaps, capped = self._episode
                self.waits.append(MemoryWait(self.blocked_since, now, self.swaps_total - swaps,
                                             self.capped_total > capped))
            self.blocked_since = None
        elif self.blocked_since is None:
            self.blocked_since = now
            self._episode = (self.swaps_total, self.capped_total)

    def _swap(self, demand: Demand, grant: AdmissionGrant, now: float) -> ActionResult | None:
        ex = self.executor
        current = ex.num_quantized()
        allowed = max(0, grant.max_quantized - current)
        layers = ex.next_layers(current, allowed)
        gains = [ex.layer_bytes_now(layer) - ex.layer_bytes_at(layer, grant.precision) for layer in layers]
        growth = growth_blocks(ex.free_bytes(), ex.block_bytes(), ex.room_blocks(), gains)
        plan = plan_admission(demand.waiting_blocks, demand.available_blocks, growth, demand.admissible_now)
        if plan.capped:
            self.capped_total += 1
        if plan.layers == 0:
            self._prefetch(current, allowed, grant)
            return None
        before = ex.capacity_blocks()
        # A policy target already heading further down is kept: these layers now, the rest as it was.
        count = min(grant.max_quantized, max(current + plan.layers, ex.pending_target() or 0))
        target = SetQuantizedTarget(count, grant.precision, max_layers_per_step=plan.layers)
        result = ex.replace_target_now(target)
        self._prefetch(current + plan.layers, allowed - plan.layers, grant)
        if result.layers_changed:
            self.swaps_total += 1
            self.layers_swapped_total += len(result.layers_changed)
        self._log("swap", now, current, before, plan.deficit_blocks, plan.admits, demand, plan.capped, result)
        return result

    def _prefetch(self, current: int, allowed: int, grant: AdmissionGrant) -> None:
        for layer in self.executor.next_layers(current, min(allowed, self.settings.prefetch_layers)):
            self.executor.swapper.prefetch(layer, grant.precision)

    def _maybe_restore(self, demand: Demand, grant: AdmissionGrant, now: float) -> ActionResult | None:
        ex = self.executor
        current = ex.num_quantized()
        if ex.pending_target() is not None:  # a target is still moving: let it land before judging demand
            self._quiet_since = None
            return None
        layers = ex.restore_layers(current, max(0, current - grant.min_quantized))
        needed = ex.used_blocks() + demand.running_reserved_blocks + demand.waiting_total_blocks
        needs = [ex.layer_bytes_full(layer) - ex.layer_bytes_now(layer) for layer in layers]
        loss = loss_blocks(ex.free_bytes(), ex.block_bytes(), needs)
        k = plan_restore(needed, ex.capacity_blocks(), loss, self.settings.restore_max_usage)
        if k == 0 or demand.waiting_blocks:
            self._quiet_since = None
            return None
        if self._quiet_since is None:
            self._quiet_since = now
        quiet = self.settings.restore_quiet_s if grant.restore_quiet_s is None else grant.restore_quiet_s
        if now - self._quiet_since < quiet:
            return None
        before = ex.capacity_blocks()
        result = ex.replace_target_now(SetQuantizedTarget(current - k, grant.precision, max_layers_per_step=k))
        self._quiet_since = now  # the next restore needs a quiet period of its own
        if result.layers_changed:
            self.restores_total += 1
            self.layers_restored_total += len(result.layers_changed)
        self._log("restore", now, current, before, 0, 0, demand, False, result)
        return result

    def _log(self, kind, now, current, before, deficit, admits, demand: Demand, capped, result: ActionResult) -> None:
        after = self.executor.num_quantized()
        event = AdmissionEvent(time=now, step=self._step_count(), kind=kind, quantized_before=current,
                               quantized_after=after, kv_capacity_before=before,
                               kv_capacity_after=self.executor.capacity_blocks(), deficit_blocks=deficit,
                               admits=admits, waiting=len(demand.waiting_blocks),
                               blocked_since=self.blocked_since if kind == "swap" else None, capped=capped,
                               seconds=result.swap_seconds + result.resize_seconds, status=result.status)
        self.events.append(event)
        logger.info("admission %s: %d -> %d quantized layers, kv %d -> %d blocks (%s)", kind, current, after,
                    before, event.kv_capacity_after, result.message)

    # -- reporting ---------------------------------------------------------------------------
    def rung_gain_blocks(self) -> tuple[tuple[str, int], ...]:
        """KV blocks one more layer (the next in the swap order) would free at each lower rung."""
        ex = self.executor
        nxt = ex.next_layers(ex.num_quantized(), 1)
        if not nxt:
            return ()
        out = []
        for rung in ex.ex.ladder[1:]:
            gain = ex.layer_bytes_now(nxt[0]) - ex.layer_bytes_at(nxt[0], rung)
            out.append((rung.value, growth_blocks(ex.free_bytes(), ex.block_bytes(), ex.room_blocks(), [gain])[1]))
        return tuple(out)

    def counters(self) -> dict[str, int]:
        return {"swaps": self.swaps_total, "layers_swapped": self.layers_swapped_total,
                "restores": self.restores_total, "layers_restored": self.layers_restored_total,
                "capped": self.capped_total}

    def status(self, recent: int | None = None) -> dict:
        """Grant, counters and the last `recent` events and waits (all kept, log_len, by default)."""
        g = self.grant
        return {"grant": None if g is None else {"max_quantized": g.max_quantized, "min_quantized": g.min_quantized,
                                                 "precision": g.precision.value,
                                                 "reservation_factor": g.reservation_factor},
                "reservation_tokens": self.reservation_tokens, "blocked_since": self.blocked_since,
                **self.counters(), "events": [e.summary() for e in list(self.events)[-(recent or len(self.events)):]],
                "waits": [w.summary() for w in list(self.waits)[-(recent or len(self.waits)):]]}


class MorphFigures:
    """The executor's layers, the ledger's bytes and the pool's blocks, as the sizing needs them.
    Assumes what every SetQuantizedTarget keeps: the quantized layers are a prefix of the swap order."""

    def __init__(self, executor):
        self.ex = executor
        self.swapper = executor.swapper

    def num_quantized(self) -> int:
        return sum(1 for p in self.swapper.precisions() if not p.is_full)

    def pending_target(self) -> int | None:
        """The count of a SetQuantizedTarget still moving, if any."""
        targets = [a.count for a in self.ex.morph_state().pending if isinstance(a, SetQuantizedTarget)]
        return targets[-1] if targets else None

    def next_layers(self, current: int, n: int) -> tuple[int, ...]:
        return self.ex.swap_order.order[current:current + max(0, n)]

    def restore_layers(self, current: int, n: int) -> tuple[int, ...]:
        return tuple(reversed(self.ex.swap_order.order[max(0, current - max(0, n)):current]))

    def layer_bytes_now(self, layer: int) -> int:
        return self.ex.ledger.layer_weights(layer)

    def layer_bytes_at(self, layer: int, precision: Precision) -> int:
        return self.swapper.store.layer_bytes(layer, precision)

    def layer_bytes_full(self, layer: int) -> int:
        return self.layer_bytes_at(layer, self.ex.full_precision)

    def free_bytes(self) -> int:
        return self.ex.ledger.free

    def block_bytes(self) -> int:
        return self.ex.kv_resizer.storage.block_bytes

    def room_blocks(self) -> int:
        return self.ex.pool.max_blocks - self.ex.pool.capacity

    def capacity_blocks(self) -> int:
        return self.ex.pool.capacity

    def used_blocks(self) -> int:
        return self.ex.pool.num_used

    def replace_target_now(self, target: SetQuantizedTarget) -> ActionResult:
        return self.ex.apply(target)  # a newer target replaces a pending one (e.g. a pending restore)


def enact(engine, grant: AdmissionGrant | None, action: SetQuantizedTarget | None,
          seen_moves: int) -> tuple[ActionResult | None, ActionResult | None]:
    """The replica's directive, at one step boundary: the new grant first (so a veto bounds the next
    admission morph at once), then the target unless the engine morphed on its own since the report
    the directive answers (`seen_moves`: the snapshot's swaps + restores; the next report decides
    with the new state), then an admission check (an idle engine takes no steps: restores by demand).
    Returns (the target's result, the admission check's result); None where nothing ran."""
    morpher = getattr(engine, "admission", None)
    if morpher is not None:
        morpher.set_grant(grant)
    result = None
    if action is not None:
        if morpher is not None and morpher.moves_total() != seen_moves:
            result = ActionResult(action, "noop", message="the engine morphed at admission since the report; "
                                                          "the next report decides")
        else:
            result = engine.apply(action)
    admitted = morpher.at_boundary(time.monotonic()) if morpher is not None else None
    return result, admitted
