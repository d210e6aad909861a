"""Morphing through the Serve application: the replica's MorphLoop with a fake engine and fake
controller handles (fast), then the real app on a local Ray cluster with the real default model: a
burst under a small memory budget swaps layers down, an idle period restores them all, and killing
the fleet controller mid-traffic leaves the replica serving on its local policy until it is back."""
from __future__ import annotations

import asyncio
import dataclasses
import concurrent.futures
import threading

import pytest

from controller.client import ControllerClient
from controller.directive import Directive
from controller.policy_config import PolicyConfig
from deployments.engine_client import AdminUpdate
from deployments.metrics import InMemoryBackend, ServeMetrics
from deployments.morph_loop import MorphLoop
from engine.errors import InvalidRequestError
from engine.morph.actions import ActionResult, MorphState, SetQuantizedTarget
from engine.precision import Precision
from engine.pressure import LedgerFigures, PressureSnapshot
from tests.serve_helpers import auto_budget, auto_precision

NUM_LAYERS, BASE_BLOCKS, BLOCKS_PER_LAYER = 8, 40, 5
FAST_POLICY = {"enter_after": 2, "relax_after": 3, "history_len": 16}


class FakeEngine:
    """Pressure as set by the test; SetQuantizedTarget applied at once (swap order: front-to-back);
    every result goes into the morph log, as AsyncLLMEngine's."""

    def __init__(self):
        self.kv_usage, self.queue_delay, self.clock = 0.0, 0.0, 0.0
        self.num_waiting, self.head_demand = 0, 0  # the queue: requests and the blocks its head needs
        self.precisions = [Precision.BF16] * NUM_LAYERS
        self.applied: list[SetQuantizedTarget] = []
        self.pending: tuple = ()
        self.log: list[ActionResult] = []

    def morph_results_since(self, cursor: int = 0) -> tuple[int, tuple[ActionResult, ...]]:
        return len(self.log), tuple(self.log[cursor:])

    def move_one_layer(self, action: SetQuantizedTarget) -> ActionResult:
        """What a step boundary does with a pending target: one more layer down."""
        n = self.state().num_quantized + 1
        self.precisions = [action.precision if i < n else Precision.BF16 for i in range(NUM_LAYERS)]
        self.pending = (action,) if n < action.count else ()
        result = ActionResult(action, "waiting" if self.pending else "done", (n - 1,), -10, BLOCKS_PER_LAYER)
        self.log.append(result)
        return result

    def pressure(self) -> PressureSnapshot:
        self.clock += 0.1
        cap = self.state().kv_capacity_blocks
        return PressureSnapshot(time=self.clock, step=int(self.clock * 10), kv_used_blocks=round(self.kv_usage * cap),
                                kv_capacity_blocks=cap, kv_max_blocks=BASE_BLOCKS + NUM_LAYERS * BLOCKS_PER_LAYER,
                                num_running=1, num_waiting=self.num_waiting, queue_delay_s=self.queue_delay,
                                ttft_recent_s=None, tpot_recent_s=None, throughput_tok_s=0.0, preemptions_total=0,
                                ledger=LedgerFigures(budget=100, weights=50, kv=40, reserve=5),
                                head_demand_blocks=self.head_demand)

    def state(self) -> MorphState:
        low = sum(1 for p in self.precisions if not p.is_full)
        return MorphState(tuple(self.precisions), Precision.BF16, tuple(range(NUM_LAYERS)), "front-to-back",
                          BASE_BLOCKS + BLOCKS_PER_LAYER * low, BASE_BLOCKS + NUM_LAYERS * BLOCKS_PER_LAYER,
                          pending=self.pending)

    morph_state = state

    async def run_at_step_boundary(self, fn):
        return fn(self)

    async def apply(self, action: SetQuantizedTarget) -> ActionResult:
        self.applied.append(action)
        before = self.state()
        self.precisions = [action.precision if i < action.count else Precision.BF16 for i in range(NUM_LAYERS)]
        changed = tuple(i for i, (a, b) in enumerate(zip(before.layer_precisions, self.precisions)) if a != b)
        blocks = self.state().kv_capacity_blocks - before.kv_capacity_blocks
        result = ActionResult(action, "done", changed, weight_bytes_delta=-blocks * 10, kv_blocks_delta=blocks,
                              swap_seconds=0.01, resize_seconds=0.001)
        self.log.append(result)
        return result


