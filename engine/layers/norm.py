"""RMSNorm as Hugging Face computes it: normalise in fp32, cast back, then scale by the weight."""
from __future__ import annotations

import torch
from torch import nn


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
        dtype = x.dtype
        x32 = x.float()
        # Why fp32: the mean of squares overflows / loses precision in bf16 and fp16.
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
