"""PrefillRate: the prefill speed a replica reports to the pressure-aware router."""
from __future__ import annotations

import pytest

from engine.step_stats import PrefillRate, StepStats


def test_prefill_rate_starts_at_the_first_prefill_and_smooths_the_rest():
    rate = PrefillRate(smoothing=0.5)
    rate.record(StepStats(num_prefill_tokens=0, num_decode_tokens=4, seconds=0.05))  # decode only: says nothing
    assert rate.tokens_per_s == 0.0
    rate.record(StepStats(num_prefill_tokens=400, num_decode_tokens=0, seconds=0.5))
    assert rate.tokens_per_s == pytest.approx(800.0)
    rate.record(StepStats(num_prefill_tokens=100, num_decode_tokens=3, seconds=0.25))  # mixed: 400 tokens/s
    assert rate.tokens_per_s == pytest.approx(600.0)
    with pytest.raises(ValueError, match="smoothing"):
        PrefillRate(smoothing=0.0)