class FakeController:
    """A controller handle: `report.remote(...)` answers with `self.directive` (or the mode it was set to)."""

    def __init__(self, target: int = 0, mode: str = "balanced"):
        self.target, self.mode, self.modes_set = target, mode, []
        outer = self

        class Method:
            def __init__(self, fn):
                self.fn = fn

            def remote(self, *args):
                async def call():
                    return self.fn(*args)
                return call()

        self.report = Method(lambda rid, snap, state: Directive(outer.target, Precision.INT4, outer.mode, "fake",
                                                                "controller"))
        self.set_mode = Method(self.modes_set.append)  # records; the controller's mode stays as set here


def make_loop(engine: FakeEngine, resolve) -> tuple[MorphLoop, ServeMetrics]:
    metrics = ServeMetrics("fake", InMemoryBackend())
    client = ControllerClient("replica-1", PolicyConfig(mode="performance", **FAST_POLICY), timeout_s=0.5,
                              resolve=resolve)
    return MorphLoop(engine, client, metrics, interval_s=0.1, max_layers_per_step=2), metrics


def unreachable():
    raise ConnectionError("no controller in this test")


def test_local_policy_swaps_down_under_pressure_and_restores_when_quiet():
    engine = FakeEngine()
    loop, metrics = make_loop(engine, unreachable)

    async def rounds(n: int) -> None:
        for _ in range(n):
            await loop.run_once()

    engine.kv_usage = 0.95
    asyncio.run(rounds(2))
    assert engine.applied == [SetQuantizedTarget(4, Precision.INT4, 2)]  # performance: 4 layers per action
    assert loop.last.directive.source == "local" and metrics.reachable.value(model_name="fake") == 0.0
    asyncio.run(rounds(1))
    assert metrics.quantized.value(model_name="fake", precision="int4") == 4
    assert metrics.actions.value(model_name="fake", kind="swap_down") == 4
    assert metrics.actions.value(model_name="fake", kind="kv_grow") == 1
    engine.kv_usage = 0.1
    asyncio.run(rounds(6))
    assert engine.state().num_quantized == 0
    assert metrics.actions.value(model_name="fake", kind="restore") == 4
    assert metrics.kv_capacity.value(model_name="fake") == BASE_BLOCKS


def test_controller_directive_is_applied_until_reached_and_a_rejection_is_not_repeated():
    engine, controller = FakeEngine(), FakeController(target=3)
    loop, metrics = make_loop(engine, lambda: controller)
    asyncio.run(loop.run_once())
    asyncio.run(loop.run_once())  # already at the target: nothing to send
    assert engine.applied == [SetQuantizedTarget(3, Precision.INT4, 2)]
    assert metrics.reachable.value(model_name="fake") == 1.0

    # A target that takes several steps: applied once; the engine goes on by itself and logs each move.
    real_apply = engine.apply

    async def one_layer_now(action):
        engine.applied.append(action)
        return engine.move_one_layer(action)

    engine.apply = one_layer_now
    controller.target = 6
    asyncio.run(loop.run_once())
    assert engine.applied[-1] == SetQuantizedTarget(6, Precision.INT4, 2) and engine.pending
    asyncio.run(loop.run_once())  # still pending: not sent again
    engine.move_one_layer(engine.pending[0])  # a step boundary in the engine
    asyncio.run(loop.run_once())
    assert len(engine.applied) == 2 and engine.state().num_quantized == 5
    assert metrics.actions.value(model_name="fake", kind="swap_down") == 5  # 3, then 1 + 1 ("waiting" counts)
    assert loop.status()["action_results"] == {"done": 1, "waiting": 2}

    async def reject(action):
        engine.applied.append(action)
        result = ActionResult(action, "rejected", message="no")
        engine.log.append(result)
        return result

    engine.apply, controller.target = reject, 7
    applied = len(engine.applied)
    for _ in range(3):
        asyncio.run(loop.run_once())
    assert len(engine.applied) == applied + 1
    engine.apply = real_apply


