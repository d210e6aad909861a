"""The packed bf16 linears over the "vnni32" layout: AMX's (engine/kernels/bf16_amx.cpp: streamed up to
32 rows, brgemm above) and AVX512-BF16's (engine/kernels/bf16_avx512.cpp: register tiles up to 255 rows,
brgemm from 256), and PackedGroup's use of them: numerics against a float64 reference on every route, row
invariance where a row's K order cannot change, bias, clear errors, and a bit-identical layout round
trip (plain rows back, bytes out and wrapped back). Each op's tests skip, saying why, where it cannot run
(the AVX512 op runs on AMX CPUs too, so both are tested there)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import bf16_amx_op, bf16_amx_reason, bf16_avx512_op, bf16_avx512_reason
from engine.layers.packed import PLAIN_GEMM_ROWS, PackedGroup, pack_vnni, unpack_vnni, vnni_op

# (op, why it cannot run here, rows up to which each row is computed the same whatever the row count)
OPS = {"amx": (bf16_amx_op, bf16_amx_reason, 32), "avx512": (bf16_avx512_op, bf16_avx512_reason, 255)}
needs_vnni = pytest.mark.skipif(vnni_op() is None, reason=f"no vnni32 op: {bf16_amx_reason()}; {bf16_avx512_reason()}")


@pytest.fixture(params=sorted(OPS))
def op(request):
    get, reason, _ = OPS[request.param]
    if reason() is not None:
        pytest.skip(f"bf16 {request.param} op: {reason()}")
    return get()


def small_group(seed: int) -> tuple[torch.Tensor, torch.Tensor, PackedGroup]:
    """A 96 x 128 bf16 weight, its bias and their PackedGroup."""
    torch.manual_seed(seed)
    w = (torch.randn(96, 128) * 0.05).to(torch.bfloat16)
    b = torch.randn(96).to(torch.bfloat16)
    return w, b, PackedGroup(w, b)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (3072, 576), (64, 32)])
@pytest.mark.parametrize("rows", [1, 7, 12, 13, 31, 32, 33, 255, 256, 300])
def test_matches_float64_on_every_route(op, n, k, rows):
    torch.manual_seed(rows * 7 + n)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    for bias in (None, b):
        y = op(x, pack_vnni(w), bias)
        want = reference(x, w, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        # fp32 accumulation, one bf16 rounding of the output: within one bf16 ulp of the exact product
        assert torch.allclose(y.double(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_row_is_computed_the_same_whatever_the_row_count(name):
    get, reason, invariant_up_to = OPS[name]
    if reason() is not None:
        pytest.skip(f"bf16 {name} op: {reason()}")
    torch.manual_seed(1)
    w = (torch.randn(576, 576) * 0.05).to(torch.bfloat16)
    packed = pack_vnni(w)
    x = torch.randn(invariant_up_to, 576).to(torch.bfloat16)
    full = get()(x, packed, None)
    for rows in (1, 5, 12, 13, 16, 17, 31, 97, 200):
        if rows < invariant_up_to:
            assert torch.equal(get()(x[:rows], packed, None), full[:rows]), rows
        # and the same rows placed after others (another tile position) give the same bits
        if rows + 7 <= invariant_up_to:
            assert torch.equal(get()(x[7:7 + rows], packed, None), full[7:7 + rows]), rows


def test_a_non_contiguous_input_gives_the_same_result(op):
    torch.manual_seed(2)
    w = (torch.randn(192, 64) * 0.05).to(torch.bfloat16)
    wide = torch.randn(9, 128).to(torch.bfloat16)
    x = wide[:, ::2]
    assert torch.equal(op(x, pack_vnni(w), None), op(x.contiguous(), pack_vnni(w), None))


def test_bad_inputs_say_what_is_wrong(op):
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="columns"):
        op(torch.zeros(2, 96, dtype=torch.bfloat16), pack_vnni(w), None)
    with pytest.raises(RuntimeError, match="x must be bf16"):
        op(torch.zeros(2, 64), pack_vnni(w), None)
    with pytest.raises(RuntimeError, match="packed must be"):
        op(torch.zeros(2, 64, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        op(torch.zeros(2, 64, dtype=torch.bfloat16), pack_vnni(w), torch.zeros(3, dtype=torch.bfloat16))


@needs_vnni
def test_packed_group_uses_the_layout_and_round_trips_bit_identically():
    w, b, group = small_group(3)
    assert group.layout == "vnni32"
    assert torch.equal(unpack_vnni(pack_vnni(w)), w)
    assert torch.equal(group.plain_rows(10, 40), w[10:40])
    assert group.nbytes() == w.nbytes + b.nbytes  # the ledger's bytes: no padding, no second copy
    blob, md = group.to_blob()
    wrapped = PackedGroup.from_blob(blob, md, b, 96, 128, torch.bfloat16)
    assert wrapped.layout == "vnni32" and wrapped.packed.data_ptr() == blob.data_ptr()  # a view, not a copy
    x = torch.randn(5, 128).to(torch.bfloat16)
    assert torch.equal(wrapped(x), group(x))


@pytest.mark.skipif(bf16_amx_reason() is not None, reason=f"bf16 AMX op: {bf16_amx_reason()}")
def test_a_large_chunk_runs_f_linear_on_the_unpacked_weight():
    # From PLAIN_GEMM_ROWS rows the group unpacks and calls F.linear: its result exactly, the packed
    # bytes untouched, and within one bf16 rounding of the brgemm route below the threshold.
    w, b, group = small_group(11)
    before = group.packed.clone()
    x = torch.randn(PLAIN_GEMM_ROWS, 128).to(torch.bfloat16)
    y = group(x)
    assert torch.equal(y, F.linear(x, w, b))
    assert torch.equal(group.packed, before)
    below = group(x[:PLAIN_GEMM_ROWS - 1])
    want = reference(x[:PLAIN_GEMM_ROWS - 1], w, b)
    assert torch.allclose(below.double(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())
    assert torch.allclose(y[:-1].double(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())


@needs_vnni
def test_shapes_the_layout_cannot_hold_keep_onednn():
    w = (torch.randn(100, 128) * 0.05).to(torch.bfloat16)  # 100 columns: not whole 32-column blocks
    group = PackedGroup(w, None)
    assert group.layout == "mkldnn"
    x = torch.randn(3, 128).to(torch.bfloat16)
    assert torch.equal(group(x), torch.nn.functional.linear(x, w))


@needs_vnni
def test_packed_group_runs_the_op_this_cpu_has():
    # Where there is no AMX the group's call is the AVX512 op's, bit for bit, at decode and prefill sizes.
    w, b, group = small_group(5)
    for rows in (1, 40, 300):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        if bf16_amx_reason() is not None:
            assert torch.equal(group(x), bf16_avx512_op()(x, pack_vnni(w), b))
        else:
            assert torch.equal(group(x), bf16_amx_op()(x, pack_vnni(w), b))
