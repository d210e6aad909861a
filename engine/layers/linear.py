"""The linear protocol and its full-precision implementation.

Every linear a decoder layer holds, whatever its precision, is an `nn.Module` that offers:

    forward(x: [..., in_features]) -> [..., out_features]   (x and the result in the model dtype)
    precision: Precision                                      (bf16 / fp16 / fp32 / int8 / int4)
    in_features: int, out_features: int
    nbytes() -> int   every byte the module holds resident (weight, bias, scales, zeros, packing)

`DenseLinear` (here) is the full-precision one; `Int8Linear` / `Int4Linear` (engine/quant/) implement
the same, so the morph executor can swap a layer's linears without the model knowing. A linear owns
its tensors outright: no sharing, no tying, so dropping the module really frees its memory (the
exceptions are decided by the model, not here: a tied lm_head, and `fuse_dense`, which makes a decoder
layer's q/k/v and gate/up weights row slices of one tensor so each group is one matmul; the layer
always replaces all of them together, so the shared tensor is freed with them).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from engine.precision import Precision, full_precision_for


@runtime_checkable
class Linear(Protocol):
    precision: Precision
    in_features: int
    out_features: int

    def nbytes(self) -> int: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def as_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x [..., in] -> [tokens, in] for a kernel that takes rows: x itself when it already is (a reshape
    costs ~1 us in Python, and a quantized layer makes 4 kernel calls a step)."""
    return x if x.dim() == 2 else x.reshape(-1, in_features)


def like_input(y: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """A kernel's [tokens, out] back to x's leading dimensions (as_rows' inverse)."""
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], out_features)


def tensor_nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class DenseLinear(nn.Module):
    """y = x W^T + b with W: [out_features, in_features] at a full precision (bf16 / fp16 / fp32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"a linear weight is [out_features, in_features], got shape {tuple(weight.shape)}")
        if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype):
            raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype} does not fit weight "
                             f"{tuple(weight.shape)} {weight.dtype}; it must be [out_features] in the same dtype")
        # Buffers, not parameters: inference only, and `.to()` still moves them.
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.precision: Precision = full_precision_for(weight.dtype)
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
              device: torch.device | str) -> "DenseLinear":
        """Uninitialised storage of the right shape, to be filled in place by the loader."""
        w = torch.empty(out_features, in_features, dtype=dtype, device=device)
        b = torch.empty(out_features, dtype=dtype, device=device) if bias else None
        return cls(w, b)

    def nbytes(self) -> int:
        return tensor_nbytes(self.weight) + tensor_nbytes(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, precision={self.precision.value}")


def _adjacent_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensor that `parts` tile exactly, in order, as consecutive rows of one storage (a view of it,
    no copy); else None."""
    first = parts[0]
    if first.dim() == 0 or first.shape[0] == 0:
        return None
    storage = first.untyped_storage().data_ptr()
    ptr, row_bytes = first.data_ptr(), first[0].numel() * first.element_size()
    for p in parts:
        if (p.dtype != first.dtype or p.shape[1:] != first.shape[1:] or not p.is_contiguous()
                or p.untyped_storage().data_ptr() != storage or p.data_ptr() != ptr):
            return None
        ptr += p.shape[0] * row_bytes
    return first.as_strided((sum(p.shape[0] for p in parts), *first.shape[1:]), first.stride(), first.storage_offset())


def fuse_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    # Reuse the tensor they already tile (a layer read from the host store, or a restore of its own
    # saved linears): no copy.
    fused = _adjacent_rows(parts)
    if fused is None:
        with torch.no_grad():
            fused = torch.cat(list(parts), dim=0)
    return fused


FusedWeight = tuple[torch.Tensor, torch.Tensor | None]  # (weight [sum of out_features, in], bias or None)


def fuse_dense(linears: Sequence[Linear]) -> FusedWeight | None:
    """(weight, bias) for one F.linear computing `linears` side by side (outputs concatenated), or None
    when they cannot be fused: not all DenseLinear, different dtype / device / in_features, bias on some only.

    The given linears are re-pointed to row slices of the fused weight (and bias), so memory does not
    grow, `nbytes()` of each stays exact and the values are bit-identical; writing into their weights
    (the loader fills them in place) writes into the fused tensor."""
    if not linears or not all(type(lin) is DenseLinear for lin in linears):
        return None
    first = linears[0].weight
    if any(lin.weight.dtype != first.dtype or lin.weight.device != first.device
           or lin.in_features != linears[0].in_features for lin in linears):
        return None
    biased = {lin.bias is not None for lin in linears}
    if len(biased) != 1:
        return None
    weight = fuse_rows([lin.weight for lin in linears])
    bias = fuse_rows([lin.bias for lin in linears]) if biased == {True} else None
    row = 0
    for lin in linears:
        n = lin.out_features
        lin.weight = weight[row:row + n]
        lin.bias = None if bias is None else bias[row:row + n]
        row += n
    return weight, bias