def test_moves_the_engine_reports_between_rounds_are_counted():
    engine, controller = FakeEngine(), FakeController(target=0)
    loop, metrics = make_loop(engine, lambda: controller)
    asyncio.run(loop.run_once())
    target = SetQuantizedTarget(2, Precision.INT4, 1)
    engine.move_one_layer(target)  # a pending target's steps, not this loop's action
    engine.move_one_layer(target)
    controller.target = 2
    asyncio.run(loop.run_once())
    assert engine.applied == []  # already at the directive's target
    assert metrics.actions.value(model_name="fake", kind="swap_down") == 2
    assert metrics.actions.value(model_name="fake", kind="kv_grow") == 2


def test_rounds_at_which_requests_waited_are_counted_by_what_they_waited_for():
    engine = FakeEngine()
    loop, metrics = make_loop(engine, unreachable)
    asyncio.run(loop.run_once())  # nothing waits: not counted
    engine.num_waiting, engine.head_demand = 3, BASE_BLOCKS + 1  # the head needs more than is free: memory
    asyncio.run(loop.run_once())
    engine.head_demand = 1  # it would fit: the step's token budget holds it back (compute)
    for _ in range(2):
        asyncio.run(loop.run_once())
    assert loop.status()["waiting_rounds"] == {"memory": 1, "compute": 2}
    assert metrics.burst.queue_waits.value(model_name="fake", cause="memory") == 1  # the same, for Prometheus
    assert metrics.burst.queue_waits.value(model_name="fake", cause="compute") == 2


def test_every_rounds_wait_for_its_directive_is_counted_by_who_decided():
    engine, controller = FakeEngine(), FakeController(target=0)
    answering, _ = make_loop(engine, lambda: controller)
    local, metrics = make_loop(FakeEngine(), unreachable)
    for _ in range(3):
        asyncio.run(answering.run_once())
    asyncio.run(local.run_once())
    assert sum(answering.status()["directive_wait"]["counts"]) == 3  # the admin status, for a benchmark
    assert sum(local.status()["directive_wait"]["counts"]) == 1
    assert metrics.directive_wait.count(model_name="fake", source="local") == 1  # the same, for Prometheus
    assert metrics.directive_wait.count(model_name="fake", source="controller") == 0


def test_operator_pins_override_the_directive():
    engine, controller = FakeEngine(), FakeController(target=2)
    modes = controller.modes_set  # what reached the controller's set_mode, through the client
    loop, _ = make_loop(engine, lambda: controller)
    asyncio.run(loop.run_once())
    asyncio.run(loop.update(AdminUpdate(quantized_layers=6, precision="int8")))
    asyncio.run(loop.run_once())
    assert engine.state().count(Precision.INT8) == 6 and loop.status()["pins"]["quantized_layers"] == 6
    asyncio.run(loop.update(AdminUpdate(morphing_enabled=False)))
    asyncio.run(loop.run_once())
    assert engine.state().num_quantized == 0
    asyncio.run(loop.update(AdminUpdate(morphing_enabled=True, mode="accuracy")))
    assert modes == ["accuracy"]
    asyncio.run(loop.run_once())  # the controller still says "balanced": the pin is asserted again
    assert modes == ["accuracy", "accuracy"] and engine.state().num_quantized == 2
    with pytest.raises(InvalidRequestError):
        asyncio.run(loop.update(AdminUpdate(morphing_enabled=False, quantized_layers=2)))


def test_a_failing_round_does_not_stop_the_loop():
    engine = FakeEngine()
    calls = []

    async def flaky(fn):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return fn(engine)

    engine.run_at_step_boundary = flaky
    loop, _ = make_loop(engine, unreachable)
    done = threading.Event()

    async def main():
        loop.start()
        while loop.rounds < 2:
            await asyncio.sleep(0.01)  # poll the loop's progress
        await loop.stop()
        done.set()

    asyncio.run(asyncio.wait_for(main(), 10))
    assert done.is_set() and len(calls) >= 3


