"""Trace loaders (Azure, BurstGPT), window selection and scaling, ShareGPT prompt fitting."""
from __future__ import annotations

import json

import pytest

from ops.bench import BenchmarkInputError
from ops.bench.prompts import build_prompts, fit_prompt, load_sharegpt_pairs, with_system_prompts
from ops.bench.traces import Trace, TraceRequest, load_azure_trace, load_burstgpt_trace, load_trace
from ops.bench.workload import WorkloadSpec, arrival_counts, build_workload, select_window

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:46.6805910,10,0
2023-11-16 18:15:48.2224670,879,55
"""

BURSTGPT = """Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type
5.0, ChatGPT, 472, 18, 490, Conversation log
3.5, GPT-4, 1000, 0, 1000, Conversation log
7.25, ChatGPT, 20, 30, 50, API log
4.0, ChatGPT, 0, 0, 0, Conversation log
"""


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_azure_loader_relative_sorted_and_drops_zero_rows(tmp_path):
    trace = load_azure_trace(_write(tmp_path, "azure.csv", AZURE))
    assert trace.name == "azure" and trace.dropped_rows == 1
    assert [(r.prompt_tokens, r.output_tokens) for r in trace.requests] == [(374, 44), (879, 55), (396, 109)]
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals[0] == 0.0
    assert arrivals[1] == pytest.approx(48.222467 - 46.68059, abs=1e-6)
    assert arrivals[2] == pytest.approx(50.995169 - 46.68059, abs=1e-6)


def test_burstgpt_loader_tolerates_spaces_drops_failures_and_filters(tmp_path):
    path = _write(tmp_path, "burst.csv", BURSTGPT)
    trace = load_trace(path)  # detected from the header
    assert trace.name == "burstgpt" and trace.dropped_rows == 2
    assert trace.requests == (TraceRequest(0.0, 472, 18), TraceRequest(2.25, 20, 30))
    only_conv = load_burstgpt_trace(path, log_type="Conversation log")
    assert only_conv.requests == (TraceRequest(0.0, 472, 18),)


def test_missing_column_is_a_clear_error(tmp_path):
    path = _write(tmp_path, "bad.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,3\n")
    with pytest.raises(BenchmarkInputError, match="GeneratedTokens"):
        load_azure_trace(path)
    with pytest.raises(BenchmarkInputError, match="neither"):
        load_trace(_write(tmp_path, "other.csv", "a,b\n1,2\n"))
    with pytest.raises(BenchmarkInputError, match="not like"):
        load_azure_trace(_write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n"))


def _trace(arrivals, prompt=100, output=50) -> Trace:
    return Trace("test", "mem", tuple(TraceRequest(a, prompt, output) for a in arrivals))


def test_arrival_counts_bins():
    assert arrival_counts([0.0, 0.5, 1.0, 2.9]).tolist() == [2, 1, 1]
    assert arrival_counts([0.0, 0.5], span_s=4).tolist() == [2, 0, 0, 0]


def test_window_rule_picks_highest_peak_to_mean_with_non_trivial_mean():
    # 0-9 s: 1 req/s (ratio 1). 10-19 s: 2 req/s with one 12-request burst at 15 s.
    # 30-39 s: a single lone request (ratio 10, but mean 0.1 is below half the trace mean).
    arrivals = [float(s) for s in range(10)]
    arrivals += [10 + s + k / 10 for s in range(10) for k in range(2)] + [15.5] * 10
    arrivals += [35.0]
    trace = _trace(sorted(arrivals))
    choice = select_window(trace, window_s=10, min_mean_fraction=0.5)
    # Windows holding second 15 peak at 12; the one with the fewest other requests is [15, 25):
    # 12 + 4 x 2 + 5 idle seconds = 20 requests, mean 2.0, ratio 6 (start 6 has 26, start 14 has 22).
    assert choice.offset_s == 15.0
    assert choice.peak_rps == 12.0
    assert choice.mean_rps == pytest.approx(2.0)
    # Without the mean rule a window with one busy second and nine idle ones wins (ratio 10): the
    # earliest such is [19, 29) (second 19 only); [26, 36) (the lone request) ties and comes later.
    lone = select_window(trace, window_s=10, min_mean_fraction=0.0)
    assert (lone.offset_s, lone.peak_rps, lone.mean_rps) == (19.0, 2.0, pytest.approx(0.2))


def test_build_workload_scales_time_and_tokens():
    trace = _trace([0.0, 2.0, 5.0, 12.0, 13.0], prompt=1000, output=7)
    spec = WorkloadSpec(window_s=10, offset_s=2.0, time_scale=0.5, prompt_scale=0.1, prompt_min=16,
                        prompt_max=64, output_scale=0.5, output_min=4, output_max=8, max_requests=2)
    w = build_workload(trace, spec)
    # window [2, 12): requests at 2 and 5 -> (0, 3) x 0.5; 1000 x 0.1 = 100 -> 64; round(3.5) = 4
    assert w.requests == (TraceRequest(0.0, 64, 4), TraceRequest(1.5, 64, 4))
    text = w.describe()
    assert "offset 2 s" in text and "x 0.5" in text and "[16, 64]" in text and "2 requests" in text


def test_workload_spec_rejects_bad_parameters():
    with pytest.raises(BenchmarkInputError, match="time_scale"):
        WorkloadSpec(time_scale=0)
    with pytest.raises(BenchmarkInputError, match="prompt_min"):
        WorkloadSpec(prompt_min=10, prompt_max=5)
    with pytest.raises(BenchmarkInputError, match="no requests"):
        build_workload(_trace([0.0, 1.0]), WorkloadSpec(window_s=5, offset_s=100))


def test_real_azure_trace_window(tmp_path):
    from tests.data_helpers import dataset_or_skip

    trace = load_trace(dataset_or_skip("azure_conv"))
    assert len(trace.requests) + trace.dropped_rows == 19366
    w = build_workload(trace, WorkloadSpec(window_s=72))
    assert w.window.peak_to_mean > 2.0 and w.window.mean_rps >= 0.5 * len(trace.requests) / trace.duration_s


# --- prompts ---------------------------------------------------------------------------------------

def _sharegpt(tmp_path, n=30, truncate=False):
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i} " + "word " * i},
                                                {"from": "gpt", "value": f"answer {i}"}]} for i in range(n)]
    convs.insert(3, {"id": "no-gpt", "conversations": [{"from": "human", "value": "alone"}]})
    text = json.dumps(convs, indent=1)
    if truncate:
        text = text[: text.rindex('"id"') + 10]  # cut inside the last conversation, like the wheel's copy
    return _write(tmp_path, "sg.json", text)


def test_sharegpt_selection_is_deterministic_by_seed(tmp_path):
    path = _sharegpt(tmp_path, n=30)
    a = load_sharegpt_pairs(10, seed=1, path=path, keep_fraction=0.3)
    assert a == load_sharegpt_pairs(10, seed=1, path=path, keep_fraction=0.3)
    other_seed = load_sharegpt_pairs(10, seed=2, path=path, keep_fraction=0.3)
    assert [p.conversation_id for p in a] != [p.conversation_id for p in other_seed]
    assert len({p.conversation_id for p in a}) == 10 and "no-gpt" not in {p.conversation_id for p in a}
    assert all(p.reference == "answer " + p.conversation_id[1:] for p in a)
    many = load_sharegpt_pairs(40, seed=1, path=path)  # more than the file holds: repeats, in order
    assert [p.conversation_id for p in many[30:]] == [p.conversation_id for p in many[:10]]


def _char_tokenizer():
    return (lambda s: list(s.encode())), (lambda ids: bytes(ids).decode("utf-8", "ignore"))


def test_fit_prompt_cuts_and_pads_to_token_count():
    encode, decode = _char_tokenizer()
    assert fit_prompt("hello world", 5, encode, decode, ["x"]) == ("hello", 5)
    text, n = fit_prompt("hi", 12, encode, decode, ["abc", "def"])
    assert (text, n) == ("hi\n\nabc\n\ndef"[:12], 12)
    text, n = fit_prompt("é" * 4, 3, encode, decode, [])  # a cut inside a 2-byte character
    assert n <= 3 and text == "é"


def test_build_prompts_one_per_request(tmp_path):
    encode, decode = _char_tokenizer()
    requests = [TraceRequest(0.0, 8, 4), TraceRequest(1.0, 400, 4)]
    prompts = build_prompts(requests, encode, decode, seed=0, path=_sharegpt(tmp_path))
    assert [p.prompt_tokens for p in prompts] == [8, 400] and [p.target_tokens for p in prompts] == [8, 400]
    assert [p.request_index for p in prompts] == [0, 1]
    assert prompts[0].reference.startswith("answer ")


def test_several_windows_do_not_overlap_and_reach_min_requests():
    # Three bursts (12 requests in one second) at 5 s, 35 s and 65 s over a 1 req/s background.
    arrivals = [float(s) for s in range(90)]
    for burst in (5, 35, 65):
        arrivals += [burst + k / 100 for k in range(12)]
    trace = _trace(sorted(arrivals))
    spec = WorkloadSpec(window_s=10, num_windows=2, min_requests=50, gap_s=3.0, time_scale=2.0)
    w = build_workload(trace, spec)
    starts = [win.offset_s for win in w.windows]
    # Two windows hold 2 x (10 + 12) = 44 < 50 requests, so a third is taken; each holds one burst.
    assert len(w.windows) == 3 and len(w.requests) == 66
    assert all(b - a >= 10 for a, b in zip(starts, starts[1:]))
    assert all(any(s <= burst < s + 10 for s in starts) for burst in (5, 35, 65))
    # Replayed one after the other: window k starts at k x (10 s x 2 + 3 s).
    assert w.window_starts_s == (0.0, 23.0, 46.0) and w.duration_s == 66.0
    assert [w.window_of.count(k) for k in range(3)] == [22, 22, 22]
    assert all(w.window_starts_s[k] <= r.arrival_s < w.window_starts_s[k] + 20
               for r, k in zip(w.requests, w.window_of))
    assert w.trace_peak_rps == 13.0  # 12 burst requests + the background one in that second
    with pytest.raises(BenchmarkInputError, match="offset_s"):
        WorkloadSpec(offset_s=1.0, num_windows=2)


def test_system_prompts_are_few_long_and_drawn_for_every_request(tmp_path):
    encode, decode = _char_tokenizer()
    path = _sharegpt(tmp_path, n=120)
    prompts = build_prompts([TraceRequest(float(i), 8, 4) for i in range(40)], encode, decode, seed=0, path=path)
    shared = with_system_prompts(prompts, 3, 50, encode, decode, seed=0, path=path)
    systems = {p.system for p in shared}
    assert len(systems) == 3 and all(len(encode(s)) == 50 for s in systems)
    assert [p.prompt for p in shared] == [p.prompt for p in prompts]  # the prompts themselves unchanged
    assert shared == with_system_prompts(prompts, 3, 50, encode, decode, seed=0, path=path)  # seeded
    assert not systems & {p.prompt for p in prompts}
    with pytest.raises(BenchmarkInputError, match="system prompts"):
        with_system_prompts(prompts, 0, 50, encode, decode, path=path)
