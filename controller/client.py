"""ControllerClient: how a replica reports to the fleet controller from its serving process.

Every report goes to the controller with a deadline (0.5 s by default). When the controller does not
answer in time, is dead or restarting, or was never started, the replica decides by itself with the
same policy over its own history (`Directive.source == "local"`), sets `reachable = False` for its
metrics, and tries the controller again on the next report, re-resolving the actor by name. Nothing
here raises into the serving path.

The local fallback applies the mode cap and the last fleet grant the controller gave this replica
(it cannot know the others' demand, so it never takes more than that share); when the controller is
back it moves the budget again. Before the controller has answered once, a replica of a fleet with an
accuracy budget has no share at all and keeps full precision: at start the controller actor can take
seconds to come up, and replicas that morphed on their own meanwhile held more than the budget together
(seen in tests/test_fleet_serve.py). (Past `replica_timeout_s` of silence the controller hands a silent
replica's share to others: a replica cut off from the controller yet alive can then overlap them.) It asks
to scale out under the same rule as the controller (at the cap for `scale_out_after_s`).

`use_controller=False` (the app's `fleet_controller: false`) never contacts a controller: every
replica runs its own policy, as a fleet without the controller would.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from controller.directive import Directive
from controller.fleet import DEFAULT_NAME, DEFAULT_NAMESPACE
from controller.policy import PolicyRunner
from controller.policy_config import FleetConfig, PolicyConfig
from controller.saturation import SaturationTimer, compute_bound, is_saturated
from engine.morph.actions import MorphState
from engine.pressure import PressureSnapshot

log = logging.getLogger(__name__)


class ControllerClient:
    def __init__(self, replica_id: str, config: PolicyConfig | None = None, *, name: str = DEFAULT_NAME,
                 namespace: str = DEFAULT_NAMESPACE, timeout_s: float = 0.5,
                 create_with: FleetConfig | None = None, resolve: Callable[[], Any] | None = None,
                 use_controller: bool = True):
        """`create_with`: start the controller with this config if none is running (else only look it
        up by name). `resolve`: returns an actor handle; replaces the Ray lookup (tests).
        `use_controller=False`: decide locally, always."""
        if not replica_id:
            raise ValueError("replica_id must be a non-empty string (e.g. the Serve replica's id)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.replica_id = replica_id
        self.timeout_s = timeout_s
        self._name, self._namespace, self._create_with = name, namespace, create_with
        self._resolve = resolve or self._resolve_by_name
        self._runner = PolicyRunner(config or (create_with.policy if create_with else PolicyConfig()))
        fleet = create_with or FleetConfig()
        self._saturation = SaturationTimer(fleet.scale_out_after_s, fleet.scale_out_reset_after_s)
        self.use_controller = use_controller
        self._handle: Any = None
        self._reachable = False  # until the controller first answers
        self.last_directive: Directive | None = None
        self.last_grant: int | None = None  # the controller's latest fleet share for this replica
        self._answered = False  # whether the controller has ever answered (see _fallback_cap)
        self._budgeted = create_with is not None and create_with.fleet_max_quantized_layers is not None
        self.last_error: str | None = None
        self.fallbacks = 0  # reports answered by the local policy

    @property
    def reachable(self) -> bool:
        """Whether the last report was answered by the controller (the metric's value)."""
        return self._reachable

    async def report(self, snapshot: PressureSnapshot, morph_state: MorphState) -> Directive:
        """Send one snapshot; the controller's directive, or the local policy's when it cannot answer."""
        try:
            self._runner.observe(snapshot)
        except Exception:  # a malformed snapshot must not reach the serving path either
            log.exception("could not record a pressure snapshot")
        if not self.use_controller:
            self.last_directive = self._local(morph_state)
            return self.last_directive
        try:
            directive = await asyncio.wait_for(self._ask(snapshot, morph_state), self.timeout_s)
            if not isinstance(directive, Directive):
                raise TypeError(f"controller answered {type(directive).__name__}, not a Directive")
        except Exception as e:  # timeout, actor dead / restarting / missing, Ray down: decide locally
            self._on_failure(e)
            directive = self._local(morph_state)
        else:
            self._reachable, self.last_error, self.last_grant, self._answered = True, None, directive.grant, True
            if directive.mode != self._runner.config.mode:  # follow a fleet-wide set_mode in the fallback too
                self._runner.set_config(self._runner.config.with_mode(directive.mode))
        self.last_directive = directive
        return directive

    async def connect(self, deadline_s: float) -> bool:
        """Start the controller (or find it) and wait until it answers, for at most `deadline_s`: a
        replica calls this while it loads its model and is ready only after it, so its first requests
        find the fleet up (in a budgeted fleet, a replica without an answer has no share and cannot
        morph; and on a small host the actor's start would take CPU from the first requests). False when
        it did not answer in time (logged; the replica serves on its local policy and reports on) or
        when this client never uses a controller."""
        if not self.use_controller or deadline_s <= 0:
            return False
        try:
            await asyncio.wait_for(self._call("ping"), deadline_s)
            return True
        except Exception as e:  # not up in time, or Ray refused: the reports keep trying
            self._forget_handle(e)
            log.warning("fleet controller did not answer within %.1f s of this replica's start (%s); "
                        "serving on the local policy until it does", deadline_s, self.last_error)
            return False

    async def set_mode(self, mode: str) -> None:
        """Switch the fleet's policy mode (the controller's set_mode) through the same handle as the
        reports, with the same deadline; raises when the controller does not answer (the caller
        keeps the mode as a pin and tries again)."""
        try:
            await asyncio.wait_for(self._call("set_mode", mode), self.timeout_s)
        except Exception:
            self._handle = None  # look the actor up again next time
            raise

    async def _ask(self, snapshot: PressureSnapshot, morph_state: MorphState) -> Directive:
        return await self._call("report", self.replica_id, snapshot, morph_state)

    async def _call(self, method: str, *args: Any) -> Any:
        if self._handle is None:
            self._handle = await asyncio.to_thread(self._resolve)
        return await getattr(self._handle, method).remote(*args)

    def _on_failure(self, error: Exception) -> None:
        if self._reachable or self.last_error is None:  # log transitions, not every report
            log.warning("fleet controller unreachable (%s: %s); using the local policy",
                        type(error).__name__, error)
        self._reachable = False
        self._forget_handle(error)
        self.fallbacks += 1

    def _forget_handle(self, error: Exception) -> None:
        self.last_error = f"{type(error).__name__}: {error}"
        self._handle = None  # look the actor up again next time (it may have been restarted or recreated)

    def _fallback_cap(self) -> int | None:
        """The most layers the local policy may quantize: the last grant; 0 in a budgeted fleet whose
        controller has not answered yet (no share yet, see the module doc); None = the mode cap only."""
        if self.use_controller and self._budgeted and not self._answered:
            return 0
        return self.last_grant

    def _local(self, morph_state: MorphState) -> Directive:
        try:
            cap = self._fallback_cap()
            directive = self._runner.decide(morph_state, cap=cap)
            history, config = self._runner.history, self._runner.config
            latest = history[-1] if history else None
            saturated = is_saturated(latest, morph_state, config, cap, compute_bound(directive))
            scale_out = self._saturation.update(saturated, directive.scale_out,
                                                latest.time if latest else 0.0)
            return dataclasses.replace(directive, scale_out=scale_out)
        except Exception as e:  # a bug in the policy must not take the replica down: hold still
            log.exception("local policy failed; holding the current morph state")
            return Directive(target_quantized=morph_state.num_quantized,
                             precision=self._runner.config.active.precision, mode=self._runner.config.mode,
                             reason=f"local policy failed ({type(e).__name__}); hold", source="local")

    def _resolve_by_name(self) -> Any:
        import ray

        if not ray.is_initialized():  # never let a lookup start a Ray cluster inside a replica
            raise RuntimeError("Ray is not initialized in this process")
        if self._create_with is not None:
            from controller.fleet import get_or_create_controller

            return get_or_create_controller(self._name, self._namespace, self._create_with)
        return ray.get_actor(self._name, namespace=self._namespace)
