"""The fleet-overhead benchmark's pure parts: its load and its summary (the runs start real servers)."""
from __future__ import annotations

import pytest

from ops.bench import BenchmarkInputError
from ops.bench.fleet_overhead import light_load, summarize


def test_the_light_load_is_seeded_poisson_within_its_bounds():
    load = light_load(rate_rps=4.0, duration_s=30.0, seed=3)
    assert load == light_load(rate_rps=4.0, duration_s=30.0, seed=3)
    assert 80 <= len(load) <= 160  # ~120 expected at 4/s for 30 s
    assert all(64 <= r.prompt_tokens <= 192 and r.output_tokens == 20 for r in load)
    assert [r.arrival_s for r in load] == sorted(r.arrival_s for r in load) and load[-1].arrival_s < 30.0
    with pytest.raises(BenchmarkInputError, match="positive"):
        light_load(rate_rps=0.0, duration_s=10.0)


def test_the_summary_is_the_median_of_repeats_and_its_ratio_to_the_baseline():
    fig = lambda ttft, itl: {"ttft_p50_ms": ttft, "itl_p50_ms": itl, "tpot_p50_ms": itl, "failed": 0}  # noqa: E731
    runs = [{"system": "base", "figures": fig(100, 20)}, {"system": "other", "figures": fig(120, 22)},
            {"system": "base", "figures": fig(110, 24)}, {"system": "other", "figures": fig(90, 30)},
            {"system": "base", "figures": fig(300, 22)}, {"system": "other", "figures": fig(132, 26)}]
    summary = summarize(runs, "base")
    assert summary["base"]["ttft_p50_ms"] == 110 and summary["base"]["repeats"] == 3
    assert summary["other"]["ttft_p50_ms"] == 120 and summary["other"]["itl_p50_ms"] == 26
    assert summary["other"]["ttft_p50_ms_vs_baseline"] == pytest.approx(120 / 110, abs=1e-3)
    assert summary["other"]["itl_p50_ms_vs_baseline"] == pytest.approx(26 / 22, abs=1e-3)
