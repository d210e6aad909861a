"""The one process-wide record of the quantized matmuls' row thresholds (engine/quant/dispatch.py)."""
from __future__ import annotations

import pytest
import torch

from engine.quant import Int8Linear, quantize_int8
from engine.quant.dispatch import AmxDispatch, amx_dispatch, set_amx_dispatch, update_amx_dispatch


@pytest.fixture(autouse=True)
def restore():
    before = amx_dispatch()
    yield
    set_amx_dispatch(before)


def test_update_changes_one_rung_and_returns_the_record_it_replaces():
    first = AmxDispatch(int4_min_rows=8, int8_min_rows=1)
    set_amx_dispatch(first)
    assert update_amx_dispatch(int4_min_rows=None) is first
    assert amx_dispatch() == AmxDispatch(int4_min_rows=None, int8_min_rows=1)
    assert set_amx_dispatch(first) == AmxDispatch(None, 1) and amx_dispatch() is first


def test_thresholds_below_one_row_are_rejected():
    with pytest.raises(ValueError, match="int8_min_rows"):
        AmxDispatch(int8_min_rows=0)
    with pytest.raises(TypeError):
        update_amx_dispatch(int2_min_rows=1)


def test_never_means_torchs_kernel_for_every_row_count():
    set_amx_dispatch(AmxDispatch(None, None))
    lin = Int8Linear(quantize_int8(torch.randn(64, 128) * 0.05))
    x = torch.randn(5, 128).to(torch.bfloat16)
    assert torch.equal(lin(x), torch.ops.aten._weight_int8pack_mm(x, lin.qweight, lin.scales.bfloat16()))
