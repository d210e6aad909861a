"""FleetController: the detached, named Ray actor every replica reports to a few times a second.

It keeps each replica's recent snapshots, runs the same pure policy for it, and adds the fleet rules:
  * accuracy budget: at most `fleet_max_quantized_layers` quantized layers over all replicas; when
    replicas together want more, the budget goes to those under most pressure first (the others are
    capped, and restore if they hold more than their share); on top of its target each replica gets
    admission headroom sized by its last report (its queue's KV deficit plus one policy step), so it
    can still morph at admission; what is left is split evenly as onset headroom for the next burst;
  * scale-out: a replica that stays at its morph cap under sustained pressure for
    `scale_out_after_s` (measured on its own snapshot clock) asks for another replica: only then does
    its directive carry `scale_out`, which the replica hands to Ray Serve's autoscaler;
  * forgetting: a replica silent for `replica_timeout_s` (controller clock) leaves the view, and its
    share of the budget goes back to the others at their next report;
  * restore hysteresis: once the burst is over, a replica's demand restores need only
    `fleet_restore_quiet_s` of quiet instead of the engine's `restore_quiet_s` (the others have room
    for what it gives back), so layers come back sooner after a burst. Over means every replica, this
    one included, has absorbed load (relaxed, nothing waiting) for `fleet_restore_calm_s` on its own
    snapshot clock: a lull inside a burst is shorter, and a restore there can be undone at the next
    arrival, both moves stalling a replica that is short of compute.

The actor holds no durable state on purpose. Ray restarts it after a crash (max_restarts=-1) with
the config it was created with: it starts empty (a `set_mode` made since is lost) and rebuilds its
view from the next report of each replica; replicas run the policy locally in the meantime.
"""
from __future__ import annotations

import collections
import dataclasses
import time
import uuid
from collections.abc import Callable

from controller.directive import Directive
from controller.fleet_metrics import FleetMetrics, GaugeBackend
from controller.policy import admission_headroom, current_target, decide, is_relaxed, morph_cap, pressure_score
from controller.policy_config import FleetConfig, PolicyConfig
from controller.saturation import SaturationTimer, compute_bound, is_saturated
from controller.slo import SloState, tune, tuning_for
from engine.errors import InvalidRequestError
from engine.morph.actions import MorphState
from engine.pressure import PressureSnapshot

DEFAULT_NAME = "morphserve-controller"
DEFAULT_NAMESPACE = "morphserve"


@dataclasses.dataclass
class ReplicaView:
    """What the controller knows about one replica (rebuilt from reports after a restart)."""
    history: collections.deque[PressureSnapshot]
    state: MorphState
    last_report: float  # controller clock
    saturation: SaturationTimer
    directive: Directive | None = None
    grant: int | None = None  # its share of the fleet budget at the last report (None: no fleet cap)
    reports: int = 0
    slo: SloState = dataclasses.field(default_factory=SloState)  # SLO feedback (controller/slo.py)

    def at_cap_for(self) -> float:
        return self.saturation.held_for(self.history[-1].time) if self.history else 0.0


