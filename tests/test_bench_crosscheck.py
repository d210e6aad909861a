"""The `vllm bench serve` cross-check's pure parts: its command line, dataset, result parsing, verdict;
and the probe's request sampling."""
from __future__ import annotations

import json

from ops.bench.crosscheck import (CrossCheck, crosscheck_requests, describe, parse_vllm_result, vllm_bench_command,
                                  write_dataset)
from ops.bench.loadgen import LoadRequest
from ops.bench.probe import probe_requests

REQUESTS = [LoadRequest(f"req-{i}", scheduled_s=float(i), prompt=f"prompt {i}", max_tokens=4 + i) for i in range(10)]


def test_command_dataset_and_result(tmp_path):
    chosen = crosscheck_requests(REQUESTS, 5)
    assert [r.prompt for r in chosen] == ["prompt 0", "prompt 2", "prompt 4", "prompt 6", "prompt 8"]
    write_dataset(chosen, tmp_path / "x.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert rows[1] == {"prompt": "prompt 2", "output_tokens": 6}
    cmd = vllm_bench_command("/v/bin/python", "http://127.0.0.1:9", "m", "/hf", tmp_path / "x.jsonl", 5, 4,
                             tmp_path, "r.json")
    text = " ".join(cmd)
    for flag in ("--backend openai-chat", "--dataset-name custom", "--custom-output-len -1", "--skip-chat-template",
                 "--max-concurrency 4", "--request-rate inf", "--ignore-eos", "--num-prompts 5", "--disable-shuffle"):
        assert flag in text
    assert "vllm.benchmarks.serve" in cmd[2]  # vLLM's own `bench serve` entry point
    (tmp_path / "r.json").write_text(json.dumps({"median_ttft_ms": 100.0, "median_tpot_ms": 50.0}))
    assert parse_vllm_result(tmp_path / "r.json") == (100.0, 50.0)


def test_verdict_within_tolerance():
    ok = CrossCheck("fp", 105.0, 47.0, 100.0, 50.0, 0.10)
    assert ok.within is True and "within 10%" in describe([ok])[0] and "+5.0%" in describe([ok])[0]
    bad = CrossCheck("fp", 120.0, 50.0, 100.0, 50.0, 0.10)
    assert bad.within is False and "NOT within" in describe([bad])[0]
    failed = CrossCheck("fp", 120.0, 50.0, None, None, 0.10, error="exit code 1")
    assert failed.within is None and "failed" in describe([failed])[0]


def test_probe_requests_spread_over_the_workload():
    probe = probe_requests(REQUESTS, 4)
    assert [r.max_tokens for r in probe] == [4, 6, 9, 11]  # indices 0, 2.5, 5, 7.5 -> 0, 2, 5, 7
    assert len({r.request_id for r in probe}) == 4 and all(r.scheduled_s == 0.0 for r in probe)
    assert len(probe_requests(REQUESTS, 15)) == 15  # more than the workload: it wraps around
