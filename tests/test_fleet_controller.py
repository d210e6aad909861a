"""The fleet controller: its rules driven directly (fake clock), the client's fallback with fake
actor handles, and the whole thing on a local Ray cluster with a controller restart."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from controller.client import ControllerClient
from controller.directive import Directive
from controller.fleet import FleetController, get_or_create_controller
from controller.policy_config import FleetConfig, PolicyConfig
from engine.errors import InvalidRequestError
from engine.morph.actions import MorphState, SetQuantizedTarget
from engine.precision import Precision
from engine.pressure import LedgerFigures, PressureSnapshot

LEDGER = LedgerFigures(budget=1000, weights=500, kv=400, reserve=50)
NUM_LAYERS, BASE_BLOCKS, BLOCKS_PER_LAYER = 10, 100, 10


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeReplica:
    """A replica's morph state plus a load it cannot shed: `queue_delay` stays as set."""

    def __init__(self, replica_id: str, kv_usage: float, queue_delay: float, waiting: int = 2):
        self.replica_id, self.kv_usage, self.queue_delay, self.t = replica_id, kv_usage, queue_delay, 0.0
        self.waiting = waiting
        self.state = MorphState(layer_precisions=(Precision.BF16,) * NUM_LAYERS, full_precision=Precision.BF16,
                                swap_order=tuple(reversed(range(NUM_LAYERS))), swap_order_source="front-to-back",
                                kv_capacity_blocks=BASE_BLOCKS, kv_max_blocks=400)

    def snapshot(self) -> PressureSnapshot:
        self.t += 0.25
        cap = self.state.kv_capacity_blocks
        return PressureSnapshot(time=self.t, step=int(self.t * 4), kv_used_blocks=round(self.kv_usage * cap),
                                kv_capacity_blocks=cap, kv_max_blocks=400, num_running=8, num_waiting=self.waiting,
                                queue_delay_s=self.queue_delay, ttft_recent_s=0.5, tpot_recent_s=0.05,
                                throughput_tok_s=50.0, preemptions_total=0, ledger=LEDGER)

    def apply(self, directive: Directive) -> None:
        action: SetQuantizedTarget = directive.to_action()
        low = set(self.state.swap_order[:action.count])
        self.state = dataclasses.replace(
            self.state, kv_capacity_blocks=BASE_BLOCKS + BLOCKS_PER_LAYER * action.count,
            layer_precisions=tuple(action.precision if i in low else Precision.BF16 for i in range(NUM_LAYERS)))


def drive(fleet: FleetController, replicas: list[FakeReplica], rounds: int, clock: FakeClock | None = None):
    """Every replica reports once per round and applies its directive; returns the max fleet total."""
    peak = 0
    for _ in range(rounds):
        for r in replicas:
            r.apply(fleet.report(r.replica_id, r.snapshot(), r.state))
            peak = max(peak, sum(r.state.num_quantized for r in replicas))
        if clock is not None:
            clock.now += 0.25
    return peak


def test_fleet_budget_goes_to_the_replica_under_most_pressure():
    fleet = FleetController(FleetConfig(fleet_max_quantized_layers=4), clock=FakeClock())
    hot, warm = FakeReplica("hot", 0.99, 0.5), FakeReplica("warm", 0.9, 0.2)
    peak = drive(fleet, [hot, warm], rounds=40)
    assert peak <= 4
    assert hot.state.num_quantized == 4 and warm.state.num_quantized == 0
    status = fleet.status()
    assert status["totals"]["target_quantized_layers"] == 4 and status["totals"]["budget_left"] == 0
    assert "fleet budget grants this replica 0" in status["replicas"]["warm"]["directive"]["reason"]
    assert status["replicas"]["hot"]["directive"]["source"] == "controller"


def set_load(replica: FakeReplica, pressed: bool) -> None:
    """Pressed: a full cache and a queue; calm: the policy's relax band with nothing waiting."""
    replica.kv_usage, replica.queue_delay, replica.waiting = (0.9, 0.5, 2) if pressed else (0.2, 0.0, 0)


def quiet_periods(fleet: FleetController, replicas: list[FakeReplica]) -> dict[str, float | None]:
    """One report round; each replica's restore_quiet_s as its directive carries it."""
    return {r.replica_id: fleet.report(r.replica_id, r.snapshot(), r.state).restore_quiet_s for r in replicas}


