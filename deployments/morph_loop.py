"""MorphLoop: an engine replica's control loop, and the operator's pins on it.

Every `interval_s` it takes a fresh pressure snapshot and morph state at a step boundary (so the
snapshot's clock moves on while the replica idles, and the policy can see a quiet period), reports
them through the ControllerClient (the fleet's directive, or the local policy's while the controller
is unreachable), turns the directive into one SetQuantizedTarget unless it is a no-op or the engine
already works on it, hands that to the engine, and updates the replica's metrics from what the
engine reports it did (its morph log), not from differences between states.

Operator pins (POST /admin/morph) override the directive:
  * quantized_layers=N (+ precision): hold exactly N layers low, whatever the pressure;
  * morphing_enabled=False: hold 0 (every layer is restored as soon as live blocks allow);
  * morphing_enabled=True: drop both pins, follow the policy again;
  * mode: switch the fleet's policy mode (the controller's set_mode), re-asserted after a
    controller restart, which would otherwise bring back the configured mode.
No Ray Serve here: tests drive it with a fake engine and a fake controller handle.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Any

from controller.client import ControllerClient
from controller.directive import Directive
from deployments.directive_wait import DirectiveWait
from deployments.engine_client import AdminUpdate
from deployments.metrics import ServeMetrics
from engine.errors import InvalidRequestError
from engine.morph.actions import ActionResult, MorphState, SetQuantizedTarget
from engine.morph.admission import AdmissionGrant
from engine.precision import Precision
from engine.pressure import PressureSnapshot

log = logging.getLogger("morphserve.replica")
# Changes of the quantized-layer count kept for the admin status (a benchmark sums them over the
# replicas of a fleet); at most one per round, so 4096 cover ~17 min of a change every 0.25 s round.
QUANTIZED_HISTORY_LEN = 4096


@dataclasses.dataclass(frozen=True)
class AdminPins:
    mode: str | None = None  # the fleet mode this replica keeps asserting
    morphing_enabled: bool = True
    quantized_layers: int | None = None  # a fixed count, instead of the policy's
    precision: Precision | None = None

    def updated(self, update: AdminUpdate, default_precision: Precision) -> "AdminPins":
        pins = self
        if update.quantized_layers is not None and update.morphing_enabled is False:
            raise InvalidRequestError("quantized_layers needs morphing on; drop morphing_enabled=false",
                                      param="quantized_layers")
        if update.mode is not None:
            pins = dataclasses.replace(pins, mode=update.mode)
        if update.morphing_enabled is not None:  # either way the fixed count is dropped
            pins = dataclasses.replace(pins, morphing_enabled=update.morphing_enabled, quantized_layers=None,
                                       precision=None)
        if update.quantized_layers is not None:
            precision = Precision(update.precision) if update.precision else default_precision
            pins = dataclasses.replace(pins, morphing_enabled=True, quantized_layers=update.quantized_layers,
                                       precision=precision)
        return pins


def pin_problem(pins: AdminPins, state: MorphState, ladder: tuple[Precision, ...] | None) -> tuple[str, str] | None:
    """(parameter, why) this engine can never hold the pin, or None. Checked when the pin is made,
    so that an impossible pin is a 400 at the call, not a refusal from the engine every round."""
    n = len(state.layer_precisions)
    if not state.morphing_enabled:
        return "quantized_layers", "this engine runs without morphing (enable_morphing is false); nothing can be pinned"
    if not 0 <= pins.quantized_layers <= n:
        return "quantized_layers", f"quantized_layers must be in [0, {n}] (this model has {n} layers), got {pins.quantized_layers}"
    if ladder is not None and pins.precision not in ladder:
        return "precision", f"precision must be one of {[p.value for p in ladder]} (the engine's morph_ladder), got {pins.precision.value}"
    return None


@dataclasses.dataclass(frozen=True)
class LoopRecord:
    """What the latest round saw and did (admin status, tests)."""
    time: float
    directive: Directive
    action: SetQuantizedTarget | None
    result: ActionResult | None


class MorphLoop:
    def __init__(self, engine: Any, client: ControllerClient, metrics: ServeMetrics, *, interval_s: float = 0.25,
                 max_layers_per_step: int = 2, ladder: tuple[Precision, ...] | None = None):
        """`engine`: an AsyncLLMEngine (run_at_step_boundary, apply, morph_results_since). `ladder`:
        the engine's lower rungs (EngineConfig.ladder), so a pin at another precision is refused
        when it is made."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.engine, self.client, self.metrics = engine, client, metrics
        self.interval_s, self.max_layers_per_step = interval_s, max_layers_per_step
        self.ladder = ladder
        self.pins = AdminPins()
        self.last: LoopRecord | None = None
        self.rounds = 0
        # (wall clock, quantized layers) at every round where the count changed: the replica's own
        # timeline, exact to one round, whichever replica a sampler's admin call happens to reach.
        self.quantized_history: collections.deque[tuple[float, int]] = collections.deque(maxlen=QUANTIZED_HISTORY_LEN)
        self.action_counts: dict[str, int] = {}  # ActionResult status -> how many (the engine's morph log)
        # Rounds at which requests waited, by what they waited for (PressureSnapshot.waiting_for: memory,
        # which morphing relieves, or compute, which it cannot): every replica's own count, so a benchmark
        # sees the fleet's whole queue, not the replica its admin poll happened to reach.
        self.waiting_rounds: dict[str, int] = {}
        self.directive_wait = DirectiveWait()  # how long each round waited for its directive
        self._task: asyncio.Task | None = None
        self._cursor = 0  # position in the engine's morph log already counted
        self._rejected: SetQuantizedTarget | None = None
        # check_integrity (block pool, block tables, ledger) runs at every observation; a failure is
        # counted and reported (admin status, soak), never raised into the serving path.
        self.integrity_checks = 0
        self.integrity_failures = 0
        self.last_integrity_error: str | None = None

    # -- the loop ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="morphserve-morph-loop")

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad round must not end the loop (or the replica)
                log.exception("morph loop round failed; trying again next interval")
            # A fixed cadence: the next report is due interval_s after this one started.
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def observe(self) -> tuple[PressureSnapshot, MorphState]:
        """A fresh snapshot and state, read together on the stepping thread between two steps,
        after checking the engine's integrity there."""
        snapshot, state, error = await self.engine.run_at_step_boundary(_checked_observation)
        self.integrity_checks += 1
        if error is not None:
            self.integrity_failures += 1
            self.last_integrity_error = error
            log.error("engine integrity check failed: %s", error)
        return snapshot, state

    async def run_once(self) -> LoopRecord:
        snapshot, state = await self.observe()
        if not self.quantized_history or self.quantized_history[-1][1] != state.num_quantized:
            self.quantized_history.append((time.time(), state.num_quantized))
        if snapshot.num_waiting > 0:
            self.waiting_rounds[snapshot.waiting_for] = self.waiting_rounds.get(snapshot.waiting_for, 0) + 1
            self.metrics.burst.count_queue_wait(snapshot.waiting_for)
        self._count_engine_results()
        self.metrics.set_pressure(snapshot)
        self.metrics.set_morph_state(state)
        asked = time.monotonic()
        directive = await self.client.report(snapshot, state)
        waited = time.monotonic() - asked
        self.directive_wait.observe(waited)
        self.metrics.observe_directive_wait(waited, directive.source)
        self.metrics.set_controller_reachable(self.client.reachable)
        self.metrics.burst.set(snapshot, directive)
        await self._assert_mode(directive)
        action = self.action_for(directive, state)
        result = await self._enact(self.grant_for(directive, state), action, snapshot)
        if action is not None and result is not None and result.status == "rejected":
            self._rejected = action
            log.warning("engine rejected %s: %s", action, result.message)
        self._count_engine_results()  # the directive's result and any admission morph at that boundary
        self.rounds += 1
        self.last = LoopRecord(snapshot.time, directive, action, result)
        return self.last

    def _count_engine_results(self) -> None:
        """Count what the morph executor did since the last look: the results of the actions this
        loop applied and of every step boundary that continued them (the engine's morph log)."""
        self._cursor, results = self.engine.morph_results_since(self._cursor)
        for result in results:
            self.metrics.count_action(result)
            self.action_counts[result.status] = self.action_counts.get(result.status, 0) + 1

    async def _enact(self, grant: AdmissionGrant | None, action: SetQuantizedTarget | None,
                     snapshot: PressureSnapshot) -> ActionResult | None:
        """Hand the engine its grant and the target (skipped if it morphed at admission since the snapshot)."""
        if hasattr(self.engine, "enact"):
            seen = snapshot.admission_swaps_total + snapshot.admission_restores_total
            return await self.engine.enact(grant, action, seen)
        return await self.engine.apply(action) if action is not None else None  # an engine without admission morphing

    def grant_for(self, directive: Directive, state: MorphState) -> AdmissionGrant | None:
        """What the engine may do by itself until the next round: up to the directive's allowed maximum
        (an operator pin holds the count exactly; morphing disabled: nothing)."""
        pins = self.pins
        if not pins.morphing_enabled:
            return None
        if pins.quantized_layers is not None:
            n = max(pins.quantized_layers, state.forced_quantized)
            return AdmissionGrant(n, n, pins.precision or directive.precision, directive.reservation_factor)
        allowed = directive.max_quantized if directive.max_quantized is not None else directive.target_quantized
        return AdmissionGrant(max(allowed, state.forced_quantized), state.forced_quantized, directive.precision,
                              directive.reservation_factor, directive.restore_quiet_s)

    def action_for(self, directive: Directive, state: MorphState) -> SetQuantizedTarget | None:
        """The directive (or the operator's pin) as an engine action; None when nothing would change."""
        pins = self.pins
        if not pins.morphing_enabled:
            directive = dataclasses.replace(directive, target_quantized=0, reason="morphing disabled by the operator")
        elif pins.quantized_layers is not None:
            directive = dataclasses.replace(directive, target_quantized=pins.quantized_layers,
                                            precision=pins.precision or directive.precision,
                                            reason="quantized layers pinned by the operator")
        if directive.is_noop_for(state):
            return None
        action = directive.to_action(self.max_layers_per_step)
        if action == self._rejected:  # the engine said it cannot; do not ask again every round
            return None
        if action in state.pending:  # the engine is on it (it keeps stepping while idle until done)
            return None
        return action

    async def _assert_mode(self, directive: Directive) -> None:
        wanted = self.pins.mode
        if wanted is None or directive.source != "controller" or directive.mode == wanted:
            return
        try:
            await self.client.set_mode(wanted)
        except Exception as e:  # the controller went away again: the next round retries
            log.warning("could not set the fleet mode to %s: %s", wanted, e)

    # -- the operator ------------------------------------------------------------------------
    async def update(self, update: AdminUpdate) -> None:
        default = self.last.directive.precision if self.last else Precision.INT4
        pins = self.pins.updated(update, default)
        if pins.quantized_layers is not None:
            _, state = await self.observe()
            problem = pin_problem(pins, state, self.ladder)
            if problem is not None:
                param, message = problem
                raise InvalidRequestError(message, param=param)
        self.pins = pins
        if update.mode is not None:
            try:
                await self.client.set_mode(update.mode)
            except Exception as e:  # kept as a pin; asserted again once the controller answers
                log.warning("fleet controller did not take mode %s yet: %s", update.mode, e)

    def status(self) -> dict[str, Any]:
        last = self.last
        return {
            "pins": {"mode": self.pins.mode, "morphing_enabled": self.pins.morphing_enabled,
                     "quantized_layers": self.pins.quantized_layers,
                     "precision": self.pins.precision.value if self.pins.precision else None},
            "controller": {"reachable": self.client.reachable, "last_error": self.client.last_error,
                           "fallbacks": self.client.fallbacks},
            "directive": last.directive.summary() if last else None,
            "last_action": None if last is None or last.action is None else {
                "count": last.action.count, "precision": last.action.precision.value,
                "status": last.result.status if last.result else None,
                "message": last.result.message if last.result else ""},
            "rounds": self.rounds,
            "quantized_history": [[round(t, 3), n] for t, n in self.quantized_history],
            "action_results": dict(self.action_counts),
            "waiting_rounds": dict(self.waiting_rounds),
            "directive_wait": self.directive_wait.as_dict(),
            "integrity": {"checks": self.integrity_checks, "failures": self.integrity_failures,
                          "last_error": self.last_integrity_error},
        }


def _checked_observation(engine: Any) -> tuple[PressureSnapshot, MorphState, str | None]:
    """On the stepping thread: (pressure, morph state, integrity error or None)."""
    error = None
    check = getattr(engine, "check_integrity", None)
    if check is not None:  # test doubles may have none
        try:
            check()
        except Exception as e:  # noqa: BLE001 - reported, the replica keeps serving
            error = f"{type(e).__name__}: {e}"
    return engine.pressure(), engine.morph_state(), error
