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


def test_auto_int4_threshold_follows_the_tile_op(monkeypatch):
    """'auto': the AMX op (16-row tiles) from 8 rows, the AVX512-BF16 op from one row; numbers and None stay."""
    import engine.kernels as kernels
    from engine.quant.int4_kernel import AMX_TILE_MIN_ROWS, resolve_int4_min_rows

    assert resolve_int4_min_rows(3) == 3 and resolve_int4_min_rows(None) is None
    monkeypatch.setattr(kernels, "int4_amx_op", lambda: object())
    assert resolve_int4_min_rows("auto") == AMX_TILE_MIN_ROWS == 8
    monkeypatch.setattr(kernels, "int4_amx_op", lambda: None)
    assert resolve_int4_min_rows("auto") == 1


def test_auto_int8_threshold_follows_the_tile_op(monkeypatch):
    """'auto': the AMX op from one row, the AVX512-BF16 op (which converts each call's codes) from 8; numbers
    and None stay."""
    import engine.kernels as kernels
    from engine.quant.int8 import AVX512_TILE_MIN_ROWS, resolve_int8_min_rows

    assert resolve_int8_min_rows(3) == 3 and resolve_int8_min_rows(None) is None
    monkeypatch.setattr(kernels, "int8_amx_op", lambda: object())
    assert resolve_int8_min_rows("auto") == 1
    monkeypatch.setattr(kernels, "int8_amx_op", lambda: None)
    assert resolve_int8_min_rows("auto") == AVX512_TILE_MIN_ROWS == 12


@pytest.mark.parametrize("name", ["int4_amx_min_rows", "int8_amx_min_rows"])
def test_engine_config_takes_auto_a_row_count_or_none(name):
    from engine.config import EngineConfig

    assert getattr(EngineConfig(), name) == "auto"
    assert getattr(EngineConfig(**{name: 4}), name) == 4
    assert getattr(EngineConfig(**{name: None}), name) is None
    with pytest.raises(ValueError):
        EngineConfig(**{name: 0})
    with pytest.raises(ValueError):
        EngineConfig(**{name: "often"})
