"""The engine's INT4 AVX2 op (engine/kernels/int4_avx2.cpp, built by `make kernels`): numerics against the
dequantized fp32 reference, row invariance across its two routes (codes decoded in registers at 1-4 rows,
a chunk of float codes from 5 rows up), bad input, and that Int4Linear and the fused INT4 call use it where
torch packs the AVX2 layout. The op tests build the AVX2 layout's bytes themselves, so they run on any CPU
the op is compiled for (AVX-512 CPUs have AVX2 too); the layer tests need a CPU whose torch packs that
layout (no AVX-512). Skipped, saying why, elsewhere."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import int4_avx2_op, int4_avx2_reason
from engine.morph.actions import SwapLayer
from engine.precision import Precision
from engine.quant import Int4Linear, quantize_int4
from engine.quant.fused import fuse_quantized
from engine.quant.int4_kernel import cpu_layout
from tests.morph_helpers import engine_for
from tests.test_engine import generate, mixed_prompts

pytestmark = pytest.mark.skipif(int4_avx2_reason() is not None, reason=f"INT4 AVX2 op: {int4_avx2_reason()}")
avx2_layout = pytest.mark.skipif(cpu_layout().split(":")[2] != "AVX2",
                                 reason=f"torch packs INT4 as {cpu_layout()} here, not the AVX2 layout")


def avx2_bytes(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15) in the AVX2 int4pack layout: [N/32][K][16] bytes, byte j = column j | column 16 + j << 4."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).reshape(n // 32, 32, k).transpose(1, 2)  # [N/32, K, 32]
    return (blocks[..., :16] | (blocks[..., 16:] << 4)).contiguous().reshape(n, k // 2)


def weight(n: int, k: int, g: int, seed: int):
    """(codes, bf16 scales_and_zeros [K/G, N, 2], the fp32 weight they stand for: (code - 8) * s + zp)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    sz = torch.stack([torch.rand(k // g, n, generator=gen) * 0.02 + 1e-3, torch.randn(k // g, n, generator=gen) * 0.01],
                     dim=-1).to(torch.bfloat16)
    s, zp = (sz[..., i].float().transpose(0, 1).repeat_interleave(g, dim=1) for i in (0, 1))
    return codes, sz, (codes.float() - 8) * s + zp


@pytest.mark.parametrize("n,k,g", [(64, 128, 32), (96, 576, 64), (64, 1536, 128), (32, 1024, 256)])
def test_matches_the_dequantized_reference_and_is_row_invariant(n, k, g):
    """K of 1536 spans three 512-k chunks; 1-4 rows decode in registers, 5+ go through the chunk."""
    codes, sz, w = weight(n, k, g, seed=n + k)
    packed, op = avx2_bytes(codes), int4_avx2_op()
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(1))
    full = op(x, packed, g, sz)
    for m in (1, 2, 3, 4, 5, 6, 7, 13, 37):
        y = op(x[:m].clone(), packed, g, sz)
        ref = x[:m].double() @ w.double().T
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item() + 1e-6
        assert torch.equal(y, full[:m])  # a row's output depends on nothing but its own input row


def test_bad_input_is_refused_with_a_message():
    codes, sz, _ = weight(64, 128, 32, seed=0)
    packed, op = avx2_bytes(codes), int4_avx2_op()
    with pytest.raises(RuntimeError, match="x must be fp32"):
        op(torch.randn(2, 128).bfloat16(), packed, 32, sz)
    with pytest.raises(RuntimeError, match="x has 96 columns"):
        op(torch.randn(2, 96), packed, 32, sz)
    with pytest.raises(RuntimeError, match="scales_and_zeros must be"):
        op(torch.randn(2, 128), packed, 32, sz.float())
    wide, wide_sz, _ = weight(48, 128, 32, seed=1)  # 48 columns: not whole 32-column blocks
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.randn(2, 128), wide.to(torch.uint8).reshape(48, 128)[:, :64].contiguous(), 32, wide_sz)


@avx2_layout
def test_int4_linear_and_the_fused_call_use_the_op_in_the_input_dtype():
    torch.manual_seed(2)
    members = [Int4Linear(quantize_int4(torch.randn(n, 128) * 0.05, 64)) for n in (128, 64, 64)]
    assert all(lin.avx2 and not lin.amx for lin in members)
    x = torch.randn(9, 128)
    op = int4_avx2_op()
    alone = [lin(x) for lin in members]
    for lin, y in zip(members, alone):
        assert y.dtype == torch.float32
        assert torch.equal(y, op(x, lin.packed, lin.group_size, lin.scales_and_zeros.contiguous()))
        ref = x @ lin.dequantize().T
        assert (y - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    fused = fuse_quantized(members)
    assert fused is not None and fused.avx2
    assert torch.equal(fused(x), torch.cat(alone, dim=1))
    assert members[0](x.bfloat16()).dtype == torch.bfloat16  # a bf16 model on this CPU: computed in fp32, returned in bf16


@avx2_layout
def test_int4_layers_are_batch_invariant(tiny_model_dir, tmp_path):
    """Every INT4 matmul is the row-invariant op at every row count: a request alone == in a batch, exactly."""
    engine = engine_for(tiny_model_dir, tmp_path)
    for i in range(engine.model.config.num_layers):
        assert engine.apply(SwapLayer(i, Precision.INT4)).status == "done"
    assert engine.model.layers[0].down_proj.avx2
    prompts = mixed_prompts(n=8, seed=5)
    alone = {rid: generate(engine, {rid: p})[rid] for rid, p in prompts.items()}
    assert generate(engine, prompts) == alone
