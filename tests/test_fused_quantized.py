"""Quantized q/k/v and gate/up run as one kernel call (o and down as one lean call each): outputs
bit-identical to the members run one by one, no extra bytes (members become slices of the fused tensors),
and members still work alone."""
from __future__ import annotations

import pytest
import torch

from engine.quant import Int4Linear, Int8Linear, quantize_int4, quantize_int8
from engine.quant.fused import fuse_quantized

OUT = (128, 64, 64)  # q / k / v of a GQA layer: every member ends on a 64-row packed block


def members(kind: str, in_features: int = 256, bias: bool = False):
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in OUT:
        w = torch.randn(n, in_features, generator=gen)
        b = torch.randn(n, generator=gen) if bias else None
        out.append(Int8Linear(quantize_int8(w), b) if kind == "int8" else Int4Linear(quantize_int4(w, 64), b))
    return out


@pytest.mark.parametrize("kind, bias", [("int8", False), ("int8", True), ("int4", False)])
def test_fused_call_equals_members_and_adds_no_bytes(kind, bias):
    linears = members(kind, bias=bias)
    x = torch.randn(5, 256).bfloat16()
    separate = torch.cat([lin(x) for lin in linears], dim=-1)
    bytes_before = sum(lin.nbytes() for lin in linears)
    fused = fuse_quantized(linears)
    assert fused is not None and fused.out_features == sum(OUT)
    assert torch.equal(fused(x), separate)
    assert sum(lin.nbytes() for lin in linears) == bytes_before  # slices of the fused tensors
    assert torch.equal(torch.cat([lin(x) for lin in linears], dim=-1), separate)  # each still runs alone


@pytest.mark.parametrize("kind, shape", [("int8", (2, 256)), ("int4", (2, 256)), ("int4", (3, 1, 256)), ("int8", (1, 4, 256))])
def test_a_group_of_one_is_the_linear_itself(kind, shape):
    # o_proj and down_proj run through this call (no module call): the same bits as the module, any leading
    # shape, in the serving dtype and in fp32 (cast in and out), and nothing re-pointed.
    lin = members(kind, bias=kind == "int8")[0]
    held = {n: b.data_ptr() for n, b in lin.named_buffers() if b is not None}
    call = fuse_quantized([lin])
    assert call is not None and call.out_features == lin.out_features
    assert {n: b.data_ptr() for n, b in lin.named_buffers() if b is not None} == held
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(shape).to(dtype)
        y = call(x)
        assert y.dtype == dtype and y.shape == (*shape[:-1], lin.out_features)
        assert torch.equal(y, lin(x))


def test_groups_that_cannot_fuse_are_left_alone():
    int8, int4 = members("int8"), members("int4")
    assert fuse_quantized([int8[0], int4[1]]) is None  # mixed formats
    assert fuse_quantized([]) is None
    odd = [Int4Linear(quantize_int4(torch.randn(n, 256), 64)) for n in (96, 32)]  # not on 64-row blocks
    assert fuse_quantized(odd) is None
