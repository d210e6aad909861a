"""RMSNorm as Hugging Face computes it: normalise in fp32, cast back, then scale by the weight.

On CPU with the compiled kernels (engine/kernels/fused_elementwise.cpp) each call is one pass over
the rows; else torch's ops, with the same rounding points."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import elementwise_ops_for


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        if weight.dim() != 1:
            raise ValueError(f"an RMSNorm weight is [hidden_size], got shape {tuple(weight.shape)}")
        self.register_buffer("weight", weight, persistent=False)
        self.eps = eps

    def set_weight(self, weight: torch.Tensor) -> None:
        if weight.shape != self.weight.shape:
            raise ValueError(f"RMSNorm weight must be {tuple(self.weight.shape)}, got {tuple(weight.shape)}")
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = elementwise_ops_for(x)
        if (ops is not None and x.dtype == self.weight.dtype and self.weight.is_contiguous()
                and (x.dim() == 2 or x.is_contiguous())):
            return ops.rms_norm(x, self.weight, self.eps)
        return self.reference(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(h), h) for h = residual + x, h rounded to the dtype as torch's add rounds it. With the
        compiled kernels one pass (the add was a pass of its own); the inputs are not modified."""
        ops = elementwise_ops_for(x)
        if (ops is not None and x.dtype == residual.dtype == self.weight.dtype and self.weight.is_contiguous()
                and residual.stride(-1) == 1 and x.dim() == 2 and residual.dim() == 2):
            return ops.add_rms_norm(x, residual, self.weight, self.eps)
        h = residual + x
        return self(h), h

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """forward() with torch's ops (any device; the kernel's reference in tests)."""
        # Why fp32: the mean of squares overflows / loses precision in bf16 and fp16. torch's fused
        # rms_norm computes x * rsqrt(mean(x^2) + eps) in one kernel instead of five.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)
