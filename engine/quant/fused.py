"""Quantized q/k/v and gate/up as one kernel call each, like the dense path (engine/layers/linear.py); o and
down as one lean call each (no module call).

INT8: the codes [out, in] and per-row scales concatenate along the output rows.
INT4 (CPU kernel layout): the packed bytes are blocks of output columns ([N, K/2] uint8 rows for
N % 64 == 0, the widest block any ISA uses), so members packed on their own concatenate along dim 0
into exactly what packing the concatenation gives; scales_and_zeros [in/G, out, 2] concatenate along
dim 1. Other layouts (CUDA's tiled one, "dequant") are not fused.

Like fuse_dense, the members are re-pointed to slices of the fused tensors (no memory growth, nbytes
of each stays exact, values bit-identical), so the layer's bytes are what the ledger counts.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from engine.layers.linear import as_rows, fuse_rows, like_input
from engine.quant.int4 import Int4Linear
from engine.quant.int4_kernel import int4_mm
from engine.quant.int8 import Int8Linear, int8_mm

_INT4_ROW_BLOCK = 64  # output rows per packed block on AVX512 (AVX2: 32): members must end on a block


class FusedQuantized:
    """One kernel call computing several quantized linears side by side (outputs concatenated)."""

    def __init__(self, kind: str, weight: Tensor, scales: Tensor, bias: Tensor | None, in_features: int,
                 out_features: int, group_size: int = 0, amx: bool = False, avx2: bool = False):
        self.kind, self.weight, self.scales, self.bias = kind, weight, scales, bias
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.amx = amx  # the AMX op may read the fused bytes (int4_kernel.amx_eligible / int8.int8_amx_eligible)
        self.avx2 = avx2  # INT4: the AVX2 fp32 op reads them (int4_kernel.avx2_eligible)

    def __call__(self, x: Tensor) -> Tensor:
        # Every tensor op skipped when it would be a no-op: a decode step makes 4 such calls per quantized
        # layer, and each reshape / .to() costs ~1 us in Python (Int4Linear's module call cost ~12 us more
        # than its kernel at 1-16 rows, ~40 us a layer with the q/k/v and gate/up calls). A decode step
        # with 30 INT4 layers went from 0.72x to 0.63x the bf16 step at batch 1, 1.01x to 0.98x at 16
        # (README, Performance, wave 17).
        x2 = as_rows(x, self.in_features)
        if self.kind == "int8":  # scales stay fp32 (the members' own storage)
            y = int8_mm(x2, self.weight, self.scales, self.amx)
        else:
            y = int4_mm(x2, self.weight, self.group_size, self.scales, self.amx, self.avx2)
        y = like_input(y, x, self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)


def _cat(parts: Sequence[Tensor], dim: int) -> Tensor:
    # Members read from the host store or the PackedStore already tile one tensor: a view of it, no copy
    # (and no second copy beside the one the ledger counts).
    fused = fuse_rows(parts) if dim == 0 else _adjacent_columns(parts)
    if fused is not None:
        return fused
    with torch.no_grad():
        return torch.cat(list(parts), dim=dim)


def _adjacent_columns(parts: Sequence[Tensor]) -> Tensor | None:
    """The [a, sum of n, ...] tensor whose dim-1 slices `parts` ([a, n_i, ...]) are, in order; else None."""
    first = parts[0]
    if first.dim() < 2 or first.shape[0] == 0:
        return None
    inner = math.prod(first.shape[2:])
    total = sum(p.shape[1] for p in parts)
    stride = (total * inner, inner, *(math.prod(first.shape[d + 1:]) for d in range(2, first.dim())))
    offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for p in parts:
        if (p.dtype != first.dtype or p.shape[0] != first.shape[0] or p.shape[2:] != first.shape[2:]
                or p.stride() != stride or p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset):
            return None
        offset += p.shape[1] * inner
    return first.as_strided((first.shape[0], total, *first.shape[2:]), stride, first.storage_offset())


def _fused_bias(linears: Sequence[nn.Module]) -> tuple[bool, Tensor | None]:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return True, None
    if any(b is None for b in biases):
        return False, None
    return True, _cat(biases, 0)


def fuse_quantized(linears: Sequence[nn.Module]) -> FusedQuantized | None:
    """The fused call for a group of same-kind quantized linears, or None when they cannot be fused. A
    group of one (o_proj, down_proj) gets the same lean call: no module call, no per-call reshape or
    cast (see FusedQuantized.__call__)."""
    if not linears or len({type(lin) for lin in linears}) != 1 or type(linears[0]) not in (Int8Linear, Int4Linear):
        return None
    if len({lin.in_features for lin in linears}) != 1:
        return None
    ok, bias = _fused_bias(linears)
    if not ok:
        return None
    k, n = linears[0].in_features, sum(lin.out_features for lin in linears)
    if type(linears[0]) is Int8Linear:
        if not all(lin.use_kernel for lin in linears):
            return None
        weight, scales = _cat([l.qweight for l in linears], 0), _cat([l.scales for l in linears], 0)
        amx = all(l.amx for l in linears) and weight.is_contiguous() and scales.is_contiguous()  # the op reads rows flat
        fused = FusedQuantized("int8", weight, scales, bias, k, n, amx=amx)
        _repoint(linears, fused, "qweight")
        return fused
    if (any(l.backend != "cpu" or l.layout != linears[0].layout or l.group_size != linears[0].group_size
            or l.out_features % _INT4_ROW_BLOCK for l in linears)):
        return None
    fused = FusedQuantized("int4", _cat([l.packed for l in linears], 0),
                           _cat([l.scales_and_zeros for l in linears], 1), bias, k, n, linears[0].group_size,
                           all(l.amx for l in linears), all(l.avx2 for l in linears))
    _repoint(linears, fused, "packed")
    return fused


def _repoint(linears: Sequence[nn.Module], fused: FusedQuantized, weight_name: str) -> None:
    """Members become row slices of the fused tensors: one copy in memory, exact bytes each. Members that
    already are those slices (read from a store that tiles them, the swap-down path) are left alone:
    nn.Module.__setattr__ on a buffer costs ~8 us (torch 2.13), ~0.1 ms a layer for nothing."""
    row = 0
    for lin in linears:
        n = lin.out_features
        _point(lin, weight_name, fused.weight[row:row + n])
        if fused.kind == "int8":
            _point(lin, "scales", fused.scales[row:row + n])
        else:  # [in/G, n, 2] column slice: a view (Int4Linear makes it contiguous if it runs alone)
            _point(lin, "scales_and_zeros", fused.scales[:, row:row + n])
        if fused.bias is not None:
            _point(lin, "bias", fused.bias[row:row + n])
        row += n


def _point(lin: nn.Module, name: str, view: Tensor) -> None:
    held = getattr(lin, name)
    if not (held.data_ptr() == view.data_ptr() and held.shape == view.shape and held.stride() == view.stride()
            and held.dtype == view.dtype):
        setattr(lin, name, view)
