"""The fused CPU elementwise kernels (engine/kernels/fused_elementwise.cpp) against the torch ops they
replace (each layer's `reference`): RMSNorm, SiLU-and-multiply, RoPE in place, in fp32 and bf16, on
contiguous rows and on the strided views the model hands them, row by row (batch invariance).

bf16 tolerance: the kernels sum squares in another order, so an element may land one bf16 rounding
step away from torch's; fp32 agrees to float rounding. RoPE rounds once where torch's ops round each
product too, so it is checked against the exact rotation: within one rounding, never worse than torch."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import available_reason
from engine.layers.activation import silu_and_mul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    # `make test` builds the library first: with a compiler present, a missing library is a failure.
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler: the kernels are not built and the layers use torch's ops")
    assert available_reason() is None, available_reason()


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # at most one bf16 rounding step apart, and nearly always the same bits
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-5)
        assert (got == want).float().mean().item() > 0.99


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_matches_torch(dtype, rows):
    weight = (1 + 0.3 * torch.randn(576, generator=gen(0))).to(dtype)
    norm = RMSNorm(weight, 1e-5)
    x = (3 * torch.randn(rows, 576, generator=gen(rows))).to(dtype)
    got = norm(x)
    assert_close(got, norm.reference(x))
    assert torch.equal(norm(x[rows // 2:rows // 2 + 1]), got[rows // 2:rows // 2 + 1])  # row-invariant


def test_rms_norm_on_a_row_slice():
    norm = RMSNorm(torch.rand(64, generator=gen(1)).to(torch.bfloat16) + 0.5, 1e-6)
    big = torch.randn(10, 128, generator=gen(2)).to(torch.bfloat16)
    x = big[2:8, 32:96]  # rows of stride 128, 64 wide
    assert_close(norm(x), norm.reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, rows):
    # The residual add fused into the norm (the model's forward_residual): the sum is torch's add to the
    # bit, the normed rows are what rms_norm gives that sum, and neither input changes.
    norm = RMSNorm((1 + 0.3 * torch.randn(576, generator=gen(3))).to(dtype), 1e-5)
    big = (3 * torch.randn(rows, 700, generator=gen(rows))).to(dtype)
    x, residual = big[:, 50:626], (2 * torch.randn(rows, 576, generator=gen(rows + 1))).to(dtype)  # x row-strided
    before = (x.clone(), residual.clone())
    normed, h = norm.add_forward(x, residual)
    assert torch.equal(h, residual + x)
    assert torch.equal(normed, norm(residual + x))
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])
    assert torch.equal(norm.add_forward(x[rows // 2:rows // 2 + 1], residual[rows // 2:rows // 2 + 1])[0],
                       normed[rows // 2:rows // 2 + 1])  # row-invariant


def test_add_rms_norm_rejects_mismatched_inputs():
    op = torch.ops.morphserve.add_rms_norm
    w = torch.ones(64)
    with pytest.raises(RuntimeError, match="same shape and dtype"):
        op(torch.zeros(2, 64), torch.zeros(3, 64), w, 1e-6)
    with pytest.raises(RuntimeError, match="same shape and dtype"):
        op(torch.zeros(2, 64), torch.zeros(2, 64, dtype=torch.bfloat16), w, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_and_mul_matches_torch(dtype, rows):
    gate_up = (4 * torch.randn(rows, 2 * 1536, generator=gen(rows))).to(dtype)
    gate_up[0, :8] = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0, -5.0])  # tails of exp
    got = silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close(got, F.silu(gate) * up)
    assert torch.equal(silu_and_mul(gate_up[-1:]), got[-1:])


def test_silu_and_mul_keeps_nan():
    gate_up = torch.ones(1, 4, dtype=torch.bfloat16)
    gate_up[0, 0] = float("nan")
    assert torch.isnan(silu_and_mul(gate_up)[0, 0])


def exact_rotation(x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
    """float64 RoPE with the model's (rounded) cos/sin tables."""
    x, half = x.double(), x.shape[-1] // 2
    cos, sin = rope.cos[positions].double().unsqueeze(1), rope.sin[positions].double().unsqueeze(1)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:]), -1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_the_fused_qkv_view(dtype):
    hq, hkv, d, t = 9, 3, 64, 37
    rope = RotaryEmbedding(d, 100000.0, 2048, None, dtype, "cpu")
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen(3)).to(dtype)
    positions = torch.randint(0, 2048, (t,), generator=gen(4))
    exact = exact_rotation(qkv[:, :hq + hkv], positions, rope)
    torch_error = (rope.rotate_reference(qkv[:, :hq + hkv], positions).double() - exact).abs()
    v_before = qkv[:, hq + hkv:].clone()
    got = rope.rotate(qkv[:, :hq + hkv], positions)
    assert got.data_ptr() == qkv.data_ptr()  # rotated where it lies
    error = (got.double() - exact).abs()
    # One rounding of the exact result, plus fp32 arithmetic inside (torch's path rounds the products
    # to the dtype too, so it is never closer).
    fp32_slack = 4 * torch.finfo(torch.float32).eps * qkv.abs().max().double()
    assert (error <= exact.abs() * torch.finfo(dtype).eps / 2 + fp32_slack).all()
    assert error.max() <= torch_error.max()
    assert torch.equal(qkv[:, hq + hkv:], v_before)  # v untouched


def test_rotary_rejects_a_position_beyond_the_table():
    rope = RotaryEmbedding(8, 10000.0, 16, None, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="beyond the cos/sin tables"):
        rope.rotate(torch.randn(1, 2, 8), torch.tensor([16]))
