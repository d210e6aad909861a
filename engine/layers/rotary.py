"""Rotary position embedding (RoPE) with a cos/sin cache, in Hugging Face's rotate_half convention:
the head dimension is split in two halves [x1 | x2] and rotated as [x1 cos - x2 sin | x2 cos + x1 sin].

Scaling (`rope_scaling` in config.json, `rope_parameters` in newer transformers):
  default / None  - plain RoPE
  linear          - positions divided by `factor` (i.e. every frequency divided by it)
  llama3          - low frequencies divided by `factor`, high ones kept, a smooth ramp in between
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.errors import ModelLoadError


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths longer than old_len / low were never seen whole in training: interpolate them.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    ramp = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(medium, ramp, scaled)


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, after scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = None if not scaling else (scaling.get("rope_type") or scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ModelLoadError(f"rope scaling type {kind!r} is not supported; MorphServe supports default, linear and llama3")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds cos/sin for every position up to `max_positions`, in the model dtype."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: dict[str, Any] | None,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]: the same angle for both halves
        self.register_buffer("cos", emb.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype=dtype, device=device), persistent=False)
        self.max_positions = max_positions

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D], positions: [T] long -> rotated (q, k)."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
