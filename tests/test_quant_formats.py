"""INT8 / INT4 records and linears: error bounds, packed kernels vs the dequantize path, sizes, storage."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError
from engine.precision import Precision
from engine.quant import (Int4Linear, Int4Weight, Int8Linear, Int8Weight, from_tensors, int4_group_size,
                          make_linear, quantize_int4, quantize_int8, quantized_nbytes, to_tensors)

# (out, in): the default model's shapes (in 576 is 4.5 x 128) and a small one with outlier rows/cols.
SHAPES = [(192, 576), (576, 1536), (64, 128)]
BF16_UNIT = 2.0 ** -8  # relative rounding error of bf16 (8 significant bits, round to nearest)


def random_weight(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    w[:, 3] *= 20  # an outlier column and row: ranges differ a lot between groups and channels
    w[5] *= 10
    return w


def dot_magnitude(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|x| @ |w|^T: the scale of a dot product's rounding error (standard error analysis)."""
    return x.float().abs() @ w.float().abs().t()


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_rtn_error_is_at_most_half_a_step(shape):
    w = random_weight(*shape)
    rec = quantize_int8(w)
    rec.check_integrity()
    err = (w - rec.dequantize()).abs()
    bound = rec.scales[:, None] / 2 * (1 + 1e-6) + 1e-9
    assert bool((err <= bound).all()), float((err / rec.scales[:, None]).max())
    assert int(rec.qweight.abs().max()) == 127  # the range is used: each row's absmax maps to +-127


@pytest.mark.parametrize("shape", SHAPES)
def test_int4_rtn_error_is_at_most_half_a_step(shape):
    w = random_weight(*shape)
    rec = quantize_int4(w, 128)
    rec.check_integrity()
    assert rec.group_size == int4_group_size(shape[1])
    s = rec.scales.repeat_interleave(rec.group_size, dim=1)
    err = (w - rec.dequantize()).abs()
    assert bool((err <= s / 2 * (1 + 1e-5) + 1e-9).all()), float((err / s).max())
    assert int(rec.codes().max()) == 15 and int(rec.codes().min()) == 0


def test_group_size_falls_back_when_in_features_needs_it():
    assert int4_group_size(576) == 64 and int4_group_size(1536) == 128 and int4_group_size(96) == 32
    assert int4_group_size(512, preferred=256) == 256
    assert quantize_int4(torch.randn(16, 576)).group_size == 64
    with pytest.raises(ModelLoadError, match="100"):
        int4_group_size(100)