class FleetController:
    """Plain class (tests drive it directly with a fake clock); `get_or_create_controller` runs it
    as a Ray actor."""

    def __init__(self, config: FleetConfig | dict | None = None, clock: Callable[[], float] = time.monotonic,
                 metrics: GaugeBackend | None = None):
        """`metrics`: where the fleet gauges go (the actor passes Ray's; None: none)."""
        self._config = config if isinstance(config, FleetConfig) else FleetConfig.model_validate(config or {})
        self._clock = clock
        self._replicas: dict[str, ReplicaView] = {}
        self._metrics = FleetMetrics(metrics) if metrics is not None else None
        self.instance_id = uuid.uuid4().hex[:12]  # changes on every (re)start: lets operators see restarts
        self.started_at = time.time()

    @property
    def config(self) -> FleetConfig:
        return self._config

    def report(self, replica_id: str, snapshot: PressureSnapshot, morph_state: MorphState) -> Directive:
        """Record one replica's snapshot and state; answer with its directive."""
        if not isinstance(replica_id, str) or not replica_id:
            raise InvalidRequestError("replica_id must be a non-empty string", param="replica_id")
        now = self._clock()
        view = self._replicas.get(replica_id)
        if view is None:
            view = ReplicaView(collections.deque(maxlen=self._config.policy.history_len), morph_state, now,
                               SaturationTimer(self._config.scale_out_after_s,
                                               self._config.scale_out_reset_after_s))
            self._replicas[replica_id] = view
        # Refreshed before forgetting the silent: a replica whose steps are slower than the timeout
        # reports rarely but is alive, and must keep its history (else no window ever fills).
        view.last_report = now
        self._forget_silent(now)
        policy = self._config.policy
        if not view.history or snapshot.time > view.history[-1].time:  # drop late retries / duplicates
            view.history.append(snapshot)
            view.slo = tune(view.slo, snapshot.ttft_recent_p95_s, policy.slo)
        view.state, view.reports = morph_state, view.reports + 1
        # One owner of the share: the fleet's allowance. The policy derives the directive's bound
        # (max_quantized) from this same grant, so the engine's admission-time morphs obey it too.
        view.grant = self._allowance(replica_id, self._grants().get(replica_id))
        tuning = tuning_for(view.slo, policy.active, policy.slo) if policy.slo.slo_ttft_s else None
        directive = decide(view.history, view.state, policy, cap=view.grant, tuning=tuning)
        reason = directive.reason
        if view.grant is not None and view.grant < morph_cap(view.state, policy):
            reason += f" [fleet budget grants this replica {view.grant} layer(s)]"
        # The policy asks as soon as it is saturated (at its cap, or compute-bound) under pressure; the
        # fleet waits scale_out_after_s of it (SaturationTimer).
        saturated = is_saturated(view.history[-1], view.state, policy, view.grant, compute_bound(directive))
        scale_out = view.saturation.update(saturated, directive.scale_out, view.history[-1].time)
        if directive.scale_out and not scale_out:
            reason += f" [saturated for {view.at_cap_for():.1f} s of {self._config.scale_out_after_s:g} s before scale-out]"
        directive = dataclasses.replace(directive, source="controller", reason=reason, scale_out=scale_out,
                                        grant=view.grant, restore_quiet_s=self._restore_quiet(replica_id))
        view.directive = directive
        self._export(replica_id, view)
        return directive

    def _grants(self) -> dict[str, int]:
        """Each replica's share of the fleet budget; empty when there is no fleet cap. Three passes, each
        over the replicas most pressed first, each up to the mode cap:
          1. what each replica's own policy targets;
          2. admission headroom sized by its last report (`admission_headroom`): the layers that free its
             queue's KV deficit plus one policy step, beyond what it is heading to. That lets its engine
             morph at admission the moment a request does not fit (engine/morph/admission.py), as it
             would with its local policy;
          3. onset headroom: what no report's demand asks for, split evenly. The headroom of pass 2 is
             sized by the *last* report, which has not seen a burst that starts now; without this pass
             the burst's first requests on a quiet replica waited a report (0.25 s) for a bigger grant
             (fleet benchmark, wave 8, 3 repeats each: reaction max 0.13 s against 0.03 s and TTFT P95
             +19% against Serve's router with local policies; with it 0.02 s and +2%). The cost: a quiet replica's unused share counts against a pressed one until
             the quiet one reports again (`_allowance`), at most one report interval.
        Grants only bound what the engine may do; its admission sizing swaps only what the queue lacks.
        A replica whose report cannot size its deficit (no gain figure) gets only its part of pass 3."""
        budget = self._config.fleet_max_quantized_layers
        if budget is None:
            return {}
        policy = self._config.policy
        demand = {rid: decide(v.history, v.state, policy).target_quantized for rid, v in self._replicas.items()}
        order = sorted(self._replicas, key=lambda rid: (-self._score(self._replicas[rid]), rid))
        grants, remaining = {}, budget
        for rid in order:
            grants[rid] = min(demand[rid], remaining)
            remaining -= grants[rid]
        for rid in order:
            view = self._replicas[rid]
            headroom = admission_headroom(view.history[-1] if view.history else None, policy.active)
            # No gain figure to size its deficit with: it gets its part of the rest in pass 3.
            wanted = grants[rid] if headroom is None else max(demand[rid], current_target(view.state)) + headroom
            extra = max(0, min(wanted, morph_cap(view.state, policy)) - grants[rid])
            extra = min(extra, remaining)
            grants[rid] += extra
            remaining -= extra
        for i, rid in enumerate(order):  # onset headroom: the rest, split evenly, most pressed first
            even = -(-remaining // (len(order) - i))
            extra = max(0, min(even, morph_cap(self._replicas[rid].state, policy) - grants[rid], remaining))
            grants[rid] += extra
            remaining -= extra
        return grants

    def _allowance(self, replica_id: str, share: int | None) -> int | None:
        """Its share, less whatever the others still hold, were told to reach, or were allowed at their
        last report beyond theirs: a grant that moves from A to B reaches B only as A gives layers back
        or reports its smaller allowance, so the layers held over the fleet never exceed the budget,
        not even while A restores or morphs at admission within what it was last allowed."""
        budget = self._config.fleet_max_quantized_layers
        if budget is None or share is None:
            return share
        others = sum(max(_committed(v), v.grant or 0) for rid, v in self._replicas.items() if rid != replica_id)
        return max(0, min(share, budget - others))

    def _restore_quiet(self, replica_id: str) -> float | None:
        """`fleet_restore_quiet_s` once the burst is over: every replica, this one included, has absorbed
        load for `fleet_restore_calm_s` (`calm_for`). What this one stops taking when it gives KV back,
        the others have room for (and the pressure-aware router sends it where it fits), so the
        hysteresis a lone replica needs against flapping can be shorter. None (the engine's own quiet
        period) when it has no peer or any replica, itself included, has been pressed since.

        Why the calm period, and why this replica too: with only the peers' last report relaxed, a
        0.5-s lull inside a burst was enough; the replica could restore with requests due any moment
        and morph again at the next admission, moving KV blocks both times (fleet benchmark, wave 25:
        long prompts, more first-burst misses in 13 of 16 pairs, gone with the sooner restores off)."""
        quiet = self._config.fleet_restore_quiet_s
        if quiet is None or len(self._replicas) < 2:
            return None
        calm, policy = self._config.fleet_restore_calm_s, self._config.policy
        return quiet if all(calm_for(v.history, calm, policy) for v in self._replicas.values()) else None

    def _score(self, view: ReplicaView) -> float:
        """Mean pressure score over the entry window: smooth enough that one spike does not reorder."""
        tail = list(view.history)[-self._config.policy.enter_after:]
        mode = self._config.policy.active
        return sum(pressure_score(s, mode) for s in tail) / len(tail) if tail else 0.0

    def _export(self, replica_id: str, view: ReplicaView) -> None:
        if self._metrics is None:
            return
        grant = view.grant if view.grant is not None else morph_cap(view.state, self._config.policy)
        self._metrics.set_replica(replica_id, grant=grant, held=view.state.num_quantized,
                                  target=view.directive.target_quantized if view.directive else 0,
                                  score=self._score(view), saturated_s=view.at_cap_for(),
                                  scale_out=bool(view.directive and view.directive.scale_out))
        signal = self.scale_out_signal()
        self._metrics.set_fleet(budget=self._config.fleet_max_quantized_layers,
                                used=sum(v.state.num_quantized for v in self._replicas.values()),
                                replicas=len(self._replicas), extra=signal["desired_extra_replicas"])

    def _forget_silent(self, now: float) -> None:
        timeout = self._config.replica_timeout_s
        for rid in [rid for rid, v in self._replicas.items() if now - v.last_report > timeout]:
            del self._replicas[rid]
            if self._metrics is not None:
                self._metrics.forget(rid)

    def scale_out_signal(self) -> dict:
        """How many more replicas would help: one per replica saturated for scale_out_after_s."""
        self._forget_silent(self._clock())
        after = self._config.scale_out_after_s
        saturated = sorted(rid for rid, v in self._replicas.items() if v.directive is not None and v.directive.scale_out)
        extra = min(len(saturated), self._config.max_extra_replicas)
        reason = (f"{len(saturated)} replica(s) at their morph cap under pressure for >= {after:g} s"
                  if saturated else "no replica is saturated")
        return {"desired_extra_replicas": extra, "saturated_replicas": saturated,
                "replicas": len(self._replicas), "reason": reason}

    def ping(self) -> str:
        """Answers once the actor is up (a starting replica waits for this: ControllerClient.connect)."""
        return self.instance_id

    def set_mode(self, mode: str) -> str:
        """Switch every replica's policy mode (lost if the actor restarts: it reverts to its config)."""
        try:
            policy = self._config.policy.with_mode(mode)
        except ValueError as e:
            raise InvalidRequestError(str(e), param="mode") from None
        self._config = self._config.model_copy(update={"policy": policy})
        return policy.mode

    def status(self) -> dict:
        """Every replica's last snapshot summary, morph state and directive, plus fleet totals."""
        now = self._clock()
        self._forget_silent(now)
        replicas = {rid: _replica_summary(v, now) for rid, v in sorted(self._replicas.items())}
        targets = sum(v.directive.target_quantized for v in self._replicas.values() if v.directive)
        budget = self._config.fleet_max_quantized_layers
        granted = sum(v.grant for v in self._replicas.values() if v.grant is not None)
        totals = {"replicas": len(replicas), "granted_layers": granted if budget is not None else None,
                  "quantized_layers": sum(v.state.num_quantized for v in self._replicas.values()),
                  "target_quantized_layers": targets, "fleet_budget": budget,
                  "budget_left": None if budget is None else budget - targets}
        return {"instance_id": self.instance_id, "started_at": self.started_at,
                "mode": self._config.policy.mode, "replicas": replicas, "totals": totals,
                "scale_out": self.scale_out_signal()}


def absorbs_load(s: PressureSnapshot, policy: PolicyConfig) -> bool:
    """A replica in the relax band with nothing waiting: it has room for more than it takes now."""
    return is_relaxed(s, policy) and s.num_waiting == 0


def calm_for(history: collections.deque[PressureSnapshot] | list[PressureSnapshot], seconds: float,
             policy: PolicyConfig) -> bool:
    """Every snapshot of the last `seconds` (the replica's own clock) absorbs load, and the history
    reaches back that far: a replica that has just joined has not shown calm yet."""
    if not history or history[0].time > history[-1].time - seconds:
        return False
    since = history[-1].time - seconds
    return all(absorbs_load(s, policy) for s in history if s.time >= since)


def _committed(view: ReplicaView) -> int:
    """Layers a replica holds or is heading to: what it has, a pending target, its last directive."""
    directed = view.directive.target_quantized if view.directive is not None else 0
    return max(view.state.num_quantized, current_target(view.state), directed)


def _replica_summary(view: ReplicaView, now: float) -> dict:
    s, st = view.history[-1], view.state
    return {
        "last_snapshot": {"time": s.time, "step": s.step, "kv_usage": round(s.kv_usage, 4),
                          "kv_capacity_blocks": s.kv_capacity_blocks, "num_running": s.num_running,
                          "num_waiting": s.num_waiting, "queue_delay_s": s.queue_delay_s,
                          "throughput_tok_s": s.throughput_tok_s, "preemptions_total": s.preemptions_total,
                          "waiting_for": s.waiting_for, "waiting_demand_blocks": s.waiting_demand_blocks,
                          "available_blocks": s.available_blocks, "ttft_recent_p95_s": s.ttft_recent_p95_s,
                          "admission_swaps_total": s.admission_swaps_total,
                          "admission_layers_total": s.admission_layers_total,
                          "admission_restores_total": s.admission_restores_total},
        "slo": {"level": round(view.slo.level, 4), "last_ratio": view.slo.last_ratio},
        "morph_state": {"num_layers": len(st.layer_precisions), "num_quantized": st.num_quantized,
                        "precisions": [p.value for p in st.layer_precisions],
                        "swap_order_source": st.swap_order_source, "pending": len(st.pending),
                        "morphing_enabled": st.morphing_enabled, "forced_quantized": st.forced_quantized},
        "directive": view.directive.summary() if view.directive else None,
        "seconds_since_report": round(now - view.last_report, 3),
        "reports": view.reports,
        "grant": view.grant,
        "at_cap_for_s": round(view.at_cap_for(), 3),
    }


def get_or_create_controller(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE,
                             config: FleetConfig | None = None):
    """The named, detached controller actor: created on first call, the existing one afterwards (its
    config wins over `config` then). Needs `ray.init` done by the caller.

    max_task_retries=0: a report is only worth its freshness; one lost in a crash is not replayed
    (the replica has already fallen back to its local policy and reports again shortly)."""
    import ray

    from controller.fleet_metrics import RayUtilBackend

    actor_cls = ray.remote(FleetController)
    return actor_cls.options(name=name, namespace=namespace, lifetime="detached", get_if_exists=True,
                             max_restarts=-1, max_task_retries=0, num_cpus=0).remote(
        config or FleetConfig(), metrics=RayUtilBackend())
