"""OverloadGate: closed from an engine refusal until a generation ends or hold_s passes."""
from __future__ import annotations

import pytest

from deployments.overload_gate import OverloadGate
from engine.errors import EngineOverloadedError


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_when_a_generation_ends():
    clock = Clock()
    gate = OverloadGate(0.5, clock)
    gate.check()  # open at start
    gate.refused()
    clock.now += 0.1
    with pytest.raises(EngineOverloadedError):
        gate.check()
    gate.ended()
    gate.check()
    assert gate.refused_here == 1


def test_opens_after_hold_s_for_a_probe_and_closes_again_on_its_refusal():
    clock = Clock()
    gate = OverloadGate(0.5, clock)
    gate.refused()
    clock.now += 0.49
    assert gate.is_closed()
    clock.now += 0.02
    gate.check()  # the probe goes through
    gate.refused()  # ... and is refused: closed again, for another hold_s
    assert gate.is_closed()
    clock.now += 0.49
    assert gate.is_closed()


def test_zero_hold_never_closes_and_negative_is_an_error():
    gate = OverloadGate(0.0, Clock())
    gate.refused()
    gate.check()
    with pytest.raises(ValueError, match="hold_s"):
        OverloadGate(-1.0)
