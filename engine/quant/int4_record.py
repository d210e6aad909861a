"""The canonical INT4 record of one linear's weight (see int4.py for the format) and its nibble
packing. A leaf module: the quantizer (int4.py) and the kernel layouts (int4_kernel.py) both build on
it, and neither imports the other back."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.precision import Precision


def pack_nibbles(codes: Tensor) -> Tensor:
    """[out, in] integer codes in [0, 15] -> uint8 [out, in/2], even input index in the low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(qweight: Tensor) -> Tensor:
    """uint8 [out, in/2] -> uint8 codes [out, in]."""
    return torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)


@dataclass(frozen=True)
class Int4Weight:
    """The canonical INT4 form of one linear's weight."""

    qweight: Tensor  # uint8 [out, in/2]
    scales: Tensor  # fp32 [out, in/G]
    zeros: Tensor  # uint8 [out, in/G], each in [0, 15]
    group_size: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 2

    def check_integrity(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.qweight.dtype != torch.uint8 or self.qweight.dim() != 2:
            raise ValueError(f"Int4Weight.qweight must be uint8 [out, in/2], got {self.qweight.dtype} {tuple(self.qweight.shape)}")
        if g <= 0 or k % g:
            raise ValueError(f"Int4Weight.group_size {g} does not divide in_features {k}")
        for name, t, dtype in (("scales", self.scales, torch.float32), ("zeros", self.zeros, torch.uint8)):
            if t.dtype != dtype or tuple(t.shape) != (n, k // g):
                raise ValueError(f"Int4Weight.{name} must be {dtype} [{n}, {k // g}], got {t.dtype} {tuple(t.shape)}")
        if self.zeros.numel() and int(self.zeros.max()) > 15:
            raise ValueError("Int4Weight.zeros must be in [0, 15]")

    def codes(self) -> Tensor:
        return unpack_nibbles(self.qweight)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """[out, in] weights: (codes - zero) * scale, computed in fp32, then cast."""
        g = self.group_size
        z = self.zeros.float().repeat_interleave(g, dim=1)
        s = self.scales.repeat_interleave(g, dim=1)
        return ((self.codes().float() - z) * s).to(dtype)

    def to_tensors(self, prefix: str = "") -> tuple[dict[str, Tensor], dict[str, str]]:
        tensors = {f"{prefix}qweight": self.qweight.contiguous(), f"{prefix}scales": self.scales.contiguous(),
                   f"{prefix}zeros": self.zeros.contiguous()}
        return tensors, {f"{prefix}format": Precision.INT4.value, f"{prefix}group_size": str(self.group_size)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], metadata: dict[str, str], prefix: str = "") -> Int4Weight:
        fmt = metadata.get(f"{prefix}format")
        if fmt != Precision.INT4.value:
            raise ValueError(f"{prefix or 'record'} is stored as {fmt!r}, not int4")
        record = cls(qweight=tensors[f"{prefix}qweight"], scales=tensors[f"{prefix}scales"],
                     zeros=tensors[f"{prefix}zeros"], group_size=int(metadata[f"{prefix}group_size"]))
        record.check_integrity()
        return record