def test_the_sooner_restore_waits_until_every_replica_has_been_calm_for_the_calm_period():
    """fleet_restore_quiet_s applies only after every replica, the restoring one included, has been relaxed
    with nothing waiting for fleet_restore_calm_s of its own reports; one pressed report (a burst that is
    not over) takes it back at once, and the calm period starts again."""
    fleet = FleetController(FleetConfig(fleet_restore_quiet_s=0.5, fleet_restore_calm_s=1.0), clock=FakeClock())
    a, b = FakeReplica("a", 0.9, 0.5), FakeReplica("b", 0.9, 0.5)
    for _ in range(8):
        assert quiet_periods(fleet, [a, b]) == {"a": None, "b": None}
    set_load(b, pressed=False)  # the peer is calm, but `a` still queues: neither restores sooner
    for _ in range(8):
        assert quiet_periods(fleet, [a, b]) == {"a": None, "b": None}
    set_load(a, pressed=False)
    calm = [quiet_periods(fleet, [a, b]) for _ in range(8)]
    # Reports every 0.25 s: the fifth calm report is the first whose last 1.0 s holds only calm ones.
    assert calm[:4] == [{"a": None, "b": None}] * 4
    assert calm[4:] == [{"a": 0.5, "b": 0.5}] * 4
    set_load(b, pressed=True)  # a lull was all it was: from b's next report on, neither restores sooner
    assert quiet_periods(fleet, [b, a]) == {"a": None, "b": None}
    set_load(b, pressed=False)
    after = [quiet_periods(fleet, [b, a]) for _ in range(5)]
    assert after[:4] == [{"a": None, "b": None}] * 4 and after[4] == {"a": 0.5, "b": 0.5}


def test_the_sooner_restore_needs_a_peer_and_a_history_as_long_as_the_calm_period():
    """A lone replica keeps the engine's quiet period; so does a fleet whose newest replica has not
    reported for the calm period yet; fleet_restore_quiet_s=None turns the rule off."""
    lone = FleetController(FleetConfig(fleet_restore_calm_s=0.0), clock=FakeClock())
    r = FakeReplica("a", 0.2, 0.0, waiting=0)
    assert all(quiet_periods(lone, [r]) == {"a": None} for _ in range(6))
    fleet = FleetController(FleetConfig(fleet_restore_calm_s=1.0), clock=FakeClock())
    old = FakeReplica("old", 0.2, 0.0, waiting=0)
    for _ in range(8):
        quiet_periods(fleet, [old])
    new = FakeReplica("new", 0.2, 0.0, waiting=0)
    joined = [quiet_periods(fleet, [new, old]) for _ in range(5)]
    assert joined[:4] == [{"old": None, "new": None}] * 4 and joined[4] == {"old": 0.5, "new": 0.5}
    off = FleetController(FleetConfig(fleet_restore_quiet_s=None, fleet_restore_calm_s=0.0), clock=FakeClock())
    calm = [FakeReplica(n, 0.2, 0.0, waiting=0) for n in ("a", "b")]
    assert all(quiet_periods(off, calm) == {"a": None, "b": None} for _ in range(6))


class SlowReplica(FakeReplica):
    """Applies each directive only at its next report (a restore waiting for live blocks)."""

    def __init__(self, *args):
        super().__init__(*args)
        self._next: Directive | None = None

    def snapshot(self) -> PressureSnapshot:
        if self._next is not None:
            FakeReplica.apply(self, self._next)
        return super().snapshot()

    def apply(self, directive: Directive) -> None:
        self._next = directive


def test_the_grant_moves_to_the_more_pressed_replica_without_ever_exceeding_the_budget():
    fleet = FleetController(FleetConfig(fleet_max_quantized_layers=4), clock=FakeClock())
    first, second = SlowReplica("first", 0.99, 0.5), SlowReplica("second", 0.9, 0.15)
    assert drive(fleet, [first, second], rounds=30) <= 4
    assert first.state.num_quantized == 4 and second.state.num_quantized == 0
    first.queue_delay, second.queue_delay, second.kv_usage = 0.15, 0.8, 0.99  # the pressure moves
    assert drive(fleet, [first, second], rounds=40) <= 4  # held layers, after every single report
    assert second.state.num_quantized == 4 and first.state.num_quantized == 0
    status = fleet.status()
    assert status["replicas"]["second"]["grant"] == 4 and status["replicas"]["first"]["grant"] == 0
    assert status["totals"]["granted_layers"] == 4


