"""The pressure-aware router's ranking (pure) and its stats round trip; the router itself runs in the
2-replica fleet test (tests/test_fleet_serve.py)."""
from __future__ import annotations

import dataclasses
import time
import types
from pathlib import Path

import pytest

from deployments.router import InFlight, Penalties, PressureAwareRouter, ReplicaLoad, Sent, fit_class, rank_replicas

NOW = 1000.0


def load(free: int, waiting: int = 0, age: float = 0.1, quantized: int = 0, morph_blocks: int = 0,
         prefill: int = 0, tps: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(free_blocks=free, num_waiting=waiting, block_size=16, taken_at=NOW - age,
                       num_quantized=quantized, morph_blocks=morph_blocks, prefill_tokens=prefill, prefill_tps=tps)


PENALIZED = Penalties(morphed=1, no_fit=2)  # an operator's router_*_penalty settings (the defaults are 0)


def rank(loads, queues, prompt_tokens=64, sent=None, **kw):
    return rank_replicas(loads, queues, prompt_tokens, sent or {}, NOW, 2.0, **kw)


def test_the_shorter_queue_wins_when_both_fit():
    # 64 tokens need 4 blocks: both admit it; how much room is left does not outweigh a queued request.
    assert rank({"a": load(40), "b": load(5)}, {"a": 3, "b": 2}) == ("fits", ["b", "a"])


def test_on_equal_queues_the_replica_where_it_fits_at_full_precision_wins():
    # "morphed" has the most room, but all of it from its morph: sending there keeps it morphed.
    loads = {"morphed": load(60, quantized=6, morph_blocks=58), "tight": load(5), "full": load(2)}
    decision, order = rank(loads, {"morphed": 1, "tight": 1, "full": 1})
    assert decision == "fits" and order == ["tight", "morphed", "full"]
    assert fit_class(loads["morphed"], 60, 4) == "fits_morphed" and fit_class(loads["full"], 2, 4) == "no_fit"


def test_by_default_the_fit_only_breaks_ties_between_equal_queues():
    loads = {"fits": load(20), "no_fit": load(2)}
    assert rank(loads, {"fits": 1, "no_fit": 1}) == ("fits", ["fits", "no_fit"])
    assert rank(loads, {"fits": 2, "no_fit": 1}) == ("no_fit", ["no_fit", "fits"])


def test_a_penalty_is_worth_that_many_queued_requests():
    loads = {"fits": load(20), "no_fit": load(2)}
    # no_fit costs 2 queued requests: a fitting replica with up to 2 more in its queue still wins (ties
    # go to the better class), with 3 more it does not.
    assert rank(loads, {"fits": 2, "no_fit": 0}, penalties=PENALIZED)[1] == ["fits", "no_fit"]
    assert rank(loads, {"fits": 3, "no_fit": 0}, penalties=PENALIZED) == ("no_fit", ["no_fit", "fits"])
    assert rank(loads, {"fits": 3, "no_fit": 0}, penalties=Penalties(morphed=1, no_fit=4))[1] == ["fits", "no_fit"]
    with pytest.raises(ValueError, match="morphed"):
        Penalties(morphed=3, no_fit=2)


def test_requests_waiting_there_make_it_no_fit_whatever_its_room():
    decision, order = rank({"queued": load(60, waiting=2), "roomy": load(20)}, {"queued": 0, "roomy": 1},
                           penalties=PENALIZED)
    assert decision == "fits" and order == ["roomy", "queued"]


def test_blocks_already_sent_since_the_stats_count_against_a_replica():
    assert rank({"a": load(20), "b": load(10)}, {"a": 0, "b": 0}, sent={"a": Sent(18, 200)}) == ("fits", ["b", "a"])
    # A fresh report (taken after those sends) includes them: nothing is subtracted any more; on equal
    # cost and class the one with more room at full precision comes first.
    assert rank({"a": load(20), "b": load(10)}, {"a": 0, "b": 0}) == ("fits", ["a", "b"])


def test_in_a_burst_the_least_prefill_backlog_wins_over_a_shorter_queue():
    # "decoding" runs 5 requests with nothing left to prefill; "prefilling" holds 2 with 400 prompt
    # tokens to go: a new request's first token comes sooner on "decoding".
    loads = {"decoding": load(20), "prefilling": load(20, prefill=400)}
    assert rank(loads, {"decoding": 5, "prefilling": 2})[1] == ["decoding", "prefilling"]
    # Prompts sent since the reports count too: 500 tokens sent to "decoding" put it behind.
    assert rank(loads, {"decoding": 5, "prefilling": 2}, sent={"decoding": Sent(8, 500)})[1] == ["prefilling", "decoding"]
    # With no backlog reported anywhere, prompts sent since the reports (prefilled long ago, maybe)
    # do not count: queue length decides.
    quiet = {"a": load(20), "b": load(20)}
    assert rank(quiet, {"a": 1, "b": 2}, sent={"a": Sent(8, 500)})[1] == ["a", "b"]


def test_an_older_report_has_its_backlog_aged_by_the_replicas_prefill_speed():
    # "early" reported 600 tokens 0.5 s ago and prefills 800 tokens/s: ~200 are left; "late" reported
    # 400 just now. Taken at face value "late" looks shorter; aged, "early" is.
    loads = {"early": load(20, age=0.5, prefill=600, tps=800.0), "late": load(20, age=0.01, prefill=400, tps=800.0)}
    assert rank(loads, {"early": 2, "late": 2})[1] == ["early", "late"]
    assert loads["early"].backlog_now(0, NOW) == pytest.approx(200.0)
    # What was sent since the report is aged with it, never below 0; unknown speed (0) ages nothing.
    assert loads["early"].backlog_now(300, NOW) == pytest.approx(500.0)
    assert load(20, age=5.0, prefill=100, tps=800.0).backlog_now(0, NOW) == 0.0
    assert load(20, age=0.5, prefill=600).backlog_now(0, NOW) == 600.0
    # Both aged to nothing: queue length decides again.
    drained = {"a": load(20, age=1.0, prefill=300, tps=800.0), "b": load(20, age=0.9, prefill=500, tps=800.0)}
    assert rank(drained, {"a": 3, "b": 1})[1] == ["b", "a"]


def test_a_backlog_is_aged_from_the_end_of_the_step_its_figures_follow_not_from_its_cutoff():
    """The cutoff is a step's start, the figures its end, with that step's chunk already prefilled.
    "busy" reported 1000 tokens after a 1.0-s, 500-token prefill step that began 1.1 s ago; "idle"
    reported 800 after a short step. Aged from the cutoff, "busy" lost its step's 500 tokens twice
    (1000 - 500 x 1.1 = 450) and looked emptier than "idle"; aged from its figures' time, 950 > 790."""
    busy = ReplicaLoad(20, 0, 16, taken_at=NOW - 1.1, prefill_tokens=1000, prefill_tps=500.0, measured_at=NOW - 0.1)
    idle = ReplicaLoad(20, 0, 16, taken_at=NOW - 0.03, prefill_tokens=800, prefill_tps=500.0, measured_at=NOW - 0.02)
    assert busy.backlog_now(0, NOW) == pytest.approx(950.0) and idle.backlog_now(0, NOW) == pytest.approx(790.0)
    assert rank({"busy": busy, "idle": idle}, {"busy": 2, "idle": 2})[1] == ["idle", "busy"]
    # Stats without the figures' time (an older replica) age from the cutoff, as before.
    assert dataclasses.replace(busy, measured_at=None).backlog_now(0, NOW) == pytest.approx(450.0)
    # Staleness is the figures' age too: a 2.5-s step whose figures are fresh is not stale.
    long_step = dataclasses.replace(busy, taken_at=NOW - 2.6)
    assert rank({"busy": long_step, "idle": idle}, {"busy": 2, "idle": 2})[0] != "stale"
    assert rank({"busy": dataclasses.replace(long_step, measured_at=None), "idle": idle},
                {"busy": 2, "idle": 2}) == ("stale", [])


def test_stale_or_missing_stats_or_queue_lengths_fall_back_to_serves_default():
    queues = {"a": 0, "b": 0}
    assert rank({"a": load(20), "b": load(20, age=5.0)}, queues) == ("stale", [])
    assert rank({"a": load(20), "b": None}, queues) == ("stale", [])
    assert rank({}, {}) == ("stale", [])
    assert rank({"a": load(20), "b": load(20)}, {"a": 0, "b": None}) == ("no_queue_len", [])


def test_stats_round_trip_and_foreign_stats_are_ignored():
    original = dataclasses.replace(load(12, waiting=3, quantized=4, morph_blocks=9, prefill=77, tps=640.5),
                                   measured_at=NOW + 0.25)
    assert ReplicaLoad.from_stats(original.to_stats()) == original
    assert ReplicaLoad.from_stats({}) is None and ReplicaLoad.from_stats({"kind": "other", "x": 1}) is None
    assert ReplicaLoad.from_stats({**original.to_stats(), "free_blocks": "many"}) is None
    newer_fields = ("morph_blocks", "prefill_tokens", "prefill_tps", "measured_at")
    older = {k: v for k, v in original.to_stats().items() if k not in newer_fields}
    assert ReplicaLoad.from_stats(older).morph_blocks == 0 == ReplicaLoad.from_stats(older).prefill_tokens  # a replica before the fields
    assert ReplicaLoad.from_stats(older).prefill_tps == 0.0 and ReplicaLoad.from_stats(older).measured_at is None


def test_a_request_needs_its_prompt_and_the_output_reservation_capped_by_max_tokens():
    roomy = ReplicaLoad(free_blocks=8, num_waiting=0, block_size=16, taken_at=NOW, reservation_tokens=64)
    assert roomy.blocks_for(100) == 11 and roomy.blocks_for(100, max_tokens=12) == 7
    # 100 prompt tokens + 64 reserved = 11 blocks do not fit 8; with max_tokens 12 (7 blocks) they do.
    assert rank({"r": roomy}, {"r": 0}, prompt_tokens=100)[0] == "no_fit"
    assert rank({"r": roomy}, {"r": 0}, prompt_tokens=100, max_tokens=12) == ("fits", ["r"])


def route_burst(loads: dict[str, ReplicaLoad], n: int, blocks: int = 4, penalties: Penalties = Penalties()) -> dict[str, int]:
    """`n` requests of `blocks` blocks (their prompts: blocks x 16 tokens) between two reports, each sent
    to the first in the order (Serve's queues are never full here), with the queue-length cache and the
    in-flight record updated per send, as Serve and the router do: the counts sent to each replica."""
    in_flight, queue = InFlight(keep_s=4.0), {rid: 0 for rid in loads}
    for i in range(n):
        sent = {rid: in_flight.since(rid, l.taken_at) for rid, l in loads.items()}
        _, order = rank_replicas(loads, queue, blocks * 16, sent, NOW + 0.01 * i, 2.0, penalties=penalties)
        queue[order[0]] += 1
        in_flight.record(order[0], NOW + 0.01 * i, Sent(blocks, blocks * 16))
    return queue


def test_a_burst_between_two_reports_spreads_evenly_over_two_equal_replicas():
    assert route_burst({"a": load(40), "b": load(40)}, 8) == {"a": 4, "b": 4}
    # Reported backlogs: the prompts sent fill the smaller one up first, then alternate (4 x 64 tokens
    # bring "b" from 64 to 320, level with "a"; the other 4 split).
    assert route_burst({"a": load(40, prefill=320), "b": load(40, prefill=64)}, 8) == {"a": 2, "b": 6}


def test_a_burst_leans_away_from_a_morphed_replica_only_as_far_as_the_penalties_allow():
    # "fresh" has room for 3 requests at full precision, "morphed" room only in its morph's blocks.
    loads = {"fresh": load(12), "morphed": load(40, quantized=8, morph_blocks=40)}
    # By default the queues stay even; "fresh" takes every tie while it has room.
    assert route_burst(loads, 4) == {"fresh": 2, "morphed": 2} and route_burst(loads, 10) == {"fresh": 5, "morphed": 5}
    # With penalties, 3 of the first 4 go to "fresh"; once it is full it would have to morph too, and
    # the rest go mostly to "morphed", its queue never more than the no_fit penalty longer.
    assert route_burst(loads, 4, penalties=PENALIZED) == {"fresh": 3, "morphed": 1}
    sent = route_burst(loads, 10, penalties=PENALIZED)
    assert sent["morphed"] > sent["fresh"] >= 3 and sent["morphed"] - sent["fresh"] <= 2


def test_requests_sent_during_a_step_count_until_a_report_holds_them():
    """A report's cutoff is the start of the step it was taken after: a request sent during that step
    (after the cutoff) is counted; one sent `transit_s` or less before the cutoff may still have been
    on its way, so it is counted too; one sent earlier is in the report and is not counted twice."""
    in_flight = InFlight(keep_s=4.0, transit_s=0.05)
    no_transit = InFlight(keep_s=4.0)
    for at, tokens in ((NOW - 1.0, 100), (NOW - 0.03, 20), (NOW + 0.3, 3)):
        in_flight.record("r", at, Sent(1, tokens))
        no_transit.record("r", at, Sent(1, tokens))
    assert in_flight.since("r", NOW) == Sent(2, 23)
    assert no_transit.since("r", NOW) == Sent(1, 3)
    assert in_flight.since("r", NOW + 0.4) == Sent(0, 0)
    with pytest.raises(ValueError, match="transit_s"):
        InFlight(keep_s=4.0, transit_s=-1)


def test_the_app_hands_its_router_settings_to_every_router():
    from deployments.app_args import AppArgs

    args = AppArgs(pressure_router=True, router_transit_s=0.2, router_stale_after_s=3.0, router_prefix_affinity=True,
                   router_affinity_queue_gap=3, router_slo_ttft_s=1.5)
    kwargs = args.request_router_config()["request_router_kwargs"]
    assert kwargs == {"stale_after_s": 3.0, "morphed_penalty": 0.0, "no_fit_penalty": 0.0, "transit_s": 0.2,
                      "prefix_affinity": True, "affinity_queue_gap": 3, "slo_ttft_s": 1.5}
    assert AppArgs().request_router_config() is None  # Serve's own router unless asked (wave 18)


def test_the_routers_own_defaults_are_the_apps():
    """A router named in a user's own serve config without kwargs behaves as the app's default router."""
    import inspect

    from deployments.app_args import AppArgs
    from deployments.router import PressureAwareRouter

    params = inspect.signature(PressureAwareRouter.initialize_state).parameters
    app = AppArgs(pressure_router=True).request_router_config()["request_router_kwargs"]
    assert {name: params[name].default for name in app} == app


def test_an_expected_prefix_hit_counts_off_the_backlog_and_before_queue_length():
    quiet = {"a": load(20), "b": load(20)}
    # Nothing backlogged: the replica likely holding 48 of the prompt's 64 tokens wins over a shorter queue...
    assert rank(quiet, {"a": 3, "b": 1}, cached={"a": 48})[1] == ["a", "b"]
    # ...unless its queue is more than affinity_queue_gap (2) longer than the shortest,
    assert rank(quiet, {"a": 4, "b": 1}, cached={"a": 48})[1] == ["b", "a"]
    assert rank(quiet, {"a": 3, "b": 1}, cached={"a": 48}, affinity_queue_gap=1)[1] == ["b", "a"]
    # ...or the hit covers less than a quarter of the prompt (the chat template's shared opening).
    assert rank(quiet, {"a": 3, "b": 1}, cached={"a": 15})[1] == ["b", "a"]
    # In a burst the hit is prefill not done: 300 backlogged - 96 cached still loses to 150 backlogged.
    burst = {"a": load(20, prefill=300), "b": load(20, prefill=150)}
    assert rank(burst, {"a": 1, "b": 1}, prompt_tokens=256, cached={"a": 96})[1] == ["b", "a"]
    assert rank(burst, {"a": 1, "b": 1}, prompt_tokens=256, cached={"a": 200})[1] == ["a", "b"]


def test_prefix_affinity_remembers_the_blocks_sent_to_each_replica_up_to_its_capacity():
    from deployments.router import PrefixAffinity

    shared, other = list(range(100, 148)), list(range(500, 548))  # 3 blocks of 16 each
    aff = PrefixAffinity()
    assert len(PrefixAffinity.digests(shared + [1], 16)) == 3 and len(PrefixAffinity.digests(shared, 16)) == 2
    aff.record("a", PrefixAffinity.digests(shared + [1], 16), keep=8)
    assert aff.matched_tokens("a", PrefixAffinity.digests(shared + [9, 9], 16), 16) == 48
    assert aff.matched_tokens("a", PrefixAffinity.digests(shared[:16] + other, 16), 16) == 16  # first block only
    assert aff.matched_tokens("b", PrefixAffinity.digests(shared + [1], 16), 16) == 0
    aff.record("a", PrefixAffinity.digests(other + [1], 16), keep=4)  # the oldest go past the capacity
    assert aff.matched_tokens("a", PrefixAffinity.digests(shared + [1], 16), 16) == 0
    assert aff.matched_tokens("a", PrefixAffinity.digests(other + [1], 16), 16) == 48


def test_stats_carry_the_capacity_and_whether_the_engine_caches_prefixes():
    stats = ReplicaLoad(10, 0, 16, NOW, capacity_blocks=65, prefix_caching=True).to_stats()
    assert ReplicaLoad.from_stats(stats) == ReplicaLoad(10, 0, 16, NOW, capacity_blocks=65, prefix_caching=True)
    del stats["capacity_blocks"], stats["prefix_caching"]  # an older replica's stats
    assert ReplicaLoad.from_stats(stats).prefix_caching is False


def _generate_call(prompt: list[int]) -> types.SimpleNamespace:
    """A pending `generate` call as Serve hands it to the router."""
    request = types.SimpleNamespace(prompt_token_ids=prompt, max_tokens=8, cache_salt=None)
    return types.SimpleNamespace(metadata=types.SimpleNamespace(call_method="generate"), args=[request])


def test_a_sent_prompt_adds_its_prompt_less_the_likely_prefix_hit_to_the_backlog_with_affinity_off():
    """The replica's backlog leaves cached tokens out, so what the router counts as sent there since must
    too, whether or not it ranks by affinity: else the replica whose report is older looks busier."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = PressureAwareRouter(deployment_id=DeploymentID(name="engine", app_name="t"),
                                 handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()  # prefix_affinity off, the app's default
    taken_at = time.time() - 1.0
    stats = {"caching": ReplicaLoad(40, 0, 16, taken_at, capacity_blocks=64, prefix_caching=True).to_stats(),
             "plain": ReplicaLoad(40, 0, 16, taken_at, capacity_blocks=64).to_stats()}
    router._replicas.update({rid: types.SimpleNamespace(routing_stats=s) for rid, s in stats.items()})
    shared = list(range(1000, 1096))  # six full blocks
    for rid in stats:
        router.on_request_routed(_generate_call(shared + [1, 2, 3, 4]), rid, None)
        router.on_request_routed(_generate_call(shared + [5, 6, 7, 8]), rid, None)
    # The second prompt finds the first's six blocks where the engine caches: 100 + 4 tokens to prefill.
    assert router._in_flight.since("caching", taken_at) == Sent(2 * 7, 104)
    assert router._in_flight.since("plain", taken_at) == Sent(2 * 7, 200)


def test_a_request_that_meets_the_slo_nowhere_overflows_to_the_most_backlogged_replica():
    """SLO 2 s; both replicas prefill 500 tokens/s."""
    def at(backlog):
        return load(40, age=0.0, prefill=backlog, tps=500.0)

    queues = {"a": 3, "b": 3}
    # "b" can still meet it (800 + 100 tokens = 1.8 s): the least backlog wins, as without an SLO.
    assert rank({"a": at(1100), "b": at(800)}, queues, prompt_tokens=100, slo_ttft_s=2.0) == ("fits", ["b", "a"])
    # Neither can (2.4 and 2.2 s): it goes where it holds back the fewest who still can, the one furthest behind.
    assert rank({"a": at(1100), "b": at(1000)}, queues, prompt_tokens=100, slo_ttft_s=2.0) == ("overflow", ["a", "b"])
    assert rank({"a": at(1100), "b": at(1000)}, queues, prompt_tokens=100)[1] == ["b", "a"]  # no SLO: off
    # ...but not past OVERFLOW_MAX_SLOS x the SLO (10 s): "a" at 11 s is skipped for "b".
    assert rank({"a": at(5400), "b": at(1000)}, queues, prompt_tokens=100, slo_ttft_s=2.0) == ("overflow", ["b", "a"])
    assert rank({"a": at(5400), "b": at(5300)}, queues, prompt_tokens=100, slo_ttft_s=2.0)[0] != "overflow"
    # A prompt too long to meet the SLO even on an idle replica (1100 tokens = 2.2 s) is not overflowed.
    assert rank({"a": at(1100), "b": at(1000)}, queues, prompt_tokens=1100, slo_ttft_s=2.0)[1] == ["b", "a"]
    # Unknown prefill speed on any replica: no estimate, no overflow.
    unknown = {"a": at(1100), "b": load(40, age=0.0, prefill=1000)}
    assert rank(unknown, queues, prompt_tokens=100, slo_ttft_s=2.0)[0] != "overflow"


def test_overflow_in_a_burst_longer_than_the_slo_keeps_one_replica_within_it():
    """60 requests of 100 tokens over 3 s onto two idle replicas that each prefill 500 tokens/s (twice
    what they can take). Spread evenly, both backlogs pass the 2-s SLO and every later request misses;
    with overflow those pile onto one replica, and what the other drains serves requests within the SLO
    (expected TTFT at dispatch, the router's own model: 37 within evenly spread, 42 with overflow)."""
    loads = {"a": load(400, age=0.0, tps=500.0, prefill=1), "b": load(400, age=0.0, tps=500.0, prefill=1)}

    def burst(slo):
        in_flight, queue, within = InFlight(keep_s=10.0), {"a": 0, "b": 0}, 0
        for i in range(60):
            now = NOW + 0.05 * i
            sent = {rid: in_flight.since(rid, load.taken_at) for rid, load in loads.items()}
            _, order = rank_replicas(loads, queue, 100, sent, now, 5.0, slo_ttft_s=slo)
            chosen = order[0]
            within += (loads[chosen].backlog_now(sent[chosen].tokens, now) + 100) / 500.0 <= 2.0
            queue[chosen] += 1
            in_flight.record(chosen, now, Sent(7, 100))
        return within, queue

    even, spread = burst(None)
    overflowed, piled = burst(2.0)
    assert abs(spread["a"] - spread["b"]) <= 1
    assert overflowed > even and piled["a"] > piled["b"]


def test_the_router_as_serve_ships_it_counts_its_decisions_where_the_ingress_reads_them(tmp_path):
    """Serve cloudpickles a request router with its module registered by value, so in the ingress the
    router's class sees a copy of deployments/router.py's globals: a count kept there was not the one GET
    /admin/router reads (every fleet benchmark run showed no decisions). The count lives in
    deployments/router_decisions.py, which the shipped class reaches by reference. Unpickled in a fresh
    process, as in the ingress (in the pickling process cloudpickle hands back the original class)."""
    import subprocess
    import sys

    from ray.serve.config import RequestRouterConfig

    from deployments.app_args import AppArgs

    config = RequestRouterConfig(**AppArgs(pressure_router=True).request_router_config())
    shipped = tmp_path / "router.pkl"
    shipped.write_bytes(config.get_serialized_request_router_cls())
    ingress = f"""
import pathlib
from ray import cloudpickle
from ray.serve._private.common import DeploymentHandleSource, DeploymentID
from deployments.router_decisions import decision_totals
cls = cloudpickle.loads(pathlib.Path({str(shipped)!r}).read_bytes())
router = cls(deployment_id=DeploymentID(name="engine", app_name="t"), handle_source=DeploymentHandleSource.UNKNOWN)
router.initialize_state()
router._count("fits")
router._count("fits")
router._count("overflow")
print(decision_totals())
"""
    out = subprocess.run([sys.executable, "-c", ingress], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "{'fits': 2, 'overflow': 1}", out.stdout