# ---- the real application ---------------------------------------------------------------------
# Budget: the weights (258.6 MiB bf16) + the activation reserve (12.5 MiB at 128 batched tokens) + 25 KV
# blocks (0.35 MiB, 16 tokens each): a burst of 12 chats (~70 tokens each: 5 blocks) needs ~60 blocks,
# so it queues for memory and the engine morphs at admission.
ADMIN = "admin-morph-test"
CONTROLLER = {"controller_name": "test-serve-morph-controller", "controller_namespace": "morphserve-test-morph"}
MORPH_ARGS = {
    "admin_token": ADMIN, "memory_budget": auto_budget("280MiB"), "mode": "performance", "report_interval_s": 0.1,
    "controller_timeout_s": 0.3, "max_layers_per_step": 4,
    "policy": {"enter_after": 2, "relax_after": 4, "history_len": 16},
    "engine": {"max_model_len": 256, "max_num_seqs": 16, "max_num_batched_tokens": 128}, **CONTROLLER,
}


@pytest.fixture(scope="module")
def morph_app():
    from tests.serve_helpers import serve_app

    with serve_app(MORPH_ARGS) as (ray, url):
        yield ray, url


def _chat(url: str, i: int, max_tokens: int = 24) -> tuple[int, dict]:
    from tests.serve_helpers import http

    # A system message of its own, starting with the request's number: no two requests share a first KV
    # block, so prefix caching does not shrink the KV pressure these tests are sized by (the model's default
    # system prompt would make every request share its first two blocks of five).
    system = f"Request {i}. You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    return http("POST", url + "/v1/chat/completions",
                {"model": "SmolLM2-135M-Instruct", "max_tokens": max_tokens, "ignore_eos": True,
                 "messages": [{"role": "system", "content": system},
                              {"role": "user", "content": f"Tell me a story about the number {i}."}]})


class Traffic:
    """Requests sent continuously from worker threads until stopped; every result is kept."""

    def __init__(self, url: str, workers: int, max_tokens: int = 16):
        self.url, self.max_tokens, self.results, self._stop = url, max_tokens, [], threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers)
        self._futures = [self._pool.submit(self._run, w) for w in range(workers)]

    def _run(self, worker: int) -> None:
        i = 0
        while not self._stop.is_set():
            self.results.append(_chat(self.url, worker * 1000 + i, self.max_tokens))
            i += 1

    def stop(self) -> list[tuple[int, dict]]:
        self._stop.set()
        for f in self._futures:
            f.result(timeout=300)
        self._pool.shutdown()
        return self.results


@pytest.mark.slow
def test_a_burst_swaps_layers_down_and_idle_restores_them(morph_app):
    from tests.serve_helpers import admin_status, http, metrics_export_port, until

    ray, url = morph_app
    start = admin_status(url, ADMIN)
    assert start["morph_state"]["num_quantized"] == 0 and start["morph_state"]["engine_morphing_enabled"]
    base_blocks = start["morph_state"]["kv_capacity_blocks"]
    traffic = Traffic(url, workers=12, max_tokens=24)
    try:
        peak = until(lambda: (lambda s: s if s["morph_state"]["num_quantized"] > 0 else None)(admin_status(url, ADMIN)),
                     120, "a layer swap under the burst")
    finally:
        results = traffic.stop()
    assert peak["morph_state"]["kv_capacity_blocks"] > base_blocks  # freed weight bytes went to the KV cache
    assert peak["action_results"].get("done", 0) >= 1
    # Read at a step boundary (a status taken during a long step repeats the last one, marked stale).
    admission = until(lambda: (lambda a: a if a and not a.get("stale") and a["swaps"] >= 1 else None)(
        admin_status(url, ADMIN)["admission"]), 60, "the admission morph's status")
    assert admission["grant"]["max_quantized"] == 30  # performance
    assert admission["events"][0]["kind"] == "swap"
    assert results and all(status == 200 for status, _ in results), [r for r in results if r[0] != 200][:3]
    assert all(body["choices"][0]["message"]["content"] for _, body in results)
    restored = until(lambda: (lambda s: s if s["morph_state"]["num_quantized"] == 0 else None)(admin_status(url, ADMIN)),
                     120, "every layer restored after the burst")
    assert set(restored["morph_state"]["precisions"]) == {auto_precision()}
    assert restored["morph_state"]["kv_capacity_blocks"] == base_blocks
    assert _chat(url, 1)[0] == 200
    # The same story in the replica's metrics, as Ray's metrics agent exports them.
    agent = f"http://127.0.0.1:{metrics_export_port(ray)}/metrics"
    until(lambda: all(_counter(http("GET", agent)[1], "ray_morphserve_morph_actions_total", kind) > 0
                      for kind in ("swap_down", "restore", "kv_grow", "kv_shrink")), 60,
          "swap and resize counters in the exported metrics", every_s=1.0)
    until(lambda: _counter(http("GET", agent)[1], "ray_morphserve_admission_morphs_total", "swap") > 0, 60,
          "the admission-morph counter in the exported metrics", every_s=1.0)


