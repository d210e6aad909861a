"""Reaction time (ops/bench/reaction.py) and the load calibration rule (ops/bench/calibration.py)."""
from __future__ import annotations

import pytest

from ops.bench import BenchmarkInputError
from ops.bench.calibration import Capacity, CalibrationRule, calibrate, capacity_from_records
from ops.bench.loadgen import RequestRecord, ServerSample
from ops.bench.reaction import engine_blocked_waits, reaction_times


def _rec(rid, sent, queue, tokens, end, prompt=64, first=None):
    first = tokens[0] if first is None else first
    return RequestRecord(request_id=rid, scheduled_s=sent, sent_s=sent, first_token_s=first,
                         token_times_s=tuple(tokens), end_s=end, status=200, output_text="x" * len(tokens),
                         output_tokens=len(tokens), prompt_tokens=prompt, error=None, queue_s=queue)


# Block size 16; every prompt is 64 tokens = 4 blocks, 65-80 tokens = 5 blocks.
RECORDS = (
    _rec("r0", 0.0, 0.0, [0.1, 0.2], 3.0),  # 66 tokens from 0.2 s: 5 blocks
    _rec("r1", 0.5, 0.0, [0.6], 3.0),  # 5 blocks from 0.6 s; at 0.5 s: 5 + 4 <= 10 fits
    _rec("r2", 1.0, 0.5, [1.6], 3.0),  # at 1.0 s: 10 in use + 4 > 10: did not fit; admitted 1.5 s
    _rec("r3", 1.2, 0.4, [1.7], 3.0),  # arrives while r2 waits: same episode
    _rec("r4", 2.0, 0.0, [2.1], 3.0),  # would not fit by the count but was admitted at once: no episode
)


def test_reaction_ends_when_capacity_grows_before_admission():
    samples = [ServerSample(0.0, {"kv_capacity_blocks": 10}), ServerSample(1.1, {"kv_capacity_blocks": 12}),
               ServerSample(1.3, {"kv_capacity_blocks": 20})]
    summary = reaction_times(RECORDS, samples, block_size=16)
    (episode,) = summary.episodes
    assert episode.first_request == "r2" and episode.num_waiting == 2
    assert (episode.capacity_at_arrival, episode.blocks_needed) == (10, 14)
    assert episode.by == "capacity" and episode.reaction_s == pytest.approx(0.3)  # 12 blocks at 1.1 s is not enough
    assert summary.median_s == summary.max_s == pytest.approx(0.3)
    assert summary.admission_source == "server queue time"


def test_static_capacity_reacts_only_by_admission_and_threshold_filters_short_waits():
    summary = reaction_times(RECORDS, [], block_size=16, fixed_capacity_blocks=10)
    (episode,) = summary.episodes
    assert episode.by == "admission" and episode.reaction_s == pytest.approx(0.5)
    assert reaction_times(RECORDS, [], block_size=16, fixed_capacity_blocks=10, stall_threshold_s=0.6).episodes == ()
    # Enough capacity for everyone: nothing to react to.
    assert reaction_times(RECORDS, [], block_size=16, fixed_capacity_blocks=100).episodes == ()


def test_without_server_queue_time_admission_is_the_first_token():
    records = [_rec(r.request_id, r.sent_s, None, r.token_times_s, r.end_s) for r in RECORDS]
    summary = reaction_times(records, [], block_size=16, fixed_capacity_blocks=10)
    assert summary.admission_source == "first token (upper bound)"
    assert [e.first_request for e in summary.episodes] == ["r2", "r4"]  # r4's first token came 0.1 s later
    summary = reaction_times(records, [], block_size=16, fixed_capacity_blocks=10, stall_threshold_s=0.15)
    assert [e.first_request for e in summary.episodes] == ["r2"]
    assert summary.episodes[0].reaction_s == pytest.approx(0.6)  # first token at 1.6 s