def test_constant_and_zero_groups_are_exact():
    w = torch.zeros(16, 64)
    w[1] = 0.3
    w[2] = -0.7
    assert torch.equal(quantize_int4(w, 32).dequantize(), w)
    assert torch.allclose(quantize_int8(w).dequantize(), w, rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch", [1, 7])
def test_int8_kernel_matches_dequantize_path(shape, batch):
    lin = Int8Linear(quantize_int8(random_weight(*shape)))
    assert lin.use_kernel
    x = torch.randn(batch, shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = lin(x)
    ref = x.float() @ lin.dequantize().t()
    # Same integer weights on both sides; the kernel applies the scale in bf16 (<= 1 unit) and rounds
    # its output to bf16 (<= 1 unit): 2 units of the dot product's magnitude.
    assert y.dtype == torch.bfloat16
    tol = 2 * BF16_UNIT * dot_magnitude(x, lin.dequantize()) + 1e-6
    assert bool(((y.float() - ref).abs() <= tol).all())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch", [1, 7])
def test_int4_kernel_matches_dequantize_path(shape, batch):
    lin = Int4Linear(quantize_int4(random_weight(*shape)))
    assert lin.backend == "cpu"
    x = torch.randn(batch, shape[1], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    y = lin(x)
    w = lin.dequantize()
    ref = x.float() @ w.t()
    # Both use (q - 8) * s + zero_point with the same bf16 s and zero_point; the kernel may round each
    # dequantized weight to bf16 (<= 1 unit) and rounds its output to bf16 (<= 1 unit).
    tol = 2 * BF16_UNIT * dot_magnitude(x, w) + 1e-6
    assert bool(((y.float() - ref).abs() <= tol).all())


def test_int4_linear_keeps_the_records_codes_and_weights():
    rec = quantize_int4(random_weight(192, 576))
    lin = Int4Linear(rec)
    assert torch.equal(lin.codes(), rec.codes())  # read back from the kernel's opaque packing
    s = rec.scales.repeat_interleave(rec.group_size, dim=1)
    # The kernel holds s and (8 - z) * s in bf16: each off by <= 1 unit, |q - 8|, |8 - z| <= 8.
    assert bool(((lin.dequantize() - rec.dequantize()).abs() <= 16 * BF16_UNIT * s + 1e-9).all())


def test_shapes_the_kernel_cannot_take_use_the_dequantize_path():
    rec = quantize_int4(random_weight(40, 64), 32)  # 40 outputs: the CPU kernel needs a multiple of 16
    lin = Int4Linear(rec)
    assert lin.backend == "dequant"
    x = torch.randn(3, 64)
    assert torch.allclose(lin(x), F.linear(x, lin.dequantize()), rtol=1e-5, atol=1e-6)
    assert torch.equal(lin.codes(), rec.codes())


@pytest.mark.parametrize("precision", [Precision.INT8, Precision.INT4])
def test_other_dtypes_leading_dims_and_bias(precision):
    w, bias = random_weight(64, 128), torch.randn(64)
    rec = quantize_int8(w) if precision == Precision.INT8 else quantize_int4(w, 64)
    lin = make_linear(rec, bias)
    assert lin.precision == precision
    x = torch.randn(2, 3, 128)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        y = lin(x.to(dtype))
        assert y.dtype == dtype and y.shape == (2, 3, 64)
        ref = x.to(dtype).float() @ lin.dequantize().t() + bias
        # fp32/fp16 activations are cast to bf16 for the kernel (1 unit), plus the kernel's 2 units.
        tol = 4 * BF16_UNIT * (dot_magnitude(x, lin.dequantize()) + bias.abs()) + 1e-3
        assert bool(((y.float() - ref).abs() <= tol).all()), dtype
    assert lin(torch.zeros(0, 128, dtype=torch.bfloat16)).shape == (0, 64)


@pytest.mark.parametrize("shape", SHAPES + [(40, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_nbytes_is_known_before_quantizing(shape, with_bias):
    w = random_weight(*shape)
    bias = torch.zeros(shape[0], dtype=torch.bfloat16) if with_bias else None
    bias_dtype = torch.bfloat16 if with_bias else None
    i8, i4 = Int8Linear(quantize_int8(w), bias), Int4Linear(quantize_int4(w, 128), bias)
    assert i8.nbytes() == quantized_nbytes(Precision.INT8, *shape, bias_dtype=bias_dtype)
    assert i4.nbytes() == quantized_nbytes(Precision.INT4, *shape, 128, bias_dtype=bias_dtype)
    bf16 = quantized_nbytes(Precision.BF16, *shape, bias_dtype=bias_dtype)
    assert bf16 == shape[0] * shape[1] * 2 + (2 * shape[0] if with_bias else 0)
    assert i4.nbytes() < i8.nbytes() < bf16


def test_records_round_trip_through_safetensors(tmp_path):
    w = random_weight(192, 576)
    records = {"q_proj.": quantize_int4(w), "o_proj.": quantize_int8(w)}
    tensors, metadata = {}, {}
    for prefix, rec in records.items():
        t, m = to_tensors(rec, prefix)
        tensors.update(t)
        metadata.update(m)
    save_file(tensors, tmp_path / "layer.safetensors", metadata=metadata)
    loaded = load_file(tmp_path / "layer.safetensors")
    back4 = from_tensors(loaded, metadata, "q_proj.")
    back8 = from_tensors(loaded, metadata, "o_proj.")
    assert isinstance(back4, Int4Weight) and isinstance(back8, Int8Weight)
    assert back4.group_size == 64
    for a, b in ((back4, records["q_proj."]), (back8, records["o_proj."])):
        assert torch.equal(a.dequantize(), b.dequantize())
    with pytest.raises(ValueError, match="k_proj"):
        from_tensors(loaded, metadata, "k_proj.")


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="float \\[out, in\\]"):
        quantize_int8(torch.randn(8))
    with pytest.raises(ValueError, match="float \\[out, in\\]"):
        quantize_int4(torch.ones(16, 64, dtype=torch.int32))
    rec = quantize_int8(torch.randn(16, 32))
    with pytest.raises(ValueError, match="scales must be fp32"):
        Int8Linear(Int8Weight(rec.qweight, rec.scales.half()))
    with pytest.raises(ValueError, match="bias must be"):
        Int8Linear(rec, torch.zeros(3))
    r4 = quantize_int4(torch.randn(16, 64), 32)
    with pytest.raises(ValueError, match="group_size 48"):
        Int4Linear(Int4Weight(r4.qweight, r4.scales, r4.zeros, 48))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_linears_match_dequantize_path(shape):
    w = random_weight(*shape).cuda()
    x = torch.randn(5, shape[1], device="cuda").to(torch.bfloat16)
    for lin in (Int8Linear(quantize_int8(w)), Int4Linear(quantize_int4(w, 128))):
        y = lin(x)
        ref = x.float() @ lin.dequantize().t()
        tol = 2 * BF16_UNIT * dot_magnitude(x, lin.dequantize()) + 1e-5
        assert bool(((y.float() - ref).abs() <= tol).all()), type(lin).__name__
        assert lin.nbytes() == quantized_nbytes(lin.precision, *shape)
