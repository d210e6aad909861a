"""RMSNorm as Hugging Face computes it: normalise in fp32, cast back, then scale by the weight."""
from __future__ import annotations

import torch
import torch.nn.functional as F
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
        # Why fp32: the mean of squares overflows / loses precision in bf16 and fp16. torch's fused
        # rms_norm computes x * rsqrt(mean(x^2) + eps) in one kernel instead of five.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)
