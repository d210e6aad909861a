"""The offline throughput benchmark: run order, numbers, prompts, and a real end-to-end run of our
engine and HF generate as worker processes on a tiny random model (vLLM is left out: its start
alone takes minutes)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ops.bench import BenchmarkInputError
from ops.bench import throughput
from ops.bench.throughput_report import RunRecord, markdown_table, ratios, summarize
from ops.bench.throughput_workers import WorkerFailed, WorkerProcess, WorkerSpec
from ops.bench.throughput_workload import Scenario, build_workloads, random_prompts, sharegpt_prompts


def test_interleaved_order_rotates_backends_and_respects_repeats():
    order = throughput.interleaved_order({"ours": 3, "hf": 3, "vllm": 2}, ["a", "b"])
    assert order[:6] == [(0, "a", "ours"), (0, "a", "hf"), (0, "a", "vllm"),
                         (0, "b", "ours"), (0, "b", "hf"), (0, "b", "vllm")]
    assert order[6:9] == [(1, "a", "hf"), (1, "a", "vllm"), (1, "a", "ours")]
    assert [o for o in order if o[0] == 2] == [(2, "a", "ours"), (2, "a", "hf"), (2, "b", "ours"), (2, "b", "hf")]
    assert sum(1 for o in order if o[2] == "vllm") == 4


def test_plan_repeats_honours_skips_and_quick():
    args = throughput.parse_args(["--skip-vllm", "--repeats", "4"])
    assert throughput.plan_repeats(args) == {"ours": 4, "hf": 4}
    args = throughput.parse_args(["--quick", "--skip-hf"])
    assert throughput.plan_repeats(args) == {"ours": 1, "vllm": 1}
    with pytest.raises(BenchmarkInputError, match="--repeats"):
        throughput.parse_args(["--repeats", "0"])


def _rec(backend, scenario, repeat, elapsed, prompt=100, gen=200, rss=1024):
    return RunRecord(backend, scenario, repeat, elapsed, elapsed / 2, prompt, gen, rss)


def test_summaries_take_medians_and_peak_rss_and_ratios_compare_medians():
    records = [_rec("ours", "a", 0, 1.0, rss=2048), _rec("ours", "a", 1, 4.0, rss=4096), _rec("ours", "a", 2, 2.0),
               _rec("vllm", "a", 0, 4.0), _rec("vllm", "a", 1, 4.0)]
    by = {s.backend: s for s in summarize(records)}
    assert by["ours"].gen_tok_s == pytest.approx(100.0)  # median of 200, 50, 100
    assert (by["ours"].gen_tok_s_min, by["ours"].gen_tok_s_max) == (pytest.approx(50.0), pytest.approx(200.0))
    assert by["ours"].total_tok_s == pytest.approx(150.0)
    assert by["ours"].peak_rss_mib == pytest.approx(4.0)
    assert by["ours"].gen_tok_per_cpu_s == pytest.approx(200.0)
    assert ratios(summarize(records)) == {"a": {"gen_ours/vllm": pytest.approx(2.0), "total_ours/vllm": pytest.approx(2.0),
                                                "per_cpu_s_ours/vllm": pytest.approx(2.0)}}
    table = markdown_table(summarize(records), [Scenario("a", "tiny", 1, 1, 1)])
    assert "| (a) tiny | MorphServe (ours) | 100.0 [50.0, 200.0] | 150.0 | 200.0 | 2.00 | 3 | 4 |" in table


def test_sharegpt_prompts_have_exact_lengths_and_differ():
    def encode(text):
        return [ord(c) % 97 for c in text]

    prompts = sharegpt_prompts(encode, n=4, length=300)
    assert [len(p) for p in prompts] == [300] * 4
    assert len({tuple(p) for p in prompts}) == 4


def test_random_prompts_are_seeded_and_in_vocab():
    a, b = random_prompts(50, 3, 7, seed=1), random_prompts(50, 3, 7, seed=1)
    assert a == b and all(0 <= t < 50 for p in a for t in p)
    assert random_prompts(50, 3, 7, seed=2) != a


def test_workload_longer_than_the_model_context_is_refused(tiny_model_dir):
    with pytest.raises(BenchmarkInputError, match="positions"):
        build_workloads(tiny_model_dir, (Scenario("b", "long", 1, 600, 8),))


def test_worker_error_reaches_the_driver_with_the_log(tmp_path):
    spec = WorkerSpec("ours", Path(sys.executable), ("--model-dir", str(tmp_path / "missing"), "--threads", "1",
                                                    "--max-model-len", "64", "--kv-gib", "0.01"), tmp_path / "w.log")
    worker = WorkerProcess(spec)
    try:
        with pytest.raises(WorkerFailed, match="does not exist"):
            worker.wait_ready(timeout_s=120)
    finally:
        worker.close()


def test_end_to_end_ours_and_hf_on_a_tiny_model(tiny_model_dir, tmp_path, monkeypatch):
    tiny = (Scenario("a", "4 x 8 x 5", 4, 8, 5), Scenario("b", "2 x 40 x 3", 2, 40, 3))
    monkeypatch.setattr(throughput, "QUICK", tiny)
    monkeypatch.setattr(throughput, "RESULTS_DIR", tmp_path)
    out = tmp_path / "r.json"
    result = throughput.main(["--model", str(tiny_model_dir), "--quick", "--skip-vllm", "--threads", "1",
                              "--kv-gib", "0.05", "--timeout", "300", "--out", str(out)])
    assert result["failed"] == {}
    saved = json.loads(out.read_text())
    runs = {(r["backend"], r["scenario"]): r for r in saved["runs"]}
    assert set(runs) == {("ours", "a"), ("hf", "a"), ("ours", "b"), ("hf", "b")}
    for (backend, scenario), r in runs.items():
        s = tiny[0] if scenario == "a" else tiny[1]
        assert r["generated_tokens"] == s.num_requests * s.max_tokens
        assert r["prompt_tokens"] == s.num_requests * s.prompt_tokens
        assert r["elapsed_s"] > 0 and r["cpu_s"] > 0 and r["vmhwm_kib"] > 0
    assert set(saved["ratios"]) == {"a", "b"}
    assert saved["scenarios"][0]["prompt_source"] == "random"