def test_two_bursts_give_two_episodes():
    later = [_rec(f"b{r.request_id}", r.sent_s + 10, r.queue_s, [t + 10 for t in r.token_times_s], r.end_s + 10)
             for r in RECORDS]
    summary = reaction_times((*RECORDS, *later), [], block_size=16, fixed_capacity_blocks=10)
    assert [e.first_request for e in summary.episodes] == ["r2", "br2"]
    assert summary.median_s == pytest.approx(0.5)


# --- calibration --------------------------------------------------------------------------------

def _capacity(rps: float) -> Capacity:
    return Capacity(requests_per_s=rps, output_tokens_per_s=rps * 30, concurrency=8, num_requests=32,
                    saturated_s=10.0, system="fp")


def test_calibration_scales_mean_load_to_a_fraction_of_capacity():
    cal = calibrate(_capacity(2.0), trace_mean_rps=4.0, trace_peak_rps=16.0, rule=CalibrationRule(0.5, 1.5, 0.9))
    assert cal.mean_load_fraction == 0.5 and cal.time_scale == pytest.approx(4.0)  # replay mean 1 req/s
    assert cal.replay_mean_rps == pytest.approx(1.0) and cal.peak_load == pytest.approx(2.0)
    # A machine 10x slower gets 10x the time scale and the same relative load.
    slow = calibrate(_capacity(0.2), trace_mean_rps=4.0, trace_peak_rps=16.0, rule=CalibrationRule(0.5, 1.5, 0.9))
    assert slow.time_scale == pytest.approx(40.0) and slow.peak_load == pytest.approx(cal.peak_load)
    assert "x 4.000" in cal.describe() and "2.00 x capacity" in cal.describe()


def test_calibration_raises_mean_load_until_bursts_exceed_capacity_but_caps_it():
    rule = CalibrationRule(mean_load_fraction=0.5, min_burst_load=1.5, max_mean_load_fraction=0.9)
    flatter = calibrate(_capacity(1.0), trace_mean_rps=4.0, trace_peak_rps=8.0, rule=rule)  # peak/mean 2
    assert flatter.mean_load_fraction == pytest.approx(0.75) and flatter.peak_load == pytest.approx(1.5)
    flat = calibrate(_capacity(1.0), trace_mean_rps=4.0, trace_peak_rps=5.0, rule=rule)  # peak/mean 1.25
    assert flat.mean_load_fraction == 0.9 and flat.peak_load == pytest.approx(1.125)
    assert "too flat" in flat.describe()
    with pytest.raises(BenchmarkInputError):
        CalibrationRule(mean_load_fraction=0.95, max_mean_load_fraction=0.9)
    with pytest.raises(BenchmarkInputError, match="completed nothing"):
        calibrate(_capacity(0.0), 4.0, 8.0)


def test_capacity_counts_completions_while_the_pool_is_full():
    # 6 requests, 2 in flight: the pool is full until the 5th completion (6 - 2 + 1).
    ends = [1.0, 2.0, 3.0, 4.0, 5.0, 7.0]
    records = [_rec(f"p{i}", 0.0 if i < 2 else ends[i - 2], 0.0, [end - 0.5, end], end) for i, end in enumerate(ends)]
    cap = capacity_from_records(records, concurrency=2, system="fp")
    assert cap.requests_per_s == pytest.approx(5 / 5.0) and cap.output_tokens_per_s == pytest.approx(10 / 5.0)
    with pytest.raises(BenchmarkInputError, match="never full"):
        capacity_from_records(records[:2], concurrency=2, system="fp")


def test_engine_blocked_waits_one_value_per_change():
    values = [None, 0.2, 0.2, None, 0.2, 0.05, 0.05]
    samples = [ServerSample(float(i), {} if v is None else {"last_blocked_for_s": v}) for i, v in enumerate(values)]
    assert engine_blocked_waits(samples) == (0.2, 0.05)
