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
from engine.kernels import elementwise_ops_for


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
        self._looked_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each [T, 1, D], for rotate(). Every layer of a step rotates at the same
        positions tensor, so the lookup is done once per step: keyed by the identity of that tensor (held,
        so no other can take its identity) and of the cos table (`.to()` replaces it)."""
        hit = self._looked_up
        if hit is None or hit[0] is not positions or hit[1] is not self.cos:
            cos = self.cos[positions].unsqueeze(1)
            sin = self.sin[positions].unsqueeze(1)
            half = sin.shape[-1] // 2
            # rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2): negating the table instead of x
            # is exact and saves one op per call.
            signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            hit = self._looked_up = (positions, self.cos, cos, signed)
        return hit[2], hit[3]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] (any heads: q, k, or both side by side), positions: [T] long -> rotated x.
        On CPU with the compiled kernels x is rotated in place, in one pass, and returned; else a new tensor."""
        ops = elementwise_ops_for(x)
        if ops is not None and x.dtype == self.cos.dtype and positions.device.type == "cpu":
            ops.rotary_(x, positions, self.cos, self.sin)
            return x
        return self.rotate_reference(x, positions)

    def rotate_reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """rotate() with torch's ops (any device; the kernel's reference in tests)."""
        cos, signed_sin = self._tables(positions)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), signed_sin)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D], positions: [T] long -> rotated (q, k)."""
        return self.rotate(q, positions), self.rotate(k, positions)
