"""PrefillRate: the prefill speed a replica reports to the pressure-aware router."""
from __future__ import annotations

import pytest

from engine.step_stats import PrefillRate


def test_prefill_rate_starts_at_the_first_prefill_and_smooths_the_rest():
    rate = PrefillRate(smoothing=0.5)
    rate.record(0, 0.05)  # a decode-only round says nothing about prefill speed
    assert rate.tokens_per_s == 0.0
    rate.record(400, 0.5)
    assert rate.tokens_per_s == pytest.approx(800.0)
    rate.record(100, 0.25)  # a mixed round, or one with a gap before its step: 400 tokens/s
    assert rate.tokens_per_s == pytest.approx(600.0)
    rate.record(100, 0.0)  # no measurable time: ignored, not infinite
    assert rate.tokens_per_s == pytest.approx(600.0)
    with pytest.raises(ValueError, match="smoothing"):
        PrefillRate(smoothing=0.0)
