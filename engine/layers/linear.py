"""The linear protocol and its full-precision implementation.

Every linear a decoder layer holds, whatever its precision, is an `nn.Module` that offers:

    forward(x: [..., in_features]) -> [..., out_features]   (x and the result in the model dtype)
    precision: Precision                                      (bf16 / fp16 / fp32 / int8 / int4)
    in_features: int, out_features: int
    nbytes() -> int   every byte the module holds resident (weight, bias, scales, zeros, packing)

`DenseLinear` (here) is the full-precision one; `Int8Linear` / `Int4Linear` (engine/quant/) implement
the same, so the morph executor can swap a layer's linears without the model knowing. A linear owns
its tensors outright: no sharing, no tying, so dropping the module really frees its memory (the one
exception, a tied lm_head, is decided by the model, not here).
"""
from __future__ import annotations

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
