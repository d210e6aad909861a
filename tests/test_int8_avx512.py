"""The engine's INT8 AVX512-BF16 ops (engine/kernels/int8_avx512.cpp, built once by `make kernels`; on a CPU
with AVX512-BF16 and no AMX-INT8, e.g. AMD Zen 4, the INT8 tile op and the few-rows op below its threshold):
the codes' exact conversion, numerics against the dequantized reference on every route (few rows, register
tiles below 256 rows, brgemm from 256), row invariance, clear errors, the row-count dispatch of Int8Linear
and the fused INT8 call, and batch invariance of a model with INT8 layers. Skipped, saying why, where the
library is not built or the CPU has no AVX512-BF16."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import int8_avx512_op, int8_avx512_reason
from engine.layers.packed import unpack_vnni
from engine.morph.actions import RestoreLayer, SwapLayer
from engine.precision import Precision
from engine.quant import Int8Linear, quantize_int8
from engine.quant.fused import fuse_quantized
from engine.quant.int8 import int8_rows_op, int8_tile_op
from tests.kernel_dispatch import assert_dispatch_by_rows
from tests.morph_helpers import engine_for
from tests.test_engine import generate, mixed_prompts

pytestmark = pytest.mark.skipif(int8_avx512_reason() is not None, reason=f"INT8 AVX512 op: {int8_avx512_reason()}")
BF16_UNIT = 2.0 ** -8  # relative rounding of one bf16 value


RUNG = "int8"  # the rung whose row threshold the `threshold` fixture (conftest.py) sets


def test_the_codes_become_bf16_exactly_in_the_vnni32_layout():
    record = quantize_int8(torch.randn(96, 160) * 0.05)
    codes = torch.ops.morphserve.int8_avx512_codes(record.qweight)
    assert codes.shape == (3, 80, 32, 2) and codes.dtype == torch.bfloat16
    assert torch.equal(unpack_vnni(codes), record.qweight.to(torch.bfloat16))


@pytest.mark.parametrize("n, k", [(32, 32), (96, 160), (576, 576), (192, 1536)])
def test_both_routes_match_the_dequantized_matmul_and_rows_are_invariant_below_256(n, k):
    gen = torch.Generator().manual_seed(n + k)
    record = quantize_int8(torch.randn(n, k, generator=gen) * 0.05)
    op = int8_avx512_op()
    x = torch.randn(300, k, generator=gen).to(torch.bfloat16)
    w = record.dequantize()
    tiles = op(x[:255], record.qweight, record.scales)
    for m in (1, 7, 12, 13, 97, 255, 256, 300):  # partial and whole 12-row tiles, > one 96-row chunk, brgemm
        y = op(x[:m], record.qweight, record.scales)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        ref = x[:m].double() @ w.double().t()
        # exact products of bf16 x and integer codes, fp32 sums, one fp32 scale, one bf16 rounding
        magnitude = x[:m].double().abs() @ w.double().abs().t()
        assert bool(((y.double() - ref).abs() <= BF16_UNIT * magnitude + 1e-6).all()), m
        if m < 256:
            assert torch.equal(y, tiles[:m])  # a row's output does not depend on the other rows


def test_bad_operands_get_clear_errors():
    op = int8_avx512_op()
    record = quantize_int8(torch.randn(64, 64))
    with pytest.raises(RuntimeError, match="multiples of 32"):
        op(torch.randn(2, 48).to(torch.bfloat16), quantize_int8(torch.randn(64, 48)).qweight, torch.ones(64))
    with pytest.raises(RuntimeError, match="64 in_features, x 32 columns"):
        op(torch.randn(2, 32).to(torch.bfloat16), record.qweight, record.scales)
    with pytest.raises(RuntimeError, match="scales must be contiguous fp32"):
        op(torch.randn(2, 64).to(torch.bfloat16), record.qweight, record.scales.to(torch.bfloat16))


def test_eligibility_and_the_dispatch_by_rows(threshold):
    """The AVX512 ops take 32-multiple shapes; below the threshold Int8Linear and the fused q/k/v call are the
    few-rows op exactly, from it up the tile op; with no threshold, torch's kernel at every row count."""
    if int8_tile_op() is not int8_avx512_op():
        pytest.skip("this CPU has AMX-INT8: the AMX op is the INT8 tile op (tests/test_int8_amx.py)")
    assert Int8Linear(quantize_int8(torch.randn(96, 64))).amx
    assert not Int8Linear(quantize_int8(torch.randn(48, 64))).amx  # rows not a multiple of 32
    gen = torch.Generator().manual_seed(1)
    members = [Int8Linear(quantize_int8(torch.randn(n, 128, generator=gen) * 0.05)) for n in (128, 64, 64)]
    x = torch.randn(17, 128, generator=gen).to(torch.bfloat16)
    threshold(None)
    assert all(torch.equal(lin(x), torch.ops.aten._weight_int8pack_mm(x, lin.qweight, lin.scales.bfloat16()))
               for lin in members)
    fused = fuse_quantized(members)
    assert fused is not None and fused.amx
    few = [int8_rows_op()(x, lin.qweight, lin.scales) for lin in members]
    new = [int8_avx512_op()(x, lin.qweight, lin.scales) for lin in members]
    threshold(4)
    assert_dispatch_by_rows(fused, members, x, few, new)


@pytest.mark.parametrize("n, k", [(32, 32), (576, 576), (192, 1536)])
def test_the_few_rows_op_matches_the_dequantized_matmul_and_is_row_invariant(n, k):
    gen = torch.Generator().manual_seed(n * k)
    record = quantize_int8(torch.randn(n, k, generator=gen) * 0.05)
    op = int8_rows_op()
    x = torch.randn(11, k, generator=gen).to(torch.bfloat16)
    full = op(x, record.qweight, record.scales)
    w = record.dequantize().double()
    for m in (1, 3, 4, 5, 11):  # groups of up to four rows of x
        y = op(x[:m], record.qweight, record.scales)
        ref = x[:m].double() @ w.t()
        magnitude = x[:m].double().abs() @ w.abs().t()
        assert bool(((y.double() - ref).abs() <= BF16_UNIT * magnitude + 1e-6).all()), m
        assert torch.equal(y, full[:m])
        assert torch.equal(op(x[m:], record.qweight, record.scales), full[m:])  # the rows' place does not matter


def test_int8_layers_are_batch_invariant_on_the_avx512_op(tiny_model_dir, tmp_path, threshold):
    """int8_amx_min_rows=1 ('auto' takes 8 on this op): every INT8 matmul of these small steps is the
    row-invariant tile op, so alone == batched exactly; a restore gives back the full-precision layer bit for bit."""
    if int8_tile_op() is not int8_avx512_op():
        pytest.skip("this CPU has AMX-INT8: the AMX op is the INT8 tile op (tests/test_int8_amx.py)")
    engine = engine_for(tiny_model_dir, tmp_path, int8_amx_min_rows=1)
    prompts = mixed_prompts(n=8, seed=7)
    before = generate(engine, prompts)
    for i in range(engine.model.config.num_layers):
        assert engine.apply(SwapLayer(i, Precision.INT8)).status == "done"
    assert engine.model.layers[0].down_proj.amx  # 128 -> 64: 32-multiples
    alone = {rid: generate(engine, {rid: p})[rid] for rid, p in prompts.items()}
    assert generate(engine, prompts) == alone
    for i in range(engine.model.config.num_layers):
        assert engine.apply(RestoreLayer(i)).status == "done"
    assert generate(engine, prompts) == before
