"""ops/bench/fleet_pooled.py: pairs read from run folders, counted per run and pooled; the drift check."""
from __future__ import annotations

import json

import pytest

from ops.bench import fleet_pooled
from ops.bench.goals import FleetPair
from ops.bench.systems import FLEET_BASELINE, FLEET_PRESSURE


def run(system: str, repeat: int, misses: int, layer_s: float | None, by_window: list[int] | None = None,
        tpot: float = 0.1) -> dict:
    return {"system": system, "repeat": repeat, "metrics": {"slo_violations": float(misses), "tpot_s.p50": tpot},
            "quantized_layer_s": layer_s, "misses_by_window": by_window}


def write_folder(root, name: str, runs: list[dict], machine) -> object:
    folder = root / name
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"machine": machine, "runs": runs}))
    return folder


ABBA = [run(FLEET_BASELINE, 0, 10, 100.0, [6, 4]), run(FLEET_PRESSURE, 0, 8, 90.0, [7, 1]),  # goal met
        run(FLEET_PRESSURE, 1, 12, 80.0, [9, 3], tpot=0.2),  # more misses
        run(FLEET_BASELINE, 1, 7, 95.0, [5, 2]),
        run(FLEET_BASELINE, 2, 5, 100.0), run(FLEET_PRESSURE, 2, 5, None)]  # equal; not scored, no windows


def test_a_folder_gives_its_pairs_by_repeat_and_its_baseline_runs_in_schedule_order(tmp_path):
    folder = write_folder(tmp_path, "fleet-a", ABBA, {"torch CPU capability": "AVX2"})
    pairs, drift = fleet_pooled.read_folder(folder)
    assert [(p.system, p.capability) for p in pairs] == [(FLEET_PRESSURE, "AVX2")]
    assert pairs[0].pairs == (FleetPair((10, 8), (100.0, 90.0)), FleetPair((7, 12), (95.0, 80.0)),
                              FleetPair((5, 5), (100.0, None)))
    assert pairs[0].first_window == ((6, 7), (5, 9))  # repeat 2's runs have no split by window
    assert pairs[0].tpot == ((0.1, 0.1), (0.1, 0.2), (0.1, 0.1))
    assert drift == [(10, 7)]  # the third baseline run has no successor in its folder
    assert [fleet_pooled.goal_met(p) for p in pairs[0].pairs] == [True, False, False]


def test_a_run_without_its_baseline_repeat_is_left_unpaired(tmp_path):
    runs = [run(FLEET_BASELINE, 0, 3, 10.0), run(FLEET_PRESSURE, 0, 2, 5.0), run(FLEET_PRESSURE, 1, 9, 5.0)]
    pairs, _ = fleet_pooled.read_folder(write_folder(tmp_path, "fleet-b", runs, {}))
    assert pairs[0].pairs == (FleetPair((3, 2), (10.0, 5.0)),)
    assert pairs[0].capability == fleet_pooled.UNKNOWN_CAPABILITY


def test_an_early_report_that_recorded_the_machine_as_text_still_gives_its_capability(tmp_path):
    machine = "cpu: cpu capability AVX512, flags avx2,avx512f, native bf16 yes"
    pairs, _ = fleet_pooled.read_folder(write_folder(tmp_path, "fleet-c", ABBA, machine))
    assert pairs[0].capability == "AVX512"


def test_pooled_lines_count_each_run_and_pool_them_per_machine_and_overall(tmp_path):
    found, drift = [], []
    for name, capability in (("fleet-a", "AVX2"), ("fleet-b", "AVX512")):
        pairs, aa = fleet_pooled.read_folder(write_folder(tmp_path, name, ABBA, {"torch CPU capability": capability}))
        found += pairs
        drift += aa
    lines = fleet_pooled.pooled_lines(found, drift)
    rows = [line for line in lines if line.startswith("| fleet-")]
    assert rows == [f"| fleet-a | AVX2 | {FLEET_PRESSURE} | 3 | 1 fewer / 1 more / 1 equal | 2 of 2 | 1 |",
                    f"| fleet-b | AVX512 | {FLEET_PRESSURE} | 3 | 1 fewer / 1 more / 1 equal | 2 of 2 | 1 |"]
    overall = next(line for line in lines if line.startswith("- all machines"))
    assert "(6 pairs): SLO misses fewer in 2, more in 2, equal in 2" in overall
    assert "both fewer in 2 of 6; SLO misses in the first burst window (4 pairs): fewer 0, more 4, equal 0" in overall
    # Repeat 1 stepped slower with fewer layer-seconds; repeat 2 has no layer-seconds to compare.
    assert overall.endswith("TPOT P50 higher in 2 of 6 pairs (2 of the 4 with fewer layer-seconds, 0 of the 0 with more)")
    assert sum(line.startswith("- AVX") for line in lines) == 2
    assert lines[-1].startswith("- drift (A/A: a baseline run against the next one of the same folder, 2 pairs): "
                                "the later run missed fewer 2, more 0, equal 0")


def test_the_published_fleet_runs_all_parse_and_pair():
    folders = fleet_pooled.published_folders()
    assert folders, "no published fleet run found"
    for folder in folders:
        pairs, _ = fleet_pooled.read_folder(folder)
        assert pairs and all(run.pairs for run in pairs), f"{folder.name} has no fleet system paired with the baseline"


def test_the_command_names_a_folder_without_results_and_writes_the_report(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        fleet_pooled.main([str(tmp_path)])
    assert exit_info.value.code == 2
    assert "no results.json in" in capsys.readouterr().err
    folder = write_folder(tmp_path, "fleet-a", ABBA, {"torch CPU capability": "AVX2"})
    out = tmp_path / "pooled.md"
    assert fleet_pooled.main([str(folder), "--out", str(out)]) == 0
    assert out.read_text().splitlines() == capsys.readouterr().out.splitlines()
