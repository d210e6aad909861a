"""The engine's INT4 tile op for the AVX512 int4pack layout (int4_kernel.int4_tile_op: engine/kernels/int4_amx.cpp
on a CPU with AMX-BF16, int4_avx512.cpp on one with AVX512-BF16 and no AMX; built once by `make kernels`):
numerics against torch's int4pack kernel on the same packed bytes, row invariance, and the row-count dispatch
of Int4Linear and the fused INT4 call (EngineConfig.int4_amx_min_rows). Skipped, saying why, where the library
is not built or the CPU has neither (AVX2-only CPUs, other torch builds)."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import bf16_avx512_op, int4_amx_op, int4_amx_reason, int4_avx512_op, int4_avx512_reason
from engine.layers.packed import unpack_vnni
from engine.morph.actions import SwapLayer
from engine.precision import Precision
from engine.quant import Int4Linear, quantize_int4
from engine.quant.fused import fuse_quantized
from engine.quant.int4_kernel import int4_tile_op
from engine.quant.dispatch import amx_dispatch
from tests.morph_helpers import engine_for
from tests.test_engine import generate, mixed_prompts
from tests.kernel_dispatch import assert_dispatch_by_rows

pytestmark = pytest.mark.skipif(int4_tile_op() is None,
                                reason=f"INT4 tile op: {int4_amx_reason()}; {int4_avx512_reason()}")


RUNG = "int4"  # the rung whose row threshold the `threshold` fixture (conftest.py) sets


@pytest.mark.parametrize("name", ["amx", "avx512"])
def test_tile_ops_match_the_int4_kernel_and_are_row_invariant(threshold, name):
    # Each op where it runs (an AMX CPU runs both; the engine picks AMX's there).
    op, reason = {"amx": (int4_amx_op, int4_amx_reason), "avx512": (int4_avx512_op, int4_avx512_reason)}[name]
    if reason() is not None:
        pytest.skip(f"INT4 {name} op: {reason()}")
    threshold(None)
    torch.manual_seed(0)
    w = torch.randn(192, 128) * 0.05
    i4 = Int4Linear(quantize_int4(w, 64))
    assert i4.amx
    op = op()
    x = torch.randn(130, 128).to(torch.bfloat16)
    full = op(x, i4.packed, i4.group_size, i4.scales_and_zeros)
    for m in (1, 3, 17, 130):  # 130 > one 128-row brgemm chunk
        ref = i4(x[:m]).float()  # torch's kernel (threshold never)
        y = op(x[:m], i4.packed, i4.group_size, i4.scales_and_zeros)
        assert y.shape == (m, 192)
        assert (y.float() - ref).abs().max().item() <= 0.02 * ref.abs().max().item()
        assert torch.equal(y, full[:m])  # a row's output does not depend on the other rows


def test_linears_dispatch_by_rows(threshold):
    """Below the threshold Int4Linear and the fused q/k/v call are torch's kernel exactly; from it up, the tile op."""
    torch.manual_seed(1)
    members = [Int4Linear(quantize_int4(torch.randn(n, 128) * 0.05, 64)) for n in (128, 64, 64)]
    x = torch.randn(17, 128).to(torch.bfloat16)
    threshold(None)
    old = [lin(x) for lin in members]
    fused = fuse_quantized(members)
    assert fused is not None and fused.amx
    op = int4_tile_op()
    new = [op(x, lin.packed, lin.group_size, lin.scales_and_zeros.contiguous()) for lin in members]
    threshold(4)
    assert_dispatch_by_rows(fused, members, x, old, new)


def test_int4_layers_are_batch_invariant_with_amx_from_one_row(tiny_model_dir, tmp_path, threshold):
    """int4_amx_min_rows=1: every INT4 matmul is the row-invariant AMX op, so alone == batched exactly."""
    engine = engine_for(tiny_model_dir, tmp_path, int4_amx_min_rows=1)
    assert amx_dispatch().int4_min_rows == 1
    for i in range(engine.model.config.num_layers):
        assert engine.apply(SwapLayer(i, Precision.INT4)).status == "done"
    assert engine.model.layers[0].down_proj.amx  # 128 -> 64: one AMX column block
    prompts = mixed_prompts(n=8, seed=5)
    alone = {rid: generate(engine, {rid: p})[rid] for rid, p in prompts.items()}
    assert generate(engine, prompts) == alone


def test_from_256_rows_the_avx512_op_multiplies_by_its_weight_dequantized_to_bf16():
    """Prefill chunks (>= kVnniGemmRows rows): the weight dequantized to bf16 in the vnni32 layout, through the
    bf16 op's brgemm route; each dequantized weight is the tile path's own weight rounded to bf16."""
    if int4_avx512_reason() is not None:
        pytest.skip(f"INT4 avx512 op: {int4_avx512_reason()}")
    torch.manual_seed(3)
    k = 192
    i4 = Int4Linear(quantize_int4(torch.randn(128, k) * 0.05, 64))
    op = int4_avx512_op()
    deq = torch.ops.morphserve.int4_avx512_dequant(i4.packed, i4.group_size, i4.scales_and_zeros, k)
    assert deq.shape == (128 // 32, k // 2, 32, 2) and deq.dtype == torch.bfloat16
    # the tile path on the identity gives every weight in fp32 (then rounded to bf16 once, like the dequant)
    per_weight = op(torch.eye(k, dtype=torch.bfloat16), i4.packed, i4.group_size, i4.scales_and_zeros).t()
    torch.testing.assert_close(unpack_vnni(deq).float(), per_weight.float(), rtol=2 ** -8, atol=1e-6)
    x = torch.randn(300, k).to(torch.bfloat16)
    y = op(x, i4.packed, i4.group_size, i4.scales_and_zeros)
    assert torch.equal(y, bf16_avx512_op()(x, deq, None))
    ref = x.double() @ unpack_vnni(deq).double().t()
    assert (y.double() - ref).abs().max().item() <= 0.01 * ref.abs().max().item()
    # below 256 rows: the tile path, row-invariant as before
    tiles = op(x[:255], i4.packed, i4.group_size, i4.scales_and_zeros)
    assert torch.equal(tiles[:7], op(x[:7], i4.packed, i4.group_size, i4.scales_and_zeros))
    with pytest.raises(RuntimeError, match="in_features|columns"):
        torch.ops.morphserve.int4_avx512_dequant(i4.packed, i4.group_size, i4.scales_and_zeros, k + 64)
