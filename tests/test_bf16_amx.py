"""The packed bf16 AMX linear (engine/kernels/bf16_amx.cpp) and the "vnni32" layout of PackedGroup:
numerics against a float64 reference on both routes (streamed up to 32 rows, brgemm above), row
invariance where a row's K order cannot change, bias, clear errors, and a bit-identical layout round
trip (plain rows back, bytes out and wrapped back). Skipped, saying why, without AMX-BF16 or the library."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import bf16_amx_op, bf16_amx_reason
from engine.layers.packed import PLAIN_GEMM_ROWS, PackedGroup, pack_vnni, unpack_vnni

pytestmark = pytest.mark.skipif(bf16_amx_reason() is not None, reason=f"bf16 AMX op: {bf16_amx_reason()}")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (3072, 576), (64, 32)])
@pytest.mark.parametrize("rows", [1, 7, 31, 32, 33, 300])
def test_matches_float64_on_both_routes(n, k, rows):
    torch.manual_seed(rows * 7 + n)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    for bias in (None, b):
        y = bf16_amx_op()(x, pack_vnni(w), bias)
        want = reference(x, w, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        # fp32 accumulation, one bf16 rounding of the output: within one bf16 ulp of the exact product
        assert torch.allclose(y.double(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())


def test_each_row_is_computed_the_same_whatever_the_row_count_up_to_32():
    torch.manual_seed(1)
    w = (torch.randn(576, 576) * 0.05).to(torch.bfloat16)
    packed = pack_vnni(w)
    x = torch.randn(32, 576).to(torch.bfloat16)
    full = bf16_amx_op()(x, packed, None)
    for rows in (1, 5, 16, 17, 31):
        assert torch.equal(bf16_amx_op()(x[:rows], packed, None), full[:rows])


def test_a_non_contiguous_input_gives_the_same_result():
    torch.manual_seed(2)
    w = (torch.randn(192, 64) * 0.05).to(torch.bfloat16)
    wide = torch.randn(9, 128).to(torch.bfloat16)
    x = wide[:, ::2]
    assert torch.equal(bf16_amx_op()(x, pack_vnni(w), None), bf16_amx_op()(x.contiguous(), pack_vnni(w), None))


def test_bad_inputs_say_what_is_wrong():
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="columns"):
        bf16_amx_op()(torch.zeros(2, 96, dtype=torch.bfloat16), pack_vnni(w), None)
    with pytest.raises(RuntimeError, match="x must be bf16"):
        bf16_amx_op()(torch.zeros(2, 64), pack_vnni(w), None)
    with pytest.raises(RuntimeError, match="packed must be"):
        bf16_amx_op()(torch.zeros(2, 64, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        bf16_amx_op()(torch.zeros(2, 64, dtype=torch.bfloat16), pack_vnni(w), torch.zeros(3, dtype=torch.bfloat16))


def test_packed_group_uses_the_layout_and_round_trips_bit_identically():
    torch.manual_seed(3)
    w = (torch.randn(96, 128) * 0.05).to(torch.bfloat16)
    b = torch.randn(96).to(torch.bfloat16)
    group = PackedGroup(w, b)
    assert group.layout == "vnni32"
    assert torch.equal(unpack_vnni(pack_vnni(w)), w)
    assert torch.equal(group.plain_rows(10, 40), w[10:40])
    assert group.nbytes() == w.nbytes + b.nbytes  # the ledger's bytes: no padding, no second copy
    blob, md = group.to_blob()
    wrapped = PackedGroup.from_blob(blob, md, b, 96, 128, torch.bfloat16)
    assert wrapped.layout == "vnni32" and wrapped.packed.data_ptr() == blob.data_ptr()  # a view, not a copy
    x = torch.randn(5, 128).to(torch.bfloat16)
    assert torch.equal(wrapped(x), group(x))


def test_a_large_chunk_runs_f_linear_on_the_unpacked_weight():
    # From PLAIN_GEMM_ROWS rows the group unpacks and calls F.linear: its result exactly, the packed
    # bytes untouched, and within one bf16 rounding of the brgemm route below the threshold.
    torch.manual_seed(11)
    w = (torch.randn(96, 128) * 0.05).to(torch.bfloat16)
    b = torch.randn(96).to(torch.bfloat16)
    group = PackedGroup(w, b)
    before = group.packed.clone()
    x = torch.randn(PLAIN_GEMM_ROWS, 128).to(torch.bfloat16)
    y = group(x)
    assert torch.equal(y, F.linear(x, w, b))
    assert torch.equal(group.packed, before)
    below = group(x[:PLAIN_GEMM_ROWS - 1])
    want = reference(x[:PLAIN_GEMM_ROWS - 1], w, b)
    assert torch.allclose(below.double(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())
    assert torch.allclose(y[:-1].double(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())


def test_shapes_the_layout_cannot_hold_keep_onednn():
    w = (torch.randn(100, 128) * 0.05).to(torch.bfloat16)  # 100 columns: not whole 32-column blocks
    group = PackedGroup(w, None)
    assert group.layout == "mkldnn"
    x = torch.randn(3, 128).to(torch.bfloat16)
    assert torch.equal(group(x), torch.nn.functional.linear(x, w))