def _counter(text: str, name: str, kind: str) -> float:
    """Sum of one counter's samples with kind=<kind> in Prometheus text format."""
    total = 0.0
    for line in str(text).splitlines():
        if line.startswith(name + "{") and f'kind="{kind}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.slow
def test_killing_the_controller_mid_traffic_falls_back_to_the_local_policy(morph_app):
    from tests.serve_helpers import admin_status, until

    ray, url = morph_app
    until(lambda: admin_status(url, ADMIN)["controller"]["reachable"], 60, "the controller to answer")
    replica_id = admin_status(url, ADMIN)["replica_id"]
    actor = ray.get_actor(CONTROLLER["controller_name"], namespace=CONTROLLER["controller_namespace"])
    before = ray.get(actor.status.remote(), timeout=30)
    assert replica_id in before["replicas"]
    traffic = Traffic(url, workers=3, max_tokens=8)
    try:
        ray.kill(actor, no_restart=False)
        # The round that notices the controller is gone reports unreachable first, then decides locally.
        local = until(lambda: (lambda s: s if not s["controller"]["reachable"] and s["directive"]
                               and s["directive"]["source"] == "local" else None)(admin_status(url, ADMIN)),
                      60, "the replica to fall back to its local policy", every_s=0.05)
        assert local["directive"]["source"] == "local"
        until(lambda: admin_status(url, ADMIN)["controller"]["reachable"], 120, "the restarted controller")
    finally:
        results = traffic.stop()
    assert results and all(status == 200 for status, _ in results), [r for r in results if r[0] != 200][:3]
    after = ray.get(ray.get_actor(CONTROLLER["controller_name"], namespace=CONTROLLER["controller_namespace"])
                    .status.remote(), timeout=30)
    assert after["instance_id"] != before["instance_id"]
    assert replica_id in after["replicas"] and after["replicas"][replica_id]["reports"] >= 1
    assert admin_status(url, ADMIN)["directive"]["source"] == "controller"


def test_impossible_pins_are_refused_when_made_and_the_old_pins_stay():
    from deployments.morph_loop import AdminPins, pin_problem
    from engine.errors import InvalidRequestError

    state = FakeEngine().state()
    ladder = (Precision.INT4,)
    assert pin_problem(AdminPins(quantized_layers=NUM_LAYERS, precision=Precision.INT4), state, ladder) is None
    param, why = pin_problem(AdminPins(quantized_layers=1000, precision=Precision.INT4), state, ladder)
    assert param == "quantized_layers" and f"[0, {NUM_LAYERS}]" in why and "1000" in why
    assert "[0," in pin_problem(AdminPins(quantized_layers=-1, precision=Precision.INT4), state, ladder)[1]
    param, why = pin_problem(AdminPins(quantized_layers=1, precision=Precision.INT8), state, ladder)
    assert param == "precision" and "morph_ladder" in why
    frozen = dataclasses.replace(state, morphing_enabled=False)
    assert "without morphing" in pin_problem(AdminPins(quantized_layers=1, precision=Precision.INT4), frozen, None)[1]

    engine = FakeEngine()
    loop, _ = make_loop(engine, unreachable)
    loop.ladder = ladder
    asyncio.run(loop.update(AdminUpdate(quantized_layers=2, precision="int4")))
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(loop.update(AdminUpdate(quantized_layers=1000)))
    assert err.value.param == "quantized_layers"
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(loop.update(AdminUpdate(quantized_layers=1, precision="int8")))
    assert err.value.param == "precision"
    assert loop.pins.quantized_layers == 2  # a refused update changes nothing
