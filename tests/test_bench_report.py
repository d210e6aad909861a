"""The report builder on a tiny fake result set: files, JSON numbers, report.md table rows, quality."""
from __future__ import annotations

import json

import pytest

from ops.bench import BenchmarkInputError
from ops.bench.loadgen import RequestRecord, ServerSample
from ops.bench.report import BenchResults, BenchSettings, SystemRun, build_report, score_quality, summarize

FP_TEXT = "the cat sat on the mat"
INT4_TEXT = "the dog sat on a mat"  # LCS with FP_TEXT is 4 of 6 tokens: ROUGE-L F1 = 2/3
BASE_TTFT = {"fp": 1.0, "int4": 0.25, "morph": 0.5}


def _record(i: int, ttft: float, text: str) -> RequestRecord:
    first = i + ttft
    times = (first, first + 0.5, first + 1.0)
    return RequestRecord(request_id=f"req-{i}", scheduled_s=float(i), sent_s=float(i), first_token_s=first,
                         token_times_s=times, end_s=times[-1], status=200, output_text=text,
                         output_tokens=3, prompt_tokens=10, error=None)


def _run(system: str, repeat: int) -> SystemRun:
    ttft = BASE_TTFT[system] + 0.125 * repeat
    texts = {"fp": [FP_TEXT] * 4, "int4": [INT4_TEXT] * 4, "morph": [FP_TEXT, INT4_TEXT, FP_TEXT, INT4_TEXT]}[system]
    timeline = tuple(ServerSample(t, {"kv_usage": 0.2 * t, "kv_capacity_blocks": 100 + 10 * t,
                                      "quantized_layers": float(t // 2), "preemptions_total": float(t)})
                     for t in range(5))
    return SystemRun(system=system, repeat=repeat, records=tuple(_record(i, ttft, texts[i]) for i in range(4)),
                     timeline=timeline)


@pytest.fixture
def results() -> BenchResults:
    runs = [_run(system, r) for r in range(3) for system in ("fp", "int4", "morph")]
    references = {f"req-{i}": FP_TEXT for i in range(4)}
    settings = BenchSettings(title="Tiny bench", model="tiny", memory_budget="1 GiB", workload="4 requests",
                             slo_ttft_s=0.75, full_precision_system="fp", static_int4_system="int4",
                             commands=("python -m ops.bench.run_all --quick",), notes=("fake data",))
    return BenchResults(settings=settings, runs=score_quality(runs, "fp", references))


def test_summary_numbers(results):
    table = summarize(results)
    ttft = table["fp"]["ttft_s.p50"]
    assert (ttft.median, ttft.min, ttft.max, ttft.n) == (1.125, 1.0, 1.25, 3)
    # SLO 0.75 s: fp (TTFT >= 1 s) never meets it; int4 and morph (TTFT <= 0.75 s, inclusive) always do
    assert table["fp"]["slo_violation_rate"].median == 1.0
    assert table["int4"]["slo_violation_rate"].max == 0.0
    assert table["morph"]["slo_violation_rate"].max == 0.0
    assert table["morph"]["preemptions"].median == 4
    assert table["int4"]["rouge_l_vs_full"].median == pytest.approx(2 / 3)
    assert table["morph"]["rouge_l_vs_full"].median == pytest.approx(5 / 6)
    # loss: int4 1/3, morph 1/6 -> reduction 1 - (1/6)/(1/3) = 0.5, by both quality measures
    assert table["morph"]["loss_reduction_vs_int4_full"].median == pytest.approx(0.5)
    assert table["morph"]["loss_reduction_vs_int4_reference"].median == pytest.approx(0.5)
    assert table["int4"]["loss_reduction_vs_int4_full"].median == pytest.approx(0.0)


def test_build_report_writes_files_json_and_table_rows(results, tmp_path):
    paths = build_report(results, tmp_path / "out")
    names = sorted(p.name for p in paths.plots)
    assert names == ["quality_vs_p95_ttft.png", "timeline_fp.png", "timeline_int4.png", "timeline_morph.png",
                     "ttft_cdf.png"]
    for p in (paths.report_md, paths.results_json, *paths.plots):
        assert p.is_file() and p.stat().st_size > 0
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths.plots)

    data = json.loads(paths.results_json.read_text())
    assert data["settings"]["slo_ttft_s"] == 0.75
    assert data["summary"]["int4"]["ttft_s.p50"] == {"median": 0.375, "min": 0.25, "max": 0.5, "n": 3}
    assert len(data["runs"]) == 9 and len(data["runs"][0]["requests"]) == 4
    assert data["runs"][0]["requests"][0]["output_text"] == FP_TEXT
    assert data["runs"][0]["timeline"][1] == {"t_s": 1, "kv_usage": 0.2, "kv_capacity_blocks": 110,
                                              "quantized_layers": 0.0, "preemptions_total": 1.0}

    md = paths.report_md.read_text()
    assert "| fp | 1.125 [1–1.25] | 1.125 [1–1.25] | 1.125 [1–1.25] | 0.5 | 0.5 | 0.5 |" in md
    assert "| int4 | 0.375 [0.25–0.5] |" in md
    assert "| morph | 0.833 | 0.833 | 0.5 | 0.5 |" in md  # the quality table
    assert "| fp | 1 | 0 | " in md  # SLO table: every request violated the SLO, so no goodput
    assert "TTFT SLO: 0.75 s" in md and "python -m ops.bench.run_all --quick" in md and "fake data" in md
    assert "## Machine" in md and "![ttft_cdf.png](ttft_cdf.png)" in md


def test_build_report_needs_runs_and_a_full_precision_run(results, tmp_path):
    with pytest.raises(BenchmarkInputError, match="no runs"):
        build_report(BenchResults(results.settings, ()), tmp_path)
    with pytest.raises(BenchmarkInputError, match="full-precision"):
        score_quality(results.runs, "missing", {})


def test_the_busiest_replicas_share_of_requests_shows_how_a_fleet_spread_its_load(results):
    even = SystemRun(system="fleet", repeat=0, records=(), generate_calls=(50, 50))
    packed = SystemRun(system="fleet", repeat=1, records=(), generate_calls=(90, 10))
    assert even.busiest_share == 0.5 and packed.busiest_share == 0.9
    assert SystemRun(system="one", repeat=0, records=(), generate_calls=(7,)).busiest_share is None
    assert SystemRun(system="none", repeat=0, records=()).busiest_share is None
    table = summarize(BenchResults(results.settings, (*results.runs, even, packed)))
    assert table["fleet"]["busiest_replica_share"].median == pytest.approx(0.7)
    assert table["fp"]["busiest_replica_share"].n == 0


def test_what_queued_requests_waited_for_is_shown_as_the_share_waiting_for_memory(results):
    compute_bound = SystemRun(system="fleet", repeat=0, records=(), waiting_rounds={"memory": 1, "compute": 3})
    memory_bound = SystemRun(system="fleet", repeat=1, records=(), waiting_rounds={"memory": 6, "compute": 2,
                                                                                     "unknown": 4})
    assert compute_bound.memory_wait_share == 0.25 and memory_bound.memory_wait_share == 0.75
    assert SystemRun(system="calm", repeat=0, records=(), waiting_rounds={"unknown": 2}).memory_wait_share is None
    assert SystemRun(system="none", repeat=0, records=()).memory_wait_share is None
    table = summarize(BenchResults(results.settings, (*results.runs, compute_bound, memory_bound)))
    assert table["fleet"]["memory_wait_share"].median == pytest.approx(0.5)
    assert table["fleet"]["waiting_rounds"].median == pytest.approx(8)  # 4 and 12 rounds with a queue
    assert table["fp"]["waiting_rounds"].n == 0


def test_misses_are_split_by_the_burst_window_each_request_arrived_in(results, tmp_path):
    import dataclasses

    from ops.bench.metrics import compute_run_metrics, misses_by_window

    fp = results.runs_of("fp")[0]  # requests scheduled at 0, 1, 2, 3 s, every one over the 0.75 s SLO
    assert misses_by_window(fp.records, 0.75, (0.0, 2.0)) == (2, 2)
    assert misses_by_window(fp.records, 0.75, (0.5, 2.5)) == (3, 1)  # before the first window: the first
    assert misses_by_window(fp.records, 0.75, ()) == ()
    assert sum(misses_by_window(fp.records, 0.75, (0.0, 1.5, 3.0))) == compute_run_metrics(fp.records, 0.75).slo_violations
    failed = dataclasses.replace(results.runs_of("int4")[0].records[3], status=500, first_token_s=None)
    assert misses_by_window((*results.runs_of("int4")[0].records[:3], failed), 0.75, (0.0, 2.0)) == (0, 1)

    windowed = dataclasses.replace(results, settings=dataclasses.replace(results.settings, window_starts_s=(0.0, 2.0)))
    paths = build_report(windowed, tmp_path / "out")
    md = paths.report_md.read_text()
    assert "| system | window 1 (from 0.0 s) | window 2 (from 2.0 s) |" in md
    assert "| fp | 2 | 2 |" in md and "| int4 | 0 | 0 |" in md
    assert json.loads(paths.results_json.read_text())["runs"][0]["misses_by_window"] == [2, 2]
    assert "by burst window" not in build_report(results, tmp_path / "one").report_md.read_text()  # one window: no table


def test_a_fleets_layer_moves_are_tabled_and_kept_per_run(results, tmp_path):
    from ops.bench.metrics import LayerMoves

    churn = SystemRun(system="fleet", repeat=0, records=results.runs_of("fp")[0].records,
                      layer_moves=LayerMoves(morphs=6, restores=5, restores_undone=3))
    calm = SystemRun(system="fleet", repeat=1, records=results.runs_of("fp")[0].records,
                     layer_moves=LayerMoves(morphs=2, restores=2, restores_undone=1))
    with_fleet = BenchResults(results.settings, (*results.runs, churn, calm))
    table = summarize(with_fleet)
    assert table["fleet"]["layer_moves.restores_undone"].median == pytest.approx(2)
    assert table["fp"]["layer_moves.restores"].n == 0
    paths = build_report(with_fleet, tmp_path / "out")
    assert "| fleet | 4 [2–6] | 4 [2–5] | 2 [1–3] |" in paths.report_md.read_text()
    runs = json.loads(paths.results_json.read_text())["runs"]
    assert runs[-2]["layer_moves"] == {"morphs": 6, "restores": 5, "restores_undone": 3}
    assert runs[0]["layer_moves"] is None


def test_the_directive_waits_of_a_run_are_tabled_and_kept_per_run(results, tmp_path):
    from deployments.directive_wait import DirectiveWait

    slow, fast = DirectiveWait(), DirectiveWait()
    for s in (0.0001, 0.0001, 0.2, 0.2):
        slow.observe(s)
    fast.observe(0.0001)
    runs = [SystemRun(system="fleet", repeat=i, records=results.runs_of("fp")[0].records, directive_wait=w.as_dict())
            for i, w in enumerate((slow, fast))]
    with_fleet = BenchResults(results.settings, (*results.runs, *runs))
    table = summarize(with_fleet)
    assert table["fleet"]["directive_wait.over_100ms_share"].max == pytest.approx(0.5)
    assert table["fleet"]["directive_wait.p95_s"].max == 0.25
    assert table["fp"]["directive_wait.mean_s"].n == 0
    paths = build_report(with_fleet, tmp_path / "out")
    assert "a round's wait for its directive, mean (s)" in paths.report_md.read_text()
    assert json.loads(paths.results_json.read_text())["runs"][-2]["directive_wait"]["counts"] == slow.as_dict()["counts"]


def test_the_pressure_routers_decisions_are_tabled_and_kept_per_run(results, tmp_path):
    from ops.bench.run_one import routed_during

    # The replay's decisions are the difference of two readings; a restarted ingress's (a count fell) is unknown.
    assert routed_during({"fits": 3}, {"fits": 10, "overflow": 4, "other_call": 0}) == {"fits": 7, "overflow": 4}
    assert routed_during({"fits": 3}, {"fits": 1}) is None and routed_during(None, {"fits": 1}) is None
    records = results.runs_of("fp")[0].records
    runs = [SystemRun(system="fleet", repeat=0, records=records, router_decisions={"fits": 100, "overflow": 12}),
            SystemRun(system="fleet", repeat=1, records=records, router_decisions={"fits": 120, "stale": 6})]
    with_fleet = BenchResults(results.settings, (*results.runs, *runs))
    table = summarize(with_fleet)
    assert table["fleet"]["router.overflow"].median == pytest.approx(6) and table["fleet"]["router.stale"].max == 6
    assert table["fp"]["router.fits"].n == 0  # no pressure router: no count, not zero
    paths = build_report(with_fleet, tmp_path / "out")
    assert "| fleet | 110 [100–120] | 0 | 0 | 6 [0–12] | 3 [0–6] | 0 |" in paths.report_md.read_text()
    assert json.loads(paths.results_json.read_text())["runs"][-1]["router_decisions"] == {"fits": 120, "stale": 6}