def test_max_quantized_is_derived_from_the_same_grant_the_fleet_allows():
    """The fleet's allowance owns the share (`grant`); the engine's admission bound (`max_quantized`)
    is the policy's cap of that same grant, so admission-time morphs cannot exceed the fleet budget."""
    fleet = FleetController(FleetConfig(fleet_max_quantized_layers=4), clock=FakeClock())
    first, second = SlowReplica("first", 0.99, 0.5), SlowReplica("second", 0.9, 0.15)
    seen = []
    for _ in range(30):
        for r in (first, second):
            d = fleet.report(r.replica_id, r.snapshot(), r.state)
            r.apply(d)
            seen.append(d)
            assert d.grant is not None and d.max_quantized == d.grant  # nothing forced: the bound is the grant
        assert sum(d.max_quantized for d in seen[-2:]) <= 4
    assert {d.grant for d in seen if d.source == "controller"} >= {0, 4}
    # A budget that forces layers raises the bound above a smaller grant, never the grant itself.
    forced = dataclasses.replace(first.state, forced_quantized=6,
                                 layer_precisions=(Precision.INT4,) * 6 + (Precision.BF16,) * (NUM_LAYERS - 6))
    d = fleet.report("first", first.snapshot(), forced)
    assert d.max_quantized == 6 and d.grant <= 4


def test_quiet_replicas_share_the_unused_budget_as_onset_headroom():
    """Quiet replicas are not held at 0: each may morph at admission one policy step beyond its target,
    and what no report's demand asks for is split among them (a burst's first requests morph at once,
    not a report later); the parts never add up to more than the budget."""
    fleet = FleetController(FleetConfig(fleet_max_quantized_layers=5), clock=FakeClock())
    a, b = FakeReplica("a", 0.1, 0.0), FakeReplica("b", 0.1, 0.0)
    last = {}
    for _ in range(4):
        for r in (a, b):
            last[r.replica_id] = fleet.report(r.replica_id, r.snapshot(), r.state)
            assert sum(d.max_quantized for d in last.values()) <= 5
    assert {d.target_quantized for d in last.values()} == {0}  # nobody is told to morph ...
    assert sorted(d.max_quantized for d in last.values()) == [2, 3]  # ... but both may, at admission
    assert fleet.status()["totals"]["granted_layers"] == 5
    # The pressure moves to b: its part grows, and a's shrinks before b's grows past the rest.
    b.kv_usage, b.queue_delay = 0.99, 0.5
    for _ in range(6):
        for r in (b, a):
            last[r.replica_id] = fleet.report(r.replica_id, r.snapshot(), r.state)
            assert sum(d.max_quantized for d in last.values()) <= 5
    assert last["b"].target_quantized == 2  # its own policy's target comes first, then its headroom
    assert last["b"].max_quantized == 4 and last["a"].max_quantized == 1


# -- admission headroom sized by the reported demand -----------------------------------------------
GAIN = 10  # KV blocks one more INT4 layer frees in BurstReplica (no free ledger bytes)


