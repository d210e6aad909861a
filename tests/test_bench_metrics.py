"""Run metrics on hand-made timings (exact percentiles and SLO counts), repeat aggregation, ROUGE-L."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ops.bench import BenchmarkInputError
from ops.bench.loadgen import RequestRecord, ServerSample
from ops.bench.metrics import aggregate, compute_run_metrics, percentile, spread
from ops.quality.rouge import agreement, lcs_length, quality_loss_reduction, rouge_l_f1, tokenize


def _ok(i: int, ttft: float, n_tokens: int = 5, gap: float = 0.25, queue: float | None = None) -> RequestRecord:
    first = i + ttft
    times = tuple(first + gap * k for k in range(n_tokens))
    return RequestRecord(request_id=f"r{i}", scheduled_s=float(i), sent_s=float(i), first_token_s=first,
                         token_times_s=times, end_s=times[-1], status=200, output_text="x " * n_tokens,
                         output_tokens=n_tokens, prompt_tokens=10, error=None, queue_s=queue)


def _records() -> list[RequestRecord]:
    # 8 served requests with TTFT 0.125, 0.25, ..., 1.0 s (exact in binary), 5 tokens 0.25 s apart;
    # one HTTP 500 (sent 0.04 s late) and one never sent.
    records = [_ok(i, 0.125 * (i + 1), queue=0.0625 * i if i < 4 else None) for i in range(8)]
    records.append(RequestRecord("r8", 8.0, 8.04, None, (), 8.1, 500, "", 0, 10, "HTTP 500: boom"))
    records.append(RequestRecord("r9", 9.0, None, None, (), None, None, "", 0, 10, "not sent before the deadline"))
    return records


def test_percentile_interpolates_linearly():
    values = list(range(1, 102))  # 1..101
    assert (percentile(values, 50), percentile(values, 95), percentile(values, 99)) == (51, 96, 100)
    assert percentile([0.0, 1.0], 25) == 0.25
    assert percentile([], 50) is None
    with pytest.raises(BenchmarkInputError):
        percentile([1.0], 101)


def test_run_metrics_on_known_timings():
    samples = [ServerSample(0.0, {"preemptions_total": 3.0}), ServerSample(4.0, {"kv_usage": 0.5}),
               ServerSample(5.0, {"preemptions_total": 7.0})]
    m = compute_run_metrics(_records(), slo_ttft_s=0.5, samples=samples)
    assert (m.num_requests, m.num_ok) == (10, 8)
    # TTFT ranks over 8 values: P50 at 3.5, P95 at 6.65, P99 at 6.93 (0-based)
    assert m.ttft_s.p50 == pytest.approx(0.5625)
    assert m.ttft_s.p95 == pytest.approx(0.875 + 0.65 * 0.125)
    assert m.ttft_s.p99 == pytest.approx(0.875 + 0.93 * 0.125)
    assert m.ttft_s.mean == pytest.approx(0.5625)
    assert (m.tpot_s.count, m.tpot_s.p50, m.tpot_s.p99) == (8, pytest.approx(0.25), pytest.approx(0.25))
    assert (m.itl_s.count, m.itl_s.p95) == (32, pytest.approx(0.25))
    assert m.e2e_s.p50 == pytest.approx(1.5625)
    # TTFT <= 0.5 s: 4 of 10 requests; the failed and the unsent ones are violations
    assert (m.slo_violations, m.slo_violation_rate) == (6, pytest.approx(0.6))
    assert m.duration_s == pytest.approx(9.0)  # last end (7 + 1.0 + 1.0) - first scheduled (0)
    assert m.goodput_rps == pytest.approx(4 / 9)
    assert m.throughput_tok_s == pytest.approx(40 / 9)
    assert (m.queue_s.count, m.queue_s.p50) == (4, pytest.approx(0.09375))
    assert m.preemptions == 4
    assert m.send_lag_p99_s == pytest.approx(0.92 * 0.04)


def test_run_metrics_without_server_reports():
    m = compute_run_metrics(_records()[4:6], slo_ttft_s=2.0)  # served, no queue reported
    assert m.queue_s.count == 0 and m.queue_s.p95 is None and m.preemptions is None
    assert m.slo_violation_rate == 0.0
    with pytest.raises(BenchmarkInputError, match="slo_ttft_s"):
        compute_run_metrics(_records(), slo_ttft_s=0)


def test_aggregate_repeats_median_min_max():
    runs = [compute_run_metrics(_records(), slo) for slo in (0.25, 0.5, 1.0)]  # 2, 4, 8 meet the SLO
    agg = aggregate(runs)
    rate = agg["slo_violation_rate"]
    assert (rate.median, rate.min, rate.max, rate.n) == (pytest.approx(0.6), pytest.approx(0.2), pytest.approx(0.8), 3)
    assert rate.format() == "0.6 [0.2–0.8]"
    assert agg["ttft_s.p50"].format() == "0.562"  # identical across repeats: no range shown
    assert agg["preemptions"].median is None and agg["preemptions"].format() == "n/a"
    s = spread([3.0, None, 1.0, 2.0])
    assert (s.median, s.min, s.max, s.n) == (2.0, 1.0, 3.0, 3)


# --- ROUGE-L ---------------------------------------------------------------------------------------

def test_rouge_l_known_values():
    assert tokenize("The CAT, sat! 42x") == ["the", "cat", "sat", "42x"]
    assert rouge_l_f1("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    # candidate 3 tokens, reference 6, LCS 3: P = 1, R = 0.5, F1 = 2/3
    assert rouge_l_f1("The cat, mat.", "the cat is on the mat") == pytest.approx(2 / 3)
    assert rouge_l_f1("", "") == 1.0 and rouge_l_f1("a", "") == 0.0 and rouge_l_f1("a b", "c d") == 0.0


def _lcs_dp(a, b):
    row = [0] * (len(b) + 1)
    for x in a:
        prev_diag = 0
        for j, y in enumerate(b, start=1):
            prev_diag, row[j] = row[j], prev_diag + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from("abcd"), max_size=40), st.lists(st.sampled_from("abcd"), max_size=40))
def test_bit_parallel_lcs_matches_dynamic_programming(a, b):
    assert lcs_length(a, b) == _lcs_dp(a, b) == lcs_length(b, a)


def test_agreement_counts_missing_responses_as_zero():
    refs = {"r0": "the cat sat", "r1": "a dog ran", "r2": "birds fly"}
    got = agreement({"r0": "the cat sat", "r1": "a dog", "extra": "ignored"}, refs)
    # r0: 1.0; r1: P = 1, R = 2/3 -> 0.8; r2 missing -> 0
    assert got.per_request == {"r0": 1.0, "r1": pytest.approx(0.8), "r2": 0.0}
    assert got.mean == pytest.approx(0.6) and (got.n_scored, got.n_missing) == (2, 1)


def test_quality_loss_reduction():
    assert quality_loss_reduction(0.1, 0.4) == pytest.approx(0.75)
    assert quality_loss_reduction(0.4, 0.4) == 0.0
    assert quality_loss_reduction(0.1, 0.0) is None and quality_loss_reduction(None, 0.3) is None


def test_fleet_total_sums_each_replicas_value_at_that_time():
    from ops.bench.metrics import fleet_total_at

    histories = {"a": [[10.0, 0], [12.0, 4], [15.0, 2]], "b": [[11.0, 0], [13.0, 6]]}
    assert [fleet_total_at(histories, t) for t in (9.0, 12.0, 12.5, 13.0, 16.0)] == [0, 4, 4, 10, 8]
    assert fleet_total_at({}, 1.0) == 0


def test_layer_moves_count_morphs_restores_and_the_restores_a_replica_undoes_soon():
    from ops.bench.metrics import LayerMoves, layer_moves

    # a: morphs at 12, restores at 13 and morphs again at 14 (undone), restores at 16 and morphs only at
    # 20 (after the burst: not undone); b: one morph at 12.5 and one restore at 30, after the window.
    histories = {"a": [[10.0, 0], [12.0, 4], [13.0, 2], [14.0, 6], [16.0, 0], [20.0, 2]],
                 "b": [[11.0, 0], [12.5, 6], [30.0, 0]]}
    assert layer_moves(histories, 11.0, 25.0) == LayerMoves(morphs=4, restores=2, restores_undone=1)
    assert layer_moves(histories, 11.0, 25.0, undone_within_s=5.0).restores_undone == 2
    assert layer_moves(histories, 13.5, 25.0) == LayerMoves(morphs=2, restores=1, restores_undone=0)
    assert layer_moves(histories, 0.0, 40.0).restores == 3
    assert layer_moves({}, 0.0, 1.0) == LayerMoves(0, 0, 0)


def test_the_fleet_goal_needs_fewer_misses_and_fewer_quantized_layer_seconds():
    from ops.bench.goals import fleet_goal
    from ops.bench.metrics import Spread
    from ops.bench.systems import FLEET_BASELINE, FLEET_PRESSURE

    def row(misses, qls):
        return {"slo_violations": Spread(misses, misses, misses, 1), "quantized_layer_s": Spread(qls, qls, qls, 1),
                "ttft_s.p95": Spread(1.0, 1.0, 1.0, 1)}

    assert fleet_goal({FLEET_BASELINE: row(10, 50.0), FLEET_PRESSURE: row(4, 20.0)}).endswith("-> REACHED")
    assert fleet_goal({FLEET_BASELINE: row(10, 50.0), FLEET_PRESSURE: row(4, 60.0)}).endswith("-> not reached")
    assert fleet_goal({FLEET_BASELINE: row(10, 50.0)}).endswith("n/a (missing runs)")


def test_the_default_fleet_is_judged_by_the_same_goal_after_the_issues_pair():
    from ops.bench.goals import goal_lines
    from ops.bench.metrics import Spread
    from ops.bench.systems import FLEET_BASELINE, FLEET_CONTROLLER_ONLY, FLEET_PRESSURE

    def row(misses, qls):
        return {"slo_violations": Spread(misses, misses, misses, 1), "quantized_layer_s": Spread(qls, qls, qls, 1)}

    lines = goal_lines({FLEET_BASELINE: row(10, 50.0), FLEET_CONTROLLER_ONLY: row(8, 40.0)})
    assert lines[0].startswith(f"goal {FLEET_PRESSURE} vs") and lines[0].endswith("n/a (missing runs)")
    assert lines[1].startswith(f"goal {FLEET_CONTROLLER_ONLY} vs {FLEET_BASELINE}") and lines[1].endswith("-> REACHED")
    assert len(goal_lines({FLEET_BASELINE: row(10, 50.0)})) == 1  # no controller system ran: the issue's line only


def test_the_fleet_goal_repeat_by_repeat_counts_pairs_and_tests_their_signs():
    from ops.bench.goals import FleetPair, fleet_pairs_line, sign_test_p

    assert sign_test_p(0, 0) == 1.0 and sign_test_p(3, 3) == 1.0
    assert sign_test_p(5, 0) == sign_test_p(0, 5) == 2 / 32  # all five one way: 2 x (1/2)^5
    assert abs(sign_test_p(8, 2) - 2 * (1 + 10 + 45) / 1024) < 1e-12
    pairs = [FleetPair((17, 1), (180.0, 110.0)), FleetPair((10, 12), (142.0, 132.0)), FleetPair((0, 0), (130.0, 96.0)),
             FleetPair((4, 10), (154.0, None))]
    line = fleet_pairs_line(pairs)
    assert line.startswith("fleet-pressure-router vs fleet-serve-router, paired by repeat")
    assert "(4 pairs): SLO misses fewer in 1, more in 2, equal in 1 (two-sided sign test p = 1)" in line
    assert fleet_pairs_line(pairs, "fleet-controller-only").startswith("fleet-controller-only vs")
    assert "quantized layer-seconds fewer in 3 of 3 (p = 0.25)" in line


def test_a_run_pairs_each_controller_system_with_the_baseline_repeat_by_repeat():
    from ops.bench.loadgen import RequestRecord
    from ops.bench.report import BenchResults, BenchSettings, SystemRun
    from ops.bench.run_all import _fleet_pairs_lines
    from ops.bench.systems import FLEET_BASELINE, FLEET_CONTROLLER_ONLY

    def run(system, repeat, ttft, layer_s):
        record = RequestRecord(request_id="r", scheduled_s=0.0, sent_s=0.0, first_token_s=ttft, token_times_s=(ttft,),
                               end_s=ttft, status=200, output_text="x", output_tokens=1, prompt_tokens=1, error=None)
        return SystemRun(system=system, repeat=repeat, records=(record,), quantized_layer_s=layer_s)

    settings = BenchSettings(title="t", model="m", memory_budget="1 GiB", workload="w", slo_ttft_s=1.0,
                             full_precision_system=FLEET_BASELINE, static_int4_system=None)
    runs = (run(FLEET_BASELINE, 0, 3.0, 50.0), run(FLEET_CONTROLLER_ONLY, 0, 0.5, 40.0),
            run(FLEET_BASELINE, 1, 0.5, 50.0), run(FLEET_CONTROLLER_ONLY, 1, 0.5, 60.0))
    lines = _fleet_pairs_lines(BenchResults(settings, runs))
    assert len(lines) == 1  # no pressure-router runs: no line for it
    assert lines[0].startswith(f"{FLEET_CONTROLLER_ONLY} vs {FLEET_BASELINE}, paired by repeat (2 pairs)")
    assert "SLO misses fewer in 1, more in 0, equal in 1" in lines[0] and "layer-seconds fewer in 1 of 2" in lines[0]


def test_prefix_hit_share_is_cached_over_served_prompt_tokens_where_the_server_reports_both():
    import dataclasses

    from ops.bench.metrics import prefix_hit_share

    base = _records()
    assert prefix_hit_share(base) is None and compute_run_metrics(base, 0.5).prefix_hit_share is None
    served = [dataclasses.replace(r, served_prompt_tokens=100, cached_prompt_tokens=c)
              for r, c in zip(base[:3], (0, 48, 96))]
    assert prefix_hit_share(served + base[3:]) == pytest.approx(144 / 300)
    assert compute_run_metrics(served + base[3:], 0.5).prefix_hit_share == pytest.approx(144 / 300)
