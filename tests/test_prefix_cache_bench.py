"""ops/bench/prefix_cache.py on the real default model, a tiny burst: the cache on prefills fewer prompt
tokens than off and finds the shared system prompts (the benchmark's plumbing, not its timings)."""
from __future__ import annotations

import json

from ops.bench import prefix_cache


def test_the_cache_on_prefills_less_and_finds_the_system_prompts(tmp_path, default_model_dir):
    out = tmp_path / "prefix_cache.json"
    assert prefix_cache.main(["--requests", "4", "--systems", "2", "--system-tokens", "48", "--prompt-tokens", "8",
                              "--max-tokens", "2", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    on, off = result["medians"]["on"], result["medians"]["off"]
    assert off["hit_share"] == 0 and on["hit_share"] > 0.5  # each system prompt's blocks were warmed first
    assert on["prefilled_tokens"] < off["prefilled_tokens"] == sum(result["workload"]["prompt_lengths"][0])
    assert result["machine"]["capability"] and result["on_over_off"]["prefilled_tokens"] < 1