class BurstReplica(FakeReplica):
    """Reports demand figures the way the engine does: `queue` waiting requests of 10 blocks each,
    and the blocks one more layer frees at each rung. Applies a directive's target, or at admission
    (as engine/morph/admission.py does) the fewest layers under its grant that fit the whole queue."""

    def __init__(self, replica_id: str, queue: int = 0):
        super().__init__(replica_id, 0.5, 0.0)
        self.queue = queue

    def snapshot(self) -> PressureSnapshot:
        s = super().snapshot()
        cap = self.state.kv_capacity_blocks
        used = round(self.kv_usage * cap)
        kv_bytes = cap * 100
        return dataclasses.replace(
            s, num_waiting=self.queue, waiting_demand_blocks=10 * self.queue,
            head_demand_blocks=10 if self.queue else 0, queue_delay_s=0.5 if self.queue else 0.0,
            rung_gain_blocks=(("int8", GAIN // 2), ("int4", GAIN)),
            ledger=LedgerFigures(budget=1000 + kv_bytes, weights=1000 - 50, kv=kv_bytes, reserve=50),
            kv_used_blocks=used)

    def deficit(self) -> int:
        cap = self.state.kv_capacity_blocks
        return 10 * self.queue - (cap - round(self.kv_usage * cap))

    def admit(self, directive: Directive) -> None:
        """Admission sizing: the fewest layers that free the deficit, within max_quantized."""
        need = -(-max(0, self.deficit()) // BLOCKS_PER_LAYER)
        count = min(directive.max_quantized, max(self.state.num_quantized, directive.target_quantized) + need)
        FakeReplica.apply(self, dataclasses.replace(directive, target_quantized=count))


@pytest.mark.parametrize("budget", [4, 12])  # scarcer than the pressed replica wants; two mode caps
def test_a_burst_on_one_replica_gets_the_headroom_first_and_admission_takes_only_what_it_needs(budget):
    """The pressed replica's grant covers its reported deficit (plus one step) ahead of the quiet one;
    no grant passes the mode cap and the grants never pass the budget; the engine's admission sizing
    takes only the layers its queue needs, whatever the grant allows."""
    policy = PolicyConfig()  # balanced: cap 6 of 10 layers, 2 per step
    step, cap = policy.active.layers_per_action, policy.active.cap_layers(NUM_LAYERS)
    fleet = FleetController(FleetConfig(policy=policy, fleet_max_quantized_layers=budget), clock=FakeClock())
    hot, quiet = BurstReplica("hot"), BurstReplica("quiet")
    for r in (hot, quiet):
        fleet.report(r.replica_id, r.snapshot(), r.state)
    hot.queue = 7  # 70 blocks against 50 available: 2 layers' worth
    for _ in range(8):
        for r in (hot, quiet):
            d = fleet.report(r.replica_id, r.snapshot(), r.state)
            assert d.max_quantized <= cap
            r.admit(d)
            assert hot.state.num_quantized + quiet.state.num_quantized <= budget
            status = fleet.status()["replicas"]
            assert sum(v["grant"] for v in status.values()) <= budget
        hot.queue = max(0, hot.queue - 1)  # admitted requests leave the queue over the next reports
    assert quiet.state.num_quantized == 0
    assert hot.state.num_quantized == 2  # what its queue needed, no more
    # A burst on the replica that reported second: the quiet one holds its onset share until it reports
    # again; from then on the pressed one's deficit comes first.
    hot2, quiet2 = BurstReplica("hot2"), BurstReplica("quiet2")
    fleet2 = FleetController(FleetConfig(policy=policy, fleet_max_quantized_layers=budget), clock=FakeClock())
    for r in (quiet2, hot2):
        fleet2.report(r.replica_id, r.snapshot(), r.state)
    hot2.queue = 9  # 4 layers' worth
    first = fleet2.report("hot2", hot2.snapshot(), hot2.state).max_quantized
    assert first <= budget - fleet2.status()["replicas"]["quiet2"]["grant"]
    wanted = min(cap, 4 + step, budget)
    assert fleet2.report("quiet2", quiet2.snapshot(), quiet2.state).max_quantized == min(cap, budget - wanted)
    assert fleet2.report("hot2", hot2.snapshot(), hot2.state).max_quantized == wanted


def test_a_pressed_replicas_deficit_comes_before_the_quiet_ones_onset_share():
    """The split of the unused budget comes last: at its next report the pressed replica's admission may
    take what its queue needs (up to its mode cap); the quiet one keeps one policy step of what is left."""
    policy = PolicyConfig()  # balanced: cap 6 of 10 layers, 2 per step
    fleet = FleetController(FleetConfig(policy=policy, fleet_max_quantized_layers=8), clock=FakeClock())
    hot, quiet = BurstReplica("hot"), BurstReplica("quiet")
    for r in (hot, quiet):
        fleet.report(r.replica_id, r.snapshot(), r.state)
    hot.queue = 9  # 90 blocks against 50 available: 4 layers
    d = fleet.report("hot", hot.snapshot(), hot.state)
    assert d.max_quantized == 6  # 4 for the deficit + one step, capped by the mode's 6
    hot.admit(d)
    assert hot.state.num_quantized == 4  # admission sizing takes only what the queue needs
    assert fleet.report("quiet", quiet.snapshot(), quiet.state).max_quantized == 2


def test_a_lone_replica_may_use_the_budget_up_to_its_cap_and_takes_what_its_queue_needs():
    """With no peer, the whole budget (up to the mode cap) is its onset headroom; its admission still
    swaps only what the queue lacks."""
    fleet = FleetController(FleetConfig(fleet_max_quantized_layers=10), clock=FakeClock())
    r = BurstReplica("r", queue=9)
    d = fleet.report("r", r.snapshot(), r.state)
    assert d.max_quantized == 6  # the balanced cap, below the budget
    r.admit(d)
    assert r.state.num_quantized == 4  # 4 layers free its 40-block deficit
    r.queue = 0
    assert fleet.report("r", r.snapshot(), r.state).max_quantized == 6
    small = FleetController(FleetConfig(fleet_max_quantized_layers=3), clock=FakeClock())
    assert small.report("r", BurstReplica("r").snapshot(), BurstReplica("r").state).max_quantized == 3


def test_a_forgotten_replica_gives_its_grant_back():
    clock = FakeClock()
    fleet = FleetController(FleetConfig(fleet_max_quantized_layers=4, replica_timeout_s=2.0), clock=clock)
    hot, warm = FakeReplica("hot", 0.99, 0.5), FakeReplica("warm", 0.9, 0.2)
    drive(fleet, [hot, warm], rounds=30, clock=clock)
    assert hot.state.num_quantized == 4 and warm.state.num_quantized == 0
    drive(fleet, [warm], rounds=30, clock=clock)  # hot died: silent for 7.5 s
    assert set(fleet.status()["replicas"]) == {"warm"} and warm.state.num_quantized == 4


def test_the_fleet_gauges_follow_the_reports():
    from deployments.metrics import InMemoryBackend

    clock, backend = FakeClock(), InMemoryBackend()
    fleet = FleetController(FleetConfig(fleet_max_quantized_layers=4, replica_timeout_s=2.0), clock=clock,
                            metrics=backend)
    hot, warm = FakeReplica("hot", 0.99, 0.5), FakeReplica("warm", 0.9, 0.2)
    drive(fleet, [hot, warm], rounds=30, clock=clock)
    m = backend.metrics
    assert m["morphserve_fleet_budget_layers"].value() == 4 and m["morphserve_fleet_replicas"].value() == 2
    assert m["morphserve_fleet_grant_layers"].value(replica="hot") == 4
    assert m["morphserve_fleet_quantized_layers"].value(replica="hot") == 4
    assert m["morphserve_fleet_grant_layers"].value(replica="warm") == 0
    assert m["morphserve_fleet_budget_used_layers"].value() == 4
    drive(fleet, [warm], rounds=12, clock=clock)
    assert m["morphserve_fleet_forgotten_replicas"].value() == 1
    assert m["morphserve_fleet_quantized_layers"].value(replica="hot") == 0


def test_without_a_fleet_budget_each_replica_reaches_its_mode_cap():
    fleet = FleetController(FleetConfig(policy=PolicyConfig(mode="accuracy")), clock=FakeClock())
    replicas = [FakeReplica("a", 0.99, 0.5), FakeReplica("b", 0.95, 0.3)]
    drive(fleet, replicas, rounds=40)
    assert [r.state.num_quantized for r in replicas] == [3, 3]  # floor(0.3 * 10)
    assert all(r.state.count(Precision.INT8) == 3 for r in replicas)


def test_scale_out_after_a_sustained_period_at_the_cap():
    fleet = FleetController(FleetConfig(scale_out_after_s=5.0, max_extra_replicas=1), clock=FakeClock())
    a, b = FakeReplica("a", 0.99, 0.5), FakeReplica("b", 0.99, 0.5)
    drive(fleet, [a, b], rounds=15)  # reaches the cap of 6 (balanced, +2 a step) but not yet for 5 s
    assert a.state.num_quantized == 6 and fleet.scale_out_signal()["desired_extra_replicas"] == 0
    directive = fleet.report("a", a.snapshot(), a.state)
    assert not directive.scale_out and "before scale-out" in directive.reason  # what the autoscaler reads
    drive(fleet, [a, b], rounds=25)  # 6.25 s more of snapshots at the cap
    assert fleet.report("a", a.snapshot(), a.state).scale_out
    signal = fleet.scale_out_signal()
    assert signal["saturated_replicas"] == ["a", "b"] and signal["desired_extra_replicas"] == 1
    a.queue_delay, a.kv_usage = 0.0, 0.5  # the load on a falls: it is no longer saturated ...
    drive(fleet, [a], rounds=1)
    assert fleet.scale_out_signal()["saturated_replicas"] == ["a", "b"]  # ... but one quiet snapshot is a gap
    drive(fleet, [a], rounds=20)  # 5 s without saturation (scale_out_reset_after_s)
    assert fleet.scale_out_signal()["saturated_replicas"] == ["b"]


def test_saturation_needs_sustained_absence_to_reset():
    from controller.saturation import SaturationTimer

    timer = SaturationTimer(after_s=3.0, reset_after_s=1.0)
    assert not timer.update(True, False, 0.0) and timer.since is None  # the policy has not asked yet
    asked = [timer.update(saturated=t % 1.0 != 0.5, policy_asks=True, now=t) for t in (x * 0.25 for x in range(1, 17))]
    assert timer.since == 0.25 and asked[-1] and not asked[10]  # a single gap every second does not restart it
    assert timer.update(False, False, 4.25) and timer.update(False, False, 5.0)  # a gap under 1 s still asks
    assert not timer.update(False, False, 5.25) and timer.since is None  # 1 s without saturation: reset
    assert not timer.update(True, True, 5.5) and timer.held_for(6.0) == 0.5  # a new episode starts from zero


def test_silent_replicas_are_forgotten():
    clock = FakeClock()
    fleet = FleetController(FleetConfig(replica_timeout_s=2.0), clock=clock)
    a, b = FakeReplica("a", 0.5, 0.0), FakeReplica("b", 0.5, 0.0)
    drive(fleet, [a, b], rounds=2, clock=clock)
    assert set(fleet.status()["replicas"]) == {"a", "b"}
    drive(fleet, [a], rounds=9, clock=clock)  # b silent for 2.25 s
    assert set(fleet.status()["replicas"]) == {"a"} and fleet.status()["totals"]["replicas"] == 1


def test_set_mode_reaches_every_directive_and_rejects_unknown_modes():
    fleet = FleetController(FleetConfig(), clock=FakeClock())
    r = FakeReplica("a", 0.5, 0.0)
    assert fleet.set_mode("accuracy") == "accuracy"
    directive = fleet.report("a", r.snapshot(), r.state)
    assert directive.mode == "accuracy" and directive.precision == Precision.INT8
    with pytest.raises(InvalidRequestError, match="use one of"):
        fleet.set_mode("turbo")
    with pytest.raises(InvalidRequestError, match="replica_id"):
        fleet.report("", r.snapshot(), r.state)


class FakeHandle:
    """An actor handle whose `report.remote` plays the given behaviours, one per call."""

    def __init__(self, *behaviours):
        self._behaviours = iter(behaviours)
        self.report = self

    def remote(self, *args):
        return next(self._behaviours)(*args)


async def report_rounds(client: ControllerClient, replica: "FakeReplica", rounds: int) -> list[Directive]:
    """`rounds` reports of `replica` through `client`, each directive applied before the next."""
    out = []
    for _ in range(rounds):
        out.append(await client.report(replica.snapshot(), replica.state))
        replica.apply(out[-1])
    return out


def test_client_falls_back_locally_and_retries_by_name():
    controller = FleetController(FleetConfig(policy=PolicyConfig(mode="performance")), clock=FakeClock())

    async def answer(*args):
        return controller.report(*args)

    async def hang(*args):
        await asyncio.Event().wait()  # never answers: the client's deadline must cut it

    async def die(*args):
        raise RuntimeError("actor died")

    handles = iter([FakeHandle(answer, hang), FakeHandle(die), FakeHandle(answer, answer)])
    resolved = []

    def resolve():
        resolved.append(next(handles))
        return resolved[-1]

    client = ControllerClient("r1", PolicyConfig(), timeout_s=0.05, resolve=resolve)
    replica = FakeReplica("r1", 0.99, 0.5)

    async def scenario():
        sources = []
        for _ in range(5):
            directive = await client.report(replica.snapshot(), replica.state)
            sources.append((directive.source, client.reachable))
            replica.apply(directive)
        return sources

    assert asyncio.run(scenario()) == [("controller", True), ("local", False), ("local", False),
                                       ("controller", True), ("controller", True)]
    assert len(resolved) == 3  # a failure drops the handle; the next report looks the actor up again
    assert client.fallbacks == 2 and client.last_error is None
    assert client.last_directive.mode == "performance"  # the local fallback follows the fleet's mode
    assert client._runner.config.mode == "performance"


def test_the_local_fallback_keeps_to_the_last_fleet_grant_and_waits_before_asking_to_scale_out():
    fleet = FleetController(FleetConfig(fleet_max_quantized_layers=2, scale_out_after_s=0.0), clock=FakeClock())

    async def answer(*args):
        return fleet.report(*args)

    async def die(*args):
        raise RuntimeError("controller gone")

    handles = iter([FakeHandle(*[answer] * 6, die), FakeHandle(*[die] * 20)])
    client = ControllerClient("r1", PolicyConfig(), timeout_s=0.05, resolve=lambda: next(handles),
                              create_with=FleetConfig(scale_out_after_s=2.0))
    replica = FakeReplica("r1", 0.99, 0.5)

    run = lambda rounds: asyncio.run(report_rounds(client, replica, rounds))  # noqa: E731
    answered = run(6)
    assert answered[-1].source == "controller" and answered[-1].grant == 2 and replica.state.num_quantized == 2
    local = run(12)  # 3 s of pressure at the grant, on the local policy alone
    assert all(d.source == "local" for d in local) and replica.state.num_quantized == 2  # not the mode cap (6)
    asked = [d.scale_out for d in local]
    assert not asked[0] and asked[-1]  # only after scale_out_after_s (2 s) at the cap


def test_client_without_ray_never_raises():
    client = ControllerClient("r1", PolicyConfig(), name="nobody-here", timeout_s=0.2)
    replica = FakeReplica("r1", 0.99, 0.5)
    directives = [asyncio.run(client.report(replica.snapshot(), replica.state)) for _ in range(3)]
    assert all(d.source == "local" for d in directives) and not client.reachable
    assert directives[-1].target_quantized == 2  # the local policy still acts on sustained pressure


# --- on a local Ray cluster -----------------------------------------------------------------------

def _until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    if ray.is_initialized():  # another module's cluster is still up: share it, leave it to its owner
        yield ray
        return
    # Ray 2.60 turns token auth on for a new local cluster; init must still work with it on.
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    assert ray.is_initialized()
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_replicas_report_through_ray_and_survive_a_controller_restart(ray_cluster):
    ray = ray_cluster
    name, namespace = "test-controller", "morphserve-test"
    actor = get_or_create_controller(name, namespace, FleetConfig(fleet_max_quantized_layers=4))
    replicas = [FakeReplica("hot", 0.99, 0.5), FakeReplica("warm", 0.9, 0.2)]
    clients = {r.replica_id: ControllerClient(r.replica_id, PolicyConfig(), name=name, namespace=namespace,
                                              timeout_s=5.0) for r in replicas}

    async def round_of_reports():
        for r in replicas:
            r.apply(await clients[r.replica_id].report(r.snapshot(), r.state))

    for _ in range(30):
        asyncio.run(round_of_reports())
        assert sum(r.state.num_quantized for r in replicas) <= 4
    assert all(c.reachable for c in clients.values())
    assert [r.state.num_quantized for r in replicas] == [4, 0]
    before = ray.get(actor.status.remote(), timeout=30)
    assert set(before["replicas"]) == {"hot", "warm"} and before["totals"]["quantized_layers"] == 4

    # Ray restarts a killed controller (max_restarts=-1): the clients reach a fresh instance, rebuilt
    # from their reports. (Its restart takes ~0.1 s since it imports no torch, too short to catch a
    # report in between reliably; the outage is shown below with a controller that stays dead.)
    def instance_id():
        try:
            return ray.get(ray.get_actor(name, namespace=namespace).status.remote(), timeout=30)["instance_id"]
        except (ray.exceptions.RayError, ValueError):  # restarting, or not found yet
            return None

    ray.kill(actor, no_restart=False)
    _until(lambda: instance_id() not in (None, before["instance_id"]), 60, "Ray to restart the controller")
    _until(lambda: (asyncio.run(round_of_reports()), all(c.reachable for c in clients.values()))[1],
           120, "the restarted controller to answer")
    restarted = ray.get(ray.get_actor(name, namespace=namespace).status.remote(), timeout=30)
    assert set(restarted["replicas"]) == {"hot", "warm"}
    assert all(restarted["replicas"][rid]["reports"] >= 1 for rid in ("hot", "warm"))

    # A controller that is gone: every client falls back to its local policy, and a new controller
    # (what a replica's get_or_create does) is followed again.
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    _until(lambda: (asyncio.run(round_of_reports()), not any(c.reachable for c in clients.values()))[1],
           60, "both clients to fall back to the local policy")
    assert all(c.last_directive.source == "local" for c in clients.values())
    actor = get_or_create_controller(name, namespace, FleetConfig(fleet_max_quantized_layers=4))
    _until(lambda: (asyncio.run(round_of_reports()), all(c.reachable for c in clients.values()))[1],
           120, "the new controller to answer")
    after = ray.get(actor.status.remote(), timeout=30)
    assert after["instance_id"] not in (before["instance_id"], restarted["instance_id"])
    assert set(after["replicas"]) == {"hot", "warm"}
    ray.kill(actor, no_restart=True)


def test_before_the_controller_first_answers_a_budgeted_fleets_replica_keeps_full_precision():
    """A replica of a fleet with an accuracy budget has no share until the controller answers: under
    pressure its local fallback holds 0 layers (two replicas morphing on their own at start held more than
    the budget together); once answered, it follows the grant. Without a budget the fallback still acts."""
    fleet = FleetController(FleetConfig(fleet_max_quantized_layers=2), clock=FakeClock())

    async def answer(*args):
        return fleet.report(*args)

    async def die(*args):
        raise RuntimeError("controller still starting")

    handles = iter([FakeHandle(die) for _ in range(8)] + [FakeHandle(*[answer] * 8)])  # a failure drops the handle
    client = ControllerClient("r1", PolicyConfig(), timeout_s=0.05, resolve=lambda: next(handles),
                              create_with=FleetConfig(fleet_max_quantized_layers=2))
    replica = FakeReplica("r1", 0.99, 0.5)

    unanswered = asyncio.run(report_rounds(client, replica, 8))  # pressure long past enter_after
    assert all(d.source == "local" and d.target_quantized == 0 for d in unanswered), unanswered[-1]
    assert replica.state.num_quantized == 0
    answered = asyncio.run(report_rounds(client, replica, 8))
    assert answered[-1].source == "controller" and replica.state.num_quantized == 2

    unbudgeted = ControllerClient("r2", PolicyConfig(), timeout_s=0.05, resolve=lambda: FakeHandle(die))
    lone = FakeReplica("r2", 0.99, 0.5)

    assert asyncio.run(report_rounds(unbudgeted, lone, 8))[-1].target_quantized > 0  # no budget to share: the local policy morphs


class PingHandle:
    """An actor handle whose `ping.remote()` answers when `up` is set (the actor's constructor done)."""

    def __init__(self):
        self.up = asyncio.Event()
        self.ping = self
        self.pings = 0

    async def remote(self):
        self.pings += 1
        await self.up.wait()
        return "instance"


def test_connect_waits_until_the_controller_is_up():
    handle = PingHandle()
    client = ControllerClient("r1", PolicyConfig(), resolve=lambda: handle, create_with=FleetConfig())

    async def start():
        connecting = asyncio.create_task(client.connect(deadline_s=30))
        while handle.pings == 0:  # the replica's model load, in the real start
            await asyncio.sleep(0)
        assert not connecting.done()  # waiting on the actor, not on a clock
        handle.up.set()
        return await connecting

    assert asyncio.run(start()) is True


def test_connect_gives_up_at_its_deadline_and_the_reports_go_on():
    handle = PingHandle()  # never up
    client = ControllerClient("r1", PolicyConfig(), timeout_s=0.05, resolve=lambda: handle, create_with=FleetConfig())
    assert asyncio.run(client.connect(deadline_s=0.05)) is False
    assert "TimeoutError" in client.last_error and not client.reachable
    controller = FleetController(FleetConfig(), clock=FakeClock())

    async def answer(*args):
        return controller.report(*args)

    client._resolve = lambda: FakeHandle(answer)  # the controller came up later
    replica = FakeReplica("r1", 0.5, 0.0)
    assert asyncio.run(client.report(replica.snapshot(), replica.state)).source == "controller"


def test_connect_without_a_controller_returns_at_once():
    def resolve():
        raise AssertionError("a replica with fleet_controller=false never looks the controller up")

    local = ControllerClient("r1", PolicyConfig(), resolve=resolve, use_controller=False)
    assert asyncio.run(local.connect(deadline_s=30)) is False
    no_wait = ControllerClient("r2", PolicyConfig(), resolve=resolve)
    assert asyncio.run(no_wait.connect(deadline_s=0)) is False
